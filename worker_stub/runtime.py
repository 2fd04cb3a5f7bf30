"""What a running worker holds between startup and shutdown: its pool, transfer engine, directory
client, engine, publisher and metrics, built and closed together by the app's lifespan."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from kvproto.client import DirectoryClient
from kvproto.hashing import KvIdentity
from kvproto.schemas import PullPlan
from kvtransfer.backends import create_engine
from kvtransfer.engine import TransferEngine
from worker_stub.config import WorkerSettings
from worker_stub.metrics import WorkerMetrics
from worker_stub.pool import KVPool
from worker_stub.publisher import Publisher
from worker_stub.stub_engine import Engine, RequestStats

log = logging.getLogger("kvdir.worker")


@dataclass
class Generation:
    """A request past its first token (queueing, pull and prefill are done): the rest is still to decode."""

    first: bytes | None
    rest: AsyncGenerator[bytes, None]
    stats: RequestStats
    ttft: float


@dataclass
class WorkerRuntime:
    """One worker's engine and the services around it; the app stores it once, on `app.state.runtime`."""

    settings: WorkerSettings
    pool: KVPool
    transfer: TransferEngine
    directory: DirectoryClient
    engine: Engine
    publisher: Publisher
    metrics: WorkerMetrics

    @classmethod
    def build(cls, settings: WorkerSettings) -> WorkerRuntime:
        """Everything wired up, the publisher not yet started."""
        pool = KVPool(settings.capacity_blocks, settings.block_bytes, settings.tp)
        transfer = create_engine(settings.transfer, settings.transfer_host)
        for region in pool.regions:
            transfer.register(region.base_addr, region.length)
        directory = DirectoryClient(settings.directory_urls, deadline=5.0, token=settings.directory_token, tenant=settings.tenant)
        engine = Engine(settings, pool, transfer, directory)
        metrics = WorkerMetrics(engine)
        publisher = Publisher(
            settings.node_id,
            settings.url,
            pool,
            directory,
            transfer_url=transfer.session,
            block_size=settings.block_size,
            models=[settings.model, *settings.adapter_names],
            fingerprint=settings.kv_fingerprint,
            shared=settings.shared,
            load=engine.load,
            interval=settings.publish_interval_s,
            heartbeat_interval=settings.heartbeat_interval_s,
            on_published=metrics.on_published,
        )
        metrics.watch_publisher(publisher)
        return cls(settings, pool, transfer, directory, engine, publisher, metrics)

    def start(self) -> None:
        settings = self.settings
        self.publisher.start()
        log.info(
            "worker %s serving %s (transfer %s at %s)", settings.node_id, settings.url, settings.transfer, self.transfer.session
        )

    async def aclose(self) -> None:
        """The publisher first: it deregisters through the directory client, which closes next; each closes
        even when the one before it failed (the transfer engine's listener and memory are always released)."""
        try:
            await self.publisher.stop()
        finally:
            try:
                await self.directory.aclose()
            finally:
                self.transfer.close()

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
        return Generation(first, gen, stats, ttft)
