"""The engines' own Prometheus series the gateway reads their load from (gateway.engine_load), by engine family.

The names are the engines' (vLLM 0.32's `vllm/v1/metrics/loggers.py`, SGLang's scheduler metrics); the worker stub
exports vLLM's (worker_stub.metrics), so the gateway reads a stub and a vLLM engine alike. One place, so that the
stub that writes them and the gateway that reads them cannot drift apart.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "FAMILIES",
    "SGLANG",
    "VLLM",
    "VLLM_KV_USAGE",
    "VLLM_LABELS",
    "VLLM_PREEMPTIONS",
    "VLLM_RUNNING",
    "VLLM_WAITING",
    "EngineSeries",
]


class EngineSeries(NamedTuple):
    """One engine family's load series: sample names as exposed (a counter's with its `_total`), and the label a
    data-parallel engine's series carry its rank in."""

    family: str
    running: str  # requests the engine's scheduler runs (a gauge)
    waiting: str  # requests queued in it, not yet scheduled (a gauge)
    kv_usage: tuple[str, ...]  # fraction of its KV cache in use, 0..1 (a gauge; the first name found is read)
    preemptions: str | None  # requests it preempted since it started (a counter; None: the family exports none)
    rank_label: str


VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"
VLLM_PREEMPTIONS = "vllm:num_preemptions"  # a counter: its sample is `vllm:num_preemptions_total`
VLLM_LABELS = ("model_name", "engine")  # the served model's name, the data-parallel rank

VLLM = EngineSeries(
    "vllm",
    VLLM_RUNNING,
    VLLM_WAITING,
    (VLLM_KV_USAGE, "vllm:gpu_cache_usage_perc"),  # the second: vLLM before 0.10
    VLLM_PREEMPTIONS + "_total",
    VLLM_LABELS[1],
)
SGLANG = EngineSeries("sglang", "sglang:num_running_reqs", "sglang:num_queue_reqs", ("sglang:token_usage",), None, "dp_rank")
FAMILIES = (VLLM, SGLANG)
