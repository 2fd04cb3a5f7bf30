"""The gateway's pure routing step (gateway.router), its load accounting (gateway.proxy.InflightTicket),
the pull-plan wire type and the cost model's one evaluation function.

No sockets, no processes: engines and holders are plain objects.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass

import httpx
import msgspec
import pytest

from gateway.config import GatewaySettings
from gateway.cost import CostModel, RouteRequest, evaluate, slot_interval_seconds, ttft_breakdown
from gateway.engine_registry import EngineRegistry, EngineState
from gateway.policy import make_policy
from gateway.prefix_hasher import PrefixHasher
from gateway.proxy import InflightTicket, cached_tokens
from gateway.router import (
    REPORTED_GBPS_MAX,
    REPORTED_GBPS_MIN,
    NoEngineAvailable,
    Router,
    build_candidates,
    cost_model,
    make_candidate,
    reported_link,
)
from gateway.sglang_policy import SGLangPolicy
from kvproto.client import DirectoryClient
from kvproto.hashing import KvIdentity, identity_hashes
from kvproto.schemas import PULL_GBPS_LABEL, PULL_PLAN_FIELD, Holder, NodeInfo, Origin, PullPlan


@dataclass
class Engine:
    """An engine as routing sees it (the fields of gateway.engine_registry.EngineState it reads)."""

    node_id: str
    epoch: int = 1
    running: float = 0.0
    waiting: float = 0.0
    inflight: int = 0
    pending_prefill_tokens: float = 0.0
    healthy: bool = True
    can_pull: bool = True
    block_bytes: int = 0
    block_size: int = 0
    capacity_blocks: int | None = None
    blocks: int = 0
    pull_gbps: float = 0.0
    fingerprint: str | None = "fp-1"
    tp_size: int = 1
    tenant: str = ""
    shared: bool = False

    @property
    def reported_inflight(self) -> int:
        return self.inflight  # as a heartbeat's figures: taken as of now


def router(policy: str = "kvdir", cost: CostModel | None = None, seed: int = 0) -> Router:
    return Router(make_policy(policy, cost), random.Random(seed), PrefixHasher(16))


def req(n_blocks: int, extra: int = 0) -> RouteRequest:
    return RouteRequest(prompt_tokens=n_blocks * 16 + extra, hashes=tuple(range(1000, 1000 + n_blocks)))


# ---------------------------------------------------------------------------
# Candidates


def test_candidate_counts_the_gateways_own_requests_once() -> None:
    c = make_candidate("a", 3, reported_running=5.0, waiting=2.0, inflight=3, pending_prefill_tokens=40.0)
    assert (c.running, c.waiting, c.inflight, c.pending_prefill_tokens) == (2, 2, 3, 40.0)
    # an engine that has not reported the gateway's requests yet: never negative
    assert make_candidate("a", 3, reported_running=1.0, waiting=0.0, inflight=4, pending_prefill_tokens=0.0).running == 0
    # the gateway's requests the engine holds queued are not also its waiting (more: tests/unit/test_engine_load.py)
    c = make_candidate("a", 3, reported_running=1.0, waiting=3.0, inflight=4, pending_prefill_tokens=0.0)
    assert (c.running, c.waiting, c.inflight) == (0, 0, 4)


def test_candidates_take_cached_blocks_only_from_the_engines_current_epoch() -> None:
    engines = [Engine("a", epoch=2), Engine("b", epoch=1, healthy=False), Engine("c", epoch=5)]
    holders = {
        "a": Holder(node_id="a", epoch=2, matched_blocks=4, slots=[7, 8, 9, 10]),
        "b": Holder(node_id="b", epoch=1, matched_blocks=3, slots=None),
        "c": Holder(node_id="c", epoch=4, matched_blocks=9, slots=[1] * 9),  # an earlier incarnation: gone
    }
    cands = build_candidates(engines, holders)
    assert [(c.node_id, c.cached_blocks, c.slots, c.healthy) for c in cands] == [
        ("a", 4, (7, 8, 9, 10), True),
        ("b", 3, (), False),
        ("c", 0, (), True),
    ]
    assert [c.node_id for c in build_candidates(engines, holders, exclude={"a"})] == ["b", "c"]


# ---------------------------------------------------------------------------
# Decisions


def test_no_healthy_engine_is_no_engine_available() -> None:
    r = router()
    with pytest.raises(NoEngineAvailable, match="no engine is available"):
        r.route(req(2), [], {})
    with pytest.raises(NoEngineAvailable):
        r.route(req(2), [Engine("a", healthy=False), Engine("b")], {}, exclude={"b"})


def test_affinity_to_the_holder_without_a_plan() -> None:
    holders = {"b": Holder(node_id="b", epoch=1, matched_blocks=10, slots=list(range(10)))}
    route = router().route(req(10, extra=4), [Engine("a"), Engine("b")], holders)
    assert (route.decision.node_id, route.decision.reason, route.decision.predicted_cached_tokens) == ("b", "affinity", 160)
    assert route.pull_plan is None and route.uncached_tokens == 4
    body = {"model": "m", "prompt": "x"}
    assert route.upstream_body(body) is body


def test_prediction_is_rounded_to_the_engines_registered_block_size() -> None:
    """Gateway blocks of 16, an engine registered with blocks of 32: 29 matched blocks are 448 tokens, not 464."""
    holders = {"b": Holder(node_id="b", epoch=1, matched_blocks=29, slots=list(range(29)))}
    route = router().route(req(40), [Engine("b", block_size=32)], holders)
    assert route.decision.predicted_cached_tokens == 448 and route.uncached_tokens == 40 * 16 - 448


def test_a_pull_becomes_the_wire_plan_in_the_body() -> None:
    # the holder is saturated: the idle peer pulls the prefix instead of queueing behind it
    holders = {"b": Holder(node_id="b", epoch=7, matched_blocks=50, slots=list(range(100, 150)))}
    engines = [Engine("a"), Engine("b", epoch=7, running=64.0)]
    route = router().route(req(50), engines, holders)
    d = route.decision
    assert (d.node_id, d.reason, d.pull_from, d.pull_epoch) == ("a", "pull", "b", 7)
    assert route.pull_plan == PullPlan(source_node="b", source_epoch=7, slots=list(range(100, 150)), fingerprint="fp-1")
    body = route.upstream_body({"model": "m", "prompt": "x", "kv_transfer_params": {"other": 1}})
    wire = {"source_node": "b", "source_epoch": 7, "slots": list(range(100, 150)), "fingerprint": "fp-1"}
    assert body == {
        "model": "m",
        "prompt": "x",
        PULL_PLAN_FIELD: wire,
        "kv_transfer_params": {"other": 1, PULL_PLAN_FIELD: wire},  # the vLLM connector's copy, beside the client's
    }
    assert list(body) == ["model", "prompt", "kv_transfer_params", "kvdir_pull"]
    assert route.uncached_tokens == 0


@pytest.mark.parametrize(
    ("puller", "holder"),
    [("fp-2", "fp-1"), (None, "fp-1"), ("fp-1", None), (None, None)],
    ids=["different", "puller-none", "holder-none", "both-none"],
)
def test_no_pull_is_planned_unless_both_fingerprints_are_equal(puller: str | None, holder: str | None) -> None:
    """Another model's (or revision's, or layout's) KV is never pulled: the same saturated holder as above."""
    holders = {"b": Holder(node_id="b", epoch=7, matched_blocks=50, slots=list(range(100, 150)))}
    engines = [Engine("a", fingerprint=puller), Engine("b", epoch=7, running=64.0, fingerprint=holder)]
    route = router().route(req(50), engines, holders)
    assert route.decision.reason != "pull" and route.pull_plan is None


@pytest.mark.parametrize(("puller", "holder"), [(2, 1), (1, 2), (2, 4)])
def test_no_pull_is_planned_between_engines_of_different_tp_sizes(puller: int, holder: int) -> None:
    """The same saturated holder: a rank's pages hold its share of the heads, so ranks must match one to one.
    The decision says why it did not pull."""
    holders = {"b": Holder(node_id="b", epoch=7, matched_blocks=50, slots=list(range(100, 150)))}
    engines = [Engine("a", tp_size=puller), Engine("b", epoch=7, running=64.0, tp_size=holder)]
    route = router().route(req(50), engines, holders)
    assert route.decision.reason != "pull" and route.pull_plan is None
    if route.decision.node_id == "a":
        assert f"no pull from b: {holder} TP ranks there, {puller} here" in route.decision.detail
    same = [Engine("a", tp_size=puller), Engine("b", epoch=7, running=64.0, tp_size=puller)]
    assert router().route(req(50), same, holders).decision.reason == "pull"  # equal sizes: the pull of before


@pytest.mark.parametrize(
    ("puller", "holder", "pulls"),
    [
        (("", True), ("bravo", False), False),
        (("", True), ("", False), False),
        (("", True), ("", True), True),
        (("bravo", False), ("", True), True),
        (("bravo", False), ("bravo", False), True),
        (("bravo", False), ("acme", False), False),
    ],
    ids=["shared-from-tenant", "shared-from-unshared", "shared-from-shared", "tenant-from-shared", "same-tenant", "other-tenant"],
)
def test_a_shared_engine_pulls_only_from_shared_ones_and_a_tenants_from_its_own_or_shared(
    puller: tuple[str, bool], holder: tuple[str, bool], pulls: bool
) -> None:
    """The same saturated holder as above, the puller (tenant, shared) and the holder: a tenant's node could serve
    crafted pages, which a shared engine would then serve to every tenant."""
    holders = {"b": Holder(node_id="b", epoch=7, matched_blocks=50, slots=list(range(100, 150)))}
    engines = [
        Engine("a", tenant=puller[0], shared=puller[1]),
        Engine("b", epoch=7, running=64.0, tenant=holder[0], shared=holder[1]),
    ]
    route = router().route(req(50), engines, holders)
    assert (route.decision.reason == "pull", route.pull_plan is not None) == (pulls, pulls), route.decision
    if not pulls:
        assert route.decision.node_id == "a" and f"no pull from b: source b is of tenant {holder[0]!r}" in route.decision.detail


def test_an_unhashed_prompt_is_routed_by_load_without_a_pull() -> None:
    holders = {"b": Holder(node_id="b", epoch=7, matched_blocks=50, slots=list(range(100, 150)))}
    engines = [Engine("a"), Engine("b", epoch=7, running=64.0)]
    route = router().route(req(50), engines, holders, unhashed="a message has images")
    d = route.decision
    assert (d.reason, d.predicted_cached_tokens, d.pull_from, route.pull_plan) == ("unhashed", 0, None, None)
    assert "a message has images" in d.detail and route.uncached_tokens == 50 * 16


def test_prompts_of_two_identities_never_share_hashes() -> None:
    r = router()
    tokens = list(range(40 * 16))
    base, lora = KvIdentity(model="m"), KvIdentity(model="m", adapter="sql")
    a, b = r.hashes(tokens, base), r.hashes(tokens, lora)
    assert not set(a) & set(b)
    assert a == identity_hashes(tokens, base) and b == identity_hashes(tokens, lora)


def test_a_failed_lookup_is_a_fallback_by_load() -> None:
    route = router("least_loaded").route(req(4), [Engine("a", running=3.0), Engine("b")], {}, lookup_failure="TimeoutError")
    d = route.decision
    assert (d.node_id, d.reason, d.predicted_cached_tokens) == ("b", "fallback", 0)
    assert d.detail == "directory lookup failed (TimeoutError): routed by load"
    assert route.uncached_tokens == 64 and route.pull_plan is None


def test_request_defaults_and_block_size() -> None:
    r = router()
    assert r.request(40, [1, 2], None) == RouteRequest(40, (1, 2), 16, 16, output_tokens=16.0)
    assert r.request(40, [1, 2], 4096, "m").output_tokens == 256.0  # the prior, not the cap: no answers seen yet
    assert r.request(40, [1, 2], 0).max_tokens == 16
    assert r.request(40, [1, 2], 300).max_tokens == 300
    assert r.hashes(list(range(40))) == PrefixHasher(16).hashes(list(range(40)))


def test_block_bytes_are_learned_from_engines_that_can_pull() -> None:
    r = router()
    r.learn_block_bytes([Engine("a", block_bytes=1 << 20, can_pull=False)])
    assert r.policy.cost.block_bytes == CostModel().block_bytes
    r.learn_block_bytes([Engine("a", block_bytes=1 << 20), Engine("b", block_bytes=1 << 21)])
    assert r.policy.cost.block_bytes == 1 << 21


def test_routed_feeds_a_policy_with_memory() -> None:
    r = router("sglang")
    rq = req(3)
    route = r.route(rq, [Engine("a"), Engine("b")], {})
    r.routed(rq, route.decision)
    assert isinstance(r.policy, SGLangPolicy)
    assert r.policy.tree_size(route.decision.node_id) == 3


# ---------------------------------------------------------------------------
# Settings -> cost model (the decode rate)


def test_cost_model_from_settings_decode_rate() -> None:
    default = cost_model(GatewaySettings())
    assert default == CostModel(decode_tokens_per_s=80.0)  # the defaults keep the model's defaults
    slow = cost_model(GatewaySettings(decode_tokens_per_s=40.0, link_gbps=4.0, pull_setup_ms=1.0, max_running=8))
    assert (slow.decode_tokens_per_s, slow.link_bytes_per_s, slow.pull_setup_s, slow.max_running) == (40.0, 4e9, 0.001, 8)
    r = req(4)
    assert slot_interval_seconds(r, slow) == pytest.approx(16 / 40 / 8)
    with pytest.raises(ValueError):
        GatewaySettings(decode_tokens_per_s=0)


# ---------------------------------------------------------------------------
# One evaluation drives the choice and the explanation


def test_evaluate_takes_a_pull_only_below_the_break_even() -> None:
    r = req(50)
    c = make_candidate("a", 1, reported_running=0.0, waiting=0.0, inflight=0, pending_prefill_tokens=0.0)
    fast = evaluate(r, c, CostModel(), pull_to_blocks=50)
    assert fast.pulled_blocks == 50 and fast.cached_tokens == 800
    slow = CostModel(link_bytes_per_s=1e7)  # 1.64 ms per block > 1.6 ms to compute it
    assert evaluate(r, c, slow, pull_to_blocks=50).pulled_blocks == 0
    assert ttft_breakdown(r, c, slow, pull_to_blocks=50).pulled_blocks == 50  # the what-if prices it anyway
    no_pull = make_candidate("a", 1, reported_running=0.0, waiting=0.0, inflight=0, pending_prefill_tokens=0.0, can_pull=False)
    assert evaluate(r, no_pull, CostModel(), pull_to_blocks=50).pulled_blocks == 0


def test_the_explanation_shows_the_evaluated_option() -> None:
    holders = {"b": Holder(node_id="b", epoch=1, matched_blocks=50, slots=list(range(50)))}
    d = router().route(req(50), [Engine("a"), Engine("b", running=64.0)], holders).decision
    assert d.reason == "pull"
    assert d.detail.startswith(f"ttft={d.estimated_ttft_s:.6f}s = queue ")
    assert " + pull " in d.detail and "50*16384/2e+09]" in d.detail and "from b@1" in d.detail


# ---------------------------------------------------------------------------
# The pull bandwidth an engine measured prices pulls to it


def test_a_reported_bandwidth_is_used_clamped_and_absent_means_configured() -> None:
    assert [reported_link(g) for g in (0.0, -3.0, math.nan)] == [0.0, 0.0, 0.0]  # none: --link-gbps
    assert reported_link(4.0) == 4e9
    assert reported_link(1e-9) == REPORTED_GBPS_MIN * 1e9
    assert reported_link(1e9) == REPORTED_GBPS_MAX * 1e9
    assert [c.link_bytes_per_s for c in build_candidates([Engine("a"), Engine("b")], {})] == [0.0, 0.0]


def test_an_engine_before_its_first_read_is_priced_at_the_slowest_link_its_peers_measured() -> None:
    """Issue #43: a fresh engine's first pull was priced at --link-gbps (2 GB/s) while its peers read at a tenth."""
    cands = build_candidates([Engine("a", pull_gbps=0.5), Engine("b", pull_gbps=0.2), Engine("c")], {})
    assert [c.link_bytes_per_s for c in cands] == [5e8, 2e8, 2e8]
    holders = {"b": Holder(node_id="b", epoch=1, matched_blocks=50, slots=list(range(50)))}
    busy_b = Engine("b", running=64.0, pull_gbps=0.01)
    d = router().route(req(50), [Engine("a"), busy_b], holders).decision  # a has read nothing yet
    assert (d.node_id, d.reason, d.pull_from) == ("a", "recompute", None)


def test_a_slow_reported_link_turns_the_pull_into_recompute() -> None:
    holders = {"b": Holder(node_id="b", epoch=1, matched_blocks=50, slots=list(range(50)))}
    busy_b = Engine("b", running=64.0)
    # Configured 2 GB/s: pulling to a wins (the holder is saturated).
    assert router().route(req(50), [Engine("a"), busy_b], holders).decision.reason == "pull"
    # a measured 0.01 GB/s: 16384 B/block take 1.64 ms > the 1.6 ms to compute a block, so a recomputes.
    d = router().route(req(50), [Engine("a", pull_gbps=0.01), busy_b], holders).decision
    assert (d.node_id, d.reason, d.pull_from) == ("a", "recompute", None)
    # A holder that queues 7 requests ahead (44 ms): worth a pull at 2 GB/s (6 ms), not an 80 ms recompute,
    # so a slow puller sends the request to its prefix instead.
    queued_b = Engine("b", running=38.0)
    assert router().route(req(50), [Engine("a"), queued_b], holders).decision.reason == "pull"
    d = router().route(req(50), [Engine("a", pull_gbps=0.01), queued_b], holders).decision
    assert (d.node_id, d.reason) == ("b", "affinity")


def test_a_fast_reported_link_allows_the_pull_a_slow_configured_one_forbids() -> None:
    holders = {"b": Holder(node_id="b", epoch=1, matched_blocks=50, slots=list(range(50)))}
    slow = CostModel(link_bytes_per_s=1e7)  # the configured link: too slow to pull
    engines = [Engine("a"), Engine("b", running=64.0)]
    assert router(cost=slow).route(req(50), engines, holders).decision.reason == "recompute"
    d = router(cost=slow).route(req(50), [Engine("a", pull_gbps=4.0), Engine("b", running=64.0)], holders).decision
    assert (d.node_id, d.reason, d.pull_from) == ("a", "pull", "b")
    assert "50*16384/4e+09 (measured by it)]" in d.detail  # the explanation names the figure used
    # The estimate is the model's with the measured link: setup + 50 blocks at 4 GB/s, nothing computed.
    assert d.estimated_ttft_s == pytest.approx(0.002 + 50 * 16384 / 4e9)


def test_the_registry_reads_the_reported_bandwidth_from_the_node_list() -> None:
    async def update() -> dict[str, float]:
        async with httpx.AsyncClient() as http:
            reg = EngineRegistry(DirectoryClient("http://127.0.0.1:1"), http, [], refresh_s=1.0, unhealthy_s=1.0)
            nodes = [
                NodeInfo(node_id=n, epoch=1, alive=True, api_url=f"http://127.0.0.1:{9000 + i}", blocks=0, load=load)
                for i, (n, load) in enumerate([("a", {"running": 1.0, PULL_GBPS_LABEL: 3.5}), ("b", {"running": 1.0})])
            ]
            await reg._update(nodes)  # no I/O: engines by IP, no networks to resolve against
            return {k: e.pull_gbps for k, e in reg.engines.items()}

    assert asyncio.run(update()) == {"a": 3.5, "b": 0.0}


def test_the_registry_learns_each_engines_tp_size_and_dp_rank() -> None:
    """TP ranks from the registered regions (kvproto.ranks); DP ranks of one API server are engines of their own."""

    def region(rank: int) -> dict[str, object]:
        return {"rank": rank, "base_addr": 0, "length": 1 << 20, "block_bytes": 4096, "transfer_url": f"tcp://r{rank}"}

    async def update() -> dict[str, tuple[int, int | None, str]]:
        async with httpx.AsyncClient() as http:
            reg = EngineRegistry(DirectoryClient("http://127.0.0.1:1"), http, [], refresh_s=1.0, unhealthy_s=1.0)
            api = "http://127.0.0.1:9000"
            nodes = [
                NodeInfo(node_id="tp4", epoch=1, alive=True, api_url="http://127.0.0.1:9001", blocks=0,
                         transfer_url="tcp://r0", regions=[region(r) for r in range(4)]),
                NodeInfo(node_id="dp0", epoch=1, alive=True, api_url=api, blocks=0, dp_rank=0),
                NodeInfo(node_id="dp1", epoch=1, alive=True, api_url=api, blocks=0, dp_rank=1),
            ]  # fmt: skip
            await reg._update(nodes)
            return {k: (e.tp_size, e.dp_rank, e.origin) for k, e in reg.engines.items()}

    got = asyncio.run(update())
    assert got["tp4"][:2] == (4, None)
    assert got["dp0"][:2] == (1, 0) and got["dp1"][:2] == (1, 1) and got["dp0"][2] == got["dp1"][2]


def test_the_registry_keeps_its_tenants_engines_and_knows_what_each_serves() -> None:
    """Tenant acme's gateway: acme's engines and shared ones, never bravo's or the shared tenant's; an engine is
    routed a model's requests when it lists it (registration or /v1/models), or while nothing says what it serves."""

    def node(n: str, i: int, tenant: str = "", shared: bool = False, models: tuple[str, ...] = (), fp: str | None = None):
        api = f"http://127.0.0.1:{9000 + i}"
        regions = [{"rank": 0, "base_addr": 0, "length": 1 << 20, "block_bytes": 4096}]
        return NodeInfo(
            node_id=n, epoch=1, alive=True, api_url=api, blocks=0, transfer_url="tcp://x", regions=regions,
            models=list(models), fingerprint=fp, tenant=tenant, shared=shared,
        )  # fmt: skip

    async def update() -> EngineRegistry:
        async with httpx.AsyncClient() as http:
            reg = EngineRegistry(DirectoryClient("http://127.0.0.1:1"), http, [], 1.0, 1.0, tenant="acme")
            nodes = [
                node("acme-1", 1, "acme", models=("alpha",), fp="f1"),
                node("acme-2", 2, "acme", models=("beta",)),
                node("bravo-1", 3, "bravo", models=("alpha",), fp="f1"),
                node("any-1", 4),
                node("shared-1", 5, shared=True),
            ]
            await reg._update([n for n in nodes if reg._ours(n)])
            return reg

    reg = asyncio.run(update())
    assert set(reg.engines) == {"acme-1", "acme-2", "shared-1"}
    assert [e.node_id for e in reg.serving("alpha")] == ["acme-1", "shared-1"]  # shared-1 has said nothing yet
    assert [e.node_id for e in reg.serving("beta")] == ["acme-2", "shared-1"]
    reg.engines["shared-1"].listed_models = frozenset({"alpha", "alpha-sql"})
    reg.engines["shared-1"].adapters = {"alpha-sql": "alpha"}
    reg.engines["shared-1"].models_known = True
    assert [e.node_id for e in reg.serving("beta")] == ["acme-2"] and reg.serving("gamma") == []
    assert reg.base_of("alpha-sql") == "alpha" and reg.base_of("alpha") is None
    # No fingerprint, no pulls: acme-2 has a transfer endpoint and regions but registered none.
    assert reg.engines["acme-1"].can_pull and reg.engines["acme-2"].can_pull
    cands = {c.node_id: c for c in build_candidates(reg.engines.values(), {})}
    assert cands["acme-1"].can_pull and cands["acme-1"].kv_fingerprint == "f1"
    assert not cands["acme-2"].can_pull and cands["acme-2"].kv_fingerprint is None


# ---------------------------------------------------------------------------
# The inflight ticket


def engine_state() -> EngineState:
    return EngineState("a", Origin("http", "127.0.0.1", 1))


def test_ticket_counts_once_and_releases_once() -> None:
    e = engine_state()
    t = InflightTicket(e, 100)
    assert (e.inflight, e.pending_prefill_tokens) == (1, 100.0)
    t.first_byte()
    t.first_byte()
    assert (e.inflight, e.pending_prefill_tokens) == (1, 0.0)
    t.close()
    t.close()
    assert (e.inflight, e.pending_prefill_tokens) == (0, 0.0)


def test_ticket_released_by_its_block_whatever_happens() -> None:
    e = engine_state()
    other = InflightTicket(e, 5)
    with pytest.raises(RuntimeError), InflightTicket(e, 100):
        assert (e.inflight, e.pending_prefill_tokens) == (2, 105.0)
        raise RuntimeError("upstream broke")
    assert (e.inflight, e.pending_prefill_tokens) == (1, 5.0)
    other.close()
    assert (e.inflight, e.pending_prefill_tokens) == (0, 0.0)


def test_cached_tokens_of_a_response() -> None:
    assert cached_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": 32}}}) == 32
    assert cached_tokens({"usage": {"prompt_tokens_details": None}}) is None
    assert cached_tokens([]) is None


# ---------------------------------------------------------------------------
# The pull plan on the wire


def test_pull_plan_round_trips_and_is_bounded() -> None:
    plan = PullPlan(source_node="worker-1", source_epoch=3, slots=[4, 5, 6])
    wire = msgspec.json.encode(plan.to_json())
    assert msgspec.json.decode(wire, type=PullPlan) == plan
    for bad in (
        b'{"source_node": "", "source_epoch": 1, "slots": []}',
        b'{"source_node": "a", "source_epoch": 0, "slots": []}',
        b'{"source_node": "a", "source_epoch": 1, "slots": [-1]}',
        b'{"source_node": "a", "source_epoch": 1, "slots": [4294967296]}',
    ):
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(bad, type=PullPlan)


def test_candidates_get_free_space_from_the_node_list_and_the_weight_from_settings() -> None:
    engines = [
        Engine("a", capacity_blocks=100, blocks=90, block_size=32),
        Engine("b", capacity_blocks=100, blocks=120),
        Engine("c"),
    ]
    free = {c.node_id: c.free_tokens for c in build_candidates(engines, {}, block_size=16)}
    assert free == {"a": 10 * 32, "b": 0, "c": None}  # unknown capacity: no displacement priced
    assert cost_model(GatewaySettings(displace_weight=2.5)).displace_weight == 2.5


def test_route_reports_a_follower_of_a_prefix_being_computed_as_inflight() -> None:
    r = router()
    first = r.route(req(8), [Engine("a"), Engine("b")], {})
    key = r.prefilling(req(8), first.decision.node_id, 1, now=0.0)
    n = first.decision.node_id
    engines = [Engine(x, inflight=int(x == n), pending_prefill_tokens=128.0 if x == n else 0.0) for x in "ab"]
    follower = r.route(req(8, extra=3), engines, {}, now=0.1)
    assert (follower.decision.node_id, follower.decision.reason) == (n, "inflight")
    assert follower.uncached_tokens == 3 and follower.pull_plan is None  # no holder: nothing to read
    r.prefilled(key, now=0.2, ok=False)  # failed: nothing is being computed any more
    again = r.route(req(8, extra=3), [Engine("a"), Engine("b")], {}, now=0.3)
    assert again.decision.reason == "balance"


def test_a_follower_of_a_prefix_being_pulled_there_carries_the_same_plan() -> None:
    """It may reach the engine before the request it follows: with the plan it reads the blocks itself, and the
    engine reads them once, for whichever request comes first (the other waits for that read)."""
    r = router()
    holders = {"b": Holder(node_id="b", epoch=1, matched_blocks=50, slots=list(range(100, 150)))}
    busy_b = Engine("b", running=64.0)
    first = r.route(req(50), [Engine("a"), busy_b], holders)
    assert (first.decision.node_id, first.decision.reason) == ("a", "pull") and first.pull_plan is not None
    r.prefilling(req(50), "a", 1, now=0.0)
    a = Engine("a", inflight=1, pending_prefill_tokens=float(first.uncached_tokens))
    follower = r.route(req(50, extra=3), [a, busy_b], holders, now=0.1)
    assert (follower.decision.node_id, follower.decision.reason) == ("a", "inflight")
    assert follower.decision.predicted_cached_tokens == 50 * 16
    assert follower.pull_plan == first.pull_plan
    # A puller that may not read the holder's KV gets no plan: it waits for the prefix as before.
    r.prefilling(req(50), "c", 1, now=0.0)
    c = Engine("c", fingerprint="fp-2", inflight=1, pending_prefill_tokens=800.0)
    other = r.route(req(50, extra=3), [c, busy_b], holders, now=0.1)
    assert (other.decision.node_id, other.decision.reason, other.pull_plan) == ("c", "inflight", None)


def test_a_models_prompts_are_hashed_at_its_engines_block_size_and_an_odd_one_is_warned_of_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A gateway whose --block-size is 16 in front of engines that register 32-token blocks hashes their model's
    prompts at 32 (the flag is only the fallback, for a model none of whose engines registered a size); an engine
    registering another size than most engines of its model is said once (not at every refresh) and listed until
    it registers theirs."""

    def node(n: str, block_size: int | None, models: tuple[str, ...] = ("m",)) -> NodeInfo:
        return NodeInfo(
            node_id=n,
            epoch=1,
            alive=True,
            api_url=f"http://127.0.0.1:{9000 + len(n)}",
            blocks=0,
            block_size=block_size,
            models=list(models),
        )

    async def run() -> list[tuple[int, int, list[str]]]:
        async with httpx.AsyncClient() as http:
            reg = EngineRegistry(DirectoryClient("http://127.0.0.1:1"), http, [], 1.0, 1.0, block_size=16)
            seen = []
            for b in (16, 16, 32):
                await reg._update([node("a", 32), node("bb", None), node("ccc", 32), node("dddd", b), node("e", None, ("n",))])
                seen.append((reg.hash_block_size("m"), reg.hash_block_size("n"), reg.mismatched_block_size))
            return seen

    with caplog.at_level("INFO", logger="kvdir.gateway"):
        assert asyncio.run(run()) == [(32, 16, ["dddd"]), (32, 16, ["dddd"]), (32, 16, [])]
    warned = [r.getMessage() for r in caplog.records if "none of its cached blocks can be found" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("engine dddd hashes 16-token blocks and the gateway hashes 'm'")


def test_a_block_size_tie_goes_to_the_engines_holding_more_blocks() -> None:
    async def run() -> int:
        async with httpx.AsyncClient() as http:
            reg = EngineRegistry(DirectoryClient("http://127.0.0.1:1"), http, [], 1.0, 1.0, block_size=16)
            nodes = [
                NodeInfo(node_id=n, epoch=1, alive=True, api_url=f"http://127.0.0.1:{p}", blocks=k, block_size=b, models=["m"])
                for n, p, k, b in (("a", 9001, 10, 16), ("b", 9002, 500, 64))
            ]
            await reg._update(nodes)
            return reg.hash_block_size("m")

    assert asyncio.run(run()) == 64
