"""The vLLM connector's Prometheus metrics (its scheduler half counts them; `metrics` serves them).

A registry of their own: vLLM's process has its own metrics, and an engine may run several connectors (DP ranks).
Every labelled counter starts with its known labels at zero, so a dashboard shows 0, not "no data".
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from kvproto.tasks import TaskFailures

PLAN_OUTCOMES = ("pull", "joined", "cached", "own", "invalid", "fingerprint", "refused")
"""What became of a request's pull plan: pulled; joined a pull of the same blocks already under way here; its
blocks were cached here already; it named this engine; malformed; another model's KV; its source is unknown, of
another TP size or tenant (docs/engines.md)."""


VLLM_COUNTERS = (
    ("pulls", "vllm:kvdir_pulls", "kvdir pulls that ended (landed, failed or given up), over TP ranks"),
    ("pulled_blocks", "vllm:kvdir_pulled_blocks", "kvdir blocks pulled from peers and validated, over TP ranks"),
    ("failed_blocks", "vllm:kvdir_pull_failed_blocks", "kvdir pulled blocks that failed (recomputed), over TP ranks"),
    ("read_bytes", "vllm:kvdir_pull_read_bytes", "KV page bytes kvdir pulls read from peers, over TP ranks"),
    ("read_s", "vllm:kvdir_pull_read_seconds", "seconds of those reads, summed over TP ranks"),
)
"""The pull counts vLLM's own /metrics shows (`KvdirConnector.build_prom_metrics`): (key of the stats vLLM gathers
from the worker halves each step, metric name, help). The connector's `metrics` port has the rest."""


class ConnectorMetrics:
    """The counters, in one registry."""

    def __init__(self, tp_size: int) -> None:
        r = self.registry = CollectorRegistry()
        self.tasks = TaskFailures("kvdir_connector", ("publish",), r)
        self.pulled = Counter("kvdir_connector_pulled_blocks_total", "Blocks pulled from peers and validated", registry=r)
        self.failed = Counter(
            "kvdir_connector_pull_failed_blocks_total", "Pulled blocks that failed (transfer or stale): recomputed", registry=r
        )
        self.failed_pulls = Counter("kvdir_connector_pull_failures_total", "Pulls with at least one failed block", registry=r)
        self.read_bytes = Counter(
            "kvdir_connector_pull_page_bytes_total", "KV page bytes read from peers (reads that completed)", registry=r
        )
        self.read_s = Counter(
            "kvdir_connector_pull_read_seconds_total",
            "Time in those reads: tags, pages, tags again (page bytes / this = the pull bandwidth)",
            registry=r,
        )
        self.rank_read_bytes = Counter(
            "kvdir_connector_pull_rank_page_bytes_total", "KV page bytes read from peers, by TP rank", ["rank"], registry=r
        )
        self.rank_read_s = Counter(
            "kvdir_connector_pull_rank_read_seconds_total", "Time in those reads, by TP rank", ["rank"], registry=r
        )
        self.plans = Counter(
            "kvdir_connector_plans_total", "Requests that carried a pull plan, by outcome", ["outcome"], registry=r
        )
        self.published = Counter("kvdir_connector_published_blocks_total", "Blocks published to the directory", registry=r)
        self.host_saved = Counter("kvdir_connector_host_saved_blocks_total", "Blocks saved to the host tier", registry=r)
        self.host_loaded = Counter(
            "kvdir_connector_host_loaded_blocks_total", "Blocks loaded back from the host tier and validated", registry=r
        )
        self.host_failed = Counter(
            "kvdir_connector_host_load_failed_blocks_total", "Host-tier loads that failed the tag check: recomputed", registry=r
        )
        self.host_evicted = Counter(
            "kvdir_connector_host_evicted_blocks_total", "Blocks the host tier dropped to make room", registry=r
        )
        self.removed = Counter("kvdir_connector_removed_blocks_total", "Published blocks found evicted", registry=r)
        self.pulls_in_flight = Gauge(
            "kvdir_connector_pulls_in_flight", "Requests waiting in vLLM's WAITING_FOR_REMOTE_KVS for a pull", registry=r
        )
        for outcome in PLAN_OUTCOMES:
            self.plans.labels(outcome)
        for rank in range(tp_size):
            self.rank_read_bytes.labels(str(rank))
            self.rank_read_s.labels(str(rank))

    def serve(self, host_port: str) -> None:
        """Serve them on HOST:PORT (a thread of prometheus_client's)."""
        host, _, port = host_port.rpartition(":")
        start_http_server(int(port), host.strip("[]"), registry=self.registry)
