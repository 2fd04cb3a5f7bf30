"""`kvdir bench gateway`: what the gateway adds to a request (latency, and its process's CPU per request),
tokenize + hash times, the policy's decision time, and the floor its HTTP stack sets (`http_stack`)."""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from gateway.cost import RouteRequest
from gateway.policy import make_policy
from gateway.prefix_hasher import PrefixHasher
from gateway.router import make_candidate
from kvdir.local_cluster import Cluster, Gateway, Workers, free_ports
from kvdir.progress import Meter, clocked, stderr_meter
from kvproto.hashing import block_hashes
from kvproto.tokenizer import ByteTokenizer
from kvtools.bench.http_stack import bench_http_stack, floor_proxy
from kvtools.bench.loadgen import LoadResult, LoadSpec, load_in_process
from kvtools.bench.proc import cpu_s
from kvtools.bench.report import emit, header, pct, say
from kvtools.plots import latency_cdf


def bench_tokenize_hash() -> dict[str, Any]:
    """Milliseconds to tokenize (bytes tokenizer) and hash prompts of 1k/10k/100k tokens, cold and as turn 2."""
    out: dict[str, Any] = {}
    tok = ByteTokenizer()
    rng = random.Random(0)
    for n in (1_000, 10_000, 100_000):
        text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))
        best_cold = best_turn = best_plain = float("inf")
        for _ in range(5):
            ph = PrefixHasher()
            t0 = time.perf_counter()
            tokens = tok.encode(text)
            ph.hashes(tokens)
            best_cold = min(best_cold, time.perf_counter() - t0)
            t0 = time.perf_counter()
            block_hashes(tokens)
            best_plain = min(best_plain, time.perf_counter() - t0)
            t0 = time.perf_counter()
            ph.hashes(tok.encode(text + " and the next user message of this conversation"))
            best_turn = min(best_turn, time.perf_counter() - t0)
        out[f"tokenize_hash_{n // 1000}k_ms"] = best_cold * 1e3
        out[f"hash_only_{n // 1000}k_ms"] = best_plain * 1e3
        out[f"tokenize_hash_{n // 1000}k_next_turn_ms"] = best_turn * 1e3
    return out


def bench_policy_choose() -> dict[str, Any]:
    """Microseconds for the kvdir policy to choose among 16 candidates with mixed cached prefixes and loads (best of 5)."""
    req = RouteRequest(prompt_tokens=62 * 16 + 8, hashes=tuple(range(1, 63)), max_tokens=16)
    cands = [
        make_candidate(
            f"n{i:02d}",
            1,
            reported_running=i % 5,
            waiting=0,
            inflight=i % 3,
            pending_prefill_tokens=100.0 * i,
            cached_blocks=(7 * i) % 50,
            slots=tuple(range((7 * i) % 50)),
        )
        for i in range(16)
    ]
    policy, rng = make_policy("kvdir"), random.Random(0)
    n, best = 2000, float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            policy.choose(req, cands, rng)
        best = min(best, (time.perf_counter() - t0) / n)
    return {"policy_choose_16_candidates_us": best * 1e6}


def _load(url: str, duration: float, rate: float, meter: Meter, stage: str) -> LoadResult:
    """One load run of `duration` seconds at `rate` requests/s, as the next stage of `meter`."""
    meter.stage(stage, duration, time.monotonic())
    spec = LoadSpec([url], "complete", duration, 8, 3, [], [], rate=rate)
    return load_in_process(spec, clocked(meter))


def _added_buckets(metrics: str) -> str | None:
    """The upper bound of the bucket that holds the median of the gateway's own added time."""
    added: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("kvdir_gateway_added_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            added[le] = float(line.split()[-1])
    total = added.get("+Inf", 0.0)
    return next((le for le, n in added.items() if total and n >= total / 2), None)


def _lookup_sources(metrics: str) -> dict[str, float]:
    return {
        line.split('source="')[1].split('"')[0]: float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("kvdir_gateway_lookups_total{")
    }


def bench_added_latency(quick: bool) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """Added latency over calling the worker directly, with the gateway's lookups answered by its mirror
    of the directory (the default) and by a replica over REST (--no-mirror), and through a proxy that does
    nothing but receive and forward on the gateway's HTTP stack (`http_stack.floor_proxy`: the least any
    gateway on these libraries adds), interleaved on one machine.

    Each proxy's CPU seconds per 1,000 requests (its process's, over its load windows, background work
    included) is the steadier figure on a shared machine: latency there moves with whatever else runs.
    Also returns every request's latency (seconds) by path (`direct` and each proxy), for the figures."""
    duration, rate = (3.0, 200.0) if quick else (10.0, 200.0)
    ports = free_ports(6)
    with tempfile.TemporaryDirectory(prefix="kvdir-bench-") as tmp:
        c = Cluster(Path(tmp), ports[:3], ports[3:], log_level="warning")
        w = Workers(
            Path(tmp),
            free_ports(1),
            c.replica_urls,
            extra_args=("--transfer", "tcp", "--time-scale", "0", "--max-running", "256"),
        )
        gateways: dict[str, Gateway] = {}
        try:
            c.start()
            c.wait_ready(60)
            w.start()
            w.wait_ready(60)
            for name, args in (("mirror", ()), ("rest", ("--no-mirror",))):
                (Path(tmp) / name).mkdir()
                gateways[name] = Gateway(Path(tmp) / name, free_ports(1)[0], c.replica_urls, extra_args=args)
                gateways[name].wait_ready(60, engines=1)
            with (
                floor_proxy(w.urls[0], free_ports(1)[0]) as floor,
                floor_proxy(w.urls[0], free_ports(1)[0], lean=True) as lean_floor,
            ):
                proxies = {"floor": floor, "lean_floor": lean_floor} | {n: (g.url, g.proc.pid) for n, g in gateways.items()}
                lat: dict[str, list[float]] = {name: [] for name in ("direct", *proxies)}
                cpu = dict.fromkeys(proxies, 0.0)
                sent = dict.fromkeys(proxies, 0)
                say(f"  {rate:.0f} requests/s for {duration:.0f}s straight to the worker, then through each proxy, twice...")
                with stderr_meter("added latency", 2 * len(lat) * duration, unit="s of load") as meter:
                    for r in (1, 2):  # interleaved, so all see the same machine
                        lat["direct"] += _load(w.urls[0], duration, rate, meter, f"{r}/2 direct")["latencies"]
                        for name, (url, pid) in proxies.items():
                            before = cpu_s(pid)
                            res = _load(url, duration, rate, meter, f"{r}/2 {name}")
                            cpu[name] += cpu_s(pid) - before
                            sent[name] += len(res["latencies"]) + res["errors"]
                            lat[name] += res["latencies"]
            metrics = {name: httpx.get(g.url + "/metrics").text for name, g in gateways.items()}
        finally:
            for g in gateways.values():
                g.stop()
            w.stop()
            c.stop()
    out: dict[str, Any] = {
        "direct_p50_ms": pct(lat["direct"], 50) * 1e3,
        "direct_p99_ms": pct(lat["direct"], 99) * 1e3,
        "requests_per_s": rate,
    }
    for name in proxies:
        label = {"floor": "floor_proxy", "lean_floor": "lean_floor_proxy"}.get(name, f"{name}_gateway")
        out[f"{label}_p50_ms"] = pct(lat[name], 50) * 1e3
        out[f"{label}_p99_ms"] = pct(lat[name], 99) * 1e3
        out[f"{name}_added_p50_ms"] = (pct(lat[name], 50) - pct(lat["direct"], 50)) * 1e3
        out[f"{name}_added_p99_ms"] = (pct(lat[name], 99) - pct(lat["direct"], 99)) * 1e3
        out[f"{label}_cpu_s_per_1000_requests"] = cpu[name] / max(1, sent[name]) * 1000
    for name in gateways:
        out[f"{name}_added_over_floor_p50_ms"] = (pct(lat[name], 50) - pct(lat["floor"], 50)) * 1e3
        out[f"{name}_added_over_lean_floor_p50_ms"] = (pct(lat[name], 50) - pct(lat["lean_floor"], 50)) * 1e3
        out[f"{name}_internal_added_p50_le_s"] = _added_buckets(metrics[name])
        out[f"{name}_lookup_sources"] = _lookup_sources(metrics[name])
    return out, lat


PATHS = {  # a request's path in the latency figure, by the bench's name for it
    "direct": "straight to the worker",
    "floor": "do-nothing proxy, old stack (uvicorn, FastAPI, httpcore)",
    "lean_floor": "do-nothing proxy, the completions' stack (uvicorn, ASGI, gateway.upstream)",
    "mirror": "gateway, lookups from its mirror",
    "rest": "gateway, lookups over REST (--no-mirror)",
}


def main(*, as_json: bool, quick: bool, plot: str | None = None) -> int:
    """The bench; with `plot`, also gateway_latency_cdf.png there (each path's latency CDF)."""
    results: dict[str, Any] = header(quick)
    say("tokenize + hash, 1k / 10k / 100k tokens...")
    results.update(bench_tokenize_hash())
    say("the kvdir policy's decision among 16 candidates...")
    results.update(bench_policy_choose())
    say(
        "added latency of the gateway (mirror lookups, then REST lookups) and of a do-nothing proxy on its HTTP stack,"
        " vs the worker directly (3 replicas, 1 worker at --time-scale 0)..."
    )
    figures, latencies = bench_added_latency(quick)
    results.update(figures)
    say(
        "the HTTP stack's own CPU per request: the gateway's client, httpcore and httpx forwarding, uvicorn + FastAPI"
        " receiving (kvtools/bench/http_stack.py)..."
    )
    results.update(bench_http_stack(quick))
    emit(results, as_json)
    if plot:
        latency_cdf(
            Path(plot) / "gateway_latency_cdf.png",
            {PATHS[name]: values for name, values in latencies.items()},
            title="Request latency by path: 1-token completions, 200 requests/s,\none worker at --time-scale 0",
            xlabel="latency",
        )
        say(f"wrote gateway_latency_cdf.png into {plot}")
    return 0
