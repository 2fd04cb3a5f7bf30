"""Feeds the directory from one real engine's KV events (vLLM, SGLang; docs/protocol.md §5).

Over 400 lines: the ZMQ receive loop, replay after gaps, restarts, batching and the engine health
gate are one ordering problem; the directory side is kvproto.session.

One subscriber per engine (per data-parallel rank: each rank publishes on
its own port); one process runs one or several of them (`--engines`, `Adapter`
at the end: shared directory client, event loop and metrics). It

* receives the engine's ZMQ event stream on a SUB socket. vLLM *connects*
  its PUB socket when the endpoint has no ``*`` (``tcp://127.0.0.1:5557``),
  so by default the subscriber *binds* ``--zmq``; ``--no-bind`` connects to
  an engine that binds (``tcp://*:5557`` on the engine's side);
* registers the engine as a node (``api_url`` = the engine's URL, so the
  gateway routes to it; no memory regions, no transfer URL; ``models`` = its
  ``--model`` when one is set; no KV fingerprint, since an events-fed engine
  never pulls nor is pulled from: docs/protocol.md §2.1) and heartbeats
  for it only while the engine's ``GET /health`` answers 200: a dead engine's
  lease runs out and its entries go with it;
* turns events into our block hashes (`adapters.kv_events.HashMapper`) and
  sends the net change in batches, one round per ``batch_window_s``
  (50 ms), or sooner once ``batch_max_blocks`` changes are pending; a
  round carries at most that many, and a full remainder goes at once:
  AllBlocksCleared first (as a clear of this node), then removals, then
  stores. A request costs the directory's leader about as much as 2,000
  more blocks in it would, so under load each round should carry hundreds.

Slots: engines do not report which slot holds a block, so every entry is
published with slot 0. That is enough for routing (the gateway only needs
*who* holds a prefix). Pulling blocks from such a node needs the worker
protocol (memory regions and real slots), so these nodes register no
regions and no transfer URL, and the gateway never plans a pull from them.
No load either: heartbeats carry none.

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
from seq 0, to learn the blocks the engine stored before it started.

Replay protocol (vLLM's ``ZmqEventPublisher._service_replay``, the same in
SGLang): the client sends, on a DEALER socket, ``[b"", start_seq]`` (8 bytes
big-endian; a REQ socket adds the empty delimiter itself); the ROUTER
answers every buffered batch with ``seq >= start_seq`` as ``[b"", seq,
payload]`` and ends with ``[b"", (-1 as 8 bytes), b""]``. TensorRT-LLM's
variant puts the topic before the seq; both are understood. A new DEALER
socket is used for each replay, so a late answer to an abandoned one can
never be mistaken for the next.

TensorRT-LLM (same framing, map-tagged events) starts its seq at the wall
clock in ns, sends empty batches as heartbeats and an AllBlocksCleared
first: a restart there looks like a gap (a resync) followed by that clear,
which ends in the same place.

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
import gc
import logging
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from adapters.config import EventsSettings
from adapters.kv_events import (
    END_SEQ,
    Batch,
    Cleared,
    DecodeError,
    DecodeStats,
    HashMapper,
    Stored,
    decode_message,
    decode_payload,
    decode_replay_reply,
    encode_seq,
)
from kvproto.addresses import parse_hostport
from kvproto.client import DirectoryClient
from kvproto.errors import RequestRejected, StaleEpochError
from kvproto.session import NodeSession

log = logging.getLogger("kvdir.events")

SLOT = 0
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


class _NodeLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """The module's logger with the engine's node id in front: one process may follow several engines."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[{self.extra['node'] if self.extra else '?'}] {msg}", kwargs


class _Collector:
    """Exposes the counters of every engine's decoder, mapper and subscriber at scrape time, labelled by node."""

    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        subs = list(self.adapter.subs.values())
        ev = CounterMetricFamily("kvdir_events_events", "engine events decoded, by type", labels=["node", "type"])
        rp = CounterMetricFamily("kvdir_events_replays", "replay requests, by outcome", labels=["node", "outcome"])
        counters: dict[str, CounterMetricFamily] = {}
        gauges: dict[str, GaugeMetricFamily] = {}
        fails = CounterMetricFamily(
            "kvdir_events_subscriber_failures",
            "times an engine's subscriber failed and was started again (the other engines go on)",
            labels=["node"],
        )
        for node, count in self.adapter.failures.items():
            fails.add_metric([node], count)
        for sub in subs:
            node = sub.node_id
            s, d, m, n = sub.stats, sub.decode_stats, sub.mapper.stats, sub.session.stats
            for name, v in (
                ("stored", d.stored),
                ("removed", d.removed),
                ("cleared", d.cleared),
                ("unknown", d.unknown_events),
                ("malformed", d.malformed_events),
                ("skipped_group", d.skipped_groups),
            ):
                ev.add_metric([node, name], v)
            rp.add_metric([node, "ok"], s.replays_ok)
            rp.add_metric([node, "failed"], s.replays_failed)
            for name, doc, v in (
                ("batches", "event batches (ZMQ messages) applied", s.batches),
                ("duplicates", "batches dropped as duplicates (same seq again)", s.duplicates),
                ("gaps", "gaps in the engine's seq", s.gaps),
                ("resyncs", "resyncs: this node's entries cleared after an unrepaired gap", s.resyncs),
                ("restarts", "engine restarts seen (seq went backwards): a new epoch each", s.restarts),
                ("garbage_frames", "ZMQ messages that were not event batches (skipped)", d.garbage_frames),
                ("unknown_events", "events of an unknown type (skipped)", d.unknown_events),
                ("extra_fields", "event fields nobody here knows (ignored)", d.extra_fields),
                ("missing_parents", "stores whose parent block is unknown (skipped)", m.missing_parents),
                ("unsupported", "stores whose block size or tokens cannot be mapped (skipped)", m.unsupported),
                ("unknown_removals", "removals of engine blocks not in the map (harmless)", m.unknown_removals),
                ("evicted", "engine blocks dropped from the bounded map (and the directory)", m.evicted),
                ("registrations", "registrations with the directory", n.registrations),
                ("published_blocks", "block entries sent to the directory", n.published_blocks),
                ("removed_blocks", "block removals sent to the directory", n.removed_blocks),
                ("directory_clears", "clears of this node's entries sent to the directory", n.directory_clears),
                ("rejected_blocks", "changes the directory refused (dropped)", n.rejected),
            ):
                if name not in counters:
                    counters[name] = CounterMetricFamily(f"kvdir_events_{name}", doc, labels=["node"])
                counters[name].add_metric([node], v)
            for name, doc, v in (
                ("engine_up", "1 while the engine's /health answers", 1 if sub.engine_healthy else 0),
                ("epoch", "this node's current epoch (0: not registered)", sub.epoch or 0),
                ("mapped_blocks", "engine blocks in the hash map", len(sub.mapper)),
                ("last_seq", "the last engine seq applied (-1: none)", -1 if sub.last_seq is None else sub.last_seq),
            ):
                if name not in gauges:
                    gauges[name] = GaugeMetricFamily(f"kvdir_events_{name}", doc, labels=["node"])
                gauges[name].add_metric([node], v)
        yield ev
        yield rp
        yield fails
        yield from counters.values()
        yield from gauges.values()


class EventsSubscriber:
    """The subscriber of one engine: `open()` its socket, then `run()` until cancelled (an `Adapter` does both)."""

    def __init__(self, settings: EventsSettings, *, directory: DirectoryClient, lag: Histogram | None = None) -> None:
        """`directory` is shared by every engine of the process; `lag` is this engine's series of the lag histogram."""
        self.s = settings
        self.node_id = settings.node
        self.log = _NodeLog(log, {"node": self.node_id})
        self.client = directory
        self.mapper = HashMapper(settings.block_size, settings.namespace, settings.max_entries, model=settings.model or "")
        self.decode_stats = DecodeStats()
        self.stats = SubscriberStats()
        self.lag = lag or _lag_histogram(None).labels(self.node_id)
        self.engine_healthy = False
        self.last_seq: int | None = None
        self._last_ts: float | None = None
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
        self._ctx: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None

    # The session's epoch, read by the metrics.
    @property
    def epoch(self) -> int | None:
        return self.session.epoch

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
            await _all_or_none(
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
            medium = ev.medium if isinstance(ev, Stored) else None
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

    def _clear_all(self) -> None:
        """Drop every entry of this node (and what was pending): AllBlocksCleared, or a resync."""
        self.mapper.reset()
        self.session.clear()
        self._wake.set()

    def _resync(self) -> None:
        self.stats.resyncs += 1
        self._clear_all()

    def _forget_engine(self) -> None:
        """Start over as a new incarnation (so a new epoch) with an empty map and nothing pending."""
        self.mapper.reset()
        self.session.restart()

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
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.s.max_message_bytes)
        got: dict[int, Batch] = {}
        ended = False
        try:
            sock.connect(self.s.replay)
            await sock.send_multipart([b"", encode_seq(start)])
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.s.replay_timeout_s
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0 or not await sock.poll(int(remaining * 1000) + 1):
                    break
                frames = await sock.recv_multipart()
                try:
                    seq, payload = decode_replay_reply(frames)
                    if seq == END_SEQ:
                        ended = True
                        break
                    if start <= seq < stop and seq not in got:
                        ts, events, dp_rank = decode_payload(payload, self.decode_stats)
                        got[seq] = Batch(seq, ts, events, b"", dp_rank)
                except DecodeError:
                    self.decode_stats.garbage_frames += 1
        finally:
            sock.close(linger=0)
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

    # -- directory ------------------------------------------------------------------

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
                self.log.exception("unexpected error while syncing with the directory")
                delay = self.session.retry.failed()
            if delay is not None:  # a 409 (0: at once), an unreachable directory or a rejection: another round later
                await asyncio.sleep(delay)
                self._wake.set()

    def _registered(self, epoch: int) -> None:
        self._down_since_registered = False

    def _holdings(self) -> Iterator[tuple[int, int, str | None]]:
        return ((h, SLOT, medium) for h, medium in self.mapper.snapshot().items())

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
        interval = self.s.heartbeat_interval_s
        url = self.s.api_url + "/health"
        while True:
            try:
                ok = (await http.get(url, timeout=max(0.2, min(2.0, interval)))).status_code == 200
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
            await asyncio.sleep(interval)

    def _lapsed(self) -> None:
        """The directory dropped this node (its lease ran out, or it lost it): register again."""
        if self._down_since_registered:
            self.log.warning(
                "node %s expired while the engine was down: it may have restarted, starting from an empty map", self.node_id
            )
            self._forget_engine()
        self._wake.set()


def _lag_histogram(registry: CollectorRegistry | None) -> Histogram:
    return Histogram(
        "kvdir_events_lag_seconds",
        "engine event time (batch ts) to committed in the directory",
        labelnames=["node"],
        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        registry=registry,
    )


class StartError(Exception):
    """An engine's ZMQ endpoint could not be bound or connected: the process stops before following any engine."""


async def _all_or_none(tasks: list[asyncio.Task[None]]) -> None:
    """Wait for every task; once one fails (or the caller is cancelled), cancel the others and wait for them."""
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Adapter:
    """Every engine one `kvdir events` process follows (one, or `--engines`).

    They share the directory client (one connection pool), the ZMQ context, the /health
    probes' HTTP pool, the event loop and one metrics server (series labelled by node): the
    fixed cost of a process is paid once per host rather than once per engine. Each engine
    keeps its own node session, epoch, hash map, stats, health gate and replay/resync.

    Failures stay with their engine: a silent endpoint, a failing /health or replay only
    affect that engine's node (as they would in a process of its own). Should one engine's
    subscriber fail outright (a bug), the error is logged, counted
    (`kvdir_events_subscriber_failures_total`), its node is deregistered, and a fresh
    subscriber for it starts after a back-off (1 s, doubling to 30 s) as a new incarnation,
    while the other engines go on. Only endpoints that cannot be bound or connected at start
    stop the process (exit status 1), before any engine is followed.
    """

    RESTART_FIRST_S = 1.0
    RESTART_MAX_S = 30.0

    def __init__(self, settings: EventsSettings) -> None:
        self.settings = settings
        self.engines = settings.per_engine()
        token = settings.directory_token.get_secret_value() if settings.directory_token else None
        self.client = DirectoryClient(settings.directory_urls, token=token, tenant=settings.tenant)
        self.registry = CollectorRegistry(auto_describe=False)
        self.lag = _lag_histogram(self.registry)
        self.subs: dict[str, EventsSubscriber] = {}
        self.failures: dict[str, int] = {e.node: 0 for e in self.engines}
        self.registry.register(_Collector(self))

    def _new(self, settings: EventsSettings) -> EventsSubscriber:
        sub = EventsSubscriber(settings, directory=self.client, lag=self.lag.labels(settings.node))
        self.subs[settings.node] = sub
        return sub

    async def run(self) -> None:
        """Follow every engine until cancelled; StartError if an endpoint cannot be bound or connected."""
        server = None
        if self.settings.metrics:
            host, port = parse_hostport(self.settings.metrics)
            server, _ = start_http_server(port, addr=host, registry=self.registry)
        ctx = zmq.asyncio.Context()
        try:
            subs: list[EventsSubscriber] = []
            for e in self.engines:
                sub = self._new(e)
                try:
                    sub.open(ctx)
                except zmq.ZMQError as exc:  # the sockets opened so far close with the context, below
                    how = "bind" if e.bind else "connect"
                    raise StartError(f"engine {e.node}: cannot {how} its ZMQ endpoint {e.zmq}: {exc}") from None
                subs.append(sub)
            if len(subs) > 1:
                log.info("following %d engines in this process: %s", len(subs), ", ".join(s.node_id for s in subs))
            async with httpx.AsyncClient() as http:
                await _all_or_none([asyncio.create_task(self._follow(s, ctx, http), name=f"engine {s.node_id}") for s in subs])
        finally:
            ctx.destroy(linger=0)
            await self.client.aclose()
            if server is not None:
                server.shutdown()
                server.server_close()

    async def _follow(self, sub: EventsSubscriber, ctx: zmq.asyncio.Context, http: httpx.AsyncClient) -> None:
        """Run one engine's subscriber; if it fails, log it and start a fresh one after a back-off."""
        delay = self.RESTART_FIRST_S
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await sub.run(http)
                return
            except Exception:
                self.failures[sub.node_id] += 1
                if loop.time() - started > 10 * self.RESTART_MAX_S:
                    delay = self.RESTART_FIRST_S  # it had been running for a while: not a crash loop
                sub.log.exception("the subscriber failed; the other engines go on, this one starts again in %.1f s", delay)
            while True:
                await asyncio.sleep(delay)
                delay = min(2 * delay, self.RESTART_MAX_S)
                sub = self._new(sub.s)
                try:
                    sub.open(ctx)
                    break
                except zmq.ZMQError as exc:
                    sub.log.error("cannot open %s again (%s); next try in %.1f s", sub.s.zmq, exc, delay)


async def run_subscriber(settings: EventsSettings) -> None:
    """Follow the engine (or `--engines`) until cancelled; on the way out each node is deregistered."""
    await Adapter(settings).run()


def serve(settings: EventsSettings) -> int:
    """Run until SIGINT/SIGTERM (for a command line), logging at settings.log_level; 1 if an endpoint cannot be opened."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # What the imports made lives as long as the process: out of the collector's sight, its full
    # collections stay cheap while the hash map grows (they cost ~1.4 ms of CPU per 1,000 blocks).
    gc.freeze()

    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await run_subscriber(settings)

    try:
        asyncio.run(main())
    except StartError as exc:
        log.error("%s", exc)
        return 1
    return 0
