"""The shard map (kvproto.shardmap) and how a group's state machine applies it (docs/scale-out.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from kvproto import codec, shardmap
from kvproto.shardmap import ShardMap, ShardMapError, UnsafeChange, apply_order
from kvproto.state import (
    EPOCH_BASE_BITS,
    OK,
    STALE_EPOCH,
    UNKNOWN_NODE,
    WRONG_SHARD,
    AssignShards,
    DirectoryState,
    Publish,
    Register,
    new_epoch_base,
)

node_ids = hs.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)


def smap(names: list[str], version: int = 1, pins: dict[str, str] | None = None) -> ShardMap:
    return ShardMap(version=version, shards={n: [f"http://127.0.0.1:{9000 + i}"] for i, n in enumerate(names)}, nodes=pins or {})


@settings(max_examples=200, deadline=None)
@given(hs.lists(node_ids, min_size=1, max_size=40, unique=True))
def test_adding_a_shard_moves_nodes_only_to_it_and_removing_one_only_moves_its_own(nodes: list[str]) -> None:
    two, three = smap(["s0", "s1"]), smap(["s0", "s1", "s2"], version=2)
    for n in nodes:
        assert two.home(n) == smap(["s1", "s0"]).home(n)  # placement does not depend on the order listed
        if three.home(n) != two.home(n):
            assert three.home(n) == "s2"
    # The reverse change (s2 removed): only s2's nodes move.
    for n in nodes:
        if three.home(n) != "s2":
            assert two.home(n) == three.home(n)


def test_placement_spreads_nodes_and_pins_win() -> None:
    m = smap(["a", "b", "c", "d"], pins={"n-1": "d"})
    homes = [m.home(f"n-{i}") for i in range(400)]
    counts = {s: homes.count(s) for s in m.names}
    assert min(counts.values()) > 60, counts  # 100 each on average
    assert m.home("n-1") == "d"


def test_apply_order_puts_shards_that_give_first_and_refuses_swaps() -> None:
    old = smap(["s0", "s1"])
    nodes = [f"n{i}" for i in range(50)]
    homes = {n: old.home(n) for n in nodes}
    added = smap(["s0", "s1", "s2"], version=2)
    order = apply_order(added, homes)
    assert order[-1] == "s2" and set(order) == {"s0", "s1", "s2"}
    moved = [n for n in nodes if added.home(n) == "s2"]
    assert moved, "some node moves to the new shard"
    assert all(order.index(homes[n]) < order.index("s2") for n in moved)
    # Removing s1: it gives, so it comes first, though the new map no longer lists it.
    removed = smap(["s0"], version=2)
    assert apply_order(removed, homes)[0] == "s1"
    # Moving one node each way between two shards has no safe order.
    a, b = next(n for n in nodes if homes[n] == "s0"), next(n for n in nodes if homes[n] == "s1")
    swap = smap(["s0", "s1"], version=2, pins={a: "s1", b: "s0"})
    with pytest.raises(UnsafeChange, match="split the change"):
        apply_order(swap, homes)


@pytest.mark.parametrize(
    ("doc", "why"),
    [
        ({"version": 0, "shards": {"a": ["http://h:1"]}}, "version"),
        ({"version": 1, "shards": {}}, "shards"),
        ({"version": 1, "shards": {"a": []}}, "lists no replica"),
        ({"version": 1, "shards": {"a": ["ftp://h"]}}, "not an http"),
        ({"version": 1, "shards": {"a": ["http://h:1"]}, "nodes": {"x": "b"}}, "does not list"),
        ({"version": 1, "shards": {"bad name": ["http://h:1"]}}, "shards"),
    ],
)
def test_invalid_maps_are_refused_with_the_reason(doc: dict, why: str) -> None:
    with pytest.raises(ShardMapError, match=why):
        shardmap.parse(json.dumps(doc))


def group(m: ShardMap, shard: str) -> DirectoryState:
    st = DirectoryState()
    assert st.apply(AssignShards.of(m, shard)).status == OK
    return st


def test_a_group_refuses_nodes_homed_elsewhere_and_drops_them_when_a_map_moves_them() -> None:
    m1 = smap(["s0", "s1"])
    a = next(f"n{i}" for i in range(100) if m1.home(f"n{i}") == "s0")
    s0, s1 = group(m1, "s0"), group(m1, "s1")
    refused = s1.apply(Register(a, "i1", "http://a"))
    assert refused.status == WRONG_SHARD and refused.value == {"version": 1, "home": "s0"}
    epoch = s0.apply(Register(a, "i1", "http://a", epoch_base=new_epoch_base(3, 0))).value
    assert s0.apply(Publish(a, epoch, np.array([7], np.uint64), np.array([0], np.uint32))).status == OK

    m2 = smap(["s0", "s1"], version=2, pins={a: "s1"})
    assert s0.apply(AssignShards.of(m2, "s0")).value == 1  # a and its entries dropped
    assert s0.lookup(np.array([7], np.uint64)) == []
    assert s0.apply(Publish(a, epoch, np.array([8], np.uint64), np.array([0], np.uint32))).status == UNKNOWN_NODE
    assert s1.apply(AssignShards.of(m2, "s1")).status == OK
    e1 = s1.apply(Register(a, "i2", "http://a", epoch_base=new_epoch_base(3, 1))).value
    assert e1 != epoch
    # The fenced incarnation's epoch is refused on both shards.
    assert s1.apply(Publish(a, epoch, np.array([8], np.uint64), np.array([0], np.uint32))).status == STALE_EPOCH
    # An older or repeated map changes nothing.
    assert s1.apply(AssignShards.of(m1, "s1")).value == 0 and s1.shard_map is not None and s1.shard_map.version == 2
    assert a in s1.nodes


def test_shards_of_one_map_never_share_an_epoch_base() -> None:
    for r in (0, 5, (1 << 64) - 1):
        for i in range(4):
            assert (new_epoch_base(r, i) >> EPOCH_BASE_BITS) & 0xFF == i


def test_the_watch_stream_carries_the_map_in_commands_and_snapshots() -> None:
    m = smap(["s0", "s1"], version=3, pins={"x": "s1"})
    cmd = AssignShards.of(m, "s1")
    assert codec.decode_command(codec.encode_command(cmd)) == cmd
    st = group(m, "s1")
    copy = codec.state_from(codec.snapshot_of(st))
    assert copy.shard_map == cmd and copy.digest() == st.digest()


def test_a_first_map_from_a_file_never_replaces_a_committed_map() -> None:
    """Replicas started with different versions of --shard-map-file race to bootstrap the group: the first
    commit is kept, so an edited file cannot skip PUT /v1/shards' safe order; PUT's changes still apply."""
    m1, m2, m3 = (smap(["s0", "s1"], version=v) for v in (1, 2, 3))
    st = DirectoryState()
    assert st.apply(AssignShards.of(m1, "s0", bootstrap=True)).status == OK
    assert st.apply(AssignShards.of(m2, "s0", bootstrap=True)).value == 0
    assert st.shard_map is not None and st.shard_map.version == 1
    assert st.apply(AssignShards.of(m3, "s0")).status == OK and st.shard_map.version == 3


def test_map_commands_round_trip_and_a_layout_without_the_bootstrap_flag_is_refused() -> None:
    """Raft entries and watch frames carry the flag; the layout before it is another codec version's."""
    cmd = AssignShards.of(smap(["s0", "s1"], version=4), "s1")
    boot = AssignShards.of(smap(["s0"], version=1), "s0", bootstrap=True)
    assert codec.decode_entry(codec.encode_entry([cmd, boot])) == [cmd, boot]
    with pytest.raises(codec.WireError, match="at least length 7, got 6"):
        codec.decode_command(codec.encode_command(cmd)[:-1])
