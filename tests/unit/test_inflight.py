"""gateway.inflight: prompts being prefilled, by node; and the kvdir policy's use of them (queue behind, not recompute)."""

from __future__ import annotations

import random

import pytest

from gateway.cost import Candidate, RouteRequest
from gateway.inflight import InflightPrefixes
from gateway.kvdir_policy import KvdirPolicy
from kvtools.replay.views import pending_estimate


def test_match_is_the_leading_run_per_node_and_epoch() -> None:
    t = InflightPrefixes()
    t.begin([1, 2, 3, 4], "a", 1, now=0.0)
    t.begin([1, 2, 9], "b", 2, now=0.0)
    assert t.match([1, 2, 3, 7], now=0.0) == {("a", 1): 3, ("b", 2): 2}
    assert t.match([5, 1, 2], now=0.0) == {}  # a chained hash names its prefix: no leading run, nothing


def test_sharing_counts_the_requests_on_a_leading_prefix_over_all_nodes() -> None:
    t = InflightPrefixes(linger_s=0.5)
    t.begin([1, 2, 3, 4], "a", 1, now=0.0)
    t.begin([1, 2, 3, 5], "a", 1, now=0.0)
    last = t.begin([1, 2, 6], "b", 1, now=0.0)
    assert t.sharing([1, 2, 3, 7], 3, now=0.0) == 2  # the two prompts that begin with blocks 1, 2, 3
    assert t.sharing([1, 2, 3, 7], 2, now=0.0) == 3  # all three begin with 1, 2, wherever they went
    assert t.sharing([1, 2, 3, 7], 0, now=0.0) == 0 and t.sharing([9], 1, now=0.0) == 0
    t.end(last, now=1.0, ok=True)
    assert t.sharing([1, 2], 2, now=1.6) == 2  # an ended entry stops counting once it has lingered


def test_end_lingers_on_success_and_drops_on_failure() -> None:
    t = InflightPrefixes(linger_s=0.5)
    ok = t.begin([1, 2], "a", 1, now=0.0)
    bad = t.begin([1, 2, 3], "b", 1, now=0.0)
    t.end(bad, now=1.0, ok=False)
    t.end(ok, now=1.0, ok=True)
    assert t.match([1, 2, 3], now=1.2) == {("a", 1): 2}  # the node holds it until the directory lists it
    assert t.match([1, 2, 3], now=1.6) == {}
    assert len(t) == 0 and t.blocks == 0


def test_bounded_in_age_entries_and_blocks() -> None:
    t = InflightPrefixes(max_entries=2, max_blocks=5, max_age_s=10.0)
    t.begin([1], "a", 1, now=0.0)  # never ended: goes after max_age_s
    assert t.match([1], now=9.9) == {("a", 1): 1}
    assert t.match([1], now=10.0) == {}
    for i in range(3):
        t.begin([10 + i], "a", 1, now=11.0)
    assert len(t) == 2 and t.match([10], now=11.0) == {}  # the oldest made room
    t.begin([20, 21, 22, 23], "b", 1, now=11.0)
    assert t.blocks <= 5
    with pytest.raises(ValueError):
        InflightPrefixes(max_entries=0)


def _burst_candidates(inflight_a: int) -> list[Candidate]:
    # "a" is computing the 60-block prefix for an earlier request: its 960 tokens are in a's pending prefill.
    return [
        Candidate("a", 1, 0, pending_prefill_tokens=961.0, inflight=1, inflight_blocks=inflight_a),
        Candidate("b", 1, 0, pending_prefill_tokens=3000.0, inflight=1),
    ]


def test_follower_queues_behind_the_prefix_being_computed() -> None:
    req = RouteRequest(prompt_tokens=970, hashes=tuple(range(60)), max_tokens=4)
    d = KvdirPolicy(balance_slack_s=0).choose(req, _burst_candidates(60), random.Random(0))
    assert (d.node_id, d.reason, d.predicted_cached_tokens) == ("a", "inflight", 960)
    # Unknown to the gateway (another gateway's, or no table): the same request recomputes on the idler node.
    d = KvdirPolicy(balance_slack_s=0).choose(req, _burst_candidates(0), random.Random(0))
    assert (d.node_id, d.reason, d.predicted_cached_tokens) == ("a", "balance", 0)
    assert d.estimated_ttft_s > 0.09


def test_follower_goes_elsewhere_when_waiting_is_slower_than_computing() -> None:
    req = RouteRequest(prompt_tokens=970, hashes=tuple(range(60)), max_tokens=4)
    cands = [
        Candidate("a", 1, 0, pending_prefill_tokens=20_000.0, inflight=5, inflight_blocks=60),  # 2 s behind
        Candidate("b", 1, 0),
    ]
    d = KvdirPolicy(balance_slack_s=0).choose(req, cands, random.Random(0))
    assert (d.node_id, d.reason) == ("b", "balance")


def test_pending_estimate_adds_the_other_gateways_share_of_the_report() -> None:
    assert pending_estimate(100.0, 0.0, 0.0, 0.0, 10_000.0) == 100.0  # nothing reported: own count
    assert pending_estimate(100.0, 5_100.0, 100.0, 0.0, 10_000.0) == 5_100.0  # others sent 5,000
    assert pending_estimate(100.0, 5_100.0, 100.0, 0.2, 10_000.0) == 3_100.0  # 0.2 s of prefill since the report
    assert pending_estimate(100.0, 5_100.0, 100.0, 1.0, 10_000.0) == 100.0  # all of it done by now
