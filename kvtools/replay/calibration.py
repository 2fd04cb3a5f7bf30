"""An engine's measured speed under load (`kvdir bench vllm --calibration-out`), for the replay's simulated engines.

Without a calibration the simulated engines make the cost model's own assumptions (one FIFO prefill at a static
rate, decode in parallel at a static rate), so a replay could only confirm the model. A calibration replaces
them with what a real engine did, measured on it:

- ``prefill``: the engine's aggregate prefill rate (tokens/s) with N uncached prompts prefilling at once, at a few
  N. vLLM's chunked prefill batches the running prefills into each step, so they share the rate: each of n
  prefills advances at ``rate(n) / n``. Between measured N the rate is interpolated linearly; beyond them it is
  the nearest one's.
- ``overhead_s``: a request's fixed cost before its prefill counts (HTTP, tokenizing, one scheduler step): the
  TTFT of a prompt the engine holds in cache.
- ``decode``: the time per output token of each request while K requests decode together, at a few K (same
  interpolation), and ``prefill_slowdown``, the factor on it while a prefill runs beside them (a step that
  carries a prefill chunk is longer).

A file is JSON: ``{"kind": "kvdir-engine-calibration", "version": 1, "prefill": {"running": [...],
"tokens_per_s": [...]}, "overhead_s": x, "decode": {"batch": [...], "token_s": [...], "prefill_slowdown": y},
"source": {...}}`` (``source``: what was measured, where and when; free form). Pure: no clock, no I/O but
`load` and `dump`.
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["KIND", "EngineCalibration", "interpolate"]

KIND = "kvdir-engine-calibration"
VERSION = 1


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """ys at x, linear between the points `xs` (increasing), the end values beyond them."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _curve(xs: Sequence[Any], ys: Sequence[Any], what: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
    if not xs or len(xs) != len(ys):
        raise ValueError(f"calibration {what}: as many points as values, at least one")
    xi = tuple(int(x) for x in xs)
    yf = tuple(float(y) for y in ys)
    if any(b <= a for a, b in itertools.pairwise(xi)) or xi[0] < 1 or min(yf) <= 0:
        raise ValueError(f"calibration {what}: points increasing from >= 1, values > 0")
    return xi, yf


@dataclass(frozen=True, slots=True)
class EngineCalibration:
    """One engine's measured prefill and decode curves (the module docstring says what each figure is)."""

    prefill_running: tuple[int, ...]
    prefill_tokens_per_s: tuple[float, ...]  # aggregate, over the running prefills
    overhead_s: float
    decode_batch: tuple[int, ...]
    decode_token_s: tuple[float, ...]  # per output token of each request
    prefill_slowdown: float = 1.0  # decode's per-token time is this much longer while any prefill runs
    source: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        _curve(self.prefill_running, self.prefill_tokens_per_s, "prefill")
        _curve(self.decode_batch, self.decode_token_s, "decode")
        if self.overhead_s < 0 or self.prefill_slowdown < 1.0:
            raise ValueError("calibration: overhead_s >= 0 and prefill_slowdown >= 1 required")

    def prefill_rate(self, running: int) -> float:
        """The aggregate prefill tokens/s with `running` (>= 1) prefills under way; each gets 1/running of it."""
        return interpolate(self.prefill_running, self.prefill_tokens_per_s, running)

    def decode_token_seconds(self, batch: int, prefilling: bool) -> float:
        """Seconds per output token of each of `batch` (>= 1) decoding requests, longer while a prefill runs."""
        t = interpolate(self.decode_batch, self.decode_token_s, batch)
        return t * self.prefill_slowdown if prefilling else t

    def as_dict(self) -> dict[str, Any]:
        """The file's JSON object."""
        return {
            "kind": KIND,
            "version": VERSION,
            "prefill": {"running": list(self.prefill_running), "tokens_per_s": list(self.prefill_tokens_per_s)},
            "overhead_s": self.overhead_s,
            "decode": {
                "batch": list(self.decode_batch),
                "token_s": list(self.decode_token_s),
                "prefill_slowdown": self.prefill_slowdown,
            },
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> EngineCalibration:
        """Parse a file's object; ValueError saying what is wrong."""
        if doc.get("kind") != KIND or doc.get("version") != VERSION:
            raise ValueError(f"not a calibration file (want kind {KIND!r}, version {VERSION})")
        try:
            pr, pt = _curve(doc["prefill"]["running"], doc["prefill"]["tokens_per_s"], "prefill")
            db, dt = _curve(doc["decode"]["batch"], doc["decode"]["token_s"], "decode")
            return cls(
                pr,
                pt,
                float(doc["overhead_s"]),
                db,
                dt,
                float(doc["decode"].get("prefill_slowdown", 1.0)),
                dict(doc.get("source") or {}),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"calibration file: missing or malformed {exc}") from exc

    @classmethod
    def load(cls, path: str | Path) -> EngineCalibration:
        """Read a calibration file; ValueError (or OSError) saying why it cannot be used."""
        try:
            doc = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from exc
        if not isinstance(doc, dict):
            raise ValueError(f"{path}: not a calibration object")
        return cls.from_dict(doc)

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=1) + "\n")
