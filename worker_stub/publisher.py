"""Keeps the directory's view of this node in step with its KV pool, off the request path.

Every `publish_interval_s` the pool's coalesced events (blocks stored and
evicted since the last round) join the pending sets of a `NodeSession` and go
out in batches: removals, then stores. A request never waits for this. While
the directory is unreachable the sets simply keep the net change (bounded by
the pool's capacity) and go out when it returns. A 409 (stale epoch, or the
lease expired) means the directory dropped this node's entries: the session
registers again and republishes everything the pool holds. Heartbeats carry
the engine's load.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence

from kvproto import media
from kvproto.client import DirectoryClient
from kvproto.schemas import Region
from kvproto.session import NodeSession
from kvproto.tasks import cancel_and_wait
from worker_stub.pool import KVPool

log = logging.getLogger("kvdir.worker")


class Publisher:
    """Runs the worker's `NodeSession` in the background: `start()`, then `stop()` on shutdown."""

    def __init__(
        self,
        node_id: str,
        api_url: str,
        pool: KVPool,
        directory: DirectoryClient,
        *,
        transfer_sessions: Sequence[str],
        block_size: int,
        models: list[str],
        fingerprint: str,
        shared: bool,
        dp_rank: int | None,
        load: Callable[[], dict[str, float]],
        interval: float,
        heartbeat_interval: float,
        on_published: Callable[[int, float], None] | None = None,
    ) -> None:
        self.node_id = node_id
        self.pool = pool
        self.interval = interval
        self.heartbeat_interval = heartbeat_interval
        self.session = NodeSession(
            directory,
            node_id,
            api_url,
            holdings=self._holdings,
            transfer_url=transfer_sessions[0] if transfer_sessions else None,
            regions=[
                Region(
                    rank=r.rank,
                    base_addr=r.base_addr,
                    length=r.length,
                    rkey=0,
                    block_bytes=r.block_bytes,
                    transfer_url=transfer_sessions[r.rank] if r.rank > 0 else None,
                    medium=medium,
                )
                for medium, memory in ((None, pool), ("host", pool.host))
                if memory is not None
                for r in memory.regions
            ],
            capacity_blocks=pool.capacity_blocks,
            block_size=block_size,
            models=models,
            fingerprint=fingerprint,
            shared=shared,
            dp_rank=dp_rank,
            load=load,
            collect=self._collect,
            on_published=on_published,
            retry_first_s=min(interval * 2, 2.0),
            retry_max_s=2.0,
            logger=log,
        )
        self._task: asyncio.Task[None] | None = None

    def start(self, failed: Callable[[], object]) -> None:
        """Publish and heartbeat until `stop`; `failed` counts a round or heartbeat that raised (kvproto.session)."""
        self._task = asyncio.create_task(self.session.run(self.interval, self.heartbeat_interval, failed))

    async def stop(self, deregister: bool = True) -> None:
        await cancel_and_wait(self._task)
        if deregister:
            await self.session.close()

    async def wait_registered(self, timeout: float) -> None:
        await self.session.wait_registered(timeout)

    @property
    def epoch(self) -> int | None:
        return self.session.epoch

    @property
    def incarnation(self) -> str:
        return self.session.incarnation

    @property
    def pending(self) -> int:
        return self.session.pending

    @property
    def registrations(self) -> int:
        return self.session.stats.registrations

    @property
    def rejected(self) -> int:
        return self.session.stats.rejected

    def _collect(self) -> None:
        stored, removed = self.pool.drain_events()
        by_medium: dict[int, list[tuple[int, int]]] = {}
        for h, loc in stored:
            code, slot = media.split(loc)
            by_medium.setdefault(code, []).append((h, slot))
        for code, blocks in by_medium.items():
            self.session.stored(blocks, media.tier(code))
        self.session.removed(removed)

    def _holdings(self) -> Iterator[tuple[int, int, str | None]]:
        self.pool.drain_events()  # superseded by the snapshot below
        device = ((h, slot, None) for h, slot in self.pool.blocks())
        return itertools.chain(device, ((h, slot, "host") for h, slot in self.pool.host_blocks()))
