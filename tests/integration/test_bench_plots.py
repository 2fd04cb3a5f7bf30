"""The benchmarks' figures (`kvtools.plots`) from small made-up results, and `kvdir bench ... --plot DIR` reaching
the three benches that draw them. No bench runs here: they start processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvdir import cli
from kvtools.plots import LagSeries, lag_over_time, latency_cdf, ttft_by_prefix
from kvtools.replay.cli import main as replay_main


def is_png(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ttft_by_path_and_prefix_size(tmp_path: Path) -> None:
    samples = {
        256: {"pulled": [0.087, 0.09], "local": [0.05, 0.049], "recomputed": [0.075, 0.08]},
        1792: {"pulled": [0.11, 0.12], "local": [0.048, 0.05], "recomputed": [0.115, 0.11]},
    }
    out = ttft_by_prefix(tmp_path / "figs" / "vllm_ttft.png", samples, title="TTFT by path")
    assert out == tmp_path / "figs" / "vllm_ttft.png" and is_png(out)


def test_latency_cdfs_by_path_including_negative_lags(tmp_path: Path) -> None:
    samples = {
        "straight to the worker": [0.001 + 0.0001 * k for k in range(50)],
        "gateway, lookups from its mirror": [0.0016 + 0.0002 * k for k in range(50)],
        "mirror lag": [-0.0005, 0.0002, 0.0005, 0.043, 0.5],  # a lag is negative when streamed before the ack
        "nothing measured": [],
    }
    out = latency_cdf(tmp_path / "cdf.png", samples, title="latency by path", xlabel="latency")
    assert is_png(out)


def test_mirror_lag_over_time_with_the_leader_kills(tmp_path: Path) -> None:
    phases = [
        LagSeries("60 s, 0 leader kills", [0.0, 1.0, 2.0], [0.0005, 0.002, 0.04]),
        LagSeries("600 s, 3 leader kills", [0.0, 100.0, 101.0, 300.0], [0.001, 0.9, 0.05, -0.0002], [100.0, 300.0, 500.0]),
    ]
    out = lag_over_time(tmp_path / "lag.png", phases, target_s=0.1)
    assert is_png(out)


@pytest.mark.parametrize("target", ["vllm", "gateway", "mirror"])
def test_bench_plot_reaches_the_benches_that_draw(target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake_main(**kwargs: Any) -> int:
        seen.update(kwargs)
        return 0

    monkeypatch.setattr(f"kvtools.bench.{target}.main", fake_main)
    assert cli.main(["bench", target, "--quick", "--plot", str(tmp_path)]) == 0
    assert seen["plot"] == str(tmp_path) and seen["quick"] is True
    assert cli.main(["bench", target]) == 0 and seen["plot"] is None


def test_bench_plot_is_refused_where_there_is_nothing_to_draw(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "directory", "--plot", "figs"])
    assert exit_.value.code == 2 and "unrecognized arguments: --plot figs" in capsys.readouterr().err


def test_the_replay_report_plots(tmp_path: Path) -> None:
    rc = replay_main(
        ["--synthetic", "shared_prefix", "--limit", "60", "--policies", "kvdir,sglang", "--plot", str(tmp_path / "plots")]
    )
    assert rc == 0
    names = sorted(f.name for f in (tmp_path / "plots").iterdir())
    assert names == ["hit_rate.png", "load_kvdir.png", "load_sglang.png", "ttft.png"]
    assert all((tmp_path / "plots" / n).read_bytes()[:4] == b"\x89PNG" for n in names)
