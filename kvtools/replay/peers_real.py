"""The real peers beside the simulated policies: NVIDIA Dynamo's router in Dynamo's own trace simulator.

`kvdir replay --peers-real` runs `dynamo.replay` (kvtools/replay/dynamo_runner.py) in the peers venv
(`make peers-install`) on the same requests, worker count, KV capacity and block size, and reports its
prefix-cache reuse beside every kvdir policy's hit rate. Engine speed changes what a load-aware router
chooses, so Dynamo's mocker is slowed or sped up to the simulated engines' prefill and decode rates
(`speedups`). The timing models still differ (the mocker batches prefills and decodes as vLLM does; kvdir's
engine runs one prefill at a time), so TTFTs are printed, not compared: hit rates are.
Dynamo's `prefix_cache_reused_ratio` and kvdir's hit rate are the same quantity: prompt tokens served from
cache over prompt tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtools.replay.params import SimParams
from kvtools.replay.trace import TraceRequest

RUNNER = Path(__file__).with_name("dynamo_runner.py")
DEFAULT_PYTHON = Path(__file__).resolve().parents[2] / ".venv-peers" / "bin" / "python"
MODES = ("kv_router", "round_robin")  # Dynamo's KV-aware router, and its round robin as the two models' anchor
# Dynamo 1.6.1's mocker at speedup_ratio 1, one request at a time (BENCHMARKS.md, "Dynamo's mocker"): prefill
# (8,192- and 32,768-token prompts) and decode (one sequence) rates.
MOCKER_PREFILL_TOKENS_PER_S = 48_400.0
MOCKER_DECODE_TOKENS_PER_S = 173.0


def speedups(params: SimParams) -> tuple[float, float]:
    """Dynamo's (speedup_ratio, decode_speedup_ratio) that give its mocker the simulated engines' prefill and
    decode rates (its decode runs at speedup_ratio * decode_speedup_ratio)."""
    speedup = params.prefill_tokens_per_s / MOCKER_PREFILL_TOKENS_PER_S
    return speedup, params.decode_tokens_per_s / MOCKER_DECODE_TOKENS_PER_S / speedup


class PeersUnavailable(RuntimeError):
    """The peers venv is missing or Dynamo's simulator failed (the message says which, and how to fix it)."""


def write_mooncake(requests: Sequence[TraceRequest], path: Path) -> None:
    """`requests` as a Mooncake JSONL trace: the simulated requests exactly (after --limit and skipped lines),
    with each request's chained block keys as its hash_ids (equal prefixes keep equal ids)."""
    with path.open("w") as f:
        for r in requests:
            row = {
                "timestamp": round(r.arrival_s * 1000),
                "input_length": r.input_tokens,
                "output_length": r.output_tokens,
                "hash_ids": list(r.blocks),
            }
            f.write(json.dumps(row) + "\n")


def dynamo_real(
    requests: Sequence[TraceRequest], params: SimParams, python: Path = DEFAULT_PYTHON, timeout_s: float = 3600.0
) -> dict[str, dict[str, Any]]:
    """Dynamo's own figures for `requests` on `params`' cluster, per router mode (`MODES`)."""
    if not Path(python).exists():
        raise PeersUnavailable(f"{python} does not exist: `make peers-install` builds the peers venv")
    with tempfile.TemporaryDirectory(prefix="kvdir-peers-") as tmp:
        trace = Path(tmp) / "trace.jsonl"
        write_mooncake(requests, trace)
        speedup, decode_speedup = speedups(params)
        spec = {
            "trace": str(trace),
            "speedup_ratio": speedup,
            "decode_speedup_ratio": decode_speedup,
            "workers": params.engines,  # each DP rank a worker of its own
            "capacity_blocks": params.capacity_blocks,
            "block_tokens": params.block_tokens,
            "modes": list(MODES),
        }
        env = {**os.environ, "DYN_LOG": "error", "RUST_LOG": "error"}
        try:
            proc = subprocess.run(
                [str(python), str(RUNNER), json.dumps(spec)], capture_output=True, text=True, timeout=timeout_s, env=env
            )
        except subprocess.TimeoutExpired as exc:
            raise PeersUnavailable(f"Dynamo's simulator took over {timeout_s:.0f} s") from exc
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise PeersUnavailable(f"Dynamo's simulator failed (exit {proc.returncode}): {tail}")
    figures: dict[str, dict[str, Any]] = json.loads(proc.stdout)
    return figures


def format_peers(real: dict[str, dict[str, Any]], results: dict[str, dict[str, Any]]) -> str:
    """The real peers' rows, and each kvdir policy's hit rate against the real Dynamo router's."""
    lines = ["real peers, in Dynamo's own simulator (hit rates compare; TTFTs do not: the timing models differ):"]
    for mode, f in real.items():
        lines.append(
            f"  dynamo {mode} (real)  hit {100 * f['prefix_cache_reused_ratio']:.1f}%  TTFT p50 / p90 / p99 "
            f"{f['median_ttft_ms'] / 1e3:.3f} / {f['p90_ttft_ms'] / 1e3:.3f} / {f['p99_ttft_ms'] / 1e3:.3f} s (its model)"
        )
    ref = real.get("kv_router", {}).get("prefix_cache_reused_ratio")
    if ref is not None:
        for name, r in results.items():
            lines.append(
                f"  {name:<14} hit {100 * r['hit_rate']:.1f}%: {100 * (r['hit_rate'] - ref):+.1f} points vs the real router"
            )
    return "\n".join(lines)
