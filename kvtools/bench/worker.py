"""`kvdir bench worker`: pull throughput vs the transfer engine's raw reads, publish lag, and
worker overhead (requests/s with no simulated time)."""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvdir.local_cluster import Cluster, Workers, free_ports
from kvdir.progress import clocked, stderr_meter
from kvtools.bench.clusters import bench_directory, pull_pair
from kvtools.bench.loadgen import LoadSpec, load_in_process, run_load
from kvtools.bench.report import emit, header, pct, say
from kvtools.bench.transfer_read import measure_read_bandwidth


def bench_pull(tmp: Path, urls: list[str], quick: bool, engine: str) -> dict[str, Any]:
    """A 1 GiB prefix (256 blocks x 4 ranks x 1 MiB) pulled by one worker from another."""
    tp, block_bytes = 4, 1 << 20
    blocks = 64 if quick else 256
    total = blocks * tp * block_bytes
    rates, with_verify = [], []
    with pull_pair(tmp, urls, blocks=blocks, tp=tp, block_bytes=block_bytes, engine=engine) as pair:
        for round_ in range(3):
            k = pair.pull(round_)
            rates.append(k["pull_bytes"] / k["pull_transfer_s"] / 1e9)
            with_verify.append(k["pull_bytes"] / k["pull_s"] / 1e9)
    say(f"  raw {engine} reads of {total >> 20} MiB in one process pair...")
    raw = measure_read_bandwidth(engine, total, block_bytes, pieces_per_batch=blocks * tp, repeats=3)
    pull_gbps = statistics.median(rates)
    return {
        "pull_engine": engine,
        "pull_bytes": total,
        "pull_transfer_gbps": pull_gbps,
        "pull_with_verify_gbps": statistics.median(with_verify),
        "raw_single_read_gbps": raw["single_read_gbps"],
        "raw_batched_gbps": raw["batched_gbps"],
        "pull_vs_raw_single": pull_gbps / raw["single_read_gbps"],
    }


async def _probe_lag(worker: str, follower: str, n: int, interval: float) -> list[float]:
    """Send unique 2-block prompts; time from each answer to its blocks being visible on a follower."""
    lags: list[float] = []
    async with httpx.AsyncClient(timeout=30) as http:
        for i in range(n):
            tokens = [int(x) for x in np.random.default_rng(i + 10_000).integers(0, 2**31, 32)]
            r = await http.post(worker + "/v1/completions", json={"model": "kvdir-stub", "prompt": tokens, "max_tokens": 0})
            done = time.perf_counter()
            r.raise_for_status()
            while True:
                res = (await http.post(follower + "/v1/lookup", json={"tokens": tokens, "model": "kvdir-stub"})).json()
                if res["holders"] and res["holders"][0]["matched_blocks"] == 2:
                    lags.append(time.perf_counter() - done)
                    break
                if time.perf_counter() - done > 10:
                    raise RuntimeError("a published block never became visible")
            await asyncio.sleep(interval)
    return lags


def bench_publish_and_overhead(tmp: Path, c: Cluster, quick: bool) -> dict[str, Any]:
    duration = 3.0 if quick else 10.0
    w = Workers(
        tmp,
        free_ports(2),
        c.replica_urls,
        extra_args=("--transfer", "tcp", "--time-scale", "0", "--capacity-blocks", "65536", "--max-running", "256"),
    )
    out: dict[str, Any] = {}
    try:
        w.start()
        w.wait_ready(120)
        leader = c.wait_ready(30)
        follower = next(u for u in c.replica_urls if u != leader)
        # Background: 250 unique prompts/s of 4 blocks each to the other worker: 1,000 block publishes/s.
        ctx = multiprocessing.get_context("spawn")
        say(f"  publish lag at 1,000 block publishes/s for {duration:.0f}s...")
        with ctx.Pool(1) as pool:
            bg = pool.apply_async(run_load, (LoadSpec([w.urls[1]], "complete", duration, 8, 1, [], [], rate=250.0),))
            lags = asyncio.run(_probe_lag(w.urls[0], follower, int(duration * 10), 0.1))
            load = bg.get()
        metrics = httpx.get(w.urls[1] + "/metrics").text
        published = next(
            float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("kvdir_worker_published_blocks_total")
        )
        out.update(
            publish_lag_p50_ms=pct(lags, 50) * 1e3,
            publish_lag_p99_ms=pct(lags, 99) * 1e3,
            publish_background_blocks_per_s=published / duration,
            publish_background_requests_per_s=load["items"] / duration,
        )
        say(f"  worker requests/s at --time-scale 0 for {duration:.0f}s...")
        with stderr_meter("  worker load", duration, unit="s") as meter:
            res = load_in_process(LoadSpec([w.urls[0]], "complete", duration, 16, 2, [], []), clocked(meter))
        out.update(
            worker_requests_per_s=res["items"] / duration,
            worker_p50_ms=pct(res["latencies"], 50) * 1e3,
            worker_p99_ms=pct(res["latencies"], 99) * 1e3,
            worker_errors=res["errors"],
        )
    finally:
        w.stop()
    return out


def main(*, as_json: bool, quick: bool) -> int:
    results: dict[str, Any] = header(quick)
    with bench_directory() as (c, tmp):
        say("pull of a 1 GiB prefix (4 ranks x 256 blocks x 1 MiB) between two workers (mooncake, tcp)...")
        results.update(bench_pull(tmp, c.replica_urls, quick, "mooncake"))
        results.update(bench_publish_and_overhead(tmp, c, quick))
    emit(results, as_json)
    return 0
