"""BlockIndex: put/lookup/remove/drop_node, merge and tombstones, ordering, digest, items."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvproto.index as index_module
from kvproto.codec import decode_state, encode_state
from kvproto.index import BlockIndex
from kvproto.index_kernels import DEAD
from kvproto.state import DirectoryState

MODES = ["delta", "merged", "t4", "mixed"]


def H(*xs) -> np.ndarray:
    return np.asarray(xs, dtype=np.uint64)


def S(*xs) -> np.ndarray:
    return np.asarray(xs, dtype=np.uint32)


def recent(ix: BlockIndex) -> int:
    """Entries in the recent level."""
    return len(ix._rkeys)


def main(ix: BlockIndex) -> int:
    """Entries in the main levels, tombstones included."""
    return sum(len(p.nodes) for p in ix._parts)


def dead(ix: BlockIndex) -> int:
    """Tombstones in the main levels."""
    return int(ix._dead.sum())


class Ix:
    """A BlockIndex driven in one of four layouts.

    delta:  merge_threshold huge, everything stays in the recent level
    merged: merge_threshold 1, every put lands in the main level
    t4:     merge_threshold 4, merges now and then
    mixed:  merge_threshold huge, but odd-numbered puts are merged explicitly, so
            some entries live in the main level and some in the recent level
    """

    def __init__(self, mode: str) -> None:
        threshold = {"delta": 10**9, "merged": 1, "t4": 4, "mixed": 10**9}[mode]
        self.ix = BlockIndex(merge_threshold=threshold)
        self.mode = mode
        self.puts = 0

    def put(self, node, hashes, slots):
        n = self.ix.put(node, H(*hashes), S(*slots))
        self.puts += 1
        if self.mode == "mixed" and self.puts % 2 == 1:
            self.ix.merge()
        return n

    def remove(self, node, hashes):
        return self.ix.remove(node, H(*hashes))

    def lookup(self, hashes, with_slots=False):
        nodes, matched, slots = self.ix.lookup(H(*hashes), with_slots)
        return [
            Match(int(n), int(k), slots[j, :k] if with_slots else None)
            for j, (n, k) in enumerate(zip(nodes.tolist(), matched.tolist()))
        ]

    def drop_node(self, node):
        return self.ix.drop_node(node)


class Match(NamedTuple):
    node: int
    matched: int
    slots: np.ndarray | None


def look(ix, hashes, with_slots=False) -> list[Match]:
    """Lookup through an Ix wrapper or on a bare BlockIndex, as Match tuples."""
    if isinstance(ix, Ix):
        return ix.lookup(hashes, with_slots)
    nodes, matched, slots = ix.lookup(np.asarray(hashes, dtype=np.uint64), with_slots)
    return [
        Match(int(n), int(k), slots[j, :k] if with_slots else None)
        for j, (n, k) in enumerate(zip(nodes.tolist(), matched.tolist()))
    ]


def matches(ms):
    return [(m.node, m.matched) for m in ms]


def matches_slots(ms):
    return [(m.node, m.matched, m.slots.tolist()) for m in ms]


@pytest.fixture(params=MODES)
def ix(request) -> Ix:
    return Ix(request.param)


# -- layouts are what the tests claim ---------------------------------------------


def test_layouts_are_exercised():
    d = Ix("delta")
    d.put(0, [1, 2, 3], [0, 1, 2])
    assert recent(d.ix) == 3 and main(d.ix) == 0

    m = Ix("merged")
    m.put(0, [1, 2, 3], [0, 1, 2])
    assert recent(m.ix) == 0 and main(m.ix) == 3

    t = Ix("t4")
    t.put(0, [1, 2, 3], [0, 1, 2])
    assert recent(t.ix) == 3 and main(t.ix) == 0
    t.put(1, [1], [9])
    assert recent(t.ix) == 0 and main(t.ix) == 4

    x = Ix("mixed")
    x.put(0, [1, 2], [0, 1])  # merged
    x.put(1, [1, 3], [5, 6])  # stays in delta
    assert recent(x.ix) == 2 and main(x.ix) == 2


# -- put / len / count ------------------------------------------------------------


def test_empty_index(ix):
    assert len(ix.ix) == 0
    assert ix.ix.count(0) == 0
    assert look(ix, [1, 2, 3]) == []
    assert look(ix, []) == []
    assert ix.remove(0, [1]) == 0
    assert ix.drop_node(0) == 0
    keys, nodes, slots = ix.ix.items()
    assert len(keys) == len(nodes) == len(slots) == 0


def test_put_counts_new_entries(ix):
    assert ix.put(0, [10, 11, 12], [0, 1, 2]) == 3
    assert len(ix.ix) == 3 and ix.ix.count(0) == 3
    assert ix.put(1, [10, 11], [5, 6]) == 2  # same hashes, other node: new entries
    assert len(ix.ix) == 5 and ix.ix.count(1) == 2
    assert ix.put(0, [10, 13], [7, 3]) == 1  # 10 known to node 0, 13 new
    assert len(ix.ix) == 6 and ix.ix.count(0) == 4 and ix.ix.count(1) == 2
    assert ix.ix.count(2) == 0


def test_reput_updates_slot(ix):
    ix.put(0, [10, 11, 12], [0, 1, 2])
    ix.put(1, [10, 11, 12], [20, 21, 22])
    assert ix.put(0, [11], [9]) == 0
    assert matches_slots(look(ix, [10, 11, 12], with_slots=True)) == [(0, 3, [0, 9, 2]), (1, 3, [20, 21, 22])]
    assert len(ix.ix) == 6 and ix.ix.count(0) == 3
    # after a merge the updated slot persists, and can be updated again in the arrays
    ix.ix.merge()
    assert ix.put(0, [12], [42]) == 0
    assert matches_slots(look(ix, [10, 11, 12], with_slots=True))[0] == (0, 3, [0, 9, 42])
    assert len(ix.ix) == 6


def test_duplicates_in_one_put_resolve_to_last(ix):
    assert ix.put(0, [5, 6, 5], [1, 2, 3]) == 2
    assert len(ix.ix) == 2 and ix.ix.count(0) == 2
    assert matches_slots(look(ix, [5, 6], with_slots=True)) == [(0, 2, [3, 2])]
    ix.ix.merge()
    assert ix.put(0, [6, 6], [7, 8]) == 0
    assert matches_slots(look(ix, [5, 6], with_slots=True)) == [(0, 2, [3, 8])]


def test_extreme_hash_values(ix):
    big = 2**64 - 1
    ix.put(0, [0, big, 2**63], [0, 1, 2])
    ix.put(1, [0, big], [3, 4])
    assert matches_slots(look(ix, [0, big, 2**63], with_slots=True)) == [(0, 3, [0, 1, 2]), (1, 2, [3, 4])]
    # a lookup starting with the largest hash finds both of its holders
    assert matches(look(ix, [big, 2**63])) == [(0, 2), (1, 1)]
    assert matches(look(ix, [2**63, big])) == [(0, 2)]


def test_lookup_starting_with_max_hash():
    for mode in MODES:
        ix = Ix(mode)
        big = 2**64 - 1
        ix.put(0, [big, 1], [0, 1])
        ix.put(1, [big], [2])
        assert matches(look(ix, [big, 1])) == [(0, 2), (1, 1)], mode


# -- longest prefix semantics -----------------------------------------------------


def test_gap_stops_the_match(ix):
    seq = [100, 101, 102, 103]
    ix.put(0, [100, 102, 103], [0, 2, 3])  # lacks seq[1]
    ix.put(1, [101, 102, 103], [1, 2, 3])  # lacks seq[0]
    ix.put(2, seq, [0, 1, 2, 3])
    ix.put(3, [100, 101], [4, 5])
    assert matches(look(ix, seq)) == [(2, 4), (3, 2), (0, 1)]
    # node 1 appears once the query starts where its run starts
    assert matches(look(ix, [101, 102, 103])) == [(1, 3), (2, 3), (3, 1)]
    assert matches(look(ix, [102, 103])) == [(0, 2), (1, 2), (2, 2)]


def test_first_hash_unknown_gives_nothing(ix):
    ix.put(0, [1, 2, 3], [0, 1, 2])
    assert look(ix, [9, 1, 2, 3]) == []
    assert look(ix, [9]) == []


def test_ties_ordered_by_node_index(ix):
    for node in (7, 2, 5, 0):
        ix.put(node, [1, 2], [node, node])
    ix.put(3, [1, 2, 3], [0, 0, 0])
    ix.put(9, [1], [0])
    ix.put(4, [1], [0])
    assert matches(look(ix, [1, 2, 3])) == [(3, 3), (0, 2), (2, 2), (5, 2), (7, 2), (4, 1), (9, 1)]


def test_with_slots(ix):
    ix.put(0, [1, 2, 3], [10, 20, 30])
    ix.put(1, [1, 2], [11, 21])
    ix.put(1, [3], [31])  # node 1 completes the run in a later put (other layout in mixed)
    ix.put(2, [1, 3], [12, 32])
    got = look(ix, [1, 2, 3], with_slots=True)
    assert matches_slots(got) == [(0, 3, [10, 20, 30]), (1, 3, [11, 21, 31]), (2, 1, [12])]
    assert all(m.slots.dtype == np.uint32 for m in got)
    # without slots: slots is None, same matches
    plain = look(ix, [1, 2, 3])
    assert matches(plain) == [(0, 3), (1, 3), (2, 1)]
    assert all(m.slots is None for m in plain)


def test_slots_only_cover_matched_prefix(ix):
    ix.put(0, [1, 3, 4], [10, 30, 40])
    got = look(ix, [1, 2, 3, 4], with_slots=True)
    assert matches_slots(got) == [(0, 1, [10])]


def test_slot_zero_and_max_slot(ix):
    ix.put(0, [1, 2], [0, 2**32 - 2])
    assert matches_slots(look(ix, [1, 2], with_slots=True)) == [(0, 2, [0, 2**32 - 2])]


def test_long_queries_cross_search_chunks(ix):
    """_search_prefix scans in growing chunks (16, 32, ...): prefixes ending in later chunks."""
    seq = list(range(1000, 1200))
    ix.put(0, seq, list(range(200)))
    ix.put(1, seq[:40], list(range(40)))
    ix.put(2, seq[:17], [1] * 17)
    ix.put(3, seq[:100], [3] * 100)
    got = look(ix, seq, with_slots=True)
    assert matches(got) == [(0, 200), (3, 100), (1, 40), (2, 17)]
    assert got[0].slots.tolist() == list(range(200))
    # a hole nobody fills at position 60 ends every match there
    q = seq[:60] + [5] + seq[61:]
    assert matches(look(ix, q)) == [(0, 60), (3, 60), (1, 40), (2, 17)]


def test_long_query_mixed_layout_hole_filled_by_delta():
    """A hash missing from the arrays but present in the delta must not end the search."""
    ix = BlockIndex(merge_threshold=10**9)
    seq = np.arange(5000, 5100, dtype=np.uint64)
    ix.put(0, seq[:50], np.arange(50, dtype=np.uint32))
    ix.merge()
    ix.put(0, seq[50:], np.arange(50, 100, dtype=np.uint32))  # delta
    ix.put(1, seq[:30], np.zeros(30, dtype=np.uint32))  # delta, overlapping array keys
    assert recent(ix) == 80 and main(ix) == 50
    got = look(ix, seq, with_slots=True)
    assert [(m.node, m.matched) for m in got] == [(0, 100), (1, 30)]
    assert got[0].slots.tolist() == list(range(100))
    # a hole in the delta part (positions 70..) stops node 0 at 70
    ix.remove(0, seq[70:71])
    assert [(m.node, m.matched) for m in look(ix, seq)] == [(0, 70), (1, 30)]
    # a hole in the array part stops at 20
    ix.remove(0, seq[20:21])
    assert [(m.node, m.matched) for m in look(ix, seq)] == [(1, 30), (0, 20)]


def test_repeated_hash_in_query(ix):
    ix.put(0, [7, 8], [1, 2])
    assert matches_slots(look(ix, [7, 7, 8], with_slots=True)) == [(0, 3, [1, 1, 2])]


# -- remove / drop_node / tombstones ---------------------------------------------


def test_remove(ix):
    ix.put(0, [1, 2, 3], [0, 1, 2])
    ix.put(1, [1, 2, 3], [5, 6, 7])
    assert ix.remove(0, [2, 99]) == 1  # unknown hash ignored
    assert len(ix.ix) == 5 and ix.ix.count(0) == 2 and ix.ix.count(1) == 3
    assert matches(look(ix, [1, 2, 3])) == [(1, 3), (0, 1)]
    assert ix.remove(0, [2]) == 0  # already gone
    assert ix.remove(2, [1, 2, 3]) == 0  # node never held anything
    assert len(ix.ix) == 5
    assert ix.remove(0, [1, 1, 3]) == 2  # duplicates counted once
    assert ix.ix.count(0) == 0 and len(ix.ix) == 3
    assert matches(look(ix, [1, 2, 3])) == [(1, 3)]


def test_remove_then_reput(ix):
    ix.put(0, [1, 2, 3], [0, 1, 2])
    ix.put(1, [1], [0])  # mixed: another layout
    ix.remove(0, [2])
    assert ix.put(0, [2], [8]) == 1
    assert matches_slots(look(ix, [1, 2, 3], with_slots=True)) == [(0, 3, [0, 8, 2]), (1, 1, [0])]
    assert len(ix.ix) == 4 and ix.ix.count(0) == 3


def test_drop_node(ix):
    ix.put(0, [1, 2, 3], [0, 1, 2])
    ix.put(1, [1, 2], [3, 4])
    ix.put(0, [4, 5], [3, 4])
    ix.put(2, [1], [9])
    assert ix.drop_node(0) == 5
    assert ix.ix.count(0) == 0 and len(ix.ix) == 3
    assert matches(look(ix, [1, 2, 3, 4, 5])) == [(1, 2), (2, 1)]
    assert look(ix, [4, 5]) == []
    assert ix.drop_node(0) == 0
    # the node index can be used again without old entries showing up
    assert ix.put(0, [3], [1]) == 1
    assert matches(look(ix, [1, 2, 3])) == [(1, 2), (2, 1)]
    assert matches(look(ix, [3])) == [(0, 1)]
    assert ix.ix.count(0) == 1 and len(ix.ix) == 4


def test_tombstones_hidden_and_compacted():
    ix = BlockIndex(merge_threshold=1)
    hashes = np.arange(1, 101, dtype=np.uint64)
    ix.put(0, hashes, np.arange(100, dtype=np.uint32))
    ix.put(1, hashes[:20], np.zeros(20, dtype=np.uint32))
    assert main(ix) == 120 and dead(ix) == 0
    before = ix.nbytes()
    # a few removals leave tombstones (under a quarter): arrays keep their size
    assert ix.remove(0, hashes[10:20]) == 10
    assert dead(ix) == 10 and main(ix) == 120
    assert sum(int((p.nodes == DEAD).sum()) for p in ix._parts) == 10
    assert len(ix) == 110 and ix.count(0) == 90
    assert [(m.node, m.matched) for m in look(ix, hashes)] == [(1, 20), (0, 10)]
    keys, nodes, _ = ix.items()
    assert len(keys) == 110 and DEAD not in nodes
    # crossing a quarter compacts: tombstones are gone and the arrays shrink
    assert ix.remove(0, hashes[20:40]) == 20
    assert dead(ix) == 0 and main(ix) == 90
    assert ix.nbytes() < before
    assert len(ix) == 90 and ix.count(0) == 70 and ix.count(1) == 20
    assert [(m.node, m.matched) for m in look(ix, hashes)] == [(1, 20), (0, 10)]
    # entries past the removed range still resolve with the right slots
    got = look(ix, hashes[40:], with_slots=True)
    assert [(m.node, m.matched) for m in got] == [(0, 60)]
    assert got[0].slots.tolist() == list(range(40, 100))


def test_drop_node_compacts_arrays():
    ix = BlockIndex(merge_threshold=1)
    ix.put(0, np.arange(1, 31, dtype=np.uint64), np.arange(30, dtype=np.uint32))
    ix.put(1, np.arange(1, 11, dtype=np.uint64), np.arange(10, dtype=np.uint32))
    assert ix.drop_node(0) == 30
    assert dead(ix) == 0 and main(ix) == 10
    assert len(ix) == 10 and ix.count(0) == 0 and ix.count(1) == 10


def test_merge_preserves_content(ix):
    ix.put(0, [5, 1, 9], [0, 1, 2])
    ix.put(1, [9, 1], [3, 4])
    ix.put(2, [3], [5])
    ix.remove(0, [9])
    before_items = [a.tolist() for a in ix.ix.items()]
    before = matches_slots(look(ix, [1, 9, 5], with_slots=True))
    n = len(ix.ix)
    ix.ix.merge()
    assert recent(ix.ix) == 0 and dead(ix.ix) == 0
    assert [a.tolist() for a in ix.ix.items()] == before_items
    assert matches_slots(look(ix, [1, 9, 5], with_slots=True)) == before
    assert len(ix.ix) == n and ix.ix.count(0) == 2 and ix.ix.count(1) == 2 and ix.ix.count(2) == 1
    ix.ix.merge()  # idempotent
    assert [a.tolist() for a in ix.ix.items()] == before_items


# -- items / digest ----------------------------------------------------------------


def test_items_canonical(ix):
    ix.put(2, [30, 10], [1, 2])
    ix.put(0, [20, 10], [3, 4])
    ix.put(1, [10, 30], [5, 6])
    keys, nodes, slots = ix.ix.items()
    assert keys.dtype == np.uint64 and nodes.dtype == np.uint32 and slots.dtype == np.uint32
    assert list(zip(keys.tolist(), nodes.tolist(), slots.tolist())) == [
        (10, 0, 4),
        (10, 1, 5),
        (10, 2, 2),
        (20, 0, 3),
        (30, 1, 6),
        (30, 2, 1),
    ]


def _build(threshold, ops, merge_after=()):
    ix = BlockIndex(merge_threshold=threshold)
    for i, (kind, node, hashes, slots) in enumerate(ops):
        if kind == "put":
            ix.put(node, H(*hashes), S(*slots))
        elif kind == "remove":
            ix.remove(node, H(*hashes))
        else:
            ix.drop_node(node)
        if i in merge_after:
            ix.merge()
    return ix


OPS_A = [
    ("put", 0, [1, 2, 3, 4], [0, 1, 2, 3]),
    ("put", 1, [1, 2], [5, 6]),
    ("put", 2, [7, 8], [1, 1]),
    ("remove", 0, [4], []),
    ("put", 1, [3], [7]),
    ("drop", 2, [], []),
    ("put", 2, [9], [4]),
]
# same final content, other order and route (temporary entries that are later removed)
OPS_B = [
    ("put", 2, [9], [4]),
    ("put", 1, [3, 2], [7, 6]),
    ("put", 0, [4, 3, 99], [9, 2, 9]),
    ("put", 0, [2, 1], [1, 0]),
    ("remove", 0, [99, 4], []),
    ("put", 1, [1], [5]),
]


def test_items_and_digest_independent_of_order_and_merge_points():
    names = {0: "a", 1: "b", 2: "c"}
    builds = [
        _build(10**9, OPS_A),
        _build(1, OPS_A),
        _build(3, OPS_A),
        _build(10**9, OPS_A, merge_after={1, 4}),
        _build(10**9, OPS_B),
        _build(1, OPS_B),
        _build(2, OPS_B),
        _build(10**9, OPS_B, merge_after={0, 2}),
    ]
    ref = [a.tolist() for a in builds[0].items()]
    assert ref == [[1, 1, 2, 2, 3, 3, 9], [0, 1, 0, 1, 0, 1, 2], [0, 5, 1, 6, 2, 7, 4]]
    digests = {b.digest(names) for b in builds}
    assert len(digests) == 1
    for b in builds:
        assert [a.tolist() for a in b.items()] == ref
        assert len(b) == 7


def test_digest_differs_when_content_differs():
    names = {0: "a", 1: "b"}
    base = _build(10**9, [("put", 0, [1, 2], [0, 1]), ("put", 1, [1], [0])])
    d0 = base.digest(names)
    variants = [
        [("put", 0, [1, 2], [0, 2]), ("put", 1, [1], [0])],  # other slot
        [("put", 0, [1, 3], [0, 1]), ("put", 1, [1], [0])],  # other hash
        [("put", 0, [1], [0]), ("put", 1, [1], [0])],  # entry missing
        [("put", 0, [1, 2], [0, 1]), ("put", 1, [1, 2], [0, 1])],  # extra entry
        [("put", 1, [1, 2], [0, 1]), ("put", 0, [1], [0])],  # holders swapped
    ]
    for v in variants:
        for threshold in (1, 10**9):
            assert _build(threshold, v).digest(names) != d0, v
    # node names matter, not the indices they got
    assert base.digest({0: "a", 1: "b"}) != base.digest({0: "b", 1: "a"})
    swapped = _build(10**9, [("put", 1, [1, 2], [0, 1]), ("put", 0, [1], [0])])
    assert swapped.digest({1: "a", 0: "b"}) == d0
    assert base.digest({0: "a", 1: "b"}) != base.digest({0: "a", 1: "z"})


def test_digest_of_empty_equal_after_removals():
    names = {0: "a"}
    empty = BlockIndex().digest(names)
    for threshold in (1, 4, 10**9):
        ix = _build(threshold, [("put", 0, [1, 2, 3], [0, 1, 2]), ("remove", 0, [1, 2, 3], [])])
        assert len(ix) == 0
        assert ix.digest(names) == empty
        ix = _build(threshold, [("put", 0, [1, 2, 3], [0, 1, 2]), ("drop", 0, [], [])])
        assert ix.digest(names) == empty


def _through_a_raft_snapshot(ix: BlockIndex) -> BlockIndex:
    """`ix` written into a Raft snapshot and read back (kvproto.codec: `export`, then `restore`)."""
    s = DirectoryState()
    s.index = ix
    return decode_state(encode_state(s)).index


def test_snapshot_roundtrip(ix):
    ix.put(0, [1, 2, 3], [0, 1, 2])
    ix.put(1, [1, 4], [5, 6])
    ix.remove(0, [3])
    clone = _through_a_raft_snapshot(ix.ix)
    names = {0: "a", 1: "b"}
    assert clone.digest(names) == ix.ix.digest(names)
    assert len(clone) == len(ix.ix) == 4
    clone.put(0, H(3), S(9))
    assert matches(look(clone, H(1, 2, 3))) == [(0, 3), (1, 1)]
    assert matches(look(ix, [1, 2, 3])) == [(0, 2), (1, 1)]  # original untouched


# -- randomised comparison with a dict model ---------------------------------------

_op = st.one_of(
    st.tuples(
        st.just("put"),
        st.integers(0, 3),
        st.lists(st.tuples(st.integers(0, 11), st.integers(0, 7)), max_size=6),
    ),
    st.tuples(st.just("remove"), st.integers(0, 3), st.lists(st.integers(0, 11), max_size=5)),
    st.tuples(st.just("drop"), st.integers(0, 3), st.just([])),
    st.tuples(st.just("merge"), st.just(0), st.just([])),
)


@settings(max_examples=150, derandomize=True, deadline=None)
@given(
    threshold=st.sampled_from([1, 3, 1000]),
    ops=st.lists(_op, max_size=25),
    queries=st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=6), min_size=1, max_size=4),
)
def test_index_matches_dict_model(threshold, ops, queries):
    ix = BlockIndex(merge_threshold=threshold)
    model: dict[int, dict[int, int]] = {}  # node -> {hash: slot}

    def hashval(i):
        return (i * 0x9E3779B97F4A7C15) % 2**64  # spread over the u64 range

    for kind, node, arg in ops:
        if kind == "put":
            hs = [hashval(h) for h, _ in arg]
            ss = [s for _, s in arg]
            held = model.setdefault(node, {})
            expect_new = len(set(hs) - set(held))
            for h, s in zip(hs, ss):
                held[h] = s
            if not held:
                model.pop(node)
            assert ix.put(node, H(*hs), S(*ss)) == expect_new
        elif kind == "remove":
            hs = [hashval(h) for h in arg]
            held = model.get(node, {})
            gone = set(hs) & set(held)
            for h in gone:
                del held[h]
            assert ix.remove(node, H(*hs)) == len(gone)
        elif kind == "drop":
            assert ix.drop_node(node) == len(model.pop(node, {}))
        else:
            ix.merge()
        assert len(ix) == sum(len(v) for v in model.values())
        for n in range(4):
            assert ix.count(n) == len(model.get(n, {}))
        for q in queries:
            qh = [hashval(h) for h in q]
            expected = []
            for n, held in model.items():
                k = 0
                while k < len(qh) and qh[k] in held:
                    k += 1
                if k:
                    expected.append((-k, n, [held[h] for h in qh[:k]]))
            expected = [(n, -k, s) for k, n, s in sorted(expected)]
            assert matches_slots(look(ix, H(*qh), with_slots=True)) == expected
    keys, nodes, slots = ix.items()
    flat = sorted((h, n, s) for n, held in model.items() for h, s in held.items())
    assert list(zip(keys.tolist(), nodes.tolist(), slots.tolist())) == flat


# -- partitions ---------------------------------------------------------------------


@pytest.fixture
def small_partitions(monkeypatch):
    """Partitions split past 64 entries, so that small indexes have many."""
    monkeypatch.setattr(index_module, "_PART_ENTRIES", 64)


def _mains(ix: BlockIndex) -> dict[int, np.ndarray]:
    return {id(p.nodes): p.nodes for p in ix._parts}


def _rebuilt(ix: BlockIndex, before: dict[int, np.ndarray]) -> int:
    """Main-level entries in arrays that `before` (from `_mains`) did not hold: what merges rebuilt since."""
    return sum(len(p.nodes) for p in ix._parts if before.get(id(p.nodes)) is not p.nodes)


def test_small_index_is_one_partition():
    ix = BlockIndex(merge_threshold=1)
    ix.put(0, np.arange(1, 1001, dtype=np.uint64), np.zeros(1000, dtype=np.uint32))
    assert ix.partitions() == 1 and main(ix) == 1000


def test_put_rebuilds_one_partition(small_partitions):
    """Growing in puts of 8, no put merges more than one partition (64 entries plus its recent level)
    however many entries the index holds; a single main level rebuilt all of them."""
    rng = np.random.default_rng(0)
    ix = BlockIndex(merge_threshold=4)
    worst = 0
    for i in range(1500):
        before = _mains(ix)
        ix.put(i % 5, rng.integers(0, 2**64 - 1, 8, dtype=np.uint64, endpoint=True), np.arange(8, dtype=np.uint32))
        worst = max(worst, _rebuilt(ix, before))
    assert len(ix) == 12000 and ix.count(0) == 2400 and ix.partitions() >= 150
    assert 0 < worst <= 64 + 16 * 8
    keys, nodes, slots = ix.items()
    assert len(keys) == 12000 and main(ix) > 10000
    for j in range(0, 12000, 997):
        assert (int(nodes[j]), 1, [int(slots[j])]) in matches_slots(look(ix, keys[j : j + 1], with_slots=True))


def test_drop_node_compacts_a_partition_at_a_time(small_partitions):
    rng = np.random.default_rng(1)
    ix = BlockIndex(merge_threshold=4)
    hashes = rng.integers(0, 2**64 - 1, 4000, dtype=np.uint64, endpoint=True)
    for i in range(0, 4000, 8):
        ix.put(0, hashes[i : i + 8], np.arange(8, dtype=np.uint32))
        ix.put(1, hashes[i : i + 4], np.arange(4, dtype=np.uint32))
    ix.merge()
    assert dead(ix) == 0 and ix.partitions() > 50
    before = _mains(ix)
    assert ix.drop_node(0) == 4000  # two thirds of every partition
    assert _rebuilt(ix, before) <= 64
    assert dead(ix) > 3000  # the others wait for later mutations...
    assert matches(look(ix, hashes[:4])) == [(1, 4)]  # ...and are not seen meanwhile
    keys, nodes, _ = ix.items()
    assert len(ix) == 2000 and keys.tolist() == sorted(hashes.reshape(-1, 8)[:, :4].ravel().tolist())
    assert set(nodes.tolist()) == {1}
    for _ in range(ix.partitions()):
        before = _mains(ix)
        ix.put(2, hashes[:1], np.zeros(1, dtype=np.uint32))  # any mutation compacts one more
        assert _rebuilt(ix, before) <= 2 * 64
    assert dead(ix) == 0 and len(ix) == 2001


@pytest.mark.parametrize("spread", [True, False], ids=["xxh3-like", "small-ints"])
def test_partitioned_index_matches_model(small_partitions, spread):
    """Many partitions, with merges, splits, tombstones and waiting partitions, against a dict model.
    Splits cut at distinct hashes, so small integer hashes (all in the lowest 2**-52 of the space)
    are cut as finely as spread ones."""
    rng = np.random.default_rng(2)
    ix = BlockIndex(merge_threshold=4)
    model: dict[int, dict[int, int]] = {}
    for i in range(800):
        node = int(rng.integers(0, 4))
        hs = rng.integers(0, 3000, 6, dtype=np.uint64)
        hs = hs * np.uint64(0x9E3779B97F4A7C15) if spread else hs
        kind = "drop" if i % 97 == 96 else ("remove" if i % 3 == 2 else "put")
        if kind == "put":
            ss = rng.integers(0, 100, 6).astype(np.uint32)
            held = model.setdefault(node, {})
            assert ix.put(node, hs, ss) == len(set(hs.tolist()) - set(held))
            held.update(zip(hs.tolist(), ss.tolist()))
        elif kind == "remove":
            gone = set(hs.tolist()) & set(model.get(node, {}))
            assert ix.remove(node, hs) == len(gone)
            for h in gone:
                del model[node][h]
        else:
            assert ix.drop_node(node) == len(model.pop(node, {}))
    assert ix.partitions() > 10
    flat = sorted((h, n, s) for n, held in model.items() for h, s in held.items())
    keys, nodes, slots = ix.items()
    assert list(zip(keys.tolist(), nodes.tolist(), slots.tolist())) == flat
    assert len(ix) == len(flat) and all(ix.count(n) == len(model.get(n, {})) for n in range(4))
    for j in range(0, len(flat), 37):
        q = keys[j : j + 5]
        expected = []
        for n, held in model.items():
            k = 0
            while k < len(q) and int(q[k]) in held:
                k += 1
            if k:
                expected.append((-k, n, [held[int(h)] for h in q[:k]]))
        assert matches_slots(look(ix, q, with_slots=True)) == [(n, -k, s) for k, n, s in sorted(expected)]
        assert [ix.missing(n, q) for n in range(4)] == [
            sum(int(h) not in model.get(n, {}) for h in set(q.tolist())) for n in range(4)
        ]
    # the same content loaded in one go is cut elsewhere, and digests alike
    names = {n: f"n{n}" for n in range(4)}
    loaded = BlockIndex(merge_threshold=4)
    loaded.load(*ix.entries())
    assert loaded.digest(names) == ix.digest(names)
    assert [p.lo for p in loaded._parts] != [p.lo for p in ix._parts]
    clone = _through_a_raft_snapshot(ix)
    assert clone.digest(names) == ix.digest(names) and clone.partitions() == ix.partitions()
    assert [matches_slots(look(clone, keys[j : j + 5], with_slots=True)) for j in range(0, len(flat), 37)] == [
        matches_slots(look(ix, keys[j : j + 5], with_slots=True)) for j in range(0, len(flat), 37)
    ]


def _sorted(entries: tuple[np.ndarray, np.ndarray, np.ndarray]) -> list[tuple[int, int, int]]:
    return sorted(zip(*(a.tolist() for a in entries)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["put", "remove", "drop", "freeze"]), st.integers(0, 3), st.integers(0, 400)),
        min_size=1,
        max_size=40,
    )
)
def test_a_frozen_view_never_changes_under_its_reader(small_partitions, ops) -> None:
    """`frozen` hands out the index's own arrays (a watch snapshot reads them off the state lock); every
    in-place write afterwards (a slot updated, a tombstone, a node dropped) must copy first, and merges
    must build new arrays: each view still reads exactly what the index held when it was taken, and the
    index itself stays right."""
    ix = BlockIndex(merge_threshold=8)  # many partitions (`small_partitions`), split and merged often
    rng = np.random.default_rng(len(ops))
    ix.put(0, rng.integers(1, 500, 300).astype(np.uint64), rng.integers(0, 99, 300).astype(np.uint32))
    views = [(ix.frozen(), _sorted(ix.entries()))]
    for op, node, x in ops:
        hashes = rng.integers(1, 500, 1 + x % 97).astype(np.uint64)
        if op == "put":
            ix.put(node, hashes, rng.integers(0, 99, len(hashes)).astype(np.uint32))
        elif op == "remove":
            ix.remove(node, hashes)
        elif op == "drop":
            ix.drop_node(node)
        else:
            views.append((ix.frozen(), _sorted(ix.entries())))
    for view, then in views:
        assert _sorted(view.entries()) == then
    fresh = BlockIndex()
    fresh.load(*ix.entries())
    assert ix.digest({}) == fresh.digest({}) and len(ix) == len(fresh)


def test_freezing_costs_the_hot_path_nothing_until_it_happens() -> None:
    """Without a frozen view no partition is shared, so a write copies nothing; after one, a write copies the
    partitions it touches once, and the view keeps the old arrays."""
    ix = BlockIndex()
    ix.put(0, H(1, 2, 3), S(10, 20, 30))
    ix.merge()
    arrays = ix._parts[0].slots
    ix.put(0, H(1), S(11))
    assert ix._parts[0].slots is arrays and ix._nshared == 0  # written in place
    view = ix.frozen()
    ix.put(0, H(2), S(21))
    assert ix._parts[0].slots is not arrays and ix._nshared == 0
    copied = ix._parts[0].slots
    ix.put(0, H(3), S(31))
    assert ix._parts[0].slots is copied  # once
    assert _sorted(view.entries()) == [(1, 0, 11), (2, 0, 20), (3, 0, 30)]
    assert _sorted(ix.entries()) == [(1, 0, 11), (2, 0, 21), (3, 0, 31)]
