"""Progress of long work (`kvdir.progress.Meter`): the bar and its ETA on a terminal, a few plain lines off one,
and never a byte on stdout, where --json goes. Times are passed in, so every line is exact."""

from __future__ import annotations

import io
import json
import sys

import pytest

from kvdir.progress import Meter, clock_text, eta_s
from kvtools.bench.directory import bench_mutation_stall
from kvtools.bench.report import emit
from kvtools.replay.cli import main as replay_main


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as stderr is when a person runs the command."""

    def isatty(self) -> bool:
        return True


def frames(stream: io.StringIO) -> list[str]:
    """Each state of the live line, as a person would have seen it."""
    return [f.replace("\x1b[K", "") for f in stream.getvalue().split("\r") if f]


def test_eta_is_the_rest_at_the_rate_so_far_and_reads_at_a_glance() -> None:
    assert eta_s(0, 100, 5.0) is None  # no rate yet
    assert eta_s(25, 100, 5.0) == 15.0
    assert eta_s(100, 100, 5.0) == 0.0
    assert [clock_text(s) for s in (4.25, 42.4, 185.0, 3720.0)] == ["4.2s", "42s", "3m05s", "1h02m"]


def test_on_a_terminal_the_bar_is_redrawn_in_place_with_the_whole_and_the_stage_eta() -> None:
    out = Terminal()
    m = Meter("replay", 200, out, live=True, now=100.0, unit="requests")
    m.stage("kvdir 1/2", 100, 100.0)
    m.update(50, 102.0)
    m.update(60, 102.05)  # within 0.1 s of the last draw: not redrawn
    m.update(100, 104.0)
    m.stage("sglang 2/2", 100, 104.0)
    m.update(25, 105.0)
    m.close(108.0)
    assert frames(out) == [
        "replay [--------------------]   0% ETA ? | kvdir 1/2 0% ETA ? | 0/200 requests ",  # cut to 79 columns
        "replay [#####---------------]  25% ETA 6.0s | kvdir 1/2 50% ETA 2.0s | 50/200 r",
        "replay [##########----------]  50% ETA 4.0s | kvdir 1/2 100% ETA 0.0s | 100/200",
        "replay [############--------]  62% ETA 3.0s | sglang 2/2 25% ETA 3.0s | 125/200",
        "replay: 62% (125/200 requests) in 8.0s\n",  # the summary replaces the bar, and the line ends
    ]
    assert m.bar_line(105.0) == ("replay [############--------]  62% ETA 3.0s | sglang 2/2 25% ETA 3.0s | 125/200 requests 5.0s")


def test_a_note_goes_above_the_live_bar_which_is_drawn_again() -> None:
    out = Terminal()
    m = Meter("mirror", 60, out, live=True, now=0.0, unit="s")
    m.update(30, 30.0)
    out.truncate(0)
    out.seek(0)
    m.note("killing the leader")
    assert out.getvalue() == "\r\x1b[Kkilling the leader\nmirror [##########----------]  50% ETA 30s | 30/60 s 30s"


def test_off_a_terminal_a_plain_line_per_tenth_of_the_work_at_least_five_seconds_apart() -> None:
    out = io.StringIO()
    m = Meter("replay", 200, out, live=False, now=0.0, unit="requests")
    m.stage("kvdir 1/2", 100, 0.0)
    for k in range(101):  # 1 request each 0.2 s: a tenth of the work every 4 s
        m.update(k, k * 0.2)
    m.stage("sglang 2/2", 100, 20.0)
    for k in range(101):
        m.update(k, 20 + k * 0.2)
    m.close(40.0)
    assert out.getvalue().splitlines() == [
        "replay: 12% (25/200 requests) after 5.0s, ETA 35s; kvdir 1/2 25%, ETA 15s",
        "replay: 25% (50/200 requests) after 10s, ETA 30s; kvdir 1/2 50%, ETA 10s",
        "replay: 38% (75/200 requests) after 15s, ETA 25s; kvdir 1/2 75%, ETA 5.0s",
        "replay: 50% (100/200 requests) after 20s, ETA 20s; kvdir 1/2 100%, ETA 0.0s",
        "replay: 62% (125/200 requests) after 25s, ETA 15s; sglang 2/2 25%, ETA 15s",
        "replay: 75% (150/200 requests) after 30s, ETA 10s; sglang 2/2 50%, ETA 10s",
        "replay: 88% (175/200 requests) after 35s, ETA 5.0s; sglang 2/2 75%, ETA 5.0s",
        "replay: 100% (200/200 requests) in 40s",  # the end: the summary, not a periodic line too
    ]
    assert "\r" not in out.getvalue()


def test_off_a_terminal_slow_work_still_says_something_every_30_seconds() -> None:
    out = io.StringIO()
    m = Meter("mirror", 600, out, live=False, now=0.0, unit="s")
    for t in range(0, 120):
        m.update(t * 0.1, float(t))  # stalled: 2% in 2 minutes
    assert out.getvalue().splitlines() == [
        "mirror: 0% (3/600 s) after 30s, ETA 1h39m",
        "mirror: 1% (6/600 s) after 1m00s, ETA 1h39m",
        "mirror: 2% (9/600 s) after 1m30s, ETA 1h38m",
    ]


def test_an_error_leaves_the_bar_where_it_got_to_and_ends_its_line() -> None:
    out = Terminal()
    with pytest.raises(RuntimeError), Meter("vllm TTFT", 15, out, live=True, now=0.0, unit="rounds") as m:
        m.update(4, 8.0)
        raise RuntimeError("a pull failed")
    assert frames(out)[-1] == "vllm TTFT [#####---------------]  27% ETA 22s | 4/15 rounds 8.0s\n"


def test_the_replay_draws_its_bar_on_stderr_and_keeps_stdout_for_the_table(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setenv("TERM", "xterm")
    out_json = tmp_path / "r.json"
    args = ["--synthetic", "multi_turn", "--limit", "40", "--policies", "kvdir,round_robin", "--json", str(out_json)]
    assert replay_main(args) == 0
    shown = frames(err)
    assert shown[0].startswith("replay [--------------------]   0% ETA ? | kvdir 1/2 0% ETA ? | 0/80 requests")
    assert any("| round_robin 2/2 " in f for f in shown), shown
    assert shown[-1].startswith("replay: 100% (80/80 requests) in ")
    stdout = capsys.readouterr().out
    assert "ETA" not in stdout and "\r" not in stdout and "\x1b" not in stdout
    assert stdout.startswith("40 requests (synthetic multi_turn)")
    assert set(json.loads(out_json.read_text())["policies"]) == {"kvdir", "round_robin"}


def test_a_bench_draws_its_bar_on_stderr_and_json_on_stdout_stays_one_object(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setenv("TERM", "xterm")
    figures = bench_mutation_stall(64 * 256)
    emit(figures, as_json=True)
    assert frames(err)[-1].startswith("  index growth: 100% (16,384/16,384 entries) in ")
    stdout = capsys.readouterr().out
    assert json.loads(stdout)["stall_entries"] == 16_384 - 16_384 // 16  # one of the 16 nodes dropped at the end
    assert stdout.count("\n") == 1
