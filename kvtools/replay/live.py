"""Live replay: send a trace through the running gateway at its (scaled) timestamps.

A trace names blocks, not tokens. Each block's tokens are generated from its
chained key, so prompts share exactly the token prefixes the trace says they
share, and the engines' real block hashing sees the same reuse the simulator
counts. Requests go out open loop (at their arrival times, whether or not
earlier ones have been answered); the answers' `cached_tokens`, the time to
first token (the engine's own figure, or with `stream` the first streamed token
timed here: real engines report none) and the gateway's decision headers give
the same metrics as the simulation.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np

from kvdir.progress import stderr_meter
from kvtools.replay.trace import TraceRequest

_MIX = np.uint64(0x9E3779B97F4A7C15)


def tokens_for(req: TraceRequest, block_tokens: int, vocab: int = 50_000) -> list[int]:
    """Token ids below `vocab` for a trace request: block j's tokens are a function of its chained key alone."""
    parts = []
    for j, key in enumerate(req.blocks):
        n = min(block_tokens, req.input_tokens - j * block_tokens)
        if n <= 0:
            break
        x = (np.arange(1, n + 1, dtype=np.uint64) * _MIX) ^ np.uint64(key & (2**64 - 1))
        x ^= x >> np.uint64(29)
        parts.append((x % np.uint64(vocab)).astype(np.int64))
    return np.concatenate(parts).tolist() if parts else []


async def _replay(
    gateway: str,
    requests: Sequence[TraceRequest],
    block_tokens: int,
    time_scale: float,
    max_output: int,
    model: str,
    progress: bool,
    stream: bool,
    vocab: int,
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    meter = stderr_meter("live replay", len(requests), unit="answered") if progress else None
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.monotonic()
        t0 = requests[0].arrival_s if requests else 0.0

        async def one(i: int, req: TraceRequest) -> None:
            await asyncio.sleep(max(0.0, start + (req.arrival_s - t0) * time_scale - time.monotonic()))
            body: dict[str, Any] = {
                "model": model,
                "prompt": tokens_for(req, block_tokens, vocab),
                "max_tokens": min(req.output_tokens, max_output),
            }
            if stream:
                body.update(stream=True, stream_options={"include_usage": True})
            sent = time.monotonic()
            async with http.stream("POST", gateway + "/v1/completions", json=body) as r:
                payload, first = await (_streamed(r, sent) if stream and r.status_code == 200 else _whole(r))
            row: dict[str, Any] = {"i": i, "status": r.status_code, "latency_s": time.monotonic() - sent}
            if r.status_code == 200:
                row.update(
                    prompt_tokens=payload["usage"]["prompt_tokens"],
                    cached_tokens=(payload["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                    ttft_s=first if first is not None else payload.get("kvdir", {}).get("ttft_s"),
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


async def _whole(r: httpx.Response) -> tuple[dict[str, Any], None]:
    await r.aread()
    return (r.json() if r.status_code == 200 else {}), None


async def _streamed(r: httpx.Response, sent: float) -> tuple[dict[str, Any], float | None]:
    """The stream's last usage chunk (as the whole answer's), and the seconds from `sent` to its first token."""
    first: float | None = None
    usage: dict[str, Any] = {}
    async for line in r.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if first is None and chunk.get("choices"):
            first = time.monotonic() - sent
        usage = chunk.get("usage") or usage
    return {"usage": usage}, first


def live_replay(
    gateway: str,
    requests: Sequence[TraceRequest],
    *,
    block_tokens: int,
    time_scale: float = 1.0,
    max_output: int = 16,
    model: str = "kvdir-stub",
    progress: bool = True,
    stream: bool = False,
    vocab: int = 50_000,
) -> dict[str, Any]:
    """Replay `requests` through `gateway`; returns the metrics the simulation reports, where measurable. `stream`:
    each answer streamed, its TTFT timed here to the first token (through the gateway); else the engine's own."""
    rows = asyncio.run(
        _replay(gateway.rstrip("/"), requests, block_tokens, time_scale, max_output, model, progress, stream, vocab)
    )
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
