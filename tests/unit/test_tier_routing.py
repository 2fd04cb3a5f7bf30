"""Routing by where a cached prefix lies (issue #32): the TTFT model prices a candidate's own host- and disk-tier
blocks as a copy to the device (gateway.cost.load_seconds), so a device hit beats a host hit beats a pull beats
a recompute only where the numbers say so; each boundary below is the formula's, checked on both sides.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from gateway.cost import Candidate, CostModel, RouteRequest, estimate_ttft, load_seconds, ttft_breakdown
from gateway.dynamo_policy import DynamoPolicy
from gateway.policy import make_policy
from gateway.router import build_candidates, make_candidate
from kvproto import media

BS = 16
N = 40  # cached blocks in play
COST = CostModel(block_bytes=1 << 20, host_copy_bytes_per_s=20e9, link_bytes_per_s=10e9, pull_setup_s=0.002)


def _req(blocks: int = N + 10) -> RouteRequest:
    return RouteRequest(prompt_tokens=blocks * BS, hashes=tuple(range(blocks)), block_size=BS)


def _cand(node_id: str, device: int = 0, host: int = 0, pending_prefill_tokens: float = 0.0) -> Candidate:
    """A candidate holding `device` blocks on its device, then `host` in its host tier (locations as the directory
    hands them out: kvproto.media)."""
    slots = [*range(device), *(media.location(s, media.HOST) for s in range(host))]
    return make_candidate(
        node_id,
        1,
        reported_running=0,
        waiting=0,
        inflight=0,
        pending_prefill_tokens=pending_prefill_tokens,
        cached_blocks=len(slots),
        slots=slots,
        kv_fingerprint="fp",
    )


def _choose(cost: CostModel, cands: list[Candidate]) -> str:
    # No near-tie band: the boundary is the TTFT formula's alone.
    policy = make_policy("kvdir", cost, balance_slack_s=0.0, balance_slack_ratio=0.0)
    return policy.choose(_req(), cands, random.Random(0)).node_id


def test_host_blocks_cost_a_copy_to_the_device_and_device_blocks_nothing() -> None:
    c = _cand("a", device=10, host=30)
    assert (c.cached_blocks, c.host_blocks, c.disk_blocks) == (40, 30, 0)
    assert load_seconds(c, COST) == pytest.approx(30 * (1 << 20) / 20e9)
    b = ttft_breakdown(_req(), c, COST)
    assert b.load_s == load_seconds(c, COST) and b.cached_tokens == 40 * BS
    assert b.total_s == pytest.approx(b.load_s + 10 * BS / COST.prefill_tokens_per_s)
    assert load_seconds(_cand("b", device=40), COST) == 0.0
    disk = replace(c, host_blocks=0, disk_blocks=30)
    assert load_seconds(disk, COST) == pytest.approx(30 * (1 << 20) / COST.disk_read_bytes_per_s)
    detail = make_policy("kvdir", COST).choose(_req(), [c], random.Random(0)).detail
    assert "+ load " in detail and "30 host + 0 disk of 40 cached blocks" in detail


@pytest.mark.parametrize("side", [0.99, 1.01])
def test_a_host_hit_beats_a_busy_device_hit_exactly_when_the_copy_is_shorter_than_the_queue(side: float) -> None:
    load = N * COST.block_bytes / COST.host_copy_bytes_per_s
    pending = side * load * COST.prefill_tokens_per_s  # the device holder's queue: `side` x the copy
    cands = [_cand("host", host=N), _cand("device", device=N, pending_prefill_tokens=pending)]
    assert _choose(COST, cands) == ("device" if side < 1 else "host")


@pytest.mark.parametrize("side", [0.99, 1.01])
def test_a_host_hit_beats_a_pull_exactly_when_the_copy_is_shorter(side: float) -> None:
    """'x' holds nothing and would pull the prefix from 'host' (wherever it lies there, at the link's rate)."""
    pull = COST.pull_setup_s + N * COST.block_bytes / COST.link_bytes_per_s
    cost = replace(COST, host_copy_bytes_per_s=N * COST.block_bytes / (side * pull))  # the copy takes `side` x the pull
    cands = [_cand("host", host=N), _cand("x")]
    assert _choose(cost, cands) == ("host" if side < 1 else "x")
    assert estimate_ttft(_req(), cands[1], cost, pull_to_blocks=N) < estimate_ttft(_req(), cands[1], cost)  # x pulls


@pytest.mark.parametrize("side", [0.99, 1.01])
def test_a_host_hit_beats_recomputing_exactly_when_the_copy_is_shorter(side: float) -> None:
    compute = N * BS / COST.prefill_tokens_per_s
    cost = replace(COST, host_copy_bytes_per_s=N * COST.block_bytes / (side * compute), link_bytes_per_s=1e3)  # no pull
    assert _choose(cost, [_cand("host", host=N), _cand("x")]) == ("host" if side < 1 else "x")


def test_the_gateway_reads_each_holders_tiers_from_its_locations() -> None:
    class Engine:
        epoch, running, waiting, inflight, reported_inflight, pending_prefill_tokens = 1, 0.0, 0.0, 0, 0, 0.0
        healthy, can_pull = True, True
        capacity_blocks, blocks, block_size, pull_gbps, fingerprint, tp_size = None, 0, 0, 0.0, "fp", 1
        tenant, shared = "", False

        def __init__(self, node_id: str) -> None:
            self.node_id = node_id

    class Holder:
        epoch = 1

        def __init__(self, slots: list[int]) -> None:
            self.slots, self.matched_blocks = slots, len(slots)

    disk = media.location(9, media.DISK)
    holders = {"a": Holder([3, media.location(7, media.HOST), disk]), "b": Holder([1, 2])}
    got = {
        c.node_id: (c.cached_blocks, c.host_blocks, c.disk_blocks) for c in build_candidates([Engine("a"), Engine("b")], holders)
    }
    assert got == {"a": (3, 1, 1), "b": (2, 0, 0)}


def test_dynamos_router_credits_host_blocks_at_three_quarters() -> None:
    """Its cost counts a host block as 0.75 of a cached block (Dynamo's tier credits): equal loads, the device
    holder wins; give it a queue worth more than the credit's difference and the host holder wins."""
    req = _req()
    policy = DynamoPolicy(COST)
    host, device = _cand("host", host=N), _cand("device", device=N)
    costs = policy.costs(req, [host, device])
    assert costs[0] - costs[1] == pytest.approx(0.25 * N)
    assert policy.choose(req, [host, device], random.Random(0)).node_id == "device"
    busy = replace(device, pending_prefill_tokens=0.3 * N * BS)
    assert DynamoPolicy(COST).choose(req, [host, busy], random.Random(0)).node_id == "host"
