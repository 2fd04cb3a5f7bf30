"""Live replay: send a trace through the running gateway at its (scaled) timestamps.

A trace names blocks, not tokens. Each block's tokens are generated from its
chained key, so prompts share exactly the token prefixes the trace says they
share, and the engines' real block hashing sees the same reuse the simulator
counts. Requests go out open loop (at their arrival times, whether or not
earlier ones have been answered); the answers' `cached_tokens`, the engines'
time to first token and the gateway's decision headers give the same metrics
as the simulation.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np

from kvdir.progress import stderr_meter
from kvtools.replay.trace import TraceRequest

_MIX = np.uint64(0x9E3779B97F4A7C15)


def tokens_for(req: TraceRequest, block_tokens: int) -> list[int]:
    """Token ids for a trace request: block j's tokens are a function of its chained key alone."""
    parts = []
    for j, key in enumerate(req.blocks):
        n = min(block_tokens, req.input_tokens - j * block_tokens)
        if n <= 0:
            break
        x = (np.arange(1, n + 1, dtype=np.uint64) * _MIX) ^ np.uint64(key & (2**64 - 1))
        x ^= x >> np.uint64(29)
        parts.append((x % np.uint64(50_000)).astype(np.int64))
    return np.concatenate(parts).tolist() if parts else []


async def _replay(
    gateway: str,
    requests: Sequence[TraceRequest],
    block_tokens: int,
    time_scale: float,
    max_output: int,
    model: str,
    progress: bool,
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    meter = stderr_meter("live replay", len(requests), unit="answered") if progress else None
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.monotonic()
        t0 = requests[0].arrival_s if requests else 0.0

        async def one(i: int, req: TraceRequest) -> None:
            await asyncio.sleep(max(0.0, start + (req.arrival_s - t0) * time_scale - time.monotonic()))
            body = {"model": model, "prompt": tokens_for(req, block_tokens), "max_tokens": min(req.output_tokens, max_output)}
            sent = time.monotonic()
            r = await http.post(gateway + "/v1/completions", json=body)
            row: dict[str, Any] = {"i": i, "status": r.status_code, "latency_s": time.monotonic() - sent}
            if r.status_code == 200:
                payload = r.json()
                row.update(
                    prompt_tokens=payload["usage"]["prompt_tokens"],
                    cached_tokens=payload["usage"]["prompt_tokens_details"]["cached_tokens"],
                    ttft_s=payload.get("kvdir", {}).get("ttft_s"),
                    pulled_tokens=payload.get("kvdir", {}).get("pulled_tokens", 0),
                    node=r.headers.get("x-kvdir-node"),
                    decision=r.headers.get("x-kvdir-decision"),
                    predicted=int(r.headers.get("x-kvdir-predicted-cached-tokens", 0)),
                )
            results.append(row)
            if meter is not None:
                meter.update(len(results), time.monotonic())

        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        if meter is not None:
            meter.close(time.monotonic())
    return sorted(results, key=lambda r: r["i"])


def live_replay(
    gateway: str,
    requests: Sequence[TraceRequest],
    *,
    block_tokens: int,
    time_scale: float = 1.0,
    max_output: int = 16,
    model: str = "kvdir-stub",
    progress: bool = True,
) -> dict[str, Any]:
    """Replay `requests` through `gateway`; returns the metrics the simulation reports, where measurable."""
    rows = asyncio.run(_replay(gateway.rstrip("/"), requests, block_tokens, time_scale, max_output, model, progress))
    ok = [r for r in rows if r["status"] == 200]
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    per_node: Counter[str | None] = Counter()
    for r in ok:
        per_node[r["node"]] += r["prompt_tokens"] - r["cached_tokens"]  # prefill work done there
    loads = list(per_node.values())
    return {
        "requests": len(rows),
        "failed": len(rows) - len(ok),
        "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft else None,
        "ttft_p90_s": float(np.percentile(ttft, 90)) if ttft else None,
        "ttft_p99_s": float(np.percentile(ttft, 99)) if ttft else None,
        "imbalance": max(loads) / (sum(loads) / len(loads)) if loads and sum(loads) else 1.0,
        "pulls": sum(1 for r in ok if r["pulled_tokens"]),
        "decisions": dict(Counter(r["decision"] for r in ok)),
        "prediction_exact": sum(1 for r in ok if r["predicted"] == r["cached_tokens"]) / len(ok) if ok else None,
    }
