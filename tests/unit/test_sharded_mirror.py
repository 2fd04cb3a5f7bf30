"""The gateway's mirror over a sharded directory (docs/scale-out.md §6), without sockets: one feed per shard,
each holding the state its shard's watch stream would build; lookups merge the shards' holders, freshness
needs every shard, and a node seen in two shards mid-move counts once, from the shard with the newer map."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from gateway.mirror import Feed, Mirror
from kvproto.shardmap import ShardMap
from kvproto.state import OK, AssignShards, DirectoryState, Publish, Register, new_epoch_base

URLS = {"s0": ["http://127.0.0.1:9"], "s1": ["http://127.0.0.1:10"]}  # never connected: the feeds are not started
MAP = ShardMap(version=1, shards=URLS)
ON_S0, ON_S1 = "worker-2", "worker-1"  # their homes under MAP (rendezvous hashing)


def _shard(name: str, m: ShardMap = MAP) -> DirectoryState:
    st = DirectoryState()
    assert st.apply(AssignShards.of(m, name)).status == OK
    return st


def _register(st: DirectoryState, node_id: str, shard_index: int) -> int:
    r = st.apply(Register(node_id, "i1", f"http://{node_id}", epoch_base=new_epoch_base(12345, shard_index)))
    assert r.status == OK, r
    return int(r.value)


def _publish(st: DirectoryState, node_id: str, epoch: int, hashes: list[int]) -> None:
    r = st.apply(Publish(node_id, epoch, np.asarray(hashes, np.uint64), np.arange(len(hashes), dtype=np.uint32) + 100))
    assert r.status == OK, r


def _mirror(states: dict[str, DirectoryState], map_version: int = 1) -> Mirror:
    mirror = Mirror([], None, max_lag_s=0.5)
    feeds = {}
    for name, st in states.items():
        feed = feeds[name] = Feed(URLS[name], None, max_lag_s=0.5)
        feed.state, feed.position, feed.fresh_at = st, st.applied, time.monotonic()
    mirror.feeds, mirror.map_version = feeds, map_version
    return mirror


def test_homes_of_the_nodes_used_here() -> None:
    assert MAP.home(ON_S0) == "s0" and MAP.home(ON_S1) == "s1"


def test_a_lookup_merges_every_shard_longest_match_first() -> None:
    s0, s1 = _shard("s0"), _shard("s1")
    e0, e1 = _register(s0, ON_S0, 0), _register(s1, ON_S1, 1)
    _publish(s0, ON_S0, e0, [1, 2])
    _publish(s1, ON_S1, e1, [1, 2, 3])

    async def scenario() -> None:
        mirror = _mirror({"s0": s0, "s1": s1})
        try:
            assert mirror.fresh() and mirror.lag_s() < 0.5
            found = await mirror.lookup([1, 2, 3, 4])
            assert found is not None
            assert [(h.node_id, h.epoch, h.matched_blocks, h.slots) for h in found] == [
                (ON_S1, e1, 3, [100, 101, 102]),
                (ON_S0, e0, 2, [100, 101]),
            ]
            assert await mirror.lookup([9]) == []
            assert mirror.position == s0.applied + s1.applied and mirror.newer_map() == 1

            mirror.feeds["s1"].fresh_at = time.monotonic() - 1.0  # one shard stale: the whole mirror is
            assert not mirror.fresh() and mirror.lag_s() >= 1.0
            mirror.feeds["s1"].fresh_at = time.monotonic()
            mirror.feeds["s0"].state = None  # one shard re-snapshotting: no answer (the gateway asks REST)
            assert not mirror.fresh() and await mirror.lookup([1]) is None
        finally:
            await mirror.stop()

    asyncio.run(scenario())


def test_a_shard_that_committed_a_newer_map_makes_the_mirror_stale_until_it_follows_that_map() -> None:
    s0, s1 = _shard("s0"), _shard("s1")
    moved = ShardMap(version=2, shards=URLS, nodes={ON_S1: "s0"})
    assert s1.apply(AssignShards.of(moved, "s1")).status == OK

    async def scenario() -> None:
        mirror = _mirror({"s0": s0, "s1": s1})
        try:
            assert mirror.newer_map() == 2 and not mirror.fresh() and mirror.lag_s() == float("inf")
            mirror.map_version = 2
            assert mirror.fresh()
        finally:
            await mirror.stop()

    asyncio.run(scenario())


def test_a_node_seen_in_two_shards_mid_move_counts_once_from_the_newer_map() -> None:
    s0, s1 = _shard("s0"), _shard("s1")
    old_epoch = _register(s1, ON_S1, 1)
    _publish(s1, ON_S1, old_epoch, [1, 2, 3])
    # The move committed in s1 (gives) then s0 (takes), and the node registered at its new home; the
    # mirror's s1 feed lags: it still holds the node's old registration and entries.
    moved = ShardMap(version=2, shards=URLS, nodes={ON_S1: "s0"})
    assert s0.apply(AssignShards.of(moved, "s0")).status == OK
    new_epoch = _register(s0, ON_S1, 0)
    _publish(s0, ON_S1, new_epoch, [1])
    assert new_epoch != old_epoch

    async def scenario() -> None:
        for states in ({"s0": s0, "s1": s1}, {"s1": s1, "s0": s0}):  # whichever feed is asked first
            mirror = _mirror(states, map_version=2)
            try:
                found = await mirror.lookup([1, 2, 3])
                assert found is not None
                assert [(h.node_id, h.epoch, h.matched_blocks) for h in found] == [(ON_S1, new_epoch, 1)]
            finally:
                await mirror.stop()

    asyncio.run(scenario())


def test_an_unsharded_mirror_is_one_feed_with_its_state_and_position() -> None:
    st = DirectoryState()
    e = _register(st, "a", 0)
    _publish(st, "a", e, [7, 8])

    async def scenario() -> None:
        mirror = Mirror(["http://127.0.0.1:9"], None, max_lag_s=0.5)
        try:
            mirror.state, mirror.position = st, st.applied
            assert list(mirror.feeds) == [""] and mirror.feeds[""].state is st and mirror.position == st.applied
            assert not mirror.fresh()  # no fresh tick yet
            found = await mirror.lookup([7, 8])
            assert found is not None and [(h.node_id, h.matched_blocks) for h in found] == [("a", 2)]
        finally:
            await mirror.stop()

    asyncio.run(scenario())
