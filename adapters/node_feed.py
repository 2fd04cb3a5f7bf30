"""The directory side of one events-fed engine (docs/protocol.md §5): its node, the rounds that carry what
its hash map changes, their lag, and the engine health gate on heartbeats.

The engine is registered as a node (``api_url`` = the engine's URL, so the
gateway routes to it; no memory regions, no transfer URL; ``models`` = its
``--model`` when one is set; no KV fingerprint, since an events-fed engine
never pulls nor is pulled from: docs/protocol.md §2.1), and heartbeats go
for it only while the engine's ``GET /health`` answers 200: a dead engine's
lease runs out and its entries go with it.

Slots: engines do not report which slot holds a block, so every entry is
published with slot 0. That is enough for routing (the gateway only needs
*who* holds a prefix). Pulling blocks from such a node needs the worker
protocol (memory regions and real slots), so these nodes register no
regions and no transfer URL, and the gateway never plans a pull from them.
No load either: heartbeats carry none.

The net change goes in batches, one round per ``batch_window_s`` (50 ms), or
sooner once ``batch_max_blocks`` changes are pending; a round carries at most
that many, and a full remainder goes at once: AllBlocksCleared first (as a
clear of this node), then removals, then stores. A request costs the
directory's leader about as much as 2,000 more blocks in it would, so under
load each round should carry hundreds.

Registration, heartbeats, the pending changes and their flushing are a
`kvproto.session.NodeSession`. If the directory answers 409 (the lease
lapsed, or the directory lost the node), the session registers again and
republishes everything the hash map holds; if the engine was down in between,
it may have restarted, so the map is dropped instead and rebuilt from new
events. A rejected round (another 4xx) is dropped and the next one backs off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Histogram

from adapters.config import EventsSettings
from adapters.hash_mapper import HashMapper
from kvproto import media
from kvproto.client import DirectoryClient
from kvproto.errors import RequestRejected, StaleEpochError
from kvproto.session import NodeSession
from kvproto.tasks import TaskFailures, every

log = logging.getLogger("kvdir.events")

SLOT = 0
TASKS = ("sync", "health")
"""An events process's tasks per engine, whose unexpected errors `kvdir_events_task_failures_total` counts."""


class NodeLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """The module's logger with the engine's node id in front: one process may follow several engines."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[{self.extra['node'] if self.extra else '?'}] {msg}", kwargs


def lag_histogram(registry: CollectorRegistry | None) -> Histogram:
    return Histogram(
        "kvdir_events_lag_seconds",
        "engine event time (batch ts) to committed in the directory",
        labelnames=["node"],
        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        registry=registry,
    )


class NodeFeed:
    """One engine's node in the directory, fed from its hash map: the subscriber queues changes in `session`
    and sets `_wake` (and `_full` once a round's worth is queued); `_sync_loop` and `_health_loop` do the rest."""

    def __init__(
        self, settings: EventsSettings, *, directory: DirectoryClient, tasks: TaskFailures, lag: Histogram | None = None
    ) -> None:
        """`directory` is shared by every engine of the process; `tasks` counts the unexpected errors of its sync
        rounds and health checks (the process's `kvdir_events_task_failures_total`, of `TASKS`); `lag` is this
        engine's series of the lag histogram."""
        self.s = settings
        self.tasks = tasks
        self.node_id = settings.node
        self.log = NodeLog(log, {"node": self.node_id})
        self.client = directory
        self.mapper = HashMapper(settings.block_size, settings.namespace, settings.max_entries, model=settings.model or "")
        self.lag = lag or lag_histogram(None).labels(self.node_id)
        self.engine_healthy = False
        self._down_since_registered = False
        # No regions, no transfer URL, no slots, no load: see the module docstring.
        self.session = NodeSession(
            self.client,
            self.node_id,
            settings.api_url,
            holdings=self._holdings,
            block_size=settings.block_size,
            models=[settings.model] if settings.model else [],
            on_registered=self._registered,
            retry_first_s=0.05,
            retry_max_s=1.0,
            logger=log,
        )
        self._pending_ts: float | None = None  # the oldest engine ts among pending changes: the lag histogram
        self._wake = asyncio.Event()
        self._full = asyncio.Event()  # batch_max_blocks changes queued: the window ends early

    # The session's epoch, read by the metrics.
    @property
    def epoch(self) -> int | None:
        return self.session.epoch

    def _clear_all(self) -> None:
        """Drop every entry of this node (and what was pending): AllBlocksCleared, or a resync."""
        self.mapper.reset()
        self.session.clear()
        self._wake.set()

    def _forget_engine(self) -> None:
        """Start over as a new incarnation (so a new epoch) with an empty map and nothing pending."""
        self.mapper.reset()
        self.session.restart()

    async def _sync_loop(self) -> None:
        while True:
            await self._wake.wait()
            if self.s.batch_window_s and not self._full.is_set() and not self.session.need_register:  # registering: at once
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._full.wait(), self.s.batch_window_s)
            self._wake.clear()
            if not self.engine_healthy:
                continue  # the health loop wakes us when it answers again; until then the lease runs out
            try:
                delay = await self.session.sync(self._flush)
            except asyncio.CancelledError:
                raise
            except Exception:
                self.tasks.failed("sync")()
                self.log.exception("unexpected error while syncing with the directory")
                delay = self.session.retry.failed()
            if delay is not None:  # a 409 (0: at once), an unreachable directory or a rejection: another round later
                await asyncio.sleep(delay)
                self._wake.set()

    def _registered(self, epoch: int) -> None:
        self._down_since_registered = False

    def _holdings(self) -> Iterator[tuple[int, int, str | None]]:
        return ((h, SLOT, media.lenient(medium)) for h, medium in self.mapper.snapshot().items())

    async def _flush(self) -> None:
        """One flush of the session, observing the lag of the engine's oldest change it committed."""
        gen, since = self.session.generation, self._pending_ts
        # A round that cannot take all that is queued leaves changes that arrived before now:
        # now is a lower bound for their engine timestamps' lag (since, the oldest, would count a
        # steady backlog as ever older).
        self._pending_ts = time.time() if self.session.queued > self.s.batch_max_blocks else None
        self._full.clear()
        try:
            await self.session.flush(self.s.batch_max_blocks)
        except RequestRejected as exc:
            if isinstance(exc, StaleEpochError):
                self._merge_back_ts(gen, since)
            raise
        except BaseException:
            self._merge_back_ts(gen, since)
            raise
        finally:
            self._rearm()
        if since is not None:
            self.lag.observe(max(0.0, time.time() - since))

    def _rearm(self) -> None:
        """After a round: what it left (a round takes at most batch_max_blocks) goes in a round of its own,
        at once if that round is full already, else when the window ends."""
        if self.session.queued >= self.s.batch_max_blocks:
            self._full.set()
        if self.session.queued:
            self._wake.set()

    def _merge_back_ts(self, gen: int, since: float | None) -> None:
        if gen == self.session.generation and since is not None:
            self._pending_ts = since if self._pending_ts is None else min(self._pending_ts, since)

    async def _health_loop(self, http: httpx.AsyncClient) -> None:
        await every(
            self.s.heartbeat_interval_s,
            lambda: self._check_health(http),
            what=f"[{self.node_id}] the engine's health check",
            log=log,
            failed=self.tasks.failed("health"),
        )

    async def _check_health(self, http: httpx.AsyncClient) -> None:
        """Probe the engine's /health; heartbeat for its node while it answers 200."""
        interval = self.s.heartbeat_interval_s
        try:
            ok = (await http.get(self.s.api_url + "/health", timeout=max(0.2, min(2.0, interval)))).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok and not self.engine_healthy:
            self.log.info("engine %s answers /health", self.s.api_url)
            self._wake.set()
        elif not ok and self.engine_healthy:
            self.log.warning("engine %s does not answer /health: heartbeats stop", self.s.api_url)
        if not ok:
            self._down_since_registered = True
        self.engine_healthy = ok
        if ok and not await self.session.heartbeat(deadline=max(0.2, interval)):
            self._lapsed()

    def _lapsed(self) -> None:
        """The directory dropped this node (its lease ran out, or it lost it): register again."""
        if self._down_since_registered:
            self.log.warning(
                "node %s expired while the engine was down: it may have restarted, starting from an empty map", self.node_id
            )
            self._forget_engine()
        self._wake.set()
