"""The tools' subcommands (kvtools), plugged into `kvdir` through the `kvdir.commands` entry points: each bench
target with its own flags, the replay's flags against SimParams, and an install without the tools."""

from __future__ import annotations

import argparse
from importlib.metadata import EntryPoint
from typing import Any

import pytest

from kvdir import cli
from kvtools.bench.cli import TARGETS
from kvtools.replay.cli import add_arguments, sim_params
from kvtools.replay.sim import SimParams


def test_every_bench_target_is_a_subcommand_that_calls_its_main_with_its_own_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, dict[str, Any]] = {}
    for t in TARGETS:
        module, function = t.entry.split(":")

        def fake(_name: str = t.name, **flags: Any) -> int:
            calls[_name] = flags
            return 0

        monkeypatch.setattr(f"{module}.{function}", fake)
    for t in TARGETS:
        assert cli.main(["bench", t.name, "--json"]) == 0
    assert set(calls) == {t.name for t in TARGETS}
    assert calls["directory"] == {"as_json": True, "quick": False}
    assert calls["soak"] == {"as_json": True, "minutes": 10.0, "replicas": 3, "shards": 1}
    assert calls["shards"] == {"as_json": True, "quick": False, "replicas": 3}
    assert calls["events"] == {"as_json": True, "quick": False}  # the bench's own default engines per adapter
    assert cli.main(["bench", "events", "--engines-per-adapter", "1"]) == 0
    assert calls["events"]["engines_per_adapter"] == 1
    assert calls["attacks"] == {"as_json": True, "quick": False, "only": None}
    assert cli.main(["bench", "attacks", "--only", "origin_hijack", "registration_flood"]) == 0
    assert calls["attacks"]["only"] == ["origin_hijack", "registration_flood"]


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "soak", "--replicas", "1"],
        ["bench", "soak", "--quick"],
        ["bench", "worker", "--minutes", "3"],
        ["bench"],
        ["bench", "attacks", "--only", "no_such_attack"],
    ],
)
def test_a_flag_the_target_does_not_take_is_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2 and "error:" in capsys.readouterr().err


def parse_replay(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--synthetic", "multi_turn", *flags])


def test_the_replay_flags_defaults_are_simparams_own() -> None:
    assert sim_params(parse_replay()) == SimParams()


def test_the_replay_flags_convert_units() -> None:
    p = sim_params(parse_replay("--link-gbps", "25", "--pull-setup-ms", "2", "--nodes", "3", "--no-share-decisions"))
    assert (p.link_bytes_per_s, p.pull_setup_s, p.nodes, p.share_decisions) == (25e9, 0.002, 3, False)


def test_a_bad_replay_model_is_refused_with_its_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["replay", "--synthetic", "multi_turn", "--nodes", "0"]) == 2
    assert "kvdir replay: nodes, dp_ranks, capacity_blocks" in capsys.readouterr().err


def test_an_install_without_the_tools_has_no_such_subcommands(monkeypatch: pytest.MonkeyPatch) -> None:
    missing = EntryPoint("bench", "kvtools_absent.bench.cli:register", cli.COMMANDS)
    monkeypatch.setattr(cli, "entry_points", lambda group: [missing])
    parser = cli._parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "directory"])
    assert parser.parse_args(["shards", "show"]).command == "shards"


def test_a_tool_whose_own_imports_fail_is_not_hidden(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    (tmp_path / "broken_tool.py").write_text("import no_such_dependency_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = EntryPoint("broken", "broken_tool:register", cli.COMMANDS)
    monkeypatch.setattr(cli, "entry_points", lambda group: [broken])
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_here"):
        cli._parser()


def test_peers_real_without_the_peers_venv_says_how_to_get_it(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--synthetic", "multi_turn", "--limit", "20", "--peers-real", "--peers-python", str(tmp_path / "none")]
    assert cli.main(argv) == 2
    assert "make peers-install" in capsys.readouterr().err


def test_dynamos_mocker_is_given_the_simulated_engines_speeds() -> None:
    from kvtools.replay.peers_real import MOCKER_DECODE_TOKENS_PER_S, MOCKER_PREFILL_TOKENS_PER_S, speedups

    p = SimParams(prefill_tokens_per_s=24_200.0, decode_tokens_per_s=346.0)
    speedup, decode_speedup = speedups(p)
    assert speedup * MOCKER_PREFILL_TOKENS_PER_S == pytest.approx(24_200.0)
    assert speedup * decode_speedup * MOCKER_DECODE_TOKENS_PER_S == pytest.approx(346.0)  # its decode: their product
