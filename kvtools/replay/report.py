"""`kvdir replay`'s report: run policies over a trace or a synthetic workload, print a table, write JSON and plots.

The flags are kvtools.replay.cli's; the figures are drawn by `kvtools.plots`, with the benchmarks'.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gateway.policy import POLICIES
from kvdir.progress import clocked, stderr_meter
from kvtools.plots import replay_plots
from kvtools.replay import trace as tr
from kvtools.replay.peers_real import PeersUnavailable, dynamo_real, format_peers
from kvtools.replay.sim import SimParams, describe_params, oracle_hit_rate, pooled_lru, simulate, ttft_floor

__all__ = ["run_replay"]

ORDER = ["kvdir", "round_robin", "least_loaded", "sglang", "dynamo", "local_only"]
LABELS = {  # baselines modeled after peers are labelled so (peers.md)
    "sglang": "sglang (modeled)",
    "dynamo": "dynamo (modeled)",
}
SYNTHETIC: dict[str, Callable[..., list[tr.TraceRequest]]] = {
    "multi_turn": tr.multi_turn,
    "shared_prefix": tr.shared_prefix,
    "hot_prefix": tr.hot_prefix_burst,
    # A live burst on one hot prefix (gateway.inflight): 48 requests on one uncached 6,144-token prefix within ~50 ms.
    "burst": functools.partial(tr.hot_prefix_burst, 48, 6144, 1000.0, suffix_tokens=64, output_tokens=16),
    # Sessions on shared documents whose distinct blocks are 3x the aggregate cache (--nodes x --capacity-blocks).
    "tight_cache": tr.tight_cache,
}
SIZED = frozenset({"tight_cache"})  # generators sized from the simulated cluster's nodes and capacity


def _policies(spec: str) -> list[str]:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in POLICIES]
    if bad or not names:
        raise ValueError(f"unknown policies {bad or spec!r}; valid: {', '.join(ORDER)}")
    return list(dict.fromkeys(names))


def simulate_all(requests: list[tr.TraceRequest], names: list[str], params: SimParams) -> dict[str, dict[str, Any]]:
    """Each policy's simulation of `requests`, in turn, under one progress bar (stderr): a full trace takes a while."""
    results: dict[str, dict[str, Any]] = {}
    with stderr_meter("replay", len(names) * len(requests), unit="requests") as meter:
        tick = clocked(meter)
        for k, name in enumerate(names, 1):
            meter.stage(f"{name} {k}/{len(names)}", len(requests), time.monotonic())
            results[name] = simulate(requests, name, params, progress=lambda done, _: tick(done))
    return results


def _fmt_s(x: float) -> str:
    return f"{x:.3f}" if x < 100 else f"{x:.0f}"


def format_table(results: dict[str, dict[str, Any]], oracle_tokens: float) -> str:
    """The results as a fixed-width text table."""
    head = [
        "policy",
        "hit%",
        "/oracle",
        "local%",
        "host%",
        "pulled%",
        "redund%",
        "ttft p50",
        "p90",
        "p99",
        "imbal",
        "pulls",
        "GB moved",
        "evictions",
        "copies",
        "pred err%",
        "exact%",
        "req/s",
        "sim s",
    ]
    rows = []
    for name, r in results.items():
        rows.append(
            [
                LABELS.get(name, name),
                f"{100 * r['hit_rate']:.1f}",
                f"{r['hit_rate'] / oracle_tokens:.2f}" if oracle_tokens else "-",
                f"{100 * r['local_hit_rate']:.1f}",
                f"{100 * r['host_hit_rate']:.1f}",
                f"{100 * r['pulled_hit_rate']:.1f}",
                f"{100 * r['redundant_prefill']:.1f}",
                _fmt_s(r["ttft_p50_s"]),
                _fmt_s(r["ttft_p90_s"]),
                _fmt_s(r["ttft_p99_s"]),
                f"{r['imbalance']:.3f}",
                str(r["pulls"]),
                f"{r['bytes_moved'] / 1e9:.1f}",
                str(r["evictions"]),
                f"{r['copies_per_block']:.3f}",
                f"{100 * r['prediction_error']:.2f}",
                f"{100 * r['prediction_exact']:.1f}",
                f"{r['throughput_rps']:.3f}",
                f"{r['wall_s']:.2f}",
            ]
        )
    widths = [max(len(h), *(len(row[k]) for row in rows)) if rows else len(h) for k, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) if k == 0 else h.rjust(w) for k, (h, w) in enumerate(zip(head, widths)))]
    for row in rows:
        lines.append("  ".join(c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def run_replay(args: argparse.Namespace, params: SimParams) -> int:
    """Run the replay the parsed `args` (kvtools.replay.cli's flags) and `params` describe; 0 on success, 2 on bad input."""
    err = sys.stderr
    try:
        names = _policies(args.policies)
    except ValueError as exc:
        print(f"kvdir replay: {exc}", file=err)
        return 2
    if args.limit is not None and args.limit < 0:
        print("kvdir replay: --limit must be >= 0", file=err)
        return 2
    t0 = time.perf_counter()
    errors: list[str] = []
    if args.trace:
        try:
            requests, errors = tr.load_mooncake(args.trace, params.block_tokens, strict=args.strict)
        except (OSError, ValueError) as exc:
            print(f"kvdir replay: {exc}", file=err)
            return 2
        source = {"trace": str(args.trace)}
        if errors:
            print(f"kvdir replay: skipped {len(errors)} malformed line(s); first: {errors[0]}", file=err)
    else:
        sized = {"nodes": params.engines, "capacity_blocks": params.capacity_blocks} if args.synthetic in SIZED else {}
        requests = SYNTHETIC[args.synthetic](seed=args.seed, block_tokens=params.block_tokens, **sized)
        source = {"synthetic": args.synthetic}
    if args.limit is not None:
        requests = requests[: args.limit]
    if not requests:
        print("kvdir replay: no requests to replay", file=err)
        return 2
    load_s = time.perf_counter() - t0
    if args.mode == "live":
        return _run_live(args, requests, names, params, source)
    oracle_blocks = oracle_hit_rate(requests)
    oracle_tokens = oracle_hit_rate(requests, by="tokens", block_tokens=params.block_tokens)
    floor = _percentiles(ttft_floor(requests, params))
    pooled_hit, pooled_ttft = pooled_lru(requests, params)
    pooled = {"hit_rate": pooled_hit, **_percentiles(pooled_ttft)}

    t1 = time.perf_counter()
    results = simulate_all(requests, names, params)
    sim_s = time.perf_counter() - t1

    print(f"{len(requests)} requests ({', '.join(f'{k} {v}' for k, v in source.items())}); {describe_params(params)}")
    print(f"oracle (infinite shared cache): {100 * oracle_tokens:.1f}% of prompt tokens, {100 * oracle_blocks:.1f}% of blocks")
    print(
        f"TTFT floor (no policy goes below: no queues, instant pulls, infinite shared cache): p50 / p90 / p99 "
        f"{floor['p50']:.3f} / {floor['p90']:.3f} / {floor['p99']:.3f} s"
    )
    print(
        f"one pooled LRU cache of the aggregate capacity (an ideal router over LRU engines; no queues): hit "
        f"{100 * pooled_hit:.1f}%, TTFT p50 / p90 / p99 {pooled['p50']:.3f} / {pooled['p90']:.3f} / {pooled['p99']:.3f} s"
    )
    print(format_table(results, oracle_tokens))
    print(f"simulated {len(names)} policies in {sim_s:.1f} s (load {load_s:.1f} s)")
    real = None
    if args.peers_real:
        try:
            real = dynamo_real(requests, params, args.peers_python)
        except PeersUnavailable as exc:
            print(f"kvdir replay: --peers-real: {exc}", file=err)
            return 2
        print(format_peers(real, results))

    if args.json:
        doc = {
            "oracle_hit_rate": oracle_tokens,
            "oracle_block_hit_rate": oracle_blocks,
            "ttft_floor_s": floor,
            "pooled_lru": pooled,
            "policies": results,
            **({"peers_real": {"dynamo": real}} if real is not None else {}),
            "params": params.as_dict(),
            "workload": {**source, "requests": len(requests), "malformed_lines": len(errors), "limit": args.limit},
            "runtime_s": {"load": load_s, "simulate": sim_s},
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        try:
            paths = replay_plots(args.plot, results, oracle_tokens, LABELS)
        except ImportError as exc:
            print(f"kvdir replay: --plot needs matplotlib ({exc})", file=err)
            return 2
        print(f"wrote {len(paths)} charts into {args.plot}")
    return 0


def _percentiles(ttft: np.ndarray) -> dict[str, float]:
    return dict(zip(("p50", "p90", "p99"), (float(x) for x in np.percentile(ttft, [50, 90, 99]))))


def _run_live(
    args: argparse.Namespace, requests: list[tr.TraceRequest], names: list[str], params: SimParams, source: dict[str, str]
) -> int:
    from kvtools.replay.live import live_replay

    err = sys.stderr
    try:
        live = live_replay(
            args.gateway,
            requests,
            block_tokens=params.block_tokens,
            time_scale=args.time_scale,
            max_output=args.max_output,
            model=args.model,
            stream=args.stream,
            vocab=args.vocab,
        )
    except OSError as exc:
        print(f"kvdir replay: cannot reach the gateway at {args.gateway}: {exc}", file=err)
        return 2
    oracle_tokens = oracle_hit_rate(requests, by="tokens", block_tokens=params.block_tokens)
    print(
        f"{len(requests)} requests ({', '.join(f'{k} {v}' for k, v in source.items())}) through {args.gateway}, "
        f"time scale {args.time_scale}"
    )
    print(f"oracle (infinite shared cache): {100 * oracle_tokens:.1f}% of prompt tokens")
    print(
        f"live: hit rate {100 * live['hit_rate']:.1f}%, TTFT p50/p90/p99 {live['ttft_p50_s']}/{live['ttft_p90_s']}/"
        f"{live['ttft_p99_s']} s ({'to the first streamed token' if args.stream else 'engine-reported'}), imbalance {live['imbalance']:.3f}, pulls {live['pulls']}, "
        f"failed {live['failed']}, decisions {live['decisions']}, predictions exact {live['prediction_exact']}"
    )
    sims: dict[str, dict[str, Any]] = {}
    if args.compare_sim:
        capped = [dataclasses.replace(r, output_tokens=min(r.output_tokens, args.max_output)) for r in requests]
        sims = simulate_all(capped, names, params)
        print("simulation of the same requests:")
        print(format_table(sims, oracle_tokens))
    if args.json:
        doc = {
            "oracle_hit_rate": oracle_tokens,
            "live": live,
            "policies": {n: {k: v for k, v in r.items() if k != "load_timeline"} for n, r in sims.items()},
            "params": params.as_dict(),
            "workload": {**source, "requests": len(requests)},
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0 if not live["failed"] else 1
