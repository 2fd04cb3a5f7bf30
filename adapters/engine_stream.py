"""One engine's KV event stream (docs/protocol.md §5): received, put in order, and applied to its hash map.

The engine's ZMQ event stream comes in on a SUB socket. vLLM *connects* its
PUB socket when the endpoint has no ``*`` (``tcp://127.0.0.1:5557``), so by
default the subscriber *binds* ``--zmq``; ``--no-bind`` connects to an engine
that binds (``tcp://*:5557`` on the engine's side). What the events change
goes to the directory through `adapters.node_feed`.

Ordering (``seq``, one per message, +1 each):

* the next seq: apply it;
* the same seq again: a duplicate, dropped (unless its ts differs: then
  it is a restarted engine's, as below);
* a gap: with ``--replay`` (the engine's ROUTER replay endpoint), ask for the
  missing batches and apply them first; if the replay cannot give all of
  them (its buffer moved on, no answer in ``replay_timeout_s``), or without
  ``--replay``: resync, i.e. clear this node's entries and the hash map, and
  rebuild as the engine works (blocks stored before the gap come back when
  the engine stores them again; until then they are misses, never stale
  hits);
* a seq lower than the last: the engine restarted (seq counts from 0 per
  publisher). Register again with a new incarnation: a new epoch, so the old
  entries vanish at once; the hash map starts empty.

On its first message, a subscriber with ``--replay`` asks for everything
from seq 0, to learn the blocks the engine stored before it started (the
replay protocol is in `adapters.replay_fetch`).

TensorRT-LLM (same framing, map-tagged events) starts its seq at the wall
clock in ns, sends empty batches as heartbeats and an AllBlocksCleared
first: a restart there looks like a gap (a resync) followed by that clear,
which ends in the same place.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import httpx
import zmq
import zmq.asyncio
from prometheus_client import Histogram

from adapters.config import EventsSettings
from adapters.engine_events import Cleared, DecodeStats, Stored
from adapters.event_wire import Batch, decode_message
from adapters.node_feed import SLOT, NodeFeed
from adapters.replay_fetch import request_replay
from kvproto import media
from kvproto.client import DirectoryClient
from kvproto.tasks import TaskFailures, cancel_and_wait

DRAIN = 64  # messages taken per wakeup of the receive loop


@dataclass(slots=True)
class SubscriberStats:
    batches: int = 0
    duplicates: int = 0
    gaps: int = 0
    replays_ok: int = 0
    replays_failed: int = 0
    resyncs: int = 0
    restarts: int = 0
    clears: int = 0  # AllBlocksCleared applied


class EventsSubscriber(NodeFeed):
    """The subscriber of one engine: `open()` its socket, then `run()` until cancelled (an `Adapter` does both)."""

    def __init__(
        self, settings: EventsSettings, *, directory: DirectoryClient, tasks: TaskFailures, lag: Histogram | None = None
    ) -> None:
        """As `NodeFeed`'s."""
        super().__init__(settings, directory=directory, tasks=tasks, lag=lag)
        self.decode_stats = DecodeStats()
        self.stats = SubscriberStats()
        self.last_seq: int | None = None
        self._last_ts: float | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None

    # -- lifecycle ----------------------------------------------------------------

    def open(self, ctx: zmq.asyncio.Context) -> None:
        """Bind (or connect) the SUB socket, in the process's ZMQ context: a bad endpoint fails here, at start."""
        self._ctx = ctx
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        # A bound socket takes messages from whoever connects: a part over the cap is never buffered whole.
        sub.setsockopt(zmq.MAXMSGSIZE, self.s.max_message_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, self.s.topic.encode())
        try:
            if self.s.bind:
                sub.bind(self.s.zmq)
            else:
                sub.connect(self.s.zmq)
        except zmq.ZMQError:
            sub.close(linger=0)
            raise
        self._sub = sub
        self.log.info(
            "events of %s on %s (%s), replay %s, directory %s",
            self.s.api_url,
            self.s.zmq,
            "bound" if self.s.bind else "connected",
            self.s.replay or "off",
            self.s.directory,
        )

    async def run(self, http: httpx.AsyncClient) -> None:
        """Receive, sync and probe /health (with the process's `http` pool) until cancelled or a loop fails;
        on the way out the socket is closed and the node deregistered."""
        assert self._sub is not None, "open() first"
        try:
            await all_or_none(
                [
                    asyncio.create_task(self._receive_loop(self._sub), name=f"receive {self.node_id}"),
                    asyncio.create_task(self._sync_loop(), name=f"sync {self.node_id}"),
                    asyncio.create_task(self._health_loop(http), name=f"health {self.node_id}"),
                ]
            )
        finally:
            self._sub.close(linger=0)
            self._sub = None
            with contextlib.suppress(asyncio.CancelledError):
                await self.session.close(deadline=2.0)

    # -- events -------------------------------------------------------------------

    async def _receive_loop(self, sub: zmq.asyncio.Socket) -> None:
        # After each awaited message, whatever else has arrived is taken without awaiting: pyzmq's asyncio
        # receive (a future and a reader registration per message) cost more than decoding a 64-block event.
        # At most DRAIN at a time, then the loop runs the rest (flushes, heartbeats) even under a backlog.
        now: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
        while True:
            frames = await sub.recv_multipart()
            for _ in range(DRAIN):
                await self._receive(frames)
                try:
                    frames = now.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
            else:
                await self._receive(frames)
                await asyncio.sleep(0)

    async def _receive(self, frames: list[bytes]) -> None:
        batch = decode_message(frames, self.decode_stats)
        if batch is None:
            self.log.debug("garbage message skipped (%d frames)", len(frames))
            return
        try:
            await self.on_batch(batch)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.log.exception("batch seq %d could not be applied", batch.seq)

    async def on_batch(self, batch: Batch) -> None:
        """Order one batch against the last seq (see the module docstring) and apply it."""
        seq, last = batch.seq, self.last_seq
        if last is None:
            if seq > 0 and self.s.replay:
                earlier = await self._fetch_replay(0, seq, partial=True)
                for b in earlier or ():
                    self._apply(b)
        elif seq == last and (batch.ts is None or batch.ts == self._last_ts):
            self.stats.duplicates += 1
            return
        elif seq <= last:
            self.log.warning("engine seq went back from %d to %d: the engine restarted; registering a new epoch", last, seq)
            self._restart()
            if seq > 0 and self.s.replay:  # the new engine's first batches may have gone out before it reached us
                for b in await self._fetch_replay(0, seq, partial=True) or ():
                    self._apply(b)
        elif seq > last + 1:
            self.stats.gaps += 1
            missed = await self._fetch_replay(last + 1, seq) if self.s.replay else None
            if missed is not None:
                self.log.info("gap %d..%d filled from the replay socket", last + 1, seq - 1)
                for b in missed:
                    self._apply(b)
            else:
                self.log.warning(
                    "gap in the engine's seq (%d..%d missed): resync (this node's entries cleared)", last + 1, seq - 1
                )
                self._resync()
        self._apply(batch)

    def _apply(self, batch: Batch) -> None:
        self.stats.batches += 1
        self.last_seq, self._last_ts = batch.seq, batch.ts
        changed = False
        for ev in batch.events:
            if isinstance(ev, Cleared):
                self.stats.clears += 1
                self._clear_all()
                changed = True
                continue
            r = self.mapper.apply(ev)
            if r.missing_parent:
                self.log.debug("seq %d: a store whose parent is unknown, skipped", batch.seq)
            elif r.unsupported:
                self.log.debug("seq %d: %s", batch.seq, r.unsupported)
            medium = media.lenient(ev.medium) if isinstance(ev, Stored) else None  # the engine's name, kvdir's
            # publish, then remove: an LRU eviction in the same event wins
            self.session.stored_in(SLOT, r.publish, medium)
            if r.remove:
                self.session.removed(r.remove)
            changed = changed or bool(r.publish or r.remove)
        if self.session.queued >= self.s.batch_max_blocks:
            self._full.set()
        if changed:
            if batch.ts is not None:
                self._pending_ts = batch.ts if self._pending_ts is None else min(self._pending_ts, batch.ts)
            self._wake.set()

    def _resync(self) -> None:
        self.stats.resyncs += 1
        self._clear_all()

    def _restart(self) -> None:
        """The engine is a new process: a new incarnation, so a new epoch, and an empty map."""
        self.stats.restarts += 1
        self._forget_engine()
        self._wake.set()

    async def _fetch_replay(self, start: int, stop: int, *, partial: bool = False) -> list[Batch] | None:
        """Batches start..stop-1 from the engine's replay socket, in order.

        None if it could not give every one of them; with `partial`, whatever
        contiguous run ending at stop-1 it gave instead.
        """
        assert self._ctx is not None and self.s.replay
        got, ended = await request_replay(
            self._ctx,
            self.s.replay,
            start,
            stop,
            timeout_s=self.s.replay_timeout_s,
            max_message_bytes=self.s.max_message_bytes,
            stats=self.decode_stats,
        )
        complete = ended and len(got) == stop - start
        if complete:
            self.stats.replays_ok += 1
            return [got[s] for s in range(start, stop)]
        self.stats.replays_failed += 1
        self.log.info(
            "replay of %d..%d %s with %d of %d batches",
            start,
            stop - 1,
            "ended" if ended else "timed out",
            len(got),
            stop - start,
        )
        if not partial:
            return None
        run: list[Batch] = []
        s = stop - 1
        while s in got:
            run.append(got[s])
            s -= 1
        return run[::-1]


async def all_or_none(tasks: list[asyncio.Task[None]]) -> None:
    """Wait for every task; once one fails (or the caller is cancelled), cancel the others and wait for them."""
    try:
        await asyncio.gather(*tasks)
    finally:
        await cancel_and_wait(*tasks)
