"""Small stand-ins that tests share, for what a test drives without the real process behind it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx

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
