"""The gateway's Prometheus metrics (`/metrics`), one registry per app.

Names follow `kvdir_gateway_<what>_<unit>`. The routing and forwarding code
(gateway.proxy) updates them; the engine gauges read the registry when scraped.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample as MetricSample

from gateway.cost import REASONS
from gateway.engine_registry import EngineRegistry
from gateway.mirror import Mirror
from kvproto.scraped import ScrapedCounters
from kvproto.tasks import TaskFailures

log = logging.getLogger("kvdir.gateway")

_LATENCY = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
PULL_FAILURES_KEPT = 20  # the latest pull failures the status page lists
# What an engine's own words on a failed pull say, as the status page may show it (first match; else "other"): the
# words themselves name peers' addresses and epochs, which the gateway's public port never shows.
PULL_FAILURE_CATEGORIES = (
    ("verification", "blocks failed verification"),
    ("transfer:", "the transfer failed"),
    ("directory:", "the directory did not answer"),
    ("not registered", "the source is not registered at that epoch"),
    ("no transfer engine", "the engine cannot pull"),
    ("fingerprint", "the source's KV is another model's or layout's"),
    ("tp ranks", "the source's KV is another model's or layout's"),
    ("tenant", "the source's tenant may not be read from"),
    ("region", "the plan does not fit the source's memory"),
    ("slot", "the plan does not fit the source's memory"),
    ("medium", "the plan does not fit the source's memory"),
    ("session", "the plan does not fit the source's memory"),
)


@dataclass(frozen=True, slots=True)
class PullFailure:
    """A pull plan the engine did not serve wholly from the pulled KV (it recomputed the rest: never wrong data)."""

    at: float  # monotonic time of the engine's answer
    node_id: str  # the engine that pulled
    source: str  # the holder it pulled from
    predicted: int  # cached tokens the plan promised
    reported: int | None  # cached tokens the engine reported (None: it reported none)
    reason: str  # what went wrong, as a category (`failure_category`): never the engine's own words


def failure_category(engine_failure: str) -> str:
    """The category of an engine's words on a failed pull (PULL_FAILURE_CATEGORIES)."""
    text = engine_failure.lower()
    return next((category for words, category in PULL_FAILURE_CATEGORIES if words in text), "other")


@dataclass(frozen=True, slots=True)
class Sample:
    """The gateway's cumulative counters at monotonic time `t`."""

    t: float
    decisions: Mapping[str, float]  # routed requests, by reason
    prompt_tokens: float
    predicted_tokens: float  # cached tokens the directory predicted
    reported_tokens: float  # cached tokens the engines reported
    error_tokens: float  # sum of |predicted - reported| over the requests whose engine reported
    reports: float  # those requests
    lookups: Mapping[str, float]  # by source
    upstream_errors: float
    pulls: Mapping[str, float]  # pull plans, by outcome

    @property
    def requests(self) -> float:
        return sum(self.decisions.values())


TASKS = ("engine_refresh", "engine_load", "status_sample", "tokenizer_parity", "peer_expiry")
"""The gateway's periodic tasks, whose failures `tasks` counts (the mirror's restarts are its own counter)."""


class GatewayMetrics:
    """The counters and histograms of one gateway, in their own `CollectorRegistry` (several apps per process in tests)."""

    def __init__(self, registry: EngineRegistry) -> None:
        r = self.registry = CollectorRegistry()
        self.decisions = Counter("kvdir_gateway_decisions_total", "Routing decisions, by reason", ["reason"], registry=r)
        self.predicted = Counter(
            "kvdir_gateway_predicted_cached_tokens_total", "Cached tokens the directory predicted", registry=r
        )
        self.reported = Counter("kvdir_gateway_reported_cached_tokens_total", "Cached tokens the engines reported", registry=r)
        self.prompt_tokens = Counter("kvdir_gateway_prompt_tokens_total", "Prompt tokens routed", registry=r)
        self.prediction_error = Histogram(
            "kvdir_gateway_prediction_error_tokens",
            "|predicted - reported| cached tokens per request",
            buckets=(0, 16, 64, 256, 1024, 4096, 16384),
            registry=r,
        )
        self.ttft_estimate_error = Histogram(
            "kvdir_gateway_ttft_estimate_error_seconds",
            "Estimated minus observed time to first token (sent to first byte) per streamed request",
            buckets=(-10, -3, -1, -0.3, -0.1, -0.03, -0.01, 0, 0.01, 0.03, 0.1, 0.3, 1, 3, 10),
            registry=r,
        )
        self.tokenize_seconds = Histogram(
            "kvdir_gateway_tokenize_seconds",
            "Tokenizing a prompt (what a remembered prompt left to do)",
            buckets=_LATENCY,
            registry=r,
        )
        self.route_seconds = Histogram(
            "kvdir_gateway_route_seconds", "Hash + lookup + decide (tokenizing apart)", buckets=_LATENCY, registry=r
        )
        self.added_seconds = Histogram(
            "kvdir_gateway_added_seconds",
            "From a request's arrival to its forwarding, tokenizing and hashing excluded",
            buckets=_LATENCY,
            registry=r,
        )
        self.upstream_errors = Counter("kvdir_gateway_upstream_errors_total", "Upstream failures, by kind", ["kind"], registry=r)
        self.lookup_failures = Counter(
            "kvdir_gateway_lookup_failures_total",
            "REST lookups that failed (the stale mirror answered, or the request was routed by load), by cause: timeout or error",
            ["cause"],
            registry=r,
        )
        self.pulls = Counter(
            "kvdir_gateway_pulls_total",
            "Pull plans sent, by outcome: full (the engine reported the predicted cached tokens), short (fewer, or it "
            "named a failure: it recomputed the rest), unreported (its answer had no usage)",
            ["outcome"],
            registry=r,
        )
        self.pull_failures: deque[PullFailure] = deque(maxlen=PULL_FAILURES_KEPT)
        self.lookups = Counter(
            "kvdir_gateway_lookups_total",
            "Prefix lookups, by source: mirror (in-process), rest (a replica), mirror_stale (REST failed; the mirror, behind), none (routed by load)",
            ["source"],
            registry=r,
        )
        # Series the dashboards and alerts read exist from the start, at zero (a rate over no series is "no data").
        for reason in REASONS:
            self.decisions.labels(reason)
        for source in ("mirror", "rest", "mirror_stale", "none"):
            self.lookups.labels(source)
        for cause in ("timeout", "error"):
            self.lookup_failures.labels(cause)
        for kind in ("connect", "error", "stream"):
            self.upstream_errors.labels(kind)
        for outcome in ("full", "short", "unreported"):
            self.pulls.labels(outcome)
        Gauge("kvdir_gateway_engines", "Engines known", registry=r).set_function(lambda: len(registry.engines))
        Gauge("kvdir_gateway_directory_up", "1 if the last directory read succeeded", registry=r).set_function(
            lambda: 1 if registry.directory_ok else 0
        )
        self.tasks = TaskFailures("kvdir_gateway", TASKS, r)

    def sample(self, now: float) -> Sample:
        """The routing counters' values now (the status page's history differences them)."""
        return Sample(
            now,
            _by_label(self.decisions),
            _value(self.prompt_tokens, "total"),
            _value(self.predicted, "total"),
            _value(self.reported, "total"),
            _value(self.prediction_error, "sum"),
            _value(self.prediction_error, "count"),
            _by_label(self.lookups),
            sum(_by_label(self.upstream_errors).values()),
            _by_label(self.pulls),
        )

    def pulled(
        self, at: float, node_id: str, source: str, predicted: int, reported: int | None, engine_failures: Sequence[str]
    ) -> None:
        """Count the outcome of one pull plan, and keep it among the latest failures if it fell short."""
        if reported is None and not engine_failures:
            self.pulls.labels("unreported").inc()
        elif engine_failures or (reported is not None and reported < predicted):
            self.pulls.labels("short").inc()
            categories = dict.fromkeys(failure_category(f) for f in engine_failures)
            reason = "; ".join(categories) or f"the engine reported {reported} of {predicted} predicted cached tokens"
            self.pull_failures.append(PullFailure(at, node_id, source, predicted, reported, reason))
            if engine_failures:
                log.debug("pull by %s from %s fell short: %s", node_id, source, "; ".join(engine_failures)[:1000])
        else:
            self.pulls.labels("full").inc()

    def watch_mirror(self, mirror: Mirror | None) -> None:
        """Gauges of the directory mirror's freshness (absent when the gateway keeps none)."""
        if mirror is None:
            return
        r = self.registry
        Gauge(
            "kvdir_gateway_mirror_lag_seconds",
            "Seconds since the mirror was last caught up with a fresh replica, its most stale shard's "
            "(above --mirror-max-lag-s: REST lookups)",
            registry=r,
        ).set_function(lambda: min(mirror.lag_s(), 1e9))
        Gauge(
            "kvdir_gateway_mirror_position", "The mirror's log position (commands applied, over every shard)", registry=r
        ).set_function(lambda: mirror.position)
        Gauge(
            "kvdir_gateway_mirror_shard_map_version",
            "The shard map the mirror follows (0: the directory is not sharded)",
            registry=r,
        ).set_function(lambda: mirror.map_version)
        r.register(_ShardGauges(mirror))
        r.register(  # the mirror's counts, summed over its feeds (one per shard, made as shards appear)
            ScrapedCounters(
                [
                    ("kvdir_gateway_mirror_snapshots", "Snapshots the mirror loaded", lambda: mirror.snapshots),
                    ("kvdir_gateway_mirror_failovers", "Streams the mirror lost and resumed elsewhere", lambda: mirror.failovers),
                    (
                        "kvdir_gateway_mirror_rejected",
                        "Streams the mirror dropped for a frame that failed its checks",
                        lambda: mirror.rejected,
                    ),
                    (
                        "kvdir_gateway_mirror_restarts",
                        "Times a task of the mirror failed and was started again (logged with a traceback)",
                        lambda: mirror.restarts,
                    ),
                ]
            )
        )


class _ShardGauges(Collector):
    """Lag and position per shard of a sharded directory: which shard holds the mirror back."""

    def __init__(self, mirror: Mirror) -> None:
        self.mirror = mirror

    def collect(self) -> Iterator[GaugeMetricFamily]:
        lag = GaugeMetricFamily(
            "kvdir_gateway_mirror_shard_lag_seconds", "Seconds since the shard's feed was last caught up", labels=["shard"]
        )
        position = GaugeMetricFamily("kvdir_gateway_mirror_shard_position", "The shard's log position", labels=["shard"])
        for name, feed in self.mirror.feeds.items():
            if name:  # an unsharded directory's one feed is the mirror itself: no label
                lag.add_metric([name], min(feed.lag_s(), 1e9))
                position.add_metric([name], feed.position)
        yield lag
        yield position


def _by_label(counter: Counter) -> dict[str, float]:
    """A one-label counter's values, by that label's value: those that happened (its series exist at zero from the
    start, for the dashboards)."""
    return {next(iter(s.labels.values())): s.value for s in _samples(counter, "total") if s.value}


def _value(metric: Counter | Histogram, sample: str) -> float:
    """An unlabelled counter's `total`, or a histogram's `sum` or `count`."""
    return sum(s.value for s in _samples(metric, sample))


def _samples(metric: Counter | Histogram, sample: str) -> list[MetricSample]:
    """The metric's samples of one kind, by their exact name: the family's name and the kind (`total`, `sum`, `count`),
    never another series whose name happens to end alike (a counter's `created`, a histogram's buckets)."""
    return [s for m in metric.collect() for s in m.samples if s.name == f"{m.name}_{sample}"]
