"""What every benchmark prints: progress on stderr, a header naming machine and date, the figures."""

from __future__ import annotations

import json
import multiprocessing
import platform
import sys
from datetime import UTC, datetime
from typing import Any

import numpy as np


def say(msg: str) -> None:
    """Progress, on stderr, so that stdout carries only the results."""
    print(msg, file=sys.stderr, flush=True)


def pct(values: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(values), p)) if values else float("nan")


def header(quick: bool) -> dict[str, Any]:
    return {
        "machine": f"{platform.machine()}, {multiprocessing.cpu_count()} cores, Python {platform.python_version()}",
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "quick": quick,
    }


def emit(results: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(results))
        return
    width = max(len(k) for k in results) + 2
    for k, v in results.items():
        print(f"{k:{width}s} {v:,.3f}" if isinstance(v, float) else f"{k:{width}s} {v}")
