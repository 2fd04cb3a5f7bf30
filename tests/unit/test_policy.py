"""Routing policies (gateway/policy.py): the TTFT model, kvdir's pull/recompute
break-even, spreading a hot prefix, the baselines and the modeled peers.

Pure code: no sockets, no clocks, fixed seeds.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.cost import (
    REASONS,
    Candidate,
    CostModel,
    Decision,
    RouteRequest,
    estimate_ttft,
    evaluate,
    pull_seconds,
    queue_seconds,
    slot_interval_seconds,
    ttft_breakdown,
)
from gateway.dynamo_policy import DynamoPolicy
from gateway.kvdir_policy import KvdirPolicy
from gateway.policy import POLICIES, Policy, make_policy
from gateway.sglang_policy import SGLangPolicy

C = CostModel()
ALL = sorted(POLICIES)


def req_of(n_blocks: int, extra: int = 0, bs: int = 16, max_tokens: int = 16, base: int = 1000) -> RouteRequest:
    return RouteRequest(
        prompt_tokens=n_blocks * bs + extra, hashes=tuple(range(base, base + n_blocks)), block_size=bs, max_tokens=max_tokens
    )


def cand(node_id: str, cached: int = 0, **kw) -> Candidate:
    kw.setdefault("slots", tuple(range(100 * len(node_id), 100 * len(node_id) + cached)))
    return Candidate(node_id=node_id, epoch=kw.pop("epoch", 1), cached_blocks=cached, **kw)


def rng(seed: int = 0) -> random.Random:
    return random.Random(seed)


# ---------------------------------------------------------------------------
# The TTFT model


def test_slot_interval_is_decode_time_over_places():
    r = req_of(10, max_tokens=16)
    assert slot_interval_seconds(r, C) == pytest.approx(16 / 80 / 32)
    assert slot_interval_seconds(r, replace(C, mean_output_tokens=64.0)) == pytest.approx(64 / 80 / 32)


def test_estimate_ttft_hand_computed():
    r = req_of(62, extra=8)  # 1000 tokens, 62 full blocks
    assert r.prompt_tokens == 1000
    c = cand("a", cached=10, running=30, inflight=5, waiting=2, pending_prefill_tokens=2000.0)
    # queue: 2000/10000 + (max(0, 30+5-32+1)=4 + 2) * (16/80/32 = 0.00625) = 0.2 + 0.0375
    assert queue_seconds(r, c, C) == pytest.approx(0.2375)
    # compute: (1000 - 160) / 10000
    b = ttft_breakdown(r, c, C)
    assert (b.queue_s, b.pull_s, b.cached_tokens) == (pytest.approx(0.2375), 0.0, 160)
    assert b.compute_s == pytest.approx(0.084)
    assert estimate_ttft(r, c, C) == pytest.approx(0.3215)
    # pull to 50 blocks: 0.002 + 40 * 16384 / 2e9, then (1000 - 800) / 10000
    assert pull_seconds(40, C) == pytest.approx(0.002 + 40 * 16384 / 2e9)
    assert estimate_ttft(r, c, C, pull_to_blocks=50) == pytest.approx(0.2375 + 0.00232768 + 0.02)
    assert ttft_breakdown(r, c, C, pull_to_blocks=50).cached_tokens == 800
    # a pull target at or below what it holds is no pull
    assert estimate_ttft(r, c, C, pull_to_blocks=5) == estimate_ttft(r, c, C)


def test_estimate_ttft_idle_below_max_running_and_caps():
    r = req_of(62, extra=8)
    # 31 running + 0 inflight: one place is free, no queueing term
    assert queue_seconds(r, cand("a", running=31), C) == 0.0
    assert queue_seconds(r, cand("a", running=31, inflight=1), C) == pytest.approx(0.00625)
    # more cached blocks than the prompt has: capped at its full blocks (992 tokens)
    assert ttft_breakdown(r, cand("a", cached=100), C).cached_tokens == 992
    assert estimate_ttft(r, cand("a", cached=100), C) == pytest.approx(8 / 10000)
    # a prompt shorter than its blocks (inconsistent input) never gets more cached tokens than it has
    short = RouteRequest(prompt_tokens=20, hashes=(1, 2, 3))
    assert ttft_breakdown(short, cand("a", cached=3), C).cached_tokens == 20
    assert pull_seconds(0, C) == 0.0


# ---------------------------------------------------------------------------
# kvdir: affinity, break-even, spreading


def kvdir(cost: CostModel = C, **kw) -> Policy:
    return make_policy("kvdir", cost, **kw)


def test_affinity_when_holder_idle():
    r = req_of(100)
    cs = [cand("b"), cand("a", cached=100), cand("c", cached=30)]
    d = kvdir().choose(r, cs, rng())
    assert (d.node_id, d.reason, d.predicted_cached_tokens, d.pull_from) == ("a", "affinity", 1600, None)
    assert d.estimated_ttft_s == pytest.approx(0.0)
    assert "ttft=" in d.detail and "compute" in d.detail


def test_balance_when_nobody_holds_anything():
    r = req_of(20)
    cs = [cand("a", inflight=3), cand("b", inflight=1), cand("c", inflight=2)]
    d = kvdir().choose(r, cs, rng())
    assert (d.node_id, d.reason, d.predicted_cached_tokens) == ("b", "balance", 0)


def saturated_holder_case(n_blocks: int, cost: CostModel, extra: int = 5) -> tuple[RouteRequest, list[Candidate]]:
    """Holder 'h' of the whole prefix is far too busy; 'x' is idle and holds nothing."""
    r = req_of(n_blocks, extra=extra)
    return r, [cand("h", cached=n_blocks, pending_prefill_tokens=1e7, epoch=7), cand("x")]


def break_even_blocks(cost: CostModel, bs: int = 16) -> float:
    """pull_setup + n*bytes/link < n*bs/rate  <=>  n > setup / (bs/rate - bytes/link)."""
    per_block_saving = bs / cost.prefill_tokens_per_s - cost.block_bytes / cost.link_bytes_per_s
    return cost.pull_setup_s / per_block_saving if per_block_saving > 0 else math.inf


@pytest.mark.parametrize(
    "cost",
    [
        C,  # default: 0.002 / (1.6e-3 - 8.192e-6) = 1.26 blocks
        CostModel(pull_setup_s=0.0105, block_bytes=16_384, link_bytes_per_s=16_384 / 0.0006),  # 0.0105 / 0.001 = 10.5
        CostModel(prefill_tokens_per_s=40_000.0, block_bytes=2 * 1024 * 1024, link_bytes_per_s=10e9, pull_setup_s=0.001),
    ],
)
def test_break_even_both_sides(cost):
    n_star = break_even_blocks(cost)
    assert 1 < n_star < 200 and n_star != int(n_star)
    below, above = math.floor(n_star), math.floor(n_star) + 1
    r, cs = saturated_holder_case(below, cost)
    d = kvdir(cost).choose(r, cs, rng())
    assert (d.node_id, d.reason, d.pull_from, d.predicted_cached_tokens) == ("x", "recompute", None, 0)
    assert d.estimated_ttft_s == pytest.approx(estimate_ttft(r, cs[1], cost))
    r, cs = saturated_holder_case(above, cost)
    d = kvdir(cost).choose(r, cs, rng())
    assert (d.node_id, d.reason, d.pull_from, d.pull_epoch) == ("x", "pull", "h", 7)
    assert d.pull_slots == cs[0].slots[:above]
    assert d.predicted_cached_tokens == above * 16
    assert d.estimated_ttft_s == pytest.approx(estimate_ttft(r, cs[1], cost, pull_to_blocks=above))
    assert d.estimated_ttft_s < estimate_ttft(r, cs[1], cost)


def test_slow_link_never_pulls_even_a_long_prefix():
    slow = CostModel(link_bytes_per_s=1e7)  # 16384/1e7 = 1.64 ms per block > 1.6 ms to recompute it
    assert break_even_blocks(slow) == math.inf
    r, cs = saturated_holder_case(1000, slow)
    d = kvdir(slow).choose(r, cs, rng())
    assert (d.node_id, d.reason, d.pull_from) == ("x", "recompute", None)
    # the same case on the default link pulls
    d = kvdir().choose(r, cs, rng())
    assert (d.node_id, d.reason, d.pull_from) == ("x", "pull", "h")


def test_pull_of_missing_part_only_and_partial_holder():
    # 'x' holds 40 of the 60 blocks: it pulls [40, 60), the plan still names the holder's 60 slots.
    r = req_of(60)
    h = cand("h", cached=60, slots=tuple(range(500, 580)), pending_prefill_tokens=1e6)
    x = cand("x", cached=40, running=2)
    d = kvdir().choose(r, [x, h], rng())
    assert (d.node_id, d.reason, d.pull_from) == ("x", "pull", "h")
    assert d.pull_slots == tuple(range(500, 560))
    expected = queue_seconds(r, x, C) + 0.002 + 20 * 16384 / 2e9
    assert d.estimated_ttft_s == pytest.approx(expected)
    assert "pull" in d.detail and "20*16384" in d.detail


def test_pull_source_is_the_longest_holder_lowest_id_on_ties():
    r = req_of(40)
    cs = [
        cand("zz", cached=40, slots=tuple(range(900, 940)), pending_prefill_tokens=1e6),
        cand("hb", cached=40, slots=tuple(range(40)), pending_prefill_tokens=1e6, epoch=4),
        cand("hc", cached=39, slots=tuple(range(300, 339)), pending_prefill_tokens=1e6),
        cand("x", cached=2),
    ]
    d = kvdir().choose(r, cs, rng())
    assert (d.node_id, d.reason, d.pull_from, d.pull_epoch, d.pull_slots) == ("x", "pull", "hb", 4, tuple(range(40)))


def test_no_slots_no_pull():
    r, cs = saturated_holder_case(50, C)
    cs[0] = replace(cs[0], slots=())
    d = kvdir().choose(r, cs, rng())
    assert (d.node_id, d.reason, d.pull_from) == ("x", "recompute", None)
    # slots for only part of the prefix: the pull covers only that part
    cs[0] = replace(cs[0], slots=tuple(range(30)))
    d = kvdir().choose(r, cs, rng())
    assert (d.reason, d.pull_slots, d.predicted_cached_tokens) == ("pull", tuple(range(30)), 30 * 16)


def test_node_that_cannot_pull_recomputes():
    r, cs = saturated_holder_case(50, C)
    cs[1] = replace(cs[1], can_pull=False)
    d = kvdir().choose(r, cs, rng())
    assert (d.node_id, d.reason, d.pull_from) == ("x", "recompute", None)
    # another idle node that can pull gets it instead
    d = kvdir().choose(r, [*cs, cand("y")], rng())
    assert (d.node_id, d.reason, d.pull_from) == ("y", "pull", "h")


def test_allow_pull_false_recomputes():
    r, cs = saturated_holder_case(50, C)
    d = kvdir(allow_pull=False).choose(r, cs, rng())
    assert (d.node_id, d.reason) == ("x", "recompute")


def test_recompute_reason_when_a_shorter_holder_is_less_busy():
    # 'a' holds 50 blocks but is saturated; 'b' holds 10 and is idle; pulls disabled (no slots anywhere)
    r = req_of(50)
    cs = [cand("a", cached=50, slots=(), pending_prefill_tokens=1e6), cand("b", cached=10, slots=())]
    d = kvdir().choose(r, cs, rng())
    assert (d.node_id, d.reason, d.predicted_cached_tokens) == ("b", "recompute", 160)


def test_hot_prefix_with_saturated_holder_is_pulled_to_an_idle_node():
    r = req_of(100, extra=1600)  # 100 shared blocks + 1600 own tokens
    hold = cand("a", cached=100, pending_prefill_tokens=50_000.0, inflight=40, running=32, epoch=3)
    idle = [cand("b"), cand("c"), cand("d", running=1)]
    d = kvdir().choose(r, [hold, *idle], rng())
    assert d.reason == "pull" and d.node_id in {"b", "c"} and d.pull_from == "a" and d.pull_epoch == 3
    assert d.pull_slots == hold.slots


def test_hot_prefix_spreads_over_the_cluster():
    """A stream of requests for one hot prefix: the saturated holder gets none; every other node pulls it once, then serves it."""
    r = req_of(100, extra=1600)
    state = {
        "a": cand("a", cached=100, pending_prefill_tokens=50_000.0, inflight=40, running=32),
        **{n: cand(n) for n in "bcde"},
    }
    pol, g = kvdir(), rng(1)
    seen: list[Decision] = []
    for _ in range(40):
        d = pol.choose(r, list(state.values()), g)
        pol.on_routed(r, d)
        seen.append(d)
        c = state[d.node_id]
        upd = {
            "inflight": c.inflight + 1,
            "pending_prefill_tokens": c.pending_prefill_tokens + r.prompt_tokens - d.predicted_cached_tokens,
        }
        if d.reason == "pull":
            upd.update(cached_blocks=100, slots=tuple(range(1000, 1100)))
        state[d.node_id] = replace(c, **upd)
    used = Counter(d.node_id for d in seen)
    assert "a" not in used
    assert set(used) == set("bcde")
    pulls = Counter(d.node_id for d in seen if d.reason == "pull")
    assert pulls == Counter("bcde")  # each pulled once, then hit its own copy
    assert all(d.reason in {"pull", "affinity"} for d in seen)
    assert max(used.values()) - min(used.values()) <= 2


def test_unhealthy_never_chosen_nor_pulled_from():
    r = req_of(50)
    dead = cand("a", cached=50, healthy=False)
    live = [cand("b", cached=5, inflight=2), cand("c")]
    for name in ALL:
        pol = make_policy(name)
        g = rng(3)
        for _ in range(20):
            d = pol.choose(r, [dead, *live], g)
            pol.on_routed(r, d)
            assert d.node_id != "a" and d.pull_from != "a"
    d = kvdir().choose(r, [dead, *live], rng())
    # the longest healthy holder is 'b' (5 blocks)
    assert d.reason in {"affinity", "pull"} and (d.node_id == "b" or d.pull_from == "b")


@pytest.mark.parametrize("name", ALL)
def test_no_healthy_candidate_is_value_error(name):
    pol = make_policy(name)
    with pytest.raises(ValueError):
        pol.choose(req_of(4), [], rng())
    with pytest.raises(ValueError):
        pol.choose(req_of(4), [cand("a", healthy=False), cand("b", cached=4, healthy=False)], rng())


def test_kvdir_tie_breaks_cached_then_inflight_then_rng():
    r = req_of(62, extra=8)
    # 'a' recomputes 1000 tokens; 'b' has 10 blocks cached but exactly 160 tokens of pending prefill:
    # equal TTFT (0.1 s) up to rounding. More cached tokens wins. No slots: no pull option.
    a = cand("a", slots=())
    b = cand("b", cached=10, slots=(), pending_prefill_tokens=160.0)
    assert estimate_ttft(r, a, C) == pytest.approx(estimate_ttft(r, b, C), abs=1e-12)
    assert kvdir().choose(r, [a, b], rng()).node_id == "b"
    # equal TTFT and cached: fewer inflight wins (inflight below max_running adds no queueing)
    a2, b2 = cand("a", inflight=3), cand("b", inflight=1)
    assert kvdir().choose(r, [a2, b2], rng()).node_id == "b"
    # all equal: the rng decides, deterministically per seed, and both sides occur
    picks = [kvdir().choose(r, [cand("a"), cand("b")], rng(s)).node_id for s in range(40)]
    assert set(picks) == {"a", "b"}
    assert picks == [kvdir().choose(r, [cand("b"), cand("a")], rng(s)).node_id for s in range(40)]


# ---------------------------------------------------------------------------
# Stateless baselines


def test_round_robin_cycles_in_node_id_order():
    r = req_of(4)
    cs = [cand("c"), cand("a", cached=4), cand("b")]
    pol = make_policy("round_robin")
    got = [pol.choose(r, cs, rng()).node_id for _ in range(7)]
    assert got == ["a", "b", "c", "a", "b", "c", "a"]
    d = pol.choose(r, cs, rng())
    assert (d.node_id, d.reason) == ("b", "balance")
    # 'c' goes unhealthy: skipped; 'd' joins: takes its place in the order
    cs2 = [replace(cs[0], healthy=False), cs[1], cs[2], cand("d")]
    got = [pol.choose(r, cs2, rng()).node_id for _ in range(4)]
    assert got == ["d", "a", "b", "d"]


def test_least_loaded():
    r = req_of(4)
    cs = [cand("a", inflight=2, running=1), cand("b", waiting=2), cand("c", running=1, waiting=1), cand("d", cached=4, running=9)]
    d = make_policy("least_loaded").choose(r, cs, rng())
    assert (d.node_id, d.reason) == ("b", "balance")  # b and c tie at 2: lowest node_id
    cs[1] = replace(cs[1], waiting=3)
    assert make_policy("least_loaded").choose(r, cs, rng()).node_id == "c"


def test_local_only_random_and_deterministic():
    r = req_of(8)
    cs = [cand("a", cached=8), cand("b"), cand("c")]
    pol = make_policy("local_only")
    g1, g2 = rng(5), rng(5)
    d1 = [pol.choose(r, cs, g1) for _ in range(60)]
    d2 = [pol.choose(r, list(reversed(cs)), g2) for _ in range(60)]
    assert [d.node_id for d in d1] == [d.node_id for d in d2]
    assert {d.node_id for d in d1} == {"a", "b", "c"}
    for d in d1:
        assert d.reason == ("affinity" if d.node_id == "a" else "balance")
        assert d.pull_from is None


# ---------------------------------------------------------------------------
# Modeled after SGLang's cache-aware router


def sg(**kw) -> SGLangPolicy:
    pol = make_policy("sglang", **kw)
    assert isinstance(pol, SGLangPolicy)
    return pol


def route(pol: Policy, r: RouteRequest, cs: list[Candidate], g: random.Random | None = None) -> Decision:
    d = pol.choose(r, cs, g or rng())
    pol.on_routed(r, d)
    return d


def test_sglang_learns_its_tree_and_ignores_the_directory():
    pol = sg()
    r = req_of(10)
    # the directory says 'c' holds it all: the modeled router does not look
    cs = [cand("a"), cand("b"), cand("c", cached=10)]
    d1 = route(pol, r, cs)
    assert (d1.node_id, d1.reason, d1.predicted_cached_tokens) == ("a", "balance", 0)  # empty trees: smallest, by id
    assert pol.tree_size("a") == 10 and pol.tree_size() == 10
    d2 = route(pol, r, cs)
    assert (d2.node_id, d2.reason, d2.predicted_cached_tokens) == ("a", "affinity", 160)
    assert pol.tree_size("a") == 10  # re-routing the same prefix adds nothing
    # a different prompt: no match -> smallest tree (b, then c)
    other = req_of(10, base=5000)
    assert route(pol, other, cs).node_id == "b"
    assert route(pol, req_of(10, base=9000), cs).node_id == "c"
    # a prompt sharing 6 of 10 leading blocks with r: ratio 0.6 > 0.5 -> a
    shared = RouteRequest(prompt_tokens=160, hashes=r.hashes[:6] + (70, 71, 72, 73))
    d = route(pol, shared, cs)
    assert (d.node_id, d.reason, d.predicted_cached_tokens) == ("a", "affinity", 96)
    assert pol.match_blocks(shared.hashes, ["a", "b", "c"]) == {"a": 10, "b": 0, "c": 0}


def test_sglang_cache_threshold():
    r = req_of(10)
    half = RouteRequest(prompt_tokens=160, hashes=r.hashes[:5] + (1, 2, 3, 4, 5))
    cs = [cand("a"), cand("b")]
    pol = sg()
    route(pol, r, cs)  # -> a (tree a=10)
    # 5/10 = 0.5 is not > 0.5: smallest tree, which is b
    d = route(pol, half, cs)
    assert (d.node_id, d.reason) == ("b", "balance")
    pol2 = sg(cache_threshold=0.3)
    route(pol2, r, cs)
    d = route(pol2, half, cs)
    assert (d.node_id, d.reason, d.predicted_cached_tokens) == ("a", "affinity", 80)


def test_sglang_load_imbalance_overrides_cache():
    r = req_of(10)
    pol = sg()
    route(pol, r, [cand("a"), cand("b")])  # a learns r
    # a: load 40, b: 5 -> 35 > 32 and 40 > 1.1*5: least loaded although a matches 100%
    busy = [cand("a", running=30, inflight=10), cand("b", waiting=5)]
    d = route(pol, r, busy)
    assert (d.node_id, d.reason) == ("b", "balance")
    assert "imbalanced" in d.detail
    # a spread of exactly 32 is not > 32: the cache decides
    pol2 = sg()
    route(pol2, r, [cand("a"), cand("b")])
    d = pol2.choose(r, [cand("a", running=32), cand("b")], rng())
    assert (d.node_id, d.reason) == ("a", "affinity")
    # absolute spread 36 > 32 but 400 <= 1.1 * 364: within the relative threshold -> cache
    d = pol2.choose(r, [cand("a", running=400), cand("b", running=330, waiting=34)], rng())
    assert (d.node_id, d.reason) == ("a", "affinity")
    # 400 vs 360: 40 > 32 and 400 > 396 -> least loaded
    d = pol2.choose(r, [cand("a", running=400), cand("b", running=360)], rng())
    assert (d.node_id, d.reason) == ("b", "balance")
    # options: a stricter absolute threshold switches to balance
    pol3 = sg(abs_threshold=4, rel_threshold=1.5)
    route(pol3, r, [cand("a"), cand("b")])
    assert pol3.choose(r, [cand("a", running=10), cand("b", running=2)], rng()).node_id == "b"


def test_sglang_lru_trimming():
    pol = sg(max_tree_size=25)
    cs = [cand("a"), cand("b")]
    r1, r2, r3 = req_of(10, base=100), req_of(10, base=200), req_of(10, base=300)
    assert route(pol, r1, cs).node_id == "a"
    assert route(pol, r2, cs).node_id == "b"
    assert pol.tree_size() == 20
    # r1 again on 'a' refreshes it; then r3 (to a: sizes tie 10/10, lowest id) overflows by 5:
    # the oldest entries are r2's deepest blocks on 'b'
    assert route(pol, r1, cs).node_id == "a"
    assert route(pol, r3, cs).node_id == "a"
    assert pol.tree_size() == 25
    assert pol.tree_size("a") == 20 and pol.tree_size("b") == 5
    assert pol.match_blocks(r2.hashes, ["b"]) == {"b": 5}  # leaves went first, the prefix stayed
    assert pol.match_blocks(r1.hashes, ["a"]) == {"a": 10}
    pol.on_engine_gone("a")
    assert pol.tree_size() == 5 and pol.tree_size("a") == 0
    assert pol.match_blocks(r1.hashes, ["a", "b"]) == {"a": 0, "b": 0}


def test_sglang_options_validated():
    with pytest.raises(ValueError):
        make_policy("sglang", max_tree_size=0)
    with pytest.raises(ValueError):
        make_policy("sglang", cache_threshold=1.5)


# ---------------------------------------------------------------------------
# Capacity, balance and engine units (kvdir)


def test_a_pull_that_would_evict_more_than_it_saves_is_refused():
    r = req_of(100)  # 1600 tokens
    a = cand("a", cached=100, pending_prefill_tokens=1000.0)  # holder, 0.1 s of queue
    full = cand("b", free_tokens=0)  # idle, cache full: storing 1600 tokens evicts as many
    roomy = cand("b", free_tokens=1600)  # idle, room for all of it
    priced = CostModel(displace_weight=8.0)
    # without a price for displacement, or with room, the idle node pulls (2.8 ms instead of 0.1 s of queue)
    assert make_policy("kvdir", CostModel(displace_weight=0.0)).choose(r, [a, full], rng()).reason == "pull"
    assert make_policy("kvdir", priced).choose(r, [a, roomy], rng()).reason == "pull"
    # full: the copy would push out 8 * 0.16 s of others' recompute, more than the 0.097 s it saves
    d = make_policy("kvdir", priced).choose(r, [a, full], rng())
    assert (d.node_id, d.reason, d.pull_from) == ("a", "affinity", None)
    assert d.estimated_ttft_s == pytest.approx(0.1)  # the estimate stays a TTFT: the price is not in it
    br = evaluate(r, full, priced, pull_to_blocks=100)
    assert br.displace_s == pytest.approx(8 * 1600 / 10_000) and br.score_s == pytest.approx(br.total_s + br.displace_s)
    assert evaluate(r, a, priced).displace_s == 0.0  # the holder stores nothing
    assert evaluate(r, cand("b", free_tokens=1000), priced).displace_s == pytest.approx(8 * 600 / 10_000)
    assert evaluate(r, cand("b"), priced).displace_s == 0.0  # free space unknown: not priced


def test_near_ties_go_to_the_node_with_the_least_recent_work():
    pol = make_policy("kvdir", balance_slack_s=0.02)
    assert isinstance(pol, KvdirPolicy)
    cs = [cand("a"), cand("b"), cand("c")]
    seen = []
    for k in range(3):
        r = req_of(10, base=1000 * (k + 1))
        d = pol.choose(r, cs, rng(k))
        pol.on_routed(r, d)
        seen.append(d.node_id)
    assert sorted(seen) == ["a", "b", "c"]  # three new prompts, three nodes
    assert pol.recent_work("a") > 0
    # a holds 1 block (1.6 ms less to compute) but has more recent work: within the slack, balance wins
    pol2 = make_policy("kvdir", balance_slack_s=0.02)
    busy = req_of(50, base=9000)
    pol2.on_routed(busy, Decision("a", "balance", 0))
    r = req_of(20)
    d = pol2.choose(r, [cand("a", cached=1), cand("b", can_pull=False)], rng())
    assert d.node_id == "b"
    # a holds 15 of 20 blocks (24 ms less): beyond the slack, the cache wins
    d = pol2.choose(r, [cand("a", cached=15), cand("b", can_pull=False)], rng())
    assert (d.node_id, d.reason) == ("a", "affinity")
    with pytest.raises(ValueError):
        make_policy("kvdir", balance_window=0)


@pytest.mark.parametrize("name", ALL)
def test_predicted_cached_tokens_are_in_the_engines_block_units(name):
    """Gateway blocks of 16, engine blocks of 32: a match of 29 blocks (464 tokens) ends mid engine block."""
    r = req_of(40)
    c = cand("a", cached=29, engine_block_size=32)
    pol = make_policy(name)
    if isinstance(pol, SGLangPolicy):  # its own tree: teach it the 29 blocks
        pol.on_routed(RouteRequest(29 * 16, r.hashes[:29], 16), Decision("a", "balance", 0))
    d = pol.choose(r, [c], rng())
    assert d.predicted_cached_tokens == 448  # not 464
    same = make_policy(name)
    if isinstance(same, SGLangPolicy):
        same.on_routed(RouteRequest(29 * 16, r.hashes[:29], 16), Decision("a", "balance", 0))
    assert same.choose(r, [cand("a", cached=29)], rng()).predicted_cached_tokens == 464  # unknown engine block: as hashed


# ---------------------------------------------------------------------------
# Modeled after Dynamo's KV router


def test_dynamo_cost_counts_prefill_blocks_and_distinct_active_blocks():
    r = req_of(20, max_tokens=12)  # 320 prompt tokens, 20 blocks of 16
    cs = [
        cand("a", cached=20, inflight=2),  # prefill 0
        cand("b", cached=5),  # prefill (320 - 80) / 16 = 15
        cand("c", cached=10, pending_prefill_tokens=32.0, inflight=1),  # (160 + 32) / 16 = 12
    ]
    pol = make_policy("dynamo", track_finished=True)
    assert isinstance(pol, DynamoPolicy)
    # decode blocks: this request's 20 blocks, none in flight anywhere yet
    assert pol.costs(r, cs) == pytest.approx([20.0, 35.0, 32.0])
    other, big = req_of(10, base=5000), req_of(30, base=6000)
    pol.on_routed(other, Decision("a", "balance", 0))
    pol.on_routed(big, Decision("a", "balance", 0))
    assert pol.active_blocks("a") == 40
    assert pol.costs(r, cs)[0] == pytest.approx(60.0)
    d = pol.choose(r, cs, rng())
    assert (d.node_id, d.reason, d.predicted_cached_tokens) == ("c", "recompute", 160)
    assert "argmin" in d.detail
    # a sequence sharing this request's blocks counts them once: c's decode blocks stay 20
    pol.on_routed(req_of(20), Decision("c", "affinity", 160))
    assert pol.costs(r, cs)[2] == pytest.approx(32.0)
    pol.on_finished(big, Decision("a", "balance", 0))  # Dynamo's free
    assert pol.active_blocks("a") == 10 and pol.costs(r, cs)[0] == pytest.approx(30.0)
    # cache-only weight: the full holder wins; weight 0: load only
    assert make_policy("dynamo", overlap_weight=100.0).choose(r, cs, rng()).node_id == "a"
    assert make_policy("dynamo", overlap_weight=0.0).costs(r, cs) == pytest.approx([20.0, 20.0, 20.0])


def test_dynamo_without_completions_trims_to_the_inflight_count():
    """A caller that never reports a request's end (a plain gateway): a node keeps at most `inflight` sequences."""
    pol = make_policy("dynamo")
    assert isinstance(pol, DynamoPolicy)
    for base in (5000, 6000, 7000):
        pol.on_routed(req_of(10, base=base), Decision("a", "balance", 0))
    assert pol.active_blocks("a") == 30
    pol.costs(req_of(4), [cand("a", inflight=1)])
    assert pol.active_blocks("a") == 10  # the newest one is left
    pol.costs(req_of(4), [cand("a", inflight=0)])
    assert pol.active_blocks("a") == 0


def test_dynamo_random_ties_are_seeded():
    r = req_of(8)
    cs = [cand("a"), cand("b"), cand("c")]
    pol = make_policy("dynamo")
    picks = [pol.choose(r, cs, rng(s)).node_id for s in range(60)]
    assert set(picks) == {"a", "b", "c"}
    assert picks == [pol.choose(r, list(reversed(cs)), rng(s)).node_id for s in range(60)]
    assert all(pol.choose(r, cs, rng(s)).reason == "balance" for s in range(5))


def test_dynamo_temperature_sampling():
    r = req_of(20)
    cs = [cand("a", cached=20), cand("b", cached=10), cand("c")]  # costs 0, 10, 20
    hot = make_policy("dynamo", temperature=1.0)
    g1, g2 = rng(11), rng(11)
    s1 = [hot.choose(r, cs, g1).node_id for _ in range(600)]
    s2 = [hot.choose(r, [cs[2], cs[0], cs[1]], g2).node_id for _ in range(600)]
    assert s1 == s2
    n = Counter(s1)
    # p ∝ exp(-0), exp(-0.5), exp(-1) = 0.506, 0.307, 0.186
    assert n["a"] > n["b"] > n["c"] > 0
    assert abs(n["a"] / 600 - 0.506) < 0.07
    # near-zero temperature is (almost) argmin; T=0 is argmin exactly
    assert Counter(make_policy("dynamo", temperature=0.01).choose(r, cs, rng(s)).node_id for s in range(50)) == Counter({"a": 50})
    with pytest.raises(ValueError):
        make_policy("dynamo", temperature=-1.0)


# ---------------------------------------------------------------------------
# Registry


def test_make_policy_names_and_errors():
    assert set(POLICIES) == {"kvdir", "round_robin", "least_loaded", "sglang", "dynamo", "local_only"}
    for name in ALL:
        pol = make_policy(name, C)
        assert pol.name == name and isinstance(pol, Policy)
    with pytest.raises(ValueError) as e:
        make_policy("nope")
    for name in ALL:
        assert name in str(e.value)
    with pytest.raises(ValueError, match="bad options"):
        make_policy("round_robin", temperature=1.0)


# ---------------------------------------------------------------------------
# Properties over every policy

NODE_IDS = ["n0", "n1", "n2", "n3", "n4", "n5"]


@st.composite
def scenario(draw):
    bs = draw(st.sampled_from([1, 4, 16]))
    nh = draw(st.integers(0, 12))
    # prompt_tokens normally covers the blocks; sometimes (inconsistent input) it does not
    prompt = draw(st.one_of(st.integers(nh * bs, nh * bs + bs - 1), st.integers(0, nh * bs + bs)))
    prefix = draw(st.integers(0, 3))  # a few prompts share hashes, so trees match
    req = RouteRequest(
        prompt_tokens=prompt,
        hashes=tuple(range(prefix * 100, prefix * 100 + nh)),
        block_size=bs,
        max_tokens=draw(st.integers(1, 64)),
    )
    ids = draw(st.lists(st.sampled_from(NODE_IDS), min_size=1, max_size=6, unique=True))
    cands = []
    for i, node in enumerate(ids):
        cached = draw(st.integers(0, nh + 2))
        cands.append(
            Candidate(
                node_id=node,
                epoch=draw(st.integers(1, 5)),
                cached_blocks=cached,
                slots=tuple(range(i * 50, i * 50 + draw(st.integers(0, cached + 1)))),
                running=draw(st.integers(0, 40)),
                waiting=draw(st.integers(0, 5)),
                pending_prefill_tokens=draw(st.floats(0, 1e5)),
                inflight=draw(st.integers(0, 40)),
                healthy=draw(st.booleans()) if i else True,
                can_pull=draw(st.booleans()),
            )
        )
    return req, cands


COSTS = st.builds(
    CostModel,
    link_bytes_per_s=st.sampled_from([1e6, 1e8, 2e9, 1e11]),
    pull_setup_s=st.sampled_from([0.0, 0.002, 0.05]),
    max_running=st.integers(1, 64),
)


def check(req: RouteRequest, cands: list[Candidate], d: Decision) -> None:
    healthy = {c.node_id: c for c in cands if c.healthy}
    assert d.node_id in healthy
    assert d.reason in REASONS
    assert 0 <= d.predicted_cached_tokens <= req.prompt_tokens
    assert d.estimated_ttft_s >= 0 and math.isfinite(d.estimated_ttft_s)
    if d.reason == "pull":
        assert healthy[d.node_id].can_pull
        assert d.pull_from in healthy and d.pull_from != d.node_id
        assert d.pull_epoch == healthy[d.pull_from].epoch
        assert 0 < len(d.pull_slots) <= healthy[d.pull_from].cached_blocks
        assert d.pull_slots == healthy[d.pull_from].slots[: len(d.pull_slots)]
    else:
        assert d.pull_from is None and d.pull_epoch is None and d.pull_slots == ()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(scenario(), min_size=1, max_size=6), COSTS, st.integers(0, 2**32 - 1))
def test_every_policy_returns_a_healthy_node_and_a_valid_decision(scenarios, cost, seed):
    for name in ALL:
        opts = {"max_tree_size": 7} if name == "sglang" else {}
        runs = []
        for _ in range(2):  # twice from the same seed: the same decisions
            pol, g = make_policy(name, cost, **opts), random.Random(seed)
            out = []
            for req, cands in scenarios:
                d = pol.choose(req, cands, g)
                check(req, cands, d)
                pol.on_routed(req, d)
                out.append(d)
            if name == "sglang":
                assert pol.tree_size() <= 7
                assert sum(pol.tree_size(n) for n in NODE_IDS) == pol.tree_size()
            runs.append(out)
        assert runs[0] == runs[1]


@settings(max_examples=200, deadline=None)
@given(scenario(), COSTS, st.integers(0, 2**32 - 1))
def test_kvdir_picks_the_minimum_estimate(sc, cost, seed):
    req, cands = sc
    d = make_policy("kvdir", cost).choose(req, cands, random.Random(seed))
    healthy = [c for c in cands if c.healthy]
    nh = len(req.hashes)
    holder = min(healthy, key=lambda c: (-min(c.cached_blocks, nh), c.node_id))
    pull_to = min(holder.cached_blocks, nh, len(holder.slots))
    options = []
    for c in healthy:
        options.append(estimate_ttft(req, c, cost))
        if pull_to > min(c.cached_blocks, nh) and c.can_pull:
            options.append(estimate_ttft(req, c, cost, pull_to_blocks=pull_to))
    assert d.estimated_ttft_s <= min(options) + 1e-9
    chosen = next(c for c in healthy if c.node_id == d.node_id)
    if d.reason == "pull":
        assert d.pull_from == holder.node_id
        assert d.estimated_ttft_s == pytest.approx(estimate_ttft(req, chosen, cost, pull_to_blocks=pull_to))
        assert len(d.pull_slots) == pull_to
    else:
        assert d.estimated_ttft_s == pytest.approx(estimate_ttft(req, chosen, cost))
        longest = min(holder.cached_blocks, nh)
        mine = min(chosen.cached_blocks, nh)
        assert d.reason == ("balance" if longest == 0 else "affinity" if mine == longest else "recompute")


def test_follower_of_an_in_flight_prefix_queues_behind_it_rather_than_computing_it_again():
    # shared_prefix's case: n6 is computing the 8-block group prefix (4,608 tokens pending); the next request of the
    # group is 51 ms faster computing it all again on an idle node, which duplicates 0.41 s of prefill and the copy.
    cost = CostModel(block_bytes=64 << 20, link_bytes_per_s=12.5e9)
    req = RouteRequest(prompt_tokens=4608, hashes=tuple(range(9)), block_size=512, max_tokens=128)
    cands = [cand(f"n{j}") for j in range(6)] + [cand("n6", inflight_blocks=8, pending_prefill_tokens=4608, inflight=1)]
    d = KvdirPolicy(cost).choose(req, cands, rng())
    assert (d.node_id, d.reason, d.predicted_cached_tokens) == ("n6", "inflight", 4096)
    plain = KvdirPolicy(cost, dup_weight=0.0).choose(req, cands, rng())
    assert plain.node_id != "n6" and plain.reason == "balance"
    # A long queue there still sends the follower elsewhere: the price is a fraction of the duplicate compute.
    busy = cands[:6] + [cand("n6", inflight_blocks=8, pending_prefill_tokens=20_000, inflight=1)]
    assert KvdirPolicy(cost).choose(req, busy, rng()).node_id != "n6"


def test_a_hot_in_flight_prefix_is_started_again_elsewhere_without_the_duplicate_price():
    # The burst's case: n1 is computing a 12-block prefix and one follower already queues behind it. Two requests
    # in flight on a prefix that takes 0.61 s to compute: it arrives faster than it is computed, so the third
    # starts a second computation on an idle node now (the TTFT's choice) rather than after the queue has grown.
    cost = CostModel(block_bytes=64 << 20, link_bytes_per_s=12.5e9)
    cands = [cand("n0"), cand("n1", inflight_blocks=12, pending_prefill_tokens=6272, inflight=2), cand("n2")]

    def follower(riding: int) -> RouteRequest:
        return RouteRequest(6208, tuple(range(13)), block_size=512, max_tokens=16, inflight_requests=riding)

    assert KvdirPolicy(cost).choose(follower(1), cands, rng()).node_id == "n1"  # one: no sign of more
    hot = KvdirPolicy(cost).choose(follower(2), cands, rng())
    assert hot.node_id in {"n0", "n2"} and hot.reason == "balance"
    assert KvdirPolicy(cost, dup_hot_requests=3).choose(follower(2), cands, rng()).node_id == "n1"
    with pytest.raises(ValueError):
        KvdirPolicy(cost, dup_hot_requests=0)


def test_a_follower_takes_the_shortest_queue_among_nodes_computing_its_prefix_not_the_near_tie_band():
    # The burst once every node computes the prefix: n1's queue is one follower (64 tokens, 6.4 ms) longer but n1
    # has the least recent work (its prefix was routed first and has decayed most). Every node will hold the
    # prefix, so balancing buys nothing later: the follower takes the shortest queue.
    cost = CostModel(block_bytes=64 << 20, link_bytes_per_s=12.5e9)
    req = RouteRequest(6208, tuple(range(13)), block_size=512, max_tokens=16, inflight_requests=5)
    cands = [
        cand("n0", inflight_blocks=12, pending_prefill_tokens=6208, inflight=1),
        cand("n1", inflight_blocks=12, pending_prefill_tokens=6272, inflight=2),
    ]
    pol = KvdirPolicy(cost)
    pol.on_routed(req, Decision("n1", "balance", 0))
    pol.on_routed(req, Decision("n0", "balance", 0))
    assert pol.recent_work("n1") < pol.recent_work("n0")
    d = pol.choose(req, cands, rng())
    assert (d.node_id, d.reason) == ("n0", "inflight")
    # Without a prefix in flight the same 6.4 ms is a near tie, and the node with less recent work gets it.
    fresh = [cand("n0", pending_prefill_tokens=0), cand("n1", pending_prefill_tokens=64)]
    assert pol.choose(req_of(20), fresh, rng()).node_id == "n1"


def test_peer_notes_count_as_recent_work_of_their_node():
    req = req_of(4)
    cands = [cand("a"), cand("b")]
    pol = KvdirPolicy()
    pol.on_peer_routed("a", 5000)
    assert pol.recent_work("a") > 0 and pol.recent_work("b") == 0
    assert {pol.choose(req, cands, rng(s)).node_id for s in range(20)} == {"b"}
    assert {KvdirPolicy().choose(req, cands, rng(s)).node_id for s in range(20)} == {"a", "b"}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_takes_every_hook(name: str) -> None:
    """The gateway hands every policy its peers' notes and the engines that left (no test of the policy's class):
    those that keep no state on an event ignore it and route as a policy told nothing does."""
    pol, told_nothing = make_policy(name), make_policy(name)
    assert isinstance(pol, Policy)
    req, cands = req_of(4), [cand("a"), cand("b")]
    expected = [told_nothing.choose(req, cands, rng(1)).node_id for _ in range(2)]
    pol.on_peer_routed("a", 5000)
    first = pol.choose(req, cands, rng(1)).node_id
    pol.on_engine_gone("a")  # and what was kept about "a" goes with it
    second = pol.choose(req, cands, rng(1)).node_id
    assert [first, second] == (["b", expected[1]] if name == "kvdir" else expected)
