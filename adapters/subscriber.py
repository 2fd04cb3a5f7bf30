"""Feeds the directory from real engines' KV events (vLLM, SGLang; docs/protocol.md §5): the `kvdir events`
process.

One subscriber per engine (per data-parallel rank: each rank publishes on
its own port); one process runs one or several of them (`--engines`, `Adapter`
below: shared directory client, event loop and metrics). Each

* receives the engine's ZMQ event stream and puts it in order, with replay
  after gaps, resyncs and restarts (`adapters.engine_stream`);
* turns events into our block hashes (`adapters.hash_mapper.HashMapper`);
* registers the engine as a node, heartbeats for it while the engine's
  ``GET /health`` answers, and sends the net change in batched rounds
  (`adapters.node_feed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal

import httpx
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, start_http_server

from adapters.config import EventsSettings
from adapters.engine_stream import EventsSubscriber, all_or_none
from adapters.node_feed import TASKS, lag_histogram
from adapters.subscriber_metrics import SubscriberCollector
from kvproto.addresses import parse_hostport
from kvproto.client import DirectoryClient
from kvproto.tasks import TaskFailures

__all__ = ["Adapter", "StartError", "run_subscriber", "serve"]

log = logging.getLogger("kvdir.events")


class StartError(Exception):
    """An engine's ZMQ endpoint could not be bound or connected: the process stops before following any engine."""


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
        self.lag = lag_histogram(self.registry)
        self.tasks = TaskFailures("kvdir_events", TASKS, self.registry)
        self.subs: dict[str, EventsSubscriber] = {}
        self.failures: dict[str, int] = {e.node: 0 for e in self.engines}
        self.registry.register(SubscriberCollector(self.subs, self.failures))

    def _new(self, settings: EventsSettings) -> EventsSubscriber:
        sub = EventsSubscriber(settings, directory=self.client, tasks=self.tasks, lag=self.lag.labels(settings.node))
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
                await all_or_none([asyncio.create_task(self._follow(s, ctx, http), name=f"engine {s.node_id}") for s in subs])
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
    # collections stay cheap while the hash map grows (they would otherwise walk it on every full pass).
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
