"""The worker's Prometheus metrics, in a registry of their own (served at `/metrics`).

Its scheduler's load is exported under vLLM's names and labels too (kvproto.engine_metrics): gateways read
an engine's running and waiting requests from its /metrics (gateway.engine_load), a stub's as a vLLM engine's.

The publisher is built after these metrics (its `on_published` callback is theirs), so its gauges
are registered here and bound to it by `watch_publisher` once it exists.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvproto.engine_metrics import VLLM_KV_USAGE, VLLM_LABELS, VLLM_PREEMPTIONS, VLLM_RUNNING, VLLM_WAITING
from kvproto.scraped import ScrapedCounters
from kvproto.tasks import TaskFailures
from worker_stub.publisher import Publisher
from worker_stub.stub_engine import Engine, EngineCounts, RequestStats


class WorkerMetrics:
    """Request counters and histograms, plus gauges read from the engine, its pool and the publisher at scrape time."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.tasks = TaskFailures("kvdir_worker", ("publish", "pull_probe"), r)
        self.engine = EngineCounts(r)  # the engine's own counts, handed to it
        self.requests = Counter("kvdir_worker_requests_total", "Requests served, by endpoint", ["endpoint"], registry=r)
        self.prompt_tokens = Counter("kvdir_worker_prompt_tokens_total", "Prompt tokens", registry=r)
        self.cached_tokens = Counter("kvdir_worker_cached_tokens_total", "Prompt tokens not recomputed", ["source"], registry=r)
        for endpoint in ("completions", "chat"):  # at zero from the start: a rate over no series is "no data"
            self.requests.labels(endpoint)
        for source in ("local", "host", "pulled"):
            self.cached_tokens.labels(source)
        self.ttft = Histogram(
            "kvdir_worker_time_to_first_token_seconds",
            "Queue + pull + prefill time",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.publish_lag = Histogram(
            "kvdir_worker_publish_lag_seconds",
            "From a block's prefill to its publish being committed",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
            registry=r,
        )
        self.published = Counter("kvdir_worker_published_blocks_total", "Blocks published to the directory", registry=r)
        self._publish_pending = Gauge("kvdir_worker_publish_pending", "Changes not yet published", registry=r)
        self._epoch = Gauge("kvdir_worker_epoch", "Current directory epoch", registry=r)

    def watch_engine(self, engine: Engine, dp_rank: int | None = None) -> None:
        """Read the engine's load, pool and host tier at scrape time, and vLLM's gauges of it (`dp_rank`: the
        data-parallel rank the engine is, vLLM's `engine` label; None: 0)."""
        self._engine_gauges(engine)
        self._vllm_gauges(engine, dp_rank or 0)

    def _engine_gauges(self, engine: Engine) -> None:
        r, pool = self.registry, engine.pool
        Gauge("kvdir_worker_running", "Requests running", registry=r).set_function(lambda: engine.running)
        Gauge("kvdir_worker_waiting", "Requests queued", registry=r).set_function(lambda: engine.waiting)
        Gauge("kvdir_worker_free_slots", "Free KV slots", registry=r).set_function(lambda: pool.free_slots)
        Gauge("kvdir_worker_cached_blocks", "Blocks cached", registry=r).set_function(lambda: pool.cached_blocks)
        # The pool's and host tier's counts stay ints in the data structures (their property tests read them).
        counts: list[tuple[str, str, Callable[[], float]]] = [
            ("kvdir_worker_evictions", "Blocks evicted (LRU)", lambda: pool.stats["evictions"])
        ]
        host = pool.host
        if host is not None:
            Gauge("kvdir_worker_host_blocks", "Blocks in the host tier", registry=r).set_function(lambda: host.used_slots)
            counts += [
                ("kvdir_worker_host_stored", "Blocks the device pool evicted into the host tier", lambda: host.stats["stored"]),
                (
                    "kvdir_worker_host_evictions",
                    "Blocks evicted from the host tier (LRU): gone from this node",
                    lambda: host.stats["evictions"],
                ),
                ("kvdir_worker_host_loads", "Blocks loaded back from the host tier for a request", lambda: host.stats["loads"]),
            ]
        r.register(ScrapedCounters(counts))

    def _vllm_gauges(self, engine: Engine, rank: int) -> None:
        """The scheduler's load as vLLM exports it: requests running and waiting, KV cache in use, preemptions (a
        stub never preempts: 0, as an idle vLLM shows)."""
        r, pool, values = self.registry, engine.pool, (engine.s.model, str(rank))

        def gauge(name: str, help_text: str, read: Callable[[], float]) -> None:
            Gauge(name, help_text, VLLM_LABELS, registry=r).labels(*values).set_function(read)

        gauge(VLLM_RUNNING, "Number of requests in model execution batches.", lambda: engine.running)
        gauge(VLLM_WAITING, "Number of requests waiting to be processed.", lambda: engine.waiting)
        gauge(VLLM_KV_USAGE, "KV-cache usage. 1 means 100 percent usage.", lambda: pool.held_slots / pool.capacity_blocks)
        Counter(VLLM_PREEMPTIONS, "Cumulative number of preemption from the engine.", VLLM_LABELS, registry=r).labels(*values)

    def watch_publisher(self, publisher: Publisher) -> None:
        """Read the publisher's backlog and epoch at scrape time."""
        self._publish_pending.set_function(lambda: publisher.pending)
        self._epoch.set_function(lambda: publisher.epoch or 0)

    def on_published(self, n: int, lag: float) -> None:
        self.published.inc(n)
        self.publish_lag.observe(lag)

    def on_first_token(self, stats: RequestStats, ttft: float) -> None:
        """Count a request's prompt once its prefill is done: what was cached is known by then."""
        self.ttft.observe(ttft)
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_tokens.labels("local").inc(stats.local_cached_tokens - stats.host_cached_tokens)
        self.cached_tokens.labels("host").inc(stats.host_cached_tokens)
        self.cached_tokens.labels("pulled").inc(stats.pulled_tokens)
