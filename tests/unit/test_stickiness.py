"""A request stays with its history unless leaving saves more than the margin (KvdirPolicy's stay margins), and
requests ahead are priced at the observed output length, not the client's max_tokens (Router.request)."""

from __future__ import annotations

import random

import pytest

from gateway.cost import Candidate, CostModel, RouteRequest, evaluate
from gateway.kvdir_policy import KvdirPolicy
from gateway.prefix_hasher import PrefixHasher
from gateway.router import Router
from gateway.ttft_learner import TtftLearner

COST = CostModel(prefill_tokens_per_s=10_000.0, max_running=4, decode_tokens_per_s=50.0)
REQ = RouteRequest(prompt_tokens=1024, hashes=tuple(range(64)), block_size=16, max_tokens=64)


def home(running: int) -> Candidate:
    return Candidate("home", 1, cached_blocks=48, slots=tuple(range(48)), running=running, can_pull=False)


def away() -> Candidate:
    return Candidate("away", 1, cached_blocks=0, can_pull=False)


def saving(running: int) -> tuple[float, float]:
    """(home's score, what moving saves) with `running` requests on the home engine."""
    h = evaluate(REQ, home(running), COST).score_s
    return h, h - evaluate(REQ, away(), COST).score_s


def choose(margin_s: float, ratio: float, running: int) -> str:
    policy = KvdirPolicy(COST, stay_margin_s=margin_s, stay_margin_ratio=ratio, allow_pull=False)
    return policy.choose(REQ, [home(running), away()], random.Random(0)).node_id


def test_without_margins_a_loaded_home_loses_the_session() -> None:
    _, saved = saving(6)
    assert saved > 0 and choose(0.0, 0.0, 6) == "away"


@pytest.mark.parametrize("side", [0.999, 1.001])
def test_the_seconds_margin_s_boundary(side: float) -> None:
    _, saved = saving(6)
    assert choose(saved * side, 0.0, 6) == ("home" if side > 1 else "away")


@pytest.mark.parametrize("side", [0.999, 1.001])
def test_the_ratio_margin_s_boundary(side: float) -> None:
    h, saved = saving(6)
    assert choose(0.0, saved / h * side, 6) == ("home" if side > 1 else "away")


def test_the_larger_margin_decides() -> None:
    h, saved = saving(6)
    assert choose(saved * 0.5, saved / h * 1.5, 6) == "home"
    assert choose(saved * 1.5, saved / h * 0.5, 6) == "home"
    assert choose(saved * 0.5, saved / h * 0.5, 6) == "away"


def test_an_idle_home_keeps_its_session_even_in_the_near_tie_band_of_a_less_worked_node() -> None:
    policy = KvdirPolicy(COST, stay_margin_s=0.1, stay_margin_ratio=0.25, allow_pull=False, balance_slack_ratio=10.0)
    for _ in range(20):  # the home has all the recent work: the band alone would send the request away
        policy.on_routed(REQ, policy.choose(REQ, [home(0), away()], random.Random(0)))
    short = RouteRequest(prompt_tokens=64 * 16, hashes=tuple(range(64)), block_size=16, max_tokens=64)
    assert policy.choose(short, [home(0), away()], random.Random(0)).node_id == "home"


def test_max_tokens_4096_with_equal_loads_does_not_move_a_session_whose_history_is_cached() -> None:
    """The gateway's defaults: a request ahead is priced at the output prior (or the observed mean), and a small
    saving does not move a session. Before, each request ahead cost 4096 / 80 / 32 s = 1.6 s, so one request of
    imbalance outweighed its history (640 tokens: 64 ms) and moved it."""
    cost = CostModel(max_running=32)  # the gateway's defaults
    policy = KvdirPolicy(cost, stay_margin_s=0.1, stay_margin_ratio=0.25)
    router = Router(policy, random.Random(0), PrefixHasher(16), learner=TtftLearner(cost.prefill_tokens_per_s))
    req = router.request(1024, list(range(64)), 4096, "m")
    loaded = dict(running=40, can_pull=False)
    h = Candidate("home", 1, cached_blocks=40, slots=tuple(range(40)), running=41, can_pull=False)  # one more there
    old = KvdirPolicy(cost)  # no margins, and the request priced by its max_tokens
    old_req = RouteRequest(1024, tuple(range(64)), 16, 4096)
    for p, r in ((policy, req), (old, old_req)):
        for other in ("a", "b", "c"):
            p.on_routed(r, p.choose(r, [h, Candidate(other, 1, 0, **loaded)], random.Random(0)))
    assert req.output_tokens == 256.0
    assert policy.choose(req, [h, Candidate("z", 1, 0, **loaded)], random.Random(0)).node_id == "home"
    assert old.choose(old_req, [h, Candidate("z", 1, 0, **loaded)], random.Random(0)).node_id == "z"
