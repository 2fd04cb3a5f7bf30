"""Small stand-ins that tests share, for what a test drives without the real process behind it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import httpx

from adapters.vllm_plan import PullSource
from gateway.engine_registry import EngineRegistry, EngineState
from kvproto.client import DirectoryClient
from kvproto.schemas import NodeInfo, Origin


class Directory:
    """The directory's node list, as given."""

    def __init__(self, nodes: list[NodeInfo]) -> None:
        self.listed = nodes

    async def nodes(self, *, deadline: float | None = None) -> list[NodeInfo]:
        return self.listed


def registry(http: httpx.AsyncClient, *ids: str) -> EngineRegistry:
    """An engine registry that knows engines `ids` (epoch 1) and never reaches a directory."""
    reg = EngineRegistry(DirectoryClient("http://127.0.0.1:1"), http, [], refresh_s=1.0, unhealthy_s=1.0)
    for i, n in enumerate(ids):
        reg.engines[n] = EngineState(n, Origin("http", "127.0.0.1", 9000 + i), epoch=1)
    return reg


def run(body: Callable[[httpx.AsyncClient], Awaitable[None]]) -> None:
    """`body(http)` in a fresh event loop, with an HTTP client closed after it."""

    async def main() -> None:
        async with httpx.AsyncClient() as http:
            await body(http)

    asyncio.run(main())


class FixedPeers:
    """The vLLM connector's pull sources as a map (adapters.connector_peers.Peers). `read()` stands for a read of the
    directory's node list that started well past any refresh period since and ends now: `listed` (sources registered
    meanwhile) joins the map. `wait` reads at once, unless `blocking` is off (the scheduler half must never wait)."""

    def __init__(self, sources: dict[tuple[str, int], PullSource] | None = None, *, blocking: bool = True) -> None:
        self.sources = dict(sources or {})
        self.listed: dict[tuple[str, int], PullSource] = {}
        self.read_started = float("-inf")
        self.blocking = blocking

    def start(self) -> None:
        return

    def stop(self) -> None:
        return

    def get(self, node_id: str, epoch: int) -> PullSource | None:
        return self.sources.get((node_id, epoch))

    def known(self) -> dict[tuple[str, int], PullSource]:
        return self.sources

    def read(self) -> None:
        self.read_started = time.monotonic() + 3600
        self.sources.update(self.listed)

    def settled(self, since: float) -> bool:
        return self.read_started > since

    def wait(self, since: float, timeout: float) -> bool:
        assert self.blocking, "the scheduler half never blocks"
        self.read()
        return True
