"""The replay's calibrated engines (kvtools.replay.calibration): batched prefill shared by the running prefills,
decode slowed by its batch and by prefills, and no calibration = the cost model's own FIFO engine, as before."""

from __future__ import annotations

import json

import pytest

from kvtools.replay.calibration import EngineCalibration, interpolate
from kvtools.replay.cli import main as replay_main
from kvtools.replay.cluster import ClusterSim
from kvtools.replay.sim import SimParams, simulate, ttft_floor
from kvtools.replay.trace import TraceRequest, chain_blocks, multi_turn, shared_prefix

# One prefill alone: 10,000 tokens/s; two at once: 12,000 in all (6,000 each); four: 16,000 (4,000 each).
CAL = EngineCalibration(
    prefill_running=(1, 2, 4),
    prefill_tokens_per_s=(10_000.0, 12_000.0, 16_000.0),
    overhead_s=0.01,
    decode_batch=(1, 4),
    decode_token_s=(0.01, 0.04),
    prefill_slowdown=2.0,
)


def req(t: float, key: int, tokens: int, out: int = 1) -> TraceRequest:
    """A request whose blocks nobody else has: all `tokens` are prefilled."""
    return TraceRequest(t, tokens, out, chain_blocks([key, key + 1]))


def run(reqs: list[TraceRequest], cal: EngineCalibration | None, **kw: object) -> ClusterSim:
    sim = ClusterSim(reqs, "round_robin", SimParams(nodes=1, calibration=cal, **kw))  # type: ignore[arg-type]
    sim.run(None)
    return sim


def test_interpolate_is_linear_between_points_and_flat_beyond():
    assert interpolate((1, 2, 4), (10.0, 12.0, 16.0), 3) == 14.0
    assert interpolate((1, 2, 4), (10.0, 12.0, 16.0), 0) == 10.0
    assert interpolate((1, 2, 4), (10.0, 12.0, 16.0), 9) == 16.0


def test_without_a_calibration_the_engine_prefills_fifo_at_the_static_rate():
    """Two 1,000-token prompts at once: one after the other at 10,000 tokens/s, no overhead (today's model)."""
    sim = run([req(0.0, 1, 1000), req(0.0, 10, 1000)], None, prefill_tokens_per_s=10_000.0)
    assert sim.ttft.tolist() == pytest.approx([0.1, 0.2])


def test_a_prefill_alone_takes_the_overhead_and_the_single_rate():
    sim = run([req(0.0, 1, 1000)], CAL)
    assert sim.ttft.tolist() == pytest.approx([0.01 + 1000 / 10_000])


def test_concurrent_prefills_share_the_batch_rate_of_the_curve():
    """Two at once share 12,000 tokens/s: both end at 0.01 + 2,000 / 12,000; four share 16,000."""
    two = run([req(0.0, 1, 1000), req(0.0, 10, 1000)], CAL)
    assert two.ttft.tolist() == pytest.approx([0.01 + 2000 / 12_000] * 2)
    four = run([req(0.0, 10 * k, 1000) for k in range(4)], CAL)
    assert four.ttft.tolist() == pytest.approx([0.01 + 4000 / 16_000] * 4)
    assert four.ttft[0] > two.ttft[0] > run([req(0.0, 1, 1000)], CAL).ttft[0]


def test_a_prefill_joining_midway_slows_the_one_under_way():
    """A runs alone from 0.01 (500 tokens by 0.06), B joins at 0.06: 6,000 tokens/s each until A ends at
    0.06 + 500 / 6,000; B then has 500 left, alone at 10,000 tokens/s."""
    sim = run([req(0.0, 1, 1000), req(0.05, 10, 1000)], CAL)
    a_end = 0.06 + 500 / 6000
    assert sim.ttft.tolist() == pytest.approx([a_end, a_end + 500 / 10_000 - 0.05])


def test_decode_slows_with_the_batch():
    """11 output tokens: the first with the prefill, then 10 at 0.01 s each alone, 0.04 s each four at once."""
    alone = run([req(0.0, 1, 10, out=11)], CAL)
    assert alone.last_end == pytest.approx(0.01 + 10 / 10_000 + 10 * 0.01)
    four = run([req(0.0, 10 * k, 10, out=11) for k in range(4)], CAL)
    assert four.last_end == pytest.approx(0.01 + 40 / 16_000 + 10 * 0.04)


def test_a_prefill_slows_the_decodes_beside_it():
    """A decodes 100 tokens from 0.011; B's 2,000-token prefill runs from 0.06 to 0.26 (alone: 10,000 tokens/s),
    during which A's tokens take 0.02 s instead of 0.01: A loses 0.1 s."""
    reqs = [req(0.0, 1, 10, out=101), req(0.05, 10, 2000)]
    slowed = run(reqs, CAL)
    plain = run(reqs, EngineCalibration(**{**_fields(CAL), "prefill_slowdown": 1.0}))
    assert plain.last_end == pytest.approx(0.011 + 100 * 0.01)
    assert slowed.last_end == pytest.approx(plain.last_end + 0.1)
    assert slowed.ttft.tolist() == pytest.approx(plain.ttft.tolist())  # prefill is not slowed by decodes here


def _fields(c: EngineCalibration) -> dict[str, object]:
    return {k: getattr(c, k) for k in c.__dataclass_fields__}


@pytest.mark.parametrize("policy", ["kvdir", "sglang", "dynamo", "least_loaded"])
def test_calibrated_replay_is_deterministic_and_differs_from_the_static_engines(policy):
    trs = multi_turn(sessions=16, rounds=3, seed=5)
    p = SimParams(nodes=3, capacity_blocks=60, calibration=CAL, ttft_learn_window=16)

    def strip(r: dict) -> dict:
        return {k: v for k, v in r.items() if k != "wall_s"}

    a, b = simulate(trs, policy, p), simulate(trs, policy, p)
    assert strip(a) == strip(b)
    static = simulate(trs, policy, SimParams(nodes=3, capacity_blocks=60))
    assert a["ttft_p50_s"] != static["ttft_p50_s"]


@pytest.mark.parametrize(
    "trs", [multi_turn(sessions=16, seed=3), shared_prefix(groups=4, prompts_per_group=10, seed=2)], ids=["mt", "sp"]
)
def test_no_request_beats_the_ttft_floor_on_calibrated_engines(trs):
    p = SimParams(nodes=3, capacity_blocks=80, calibration=CAL)
    floor = ttft_floor(trs, p)
    for policy in ("kvdir", "round_robin", "dynamo"):
        sim = ClusterSim(sorted(trs, key=lambda r: r.arrival_s), policy, p)
        sim.run(None)
        assert (sim.ttft >= floor - 1e-9).all(), policy


def test_the_file_round_trips_and_a_bad_one_says_why(tmp_path):
    path = tmp_path / "cal.json"
    CAL.dump(path)
    assert EngineCalibration.load(path) == CAL
    doc = json.loads(path.read_text())
    doc["prefill"]["running"] = [2, 1, 4]
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="increasing"):
        EngineCalibration.load(path)
    path.write_text(json.dumps({"kind": "something else"}))
    with pytest.raises(ValueError, match="not a calibration file"):
        EngineCalibration.load(path)


def test_the_command_line_reads_a_calibration_and_replays_deterministically(tmp_path, capsys):
    cal = tmp_path / "cal.json"
    CAL.dump(cal)
    args = ["--synthetic", "multi_turn", "--limit", "60", "--nodes", "2", "--policies", "kvdir", "--calibration", str(cal)]
    outs = []
    for k in range(2):
        out = tmp_path / f"r{k}.json"
        assert replay_main([*args, "--stay-margin-ms", "100", "--stay-margin-ratio", "0.25", "--json", str(out)]) == 0
        outs.append(json.loads(out.read_text()))
    assert "engines calibrated" in capsys.readouterr().out
    assert outs[0]["params"]["calibration"]["prefill_tokens_per_s"] == [10_000.0, 12_000.0, 16_000.0]
    assert outs[0]["params"]["policy_options"] == {"kvdir": {"stay_margin_s": 0.1, "stay_margin_ratio": 0.25}}
    drop = ("wall_s", "load_timeline")
    a, b = ({k: v for k, v in o["policies"]["kvdir"].items() if k not in drop} for o in outs)
    assert a == b
    (tmp_path / "bad.json").write_text("{}")
    assert replay_main([*args[:-1], str(tmp_path / "bad.json")]) == 2
    assert "not a calibration file" in capsys.readouterr().err
