"""Every figure kvdir draws, as PNG files: the replay's (`kvdir replay --plot`) and the benchmarks'
(`kvdir bench vllm|gateway|mirror --plot`), in one place so that they share a look and one way of writing.

Each function takes what a run already measured (plain lists and dicts, seconds) and returns the paths it wrote.
matplotlib is imported on first use, on its file-only Agg backend: only --plot needs it, and a machine
without a display must still draw.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["LagSeries", "lag_over_time", "latency_cdf", "replay_plots", "ttft_by_prefix"]

DPI = 110


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    """Write `fig` to `path` (its folder created) and free it: a run draws many."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    _pyplot().close(fig)
    return path


def _ms(values: Sequence[float]) -> np.ndarray:
    return np.asarray(values, dtype=float) * 1e3


def _log_axis(ax: Any, axis: str, values: np.ndarray, linthresh: float) -> None:
    """A log `axis` ("x" or "y") fitted to `values`: latencies span sub-milliseconds to seconds. Symmetric-log
    (linear within `linthresh` of 0) where some are not positive: a mirror's lag is negative when the stream
    delivered a write before its acknowledgement did."""
    if not len(values):
        return
    lo, hi = float(values.min()), float(values.max())
    if lo > 0:
        getattr(ax, f"set_{axis}scale")("log")
        getattr(ax, f"set_{axis}lim")(lo / 1.3, hi * 1.3)
    else:
        getattr(ax, f"set_{axis}scale")("symlog", linthresh=linthresh)
        getattr(ax, f"set_{axis}lim")(lo * 1.3 - linthresh / 10, max(hi * 1.3, linthresh))


# -- the replay ------------------------------------------------------------------------------------------------


def replay_plots(
    directory: str | Path, results: dict[str, dict[str, Any]], oracle_tokens: float, labels: Mapping[str, str]
) -> list[Path]:
    """hit_rate.png, ttft.png and load_<policy>.png (prefill-busy fraction per node over time) of a simulated
    replay (`results` by policy, `labels` the policies' display names); the paths written."""
    plt = _pyplot()
    d = Path(directory)
    names = list(results)
    shown = [labels.get(n, n) for n in names]
    x = np.arange(len(names))
    written = []

    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(names)), 4))
    host = [100 * results[n]["host_hit_rate"] for n in names]
    local = [100 * results[n]["local_hit_rate"] for n in names]
    device = [a - b for a, b in zip(local, host)]
    pulled = [100 * results[n]["pulled_hit_rate"] for n in names]
    ax.bar(x, device, label="local, device")
    if any(host):
        ax.bar(x, host, bottom=device, label="local, host tier")
    ax.bar(x, pulled, bottom=local, label="pulled")
    ax.axhline(100 * oracle_tokens, color="k", linestyle="--", label=f"oracle {100 * oracle_tokens:.1f}%")
    ax.set_xticks(x, shown, rotation=20, ha="right")
    ax.set_ylabel("prompt tokens cached (%)")
    ax.set_ylim(0, 1.3 * max(100 * oracle_tokens, *(a + b for a, b in zip(local, pulled)), 1.0))
    ax.set_title("Hit rate per policy")
    ax.legend(loc="upper right", ncols=3)
    written.append(_save(fig, d / "hit_rate.png"))

    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(names)), 4))
    w = 0.27
    for k, (key, lab) in enumerate([("ttft_p50_s", "p50"), ("ttft_p90_s", "p90"), ("ttft_p99_s", "p99")]):
        ax.bar(x + (k - 1) * w, [max(results[n][key], 1e-6) for n in names], w, label=lab)
    ax.set_yscale("log")
    ax.set_xticks(x, shown, rotation=20, ha="right")
    ax.set_ylabel("TTFT (s, log)")
    ax.set_title("Time to first token per policy")
    ax.legend()
    written.append(_save(fig, d / "ttft.png"))

    for n in names:
        tl = results[n]["load_timeline"]
        busy = np.array(tl["busy"])
        fig, ax = plt.subplots(figsize=(9, 0.35 * busy.shape[0] + 1.6))
        span = tl["bucket_s"] * busy.shape[1]
        im = ax.imshow(
            busy,
            aspect="auto",
            interpolation="nearest",
            vmin=0.0,
            vmax=1.0,
            cmap="viridis",
            extent=(0.0, span if span > 0 else 1.0, busy.shape[0] - 0.5, -0.5),
        )
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel("node")
        ax.set_title(f"{labels.get(n, n)}: prefill-busy fraction per node (imbalance {results[n]['imbalance']:.3f})")
        fig.colorbar(im, ax=ax, label="busy")
        written.append(_save(fig, d / f"load_{n}.png"))
    return written


# -- the benchmarks ----------------------------------------------------------------------------------------------


def ttft_by_prefix(path: str | Path, samples: Mapping[int, Mapping[str, Sequence[float]]], *, title: str) -> Path:
    """Grouped bars of the median TTFT per prefix size (tokens) and path (pulled, local, ...), each round a dot:
    `samples[size][path]` are seconds. Medians alone hide how far rounds spread on a loaded machine."""
    plt = _pyplot()
    sizes = sorted(samples)
    paths = list(dict.fromkeys(p for size in sizes for p in samples[size]))
    x = np.arange(len(sizes))
    w = 0.8 / max(1, len(paths))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(sizes)), 4))
    for k, name in enumerate(paths):
        at = x + (k - (len(paths) - 1) / 2) * w
        rounds = [_ms(samples[size].get(name, ())) for size in sizes]
        bars = ax.bar(at, [float(np.median(r)) if len(r) else 0.0 for r in rounds], w, label=name)
        for xi, r in zip(at, rounds):
            ax.plot(np.full(len(r), xi), r, "o", color="k", markersize=3, alpha=0.6)
        ax.bar_label(bars, fmt="%.0f", fontsize=8, label_type="center", color="white")  # clear of the dots
    ax.set_xticks(x, [f"{s:,} tokens" for s in sizes])
    ax.set_xlabel("prefix")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    return _save(fig, Path(path))


def latency_cdf(path: str | Path, samples: Mapping[str, Sequence[float]], *, title: str, xlabel: str) -> Path:
    """The empirical CDF of each named series (seconds, drawn in ms on a log axis), its p50 and p99 in the legend:
    where a median hides a tail, and which path the tail belongs to."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    drawn = []
    for name, values in samples.items():
        v = np.sort(_ms(values))
        if not len(v):
            continue
        drawn.append(v)
        p50, p99 = np.percentile(v, [50, 99])
        ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=f"{name} (p50 {p50:.2f}, p99 {p99:.1f} ms)")
    ax.axhline(0.99, color="grey", linestyle=":", linewidth=1)
    _log_axis(ax, "x", np.concatenate(drawn) if drawn else np.zeros(0), 0.1)
    ax.set_xlabel(f"{xlabel} (ms, log)")
    ax.set_ylabel("fraction")
    ax.set_ylim(0, 1.01)
    ax.grid(True, which="major", alpha=0.3)
    ax.set_title(title, fontsize=10)
    if drawn:
        ax.legend(loc="lower right", fontsize=8)
    return _save(fig, Path(path))


@dataclass
class LagSeries:
    """One phase of `kvdir bench mirror`: each publish's lag into the mirror by when it was acknowledged."""

    name: str
    at_s: list[float]  # acknowledgement, seconds since the phase began
    lag_s: list[float]
    kills_s: list[float] = field(default_factory=list)  # leader kills, seconds since the phase began


def lag_over_time(path: str | Path, phases: Sequence[LagSeries], *, target_s: float | None = None) -> Path:
    """One panel per phase: every publish's lag over time, the leader kills as vertical lines, `target_s` (the
    p99 bound) as a horizontal one; where the tail comes from in time (a kill, a merge) shows at a glance."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(phases), 1, figsize=(9, 2.6 * len(phases) + 0.4), squeeze=False)
    for ax, ph in zip(axes[:, 0], phases):
        ax.plot(ph.at_s, _ms(ph.lag_s), ".", markersize=2, alpha=0.5)
        for k, t in enumerate(ph.kills_s):
            ax.axvline(t, color="tab:red", linestyle="--", linewidth=1, label="leader killed" if k == 0 else None)
        if target_s is not None:
            ax.axhline(target_s * 1e3, color="grey", linestyle=":", label=f"p99 target {target_s * 1e3:.0f} ms")
        _log_axis(ax, "y", _ms([*ph.lag_s, *([target_s] if target_s is not None else [])]), 1.0)
        ax.set_ylabel("lag (ms, log)")
        ax.set_title(ph.name, fontsize=10)
        if ph.kills_s or target_s is not None:
            ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds into the phase (when the publish was acknowledged)")
    fig.suptitle("Mirror lag: publish acknowledged -> applied in the gateway's mirror")
    return _save(fig, Path(path))
