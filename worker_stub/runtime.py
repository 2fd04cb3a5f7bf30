"""What a running worker holds between startup and shutdown: its pool, transfer engine, directory
client, engine, publisher and metrics, built and closed together by the app's lifespan."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from kvproto.client import DirectoryClient
from kvproto.hashing import KvIdentity
from kvproto.schemas import PullPlan
from kvproto.tasks import cancel_and_wait, every
from kvtransfer.backends import create_engine
from kvtransfer.engine import TransferEngine
from worker_stub.config import WorkerSettings
from worker_stub.metrics import WorkerMetrics
from worker_stub.pool import KVPool
from worker_stub.publisher import Publisher
from worker_stub.pull_probe import PROBE_INTERVAL_S, PullProbe
from worker_stub.stub_engine import Engine, RequestStats

log = logging.getLogger("kvdir.worker")


@dataclass
class Generation:
    """A request past its first token (queueing, pull and prefill are done): the rest is still to decode."""

    node_id: str  # the directory node that served it (a data-parallel rank's own)
    first: bytes | None
    rest: AsyncGenerator[bytes, None]
    stats: RequestStats
    ttft: float


@dataclass
class WorkerRuntime:
    """One worker's engine and the services around it; the app stores it once, on `app.state.runtime`."""

    settings: WorkerSettings
    node_id: str
    """The directory node it is: the worker's, or with `--dp N` its data-parallel rank's (`NODE_ID-dpR`)."""
    pool: KVPool
    transfers: list[TransferEngine]
    """One per TP rank, rank order."""
    directory: DirectoryClient
    engine: Engine
    publisher: Publisher
    metrics: WorkerMetrics
    probe: PullProbe | None
    """Measures the pull bandwidth before the first pull (None: `--pull-probe-blocks 0`, or it never pulls)."""
    _probe_task: asyncio.Task[None] | None = field(default=None, init=False)

    @classmethod
    def build(cls, settings: WorkerSettings, dp_rank: int | None = None) -> WorkerRuntime:
        """Everything wired up, the publisher not yet started; `dp_rank`: the data-parallel rank it is (its own
        node, registered with that rank so that gateways name it in each request)."""
        node_id = settings.node_id if dp_rank is None else f"{settings.node_id}-dp{dp_rank}"
        pool = KVPool(settings.capacity_blocks, settings.block_bytes, settings.tp, host_blocks=settings.host_blocks)
        # One transfer engine per TP rank, as each rank of a real engine is its own process with its own.
        transfers: list[TransferEngine] = []
        try:
            for region in pool.regions:
                transfers.append(create_engine(settings.transfer, settings.transfer_host))
                transfers[-1].register(region.base_addr, region.length)
                if pool.host is not None:  # the rank's host tier, read through the same engine
                    host = pool.host.regions[region.rank]
                    transfers[-1].register(host.base_addr, host.length)
        except BaseException:
            for t in transfers:
                t.close()
            raise
        directory = DirectoryClient(settings.directory_urls, deadline=5.0, token=settings.directory_token, tenant=settings.tenant)
        metrics = WorkerMetrics()
        engine = Engine(settings, pool, transfers, directory, node_id, metrics.engine)
        metrics.watch_engine(engine, dp_rank)
        publisher = Publisher(
            node_id,
            settings.url,
            pool,
            directory,
            transfer_sessions=[t.session for t in transfers],
            block_size=settings.block_size,
            models=[settings.model, *settings.adapter_names],
            fingerprint=settings.kv_fingerprint,
            shared=settings.shared,
            dp_rank=dp_rank,
            load=engine.load,
            interval=settings.publish_interval_s,
            heartbeat_interval=settings.heartbeat_interval_s,
            on_published=metrics.on_published,
        )
        metrics.watch_publisher(publisher)
        probe = None
        if settings.pull_probe_blocks and transfers:
            probe = PullProbe(settings, node_id, transfers, directory, engine.pull_bandwidth)
        return cls(settings, node_id, pool, transfers, directory, engine, publisher, metrics, probe)

    def start(self) -> None:
        settings = self.settings
        self.publisher.start(self.metrics.tasks.failed("publish"))
        if self.probe is not None:
            self._probe_task = asyncio.create_task(
                every(
                    PROBE_INTERVAL_S,
                    self.probe.step,
                    what="pull bandwidth probe",
                    log=log,
                    failed=self.metrics.tasks.failed("pull_probe"),
                    first_now=False,
                ),
                name="pull probe",
            )
        log.info(
            "worker %s serving %s (transfer %s at %s)",
            self.node_id,
            settings.url,
            settings.transfer,
            ", ".join(t.session for t in self.transfers),
        )

    async def aclose(self) -> None:
        """The publisher first: it deregisters through the directory client, which closes next; each closes
        even when the one before it failed (the transfer engines' listeners and memory are always released)."""
        try:
            await cancel_and_wait(self._probe_task)
            await self.publisher.stop()
        finally:
            try:
                await self.directory.aclose()
            finally:
                for t in self.transfers:
                    t.close()

    async def generate(
        self, endpoint: str, tokens: list[int], max_tokens: int, plan: PullPlan | None, kv: KvIdentity
    ) -> Generation:
        """Run a request up to its first token, counted under `endpoint`; raises QueueFull when it cannot queue."""
        self.metrics.requests.labels(endpoint).inc()
        stats = RequestStats()
        gen = self.engine.generate(tokens, max_tokens, plan, stats, kv)
        first = await anext(gen, None)  # queueing, pull and prefill happen here
        ttft = stats.queue_s + stats.pull_s + stats.prefill_s
        self.metrics.on_first_token(stats, ttft)
        return Generation(self.node_id, first, gen, stats, ttft)
