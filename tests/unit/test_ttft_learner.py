"""The gateway's TTFT curve per engine and output length per model (gateway.ttft_learner)."""

from __future__ import annotations

import random

import pytest

from gateway.ttft_learner import EngineCurve, Observation, OutputLengths, TtftLearner

PRIOR = 10_000.0  # tokens/s: the configured rate, five times the truth below


def truth(work: float, running: float) -> float:
    """An engine that prefills 2,000 tokens/s idle, 10% slower per running request, plus 30 ms per request."""
    return 0.03 + work / 2000.0 * (1 + 0.1 * running)


def stream(n: int, seed: int = 0, noise: float = 0.05) -> list[Observation]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        work, running = rng.uniform(100, 3000), rng.randint(0, 8)
        y = truth(work, running) * (1 + rng.uniform(-noise, noise))
        out.append(Observation(observed_s=y, predicted_s=0.0, work_tokens=work, running=running))
    return out


def test_the_curve_converges_on_the_engine_s_rate_overhead_and_load_slope() -> None:
    c = EngineCurve(PRIOR, window=256)
    for o in stream(1000):
        c.observe(o)
    for running in (0, 4, 8):
        want = 2000.0 / (1 + 0.1 * running)
        assert c.rate(running) == pytest.approx(want, rel=0.1)
    assert c.overhead_s == pytest.approx(0.03, abs=0.015)


def test_one_outlier_barely_moves_a_converged_curve() -> None:
    c = EngineCurve(PRIOR, window=64)
    for o in stream(400):
        c.observe(o)
    before = (c.rate(2), c.overhead_s)
    c.observe(Observation(observed_s=20.0, predicted_s=0.0, work_tokens=500, running=2))  # a 20 s stall
    assert c.rate(2) == pytest.approx(before[0], rel=0.05)
    assert c.overhead_s == pytest.approx(before[1], abs=0.02)


def test_without_the_huber_weight_the_same_outlier_would_move_it_far() -> None:
    """The outlier test above is not vacuous: an unweighted fit of the same stream moves by much more."""
    c = EngineCurve(PRIOR, window=64)
    for o in stream(400):
        c.observe(o)
    before = c.rate(2)
    c._scale = 1e9  # every residual within the limit: plain least squares
    c.observe(Observation(observed_s=20.0, predicted_s=0.0, work_tokens=500, running=2))
    assert abs(c.rate(2) / before - 1) > 0.05 or abs(c.overhead_s - 0.03) > 0.02


def test_the_curve_follows_an_engine_that_slows_down() -> None:
    c = EngineCurve(PRIOR, window=32)
    for o in stream(300):
        c.observe(o)
    for o in stream(300, seed=1):  # the engine now takes twice as long
        c.observe(Observation(o.observed_s * 2, 0.0, o.work_tokens, o.running))
    assert c.rate(4) == pytest.approx(1000.0 / 1.4, rel=0.1)


def test_a_few_observations_move_the_curve_only_part_way_from_the_prior() -> None:
    c = EngineCurve(PRIOR, window=64)
    for o in stream(2):
        c.observe(o)
    assert 2000.0 < c.rate(0) < PRIOR


def test_fixed_parts_are_left_out_of_the_fit() -> None:
    c = EngineCurve(PRIOR, window=256)
    for o in stream(1000):
        c.observe(Observation(o.observed_s + 0.5, 0.0, o.work_tokens, o.running, fixed_s=0.5))  # e.g. a pull
    assert c.overhead_s == pytest.approx(0.03, abs=0.015)


def test_nothing_is_learned_before_an_engine_is_observed_nor_with_learning_off() -> None:
    on, off = TtftLearner(PRIOR, window=64), TtftLearner(PRIOR, window=0)
    assert on.learned("a", 0) is None
    for learner in (on, off):
        for o in stream(50):
            learner.observe("a", Observation(o.observed_s, o.observed_s * 2, o.work_tokens, o.running))
    assert on.learned("a", 0) is not None and off.learned("a", 0) is None
    curve = off.curves["a"]  # the errors are kept either way
    assert curve.seen == 50 and curve.median_relative_error() == pytest.approx(1.0)


def test_output_length_is_the_observed_mean_else_the_prior_capped_by_max_tokens() -> None:
    learner = TtftLearner(PRIOR, window=64, output_prior=256)
    assert learner.output_tokens("m", 4096) == 256.0
    assert learner.output_tokens("m", 16) == 16.0
    learner.outputs.observe("m", 1)  # a warm-up of max_tokens 1: the prior still counts
    assert 150 < learner.output_tokens("m", 4096) < 256
    for _ in range(500):
        learner.outputs.observe("m", 40)
    assert learner.output_tokens("m", 4096) == pytest.approx(40.0, rel=0.01)  # the prior decayed away
    assert learner.output_tokens("other", 4096) == 256.0


def test_output_lengths_decay_toward_the_recent_ones() -> None:
    lengths = OutputLengths(window=8, prior=256)
    for _ in range(50):
        lengths.observe("m", 1000)
    for _ in range(50):
        lengths.observe("m", 10)
    mean = lengths.mean("m")
    assert mean is not None and mean < 20
