"""Keeps the directory's view of this node in step with its KV pool, off the request path.

Every `publish_interval_s` the pool's coalesced events (blocks stored and
evicted since the last round) join the pending sets and go out in batches:
removals, then stores. A request never waits for this. While the directory
is unreachable the sets simply keep the net change (bounded by the pool's
capacity) and go out when it returns. A 409 (stale epoch, or the lease
expired) means the directory dropped this node's entries: register again and
republish everything the pool holds. Heartbeats carry the engine's load.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

from directory.client import DirectoryClient
from directory.errors import DirectoryError, RequestRejected, StaleEpochError
from worker_stub.pool import KVPool

log = logging.getLogger("kvdir.worker")

BATCH = 4096


class Publisher:
    def __init__(
        self,
        node_id: str,
        api_url: str,
        pool: KVPool,
        directory: DirectoryClient,
        *,
        transfer_url: str | None,
        block_size: int,
        load: Callable[[], dict[str, float]],
        interval: float,
        heartbeat_interval: float,
        on_published: Callable[[int, float], None] | None = None,
    ) -> None:
        self.node_id = node_id
        self.api_url = api_url
        self.pool = pool
        self.directory = directory
        self.transfer_url = transfer_url
        self.block_size = block_size
        self.load = load
        self.interval = interval
        self.heartbeat_interval = heartbeat_interval
        self.on_published = on_published
        self.incarnation = uuid.uuid4().hex  # one per process start: a restart is a new epoch
        self.epoch: int | None = None
        self.registrations = 0
        self.rejected = 0
        self._store: dict[int, tuple[int, float]] = {}  # hash -> (slot, when it was stored)
        self._remove: set[int] = set()
        self._registered = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._publish_loop()), asyncio.create_task(self._heartbeat_loop())]

    async def stop(self, deregister: bool = True) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if deregister and self.epoch is not None:
            try:
                await self.directory.request("DELETE", f"/v1/nodes/{self.node_id}", deadline=2.0)
            except DirectoryError as exc:
                log.info("could not deregister %s on shutdown: %s", self.node_id, exc)

    async def wait_registered(self, timeout: float) -> None:
        await asyncio.wait_for(self._registered.wait(), timeout)

    @property
    def pending(self) -> int:
        return len(self._store) + len(self._remove)

    def _drain(self) -> None:
        stored, removed = self.pool.drain_events()
        now = time.monotonic()
        for h, slot in stored:
            self._store[h] = (slot, now)
            self._remove.discard(h)
        for h in removed:
            self._store.pop(h, None)
            self._remove.add(h)

    async def _register(self) -> None:
        regions = [
            {"rank": r.rank, "base_addr": r.base_addr, "length": r.length, "rkey": 0, "block_bytes": r.block_bytes}
            for r in self.pool.regions
        ]
        reg = await self.directory.register(
            self.node_id,
            self.api_url,
            incarnation=self.incarnation,
            transfer_url=self.transfer_url,
            regions=regions,
            capacity_blocks=self.pool.capacity_blocks,
            block_size=self.block_size,
        )
        if self.epoch is not None:
            # A registration after the first follows a 409: the directory no longer holds our entries
            # (lease expired, or it lost its state and even hands out the same epoch number again),
            # so everything the pool holds must be published again.
            self._drain()
            now = time.monotonic()
            self._store = {h: (s, now) for h, s in self.pool.blocks()}
            self._remove.clear()
        self.epoch = reg.epoch
        self.registrations += 1
        self._registered.set()
        log.info("worker %s registered with epoch %d", self.node_id, reg.epoch)

    async def _publish_loop(self) -> None:
        backoff = self.interval
        while True:
            try:
                if self.epoch is None or not self._registered.is_set():
                    await self._register()
                self._drain()
                await self._flush()
                backoff = self.interval
            except StaleEpochError:
                log.warning("directory answered 409 for %s epoch %s: registering again", self.node_id, self.epoch)
                self._registered.clear()
                continue
            except RequestRejected as exc:
                # Retrying cannot help (a limit, a wrong token, or a bug): drop what is pending, keep serving,
                # and back off so that a misconfiguration (401/403 on every try) does not flood the log.
                log.error("directory refused this node's changes (%s); dropping %d pending changes", exc, self.pending)
                self.rejected += self.pending
                self._store.clear()
                self._remove.clear()
                backoff = min(backoff * 2, 2.0)
            except DirectoryError as exc:
                backoff = min(backoff * 2, 2.0)
                log.info("directory unavailable (%s); %d changes pending", exc, self.pending)
            await asyncio.sleep(backoff)

    async def _flush(self) -> None:
        assert self.epoch is not None
        while self._remove:
            batch = list(self._remove)[:BATCH]
            await self.directory.remove(self.node_id, self.epoch, batch)
            self._remove.difference_update(batch)
        while self._store:
            stored = list(self._store.items())[:BATCH]
            await self.directory.publish(self.node_id, self.epoch, [(h, slot) for h, (slot, _) in stored])
            now = time.monotonic()
            for h, (slot, _) in stored:
                if self._store.get(h, (None, 0.0))[0] == slot:
                    del self._store[h]
            if self.on_published is not None:
                self.on_published(len(stored), now - min(when for _, (_, when) in stored))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            if self.epoch is None or not self._registered.is_set():
                continue
            try:
                await self.directory.heartbeat(self.node_id, self.epoch, self.load())
            except StaleEpochError:
                log.warning("heartbeat of %s epoch %s refused (expired?): registering again", self.node_id, self.epoch)
                self._registered.clear()
            except DirectoryError as exc:
                log.info("heartbeat failed: %s", exc)
