"""The engines the gateway can route to: discovered from the directory, plus static ones.

The directory's node list gives each engine's API URL, epoch, transfer
endpoint and the load it reported in its last heartbeat. The gateway adds
what it knows first-hand: requests it has in flight to each engine and the
uncached prompt tokens it sent there that have not produced a first token
yet. An engine that refuses a connection is skipped for `unhealthy_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx

from directory.client import DirectoryClient
from directory.errors import DirectoryError

log = logging.getLogger("kvdir.gateway")


def usable_url(url: str) -> bool:
    """Whether `url` is an absolute http(s) URL the gateway can send requests to.

    The directory stores whatever a node registered; a garbage URL must make
    the gateway skip that node, not fail the requests routed there.
    """
    try:
        u = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError):
        return False
    return u.scheme in ("http", "https") and bool(u.host) and (u.port is None or 0 < u.port < 65536)


@dataclass(slots=True)
class EngineState:
    node_id: str
    url: str
    epoch: int = 0
    registered: bool = True  # from the directory (False: a static --engine)
    can_pull: bool = False  # has a transfer endpoint, so it understands kvdir_pull plans
    block_bytes: int = 0  # KV bytes of one block over all ranks
    running: float = 0.0
    waiting: float = 0.0
    inflight: int = 0
    pending_prefill_tokens: float = 0.0
    unhealthy_until: float = 0.0
    served: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    last_seen: float = field(default_factory=time.monotonic)

    @property
    def healthy(self) -> bool:
        return time.monotonic() >= self.unhealthy_until


class EngineRegistry:
    """Engine list and load, refreshed from the directory in the background."""

    def __init__(self, directory: DirectoryClient, static: list[str], refresh_s: float, unhealthy_s: float) -> None:
        self.directory = directory
        self.refresh_s = refresh_s
        self.unhealthy_s = unhealthy_s
        self.engines: dict[str, EngineState] = {}
        for i, url in enumerate(static):
            self.engines[f"static-{i + 1}"] = EngineState(f"static-{i + 1}", url, registered=False)
        self.directory_ok = False
        self._task: asyncio.Task[None] | None = None
        self._unusable: set[tuple[str, str]] = set()  # (node id, URL) already warned about

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def refresh(self) -> None:
        try:
            nodes = await self.directory.nodes()
        except DirectoryError as exc:
            if self.directory_ok:
                log.warning("directory unreachable (%s): routing by load alone", exc)
            self.directory_ok = False
            return
        self.directory_ok = True
        seen = set()
        for n in nodes:
            if not usable_url(n.api_url):
                if (n.node_id, n.api_url) not in self._unusable:
                    self._unusable.add((n.node_id, n.api_url))
                    log.warning("node %r registered an unusable API URL %r: not routed to", n.node_id, n.api_url[:200])
                continue
            seen.add(n.node_id)
            e = self.engines.get(n.node_id)
            if e is None or e.url != n.api_url.rstrip("/"):
                e = self.engines[n.node_id] = EngineState(n.node_id, n.api_url.rstrip("/"))
                log.info("engine %s at %s (epoch %d)", n.node_id, e.url, n.epoch)
            e.epoch = n.epoch
            e.can_pull = bool(n.transfer_url) and bool(n.regions)
            e.block_bytes = sum(r.block_bytes for r in n.regions)
            e.running = n.load.get("running", 0.0)
            e.waiting = n.load.get("waiting", 0.0)
            e.last_seen = time.monotonic()
        for node_id in [k for k, e in self.engines.items() if e.registered and k not in seen and e.inflight == 0]:
            log.info("engine %s left the directory", node_id)
            del self.engines[node_id]

    async def _loop(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.refresh_s)

    def mark_unhealthy(self, node_id: str) -> None:
        e = self.engines.get(node_id)
        if e is not None:
            e.unhealthy_until = time.monotonic() + self.unhealthy_s
            log.warning("engine %s refused a connection: skipped for %.1fs", node_id, self.unhealthy_s)
