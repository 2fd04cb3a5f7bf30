"""The engines' load read from their own /metrics (gateway.engine_load): vLLM's and SGLang's series, a data-parallel
engine's rank, text that is not what it should be; the reads themselves against in-process engines (httpx's
MockTransport); and what routing makes of the figures with the gateway's own requests (gateway.router)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from gateway import engine_load
from gateway.engine_load import EngineLoad, LoadScraper, parse_load
from gateway.engine_registry import EngineState, parse_origin
from gateway.router import make_candidate
from kvproto.schemas import DP_RANK_HEADER
from tests.support.wait import until

# As vLLM 0.32 writes it (abridged): help and type lines, a histogram, `_created` samples, a longer name that
# starts with a shorter one's, two data-parallel ranks of one API server.
VLLM_DP = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-0.6B"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-0.6B"} 7.0
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="1",model_name="Qwen/Qwen3-0.6B",reason="capacity"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.75
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.0
vllm:num_preemptions_total{engine="1",model_name="Qwen/Qwen3-0.6B"} 4.0
vllm:num_preemptions_created{engine="1",model_name="Qwen/Qwen3-0.6B"} 1.7e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="Qwen/Qwen3-0.6B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-0.6B"} 12.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen3-0.6B"} 12.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Qwen/Qwen3-0.6B"} 1.5
"""

SGLANG = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0"} 2.0
sglang:num_running_reqs{model_name="m",tp_rank="1"} 2.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 6.0
sglang:num_queue_reqs{model_name="m",tp_rank="1"} 6.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m",tp_rank="0"} 0.5
"""


def _vllm(running: float, waiting: float, usage: float = 0.5, preempted: float = 0.0) -> str:
    labels = '{engine="0",model_name="m"}'
    return (
        f"vllm:num_requests_running{labels} {running}\nvllm:num_requests_waiting{labels} {waiting}\n"
        f"vllm:kv_cache_usage_perc{labels} {usage}\nvllm:num_preemptions_total{labels} {preempted}\n"
    )


# ---------------------------------------------------------------------------
# The figures in the text


def test_a_data_parallel_rank_reads_its_own_series() -> None:
    assert parse_load(VLLM_DP, 1) == EngineLoad("vllm", 5.0, 7.0, 0.75, 4.0)
    assert parse_load(VLLM_DP, 0) == EngineLoad("vllm", 3.0, 0.0, 0.25, 0.0)
    # One engine for the whole API server: its ranks summed, their KV use averaged.
    assert parse_load(VLLM_DP, None) == EngineLoad("vllm", 8.0, 7.0, 0.5, 4.0)
    # A rank the server does not label: not this engine's figures.
    assert parse_load(VLLM_DP, 2) is None


def test_unlabelled_series_are_the_engines_whatever_its_rank() -> None:
    text = "vllm:num_requests_running 2\nvllm:num_requests_waiting 1\n"
    assert parse_load(text, 3) == EngineLoad("vllm", 2.0, 1.0, None, None)


def test_sglang_series_count_a_schedulers_tp_ranks_once() -> None:
    assert parse_load(SGLANG, None) == EngineLoad("sglang", 2.0, 6.0, 0.5, None)


def test_text_without_load_or_with_hostile_figures() -> None:
    assert parse_load("# nothing here\nprocess_cpu_seconds_total 12.0\n", None) is None
    assert parse_load("vllm:num_requests_running 2\n", None) is None  # running without waiting: not read
    # Negative or non-finite figures (outside input) count as 0, a usage past 1 as 1.
    assert parse_load(_vllm(-5, float("nan"), usage=7.0), None) == EngineLoad("vllm", 0.0, 0.0, 1.0, 0.0)
    with pytest.raises(ValueError):
        parse_load("vllm:num_requests_running{engine=0} two\n", None)


# ---------------------------------------------------------------------------
# Reading them


def _engine(node_id: str, port: int, dp_rank: int | None = None) -> EngineState:
    e = EngineState(node_id, parse_origin(f"http://127.0.0.1:{port}"))
    e.dp_rank = dp_rank
    e.heartbeat_running, e.heartbeat_waiting = 9.0, 9.0
    return e


def test_each_engine_is_read_on_its_own_and_a_failing_one_falls_back_to_its_heartbeat(monkeypatch) -> None:
    monkeypatch.setattr(engine_load, "SCRAPE_TIMEOUT_S", 0.2)
    asyncio.run(_read_engines())


async def _read_engines() -> None:
    release = asyncio.Event()
    asked: list[tuple[int, str | None]] = []

    async def engines(request: httpx.Request) -> httpx.Response:
        port = request.url.port or 0
        asked.append((port, request.headers.get(DP_RANK_HEADER)))
        if port == 1:  # answers for the rank it is asked about, as the worker stub does
            rank = int(request.headers[DP_RANK_HEADER])
            return httpx.Response(200, text=_vllm(rank + 1, 2 * rank, preempted=3).replace('"0"', f'"{rank}"'))
        if port == 2:  # hangs
            await release.wait()
        return httpx.Response(404)  # port 3: no /metrics

    registry = {"dp0": _engine("dp0", 1, 0), "dp1": _engine("dp1", 1, 1), "slow": _engine("slow", 2), "none": _engine("none", 3)}
    registry["dp1"].inflight = 2  # the gateway's requests there when the read began
    async with httpx.AsyncClient(transport=httpx.MockTransport(engines)) as http:
        scraper = LoadScraper(registry, http, interval_s=10.0)  # reads only when the test ticks
        t0 = time.monotonic()
        try:
            scraper.tick(t0)
            # The hanging engine does not hold up the others' reads.
            await until(lambda: registry["dp1"].load_scraped is not None, what="rank 1 read")
            dp0, dp1 = registry["dp0"], registry["dp1"]
            assert (dp0.running, dp0.waiting, dp1.running, dp1.waiting) == (1.0, 0.0, 2.0, 2.0)
            assert dp1.reported_inflight == 2 and dp1.load_scraped == EngineLoad("vllm", 2.0, 2.0, 0.5, 3.0)
            dp1.inflight = 5  # sent since: in the engine's next read, not in this one
            assert dp1.reported_inflight == 2
            assert sorted(asked) == [(1, "0"), (1, "1"), (2, None), (3, None)]
            scraper.tick(t0 + 1.0)  # none due yet, none read twice at once
            await until(lambda: not scraper._reads, what="the hanging read timed out")
            # Both failures fell back on their heartbeats' figures ...
            for e in (registry["slow"], registry["none"]):
                assert (e.load_scraped, e.running, e.waiting, e.reported_inflight) == (None, 9.0, 9.0, e.inflight)
            # ... and are read again after two intervals, not one.
            del asked[:]
            scraper.tick(t0 + 10.5)
            await until(lambda: not scraper._reads, what="the ranks read again")
            assert sorted(asked) == [(1, "0"), (1, "1")]
            scraper.tick(t0 + 20.5)
            await until(lambda: len(asked) == 6 and not scraper._reads, what="all read again")
            # An engine the registry forgot is forgotten here too.
            del registry["none"]
            scraper.tick(t0 + 100)
            assert "none" not in scraper._due and "none" not in scraper._failing
        finally:
            release.set()
            await scraper.stop()


def test_a_read_is_routed_on_while_fresh_then_the_heartbeat() -> None:
    e = _engine("a", 1)
    e.inflight = 4
    e.scraped, e.scraped_inflight, e.scraped_at = EngineLoad("vllm", 1.0, 3.0, 0.5, 0.0), 3, time.monotonic()
    e.scraped_until = time.monotonic() + 60
    assert (e.running, e.waiting, e.reported_inflight) == (1.0, 3.0, 3)
    e.scraped_until = time.monotonic() - 1
    assert (e.running, e.waiting, e.reported_inflight) == (9.0, 9.0, 4)


# ---------------------------------------------------------------------------
# What routing makes of them: the gateway's own requests counted once


def _load(running: float, waiting: float, inflight: int, reported_inflight: int | None) -> tuple[int, int, int]:
    c = make_candidate(
        "a",
        1,
        reported_running=running,
        waiting=waiting,
        inflight=inflight,
        reported_inflight=reported_inflight,
        pending_prefill_tokens=0.0,
    )
    return c.running, c.waiting, c.inflight


def test_the_gateways_requests_queued_at_the_engine_are_not_also_its_waiting() -> None:
    # A stub running one request of ours and holding three more of ours queued: four requests, not seven.
    assert _load(1, 3, 4, None) == (0, 0, 4)
    # Two of another client's queued behind them: they stay waiting.
    assert _load(1, 5, 4, None) == (0, 2, 4)
    # Others running beside ours: running, as before.
    assert _load(5, 2, 3, None) == (2, 2, 3)


def test_a_read_counts_what_the_gateway_sent_and_finished_since() -> None:
    # Read with 4 of ours there (1 running, 3 queued); 2 sent since: the engine has not seen them, they count.
    assert _load(1, 3, 6, 4) == (0, 0, 6)
    # Read with 3 of ours among 6; one of ours finished since: 5 left.
    assert sum(_load(4, 2, 2, 3)) == 5
    # Subtracting today's in-flight count instead would take the 2 just sent out of the others' requests.
    assert _load(4, 2, 5, 3) == (1, 2, 5)


@pytest.mark.parametrize("running", range(6))
def test_the_total_is_the_engines_others_plus_the_gateways_own_now(running: int) -> None:
    for waiting in range(6):
        for then in range(8):
            for now in range(8):
                r, w, i = _load(running, waiting, now, then)
                assert min(r, w, i) >= 0
                assert r + w + i == max(0, running + waiting - then) + now
                assert r <= max(0, running - then)  # ours leave the engine's running first
