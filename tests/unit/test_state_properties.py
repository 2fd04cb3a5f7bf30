"""Property tests: DirectoryState against a naive pure-Python model; digests; snapshots.

Small universes (4 node ids, 2 incarnations, 12 hashes, 6 slots) so that random
command sequences collide often: re-registrations, stale epochs, expiries that
a heartbeat voids, re-used node indices, slots beyond capacity, a full index.
merge_threshold 1, 3 and 1000 drive the index through its sorted arrays, its
delta and both at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvproto.codec import decode_state, encode_state
from kvproto.state import (
    INDEX_FULL,
    INVALID,
    NODE_LIMIT,
    OK,
    STALE_EPOCH,
    UNKNOWN_NODE,
    Clear,
    Deregister,
    DirectoryState,
    Expire,
    Heartbeat,
    Publish,
    Register,
    Remove,
)

NODE_IDS = ["n0", "n1", "n2", "n3"]
INCARNATIONS = ["inc-a", "inc-b"]
# 12 hashes spread over the u64 range, both ends included
HASHES = [0, 2**64 - 1] + [((i + 1) * 0x9E3779B97F4A7C15) % 2**64 for i in range(10)]
N_SLOTS = 6
CAPACITIES = [None, None, 4, 8]


def H(xs) -> np.ndarray:
    return np.asarray(xs, dtype=np.uint64)


def S(xs) -> np.ndarray:
    return np.asarray(xs, dtype=np.uint32)


# -- the reference model --------------------------------------------------------------


@dataclass
class MNode:
    epoch: int
    incarnation: str
    capacity: int | None
    seen: int = 0
    entries: dict[int, int] = field(default_factory=dict)  # hash -> slot


class Model:
    """The rules of state.py, written as plainly as possible."""

    def __init__(self, max_nodes: int, max_entries: int) -> None:
        self.max_nodes = max_nodes
        self.max_entries = max_entries
        self.nodes: dict[str, MNode] = {}
        self.counter = 0

    def total(self) -> int:
        return sum(len(n.entries) for n in self.nodes.values())

    def _current(self, node_id, epoch):
        node = self.nodes.get(node_id)
        if node is None:
            return (UNKNOWN_NODE, None)
        if node.epoch != epoch:
            return (STALE_EPOCH, node.epoch)
        node.seen += 1
        return node

    def apply(self, cmd):
        if isinstance(cmd, Register):
            node = self.nodes.get(cmd.node_id)
            if node is not None and node.incarnation == cmd.incarnation:
                node.seen += 1
                return (OK, node.epoch)
            if node is None and len(self.nodes) >= self.max_nodes:
                return (NODE_LIMIT, None)
            self.counter += 1
            self.nodes[cmd.node_id] = MNode(self.counter, cmd.incarnation, cmd.capacity_blocks)
            return (OK, self.counter)
        if isinstance(cmd, Deregister):
            node = self.nodes.get(cmd.node_id)
            if node is None:
                return (UNKNOWN_NODE, None)
            if cmd.epoch is not None and cmd.epoch != node.epoch:
                return (STALE_EPOCH, node.epoch)  # ends an earlier registration: the current one stays
            del self.nodes[cmd.node_id]
            return (OK, len(node.entries))
        if isinstance(cmd, Expire):
            node = self.nodes.get(cmd.node_id)
            if node is None or node.epoch != cmd.epoch or node.seen != cmd.seen:
                return (OK, False)
            del self.nodes[cmd.node_id]
            return (OK, True)
        node = self._current(cmd.node_id, cmd.epoch)
        if isinstance(node, tuple):
            return node
        if isinstance(cmd, Heartbeat):
            return (OK, node.epoch)
        if isinstance(cmd, Publish):
            hashes, slots = cmd.hashes.tolist(), cmd.slots.tolist()
            if node.capacity is not None and any(s >= node.capacity for s in slots):
                return (INVALID, None)
            new = len(set(hashes) - set(node.entries))
            if self.total() + new > self.max_entries:  # only new entries count against the limit
                return (INDEX_FULL, None)
            for h, s in zip(hashes, slots):
                node.entries[h] = s
            return (OK, new)
        if isinstance(cmd, Remove):
            gone = set(cmd.hashes.tolist()) & set(node.entries)
            for h in gone:
                del node.entries[h]
            return (OK, len(gone))
        if isinstance(cmd, Clear):
            n = len(node.entries)
            node.entries.clear()
            return (OK, n)
        raise AssertionError(f"model does not know {cmd!r}")

    def lookup(self, hashes):
        """Per node, the longest run hashes[0..k-1] it holds entirely, as a set of tuples."""
        out = set()
        for node_id, node in self.nodes.items():
            k = 0
            while k < len(hashes) and hashes[k] in node.entries:
                k += 1
            if k:
                out.add((node_id, node.epoch, k, tuple(node.entries[h] for h in hashes[:k])))
        return out


# -- commands as drawn, resolved against a state when applied ------------------------

# Hypothesis draws the first branch / element / small integer most readily, so the
# first choice of each is the one that keeps nodes alive and writing: a write goes
# to a registered node (an int picks one of those) with its current epoch; ids,
# stale and made-up epochs, and Expires that really expire, come less often.
node_choice = st.one_of(st.integers(0, 3), st.sampled_from(NODE_IDS))
epoch_choice = st.one_of(st.sampled_from(["cur", "cur", "cur", "old"]), st.integers(0, 12))
hash_list = st.lists(st.integers(0, len(HASHES) - 1), max_size=6)
pairs_list = st.lists(st.tuples(st.integers(0, len(HASHES) - 1), st.integers(0, N_SLOTS - 1)), min_size=1, max_size=6)

register_op = st.tuples(
    st.just("register"), st.sampled_from(NODE_IDS), st.sampled_from(INCARNATIONS), st.sampled_from(CAPACITIES)
)
publish_op = st.tuples(st.just("publish"), node_choice, epoch_choice, pairs_list)
heartbeat_op = st.tuples(st.just("heartbeat"), node_choice, epoch_choice)
remove_op = st.tuples(st.just("remove"), node_choice, epoch_choice, hash_list)
clear_op = st.tuples(st.just("clear"), node_choice, epoch_choice)
expire_op = st.tuples(st.just("expire"), node_choice, epoch_choice, st.sampled_from(["before", "before", "cur"]))
deregister_op = st.tuples(st.just("deregister"), node_choice, st.one_of(epoch_choice, st.none()))

# the leader's view is current: this Expire does expire a registered node
expire_now_op = st.tuples(st.just("expire"), st.integers(0, 3), st.just("cur"), st.just("cur"))

# Kinds drawn by weight (sampled_from draws about uniformly; one_of would favour its
# first branches), so that nodes live long enough to hold entries.
_KIND_OPS = {
    "publish": publish_op,
    "register": register_op,
    "heartbeat": heartbeat_op,
    "remove": remove_op,
    "clear": clear_op,
    "expire": expire_op,
    "expire_now": expire_now_op,
    "deregister": deregister_op,
}
_WEIGHTED_KINDS = (
    ["publish"] * 6
    + ["register"] * 2
    + ["heartbeat"] * 2
    + [
        "remove",
        "clear",
        "expire",
        "expire_now",
        "deregister",
    ]
)
op_strategy = st.sampled_from(_WEIGHTED_KINDS).flatmap(_KIND_OPS.__getitem__)


class History:
    """Epochs handed out per node id, so that 'old' can name a really stale one."""

    def __init__(self) -> None:
        self.epochs: dict[str, list[int]] = {}

    def note(self, cmd, result) -> None:
        if isinstance(cmd, Register) and result.status == OK:
            lst = self.epochs.setdefault(cmd.node_id, [])
            if not lst or lst[-1] != result.value:
                lst.append(result.value)


def resolve(op, state: DirectoryState, hist: History):
    kind, node_id = op[0], op[1]
    if isinstance(node_id, int):  # one of the registered nodes, if there are any
        live = sorted(state.nodes)
        node_id = live[node_id % len(live)] if live else NODE_IDS[node_id % len(NODE_IDS)]
    node = state.nodes.get(node_id)

    def epoch(choice):
        if choice == "cur":
            return node.epoch if node is not None else 1
        if choice == "old":
            past = [e for e in hist.epochs.get(node_id, []) if node is None or e != node.epoch]
            return past[-1] if past else 0
        return choice

    if kind == "register":
        return Register(node_id, op[2], f"http://{node_id}", capacity_blocks=op[3])
    if kind == "heartbeat":
        return Heartbeat(node_id, epoch(op[2]), {"load": float(len(hist.epochs))})
    if kind == "publish":
        return Publish(node_id, epoch(op[2]), H([HASHES[h] for h, _ in op[3]]), S([s for _, s in op[3]]))
    if kind == "remove":
        return Remove(node_id, epoch(op[2]), H([HASHES[h] for h in op[3]]))
    if kind == "clear":
        return Clear(node_id, epoch(op[2]))
    if kind == "expire":
        seen = 0 if node is None else node.seen - (op[3] == "before")
        return Expire(node_id, epoch(op[2]), seen)
    return Deregister(node_id, None if op[2] is None else epoch(op[2]))  # None: an admin's, whatever is current


# -- checks -----------------------------------------------------------------------------


def check_against_model(state: DirectoryState, model: Model, queries) -> None:
    assert set(state.nodes) == set(model.nodes)
    assert len(state.index) == model.total()
    for node_id, mnode in model.nodes.items():
        node = state.nodes[node_id]
        assert node.epoch == mnode.epoch
        assert node.seen == mnode.seen
        assert state.blocks_held(node) == len(mnode.entries)
        assert state.by_idx[node.idx] is node
    assert len(state.by_idx) == len(state.nodes)
    # no entries left behind under an index no node holds
    live_idx = {n.idx for n in state.nodes.values()}
    for idx in range(len(NODE_IDS) + 2):
        if idx not in live_idx:
            assert state.index.count(idx) == 0
    keys, nodes, _ = state.index.items()
    assert set(nodes.tolist()) <= live_idx
    assert len(keys) == model.total()

    for q in queries:
        hashes = [HASHES[i] for i in q]
        got = state.lookup(H(hashes), with_slots=True)
        # the same answer as the model
        assert {(h.node_id, h.epoch, h.matched_blocks, tuple(h.slots)) for h in got} == model.lookup(hashes)
        assert len(got) == len({h.node_id for h in got})
        # only current registrations are ever handed out
        for h in got:
            assert h.node_id in state.nodes and state.nodes[h.node_id].epoch == h.epoch
            assert model.nodes[h.node_id].epoch == h.epoch
            assert 1 <= h.matched_blocks <= len(hashes) and len(h.slots) == h.matched_blocks
        # longest first, ties by node index
        keys_ = [(-h.matched_blocks, state.nodes[h.node_id].idx) for h in got]
        assert keys_ == sorted(keys_)
        # without slots: the same holders in the same order
        plain = state.lookup(H(hashes))
        assert [(h.node_id, h.epoch, h.matched_blocks) for h in plain] == [(h.node_id, h.epoch, h.matched_blocks) for h in got]
        assert all(h.slots is None for h in plain)


FIXED_QUERIES = [[i] for i in range(len(HASHES))] + [list(range(12)), [0, 1, 2, 3], [5, 4, 3, 2, 1, 0], [11, 0, 11]]

queries_strategy = st.lists(st.lists(st.integers(0, len(HASHES) - 1), min_size=1, max_size=6), min_size=1, max_size=3)


# -- stateful test -------------------------------------------------------------------------


class DirectoryMachine(RuleBasedStateMachine):
    """One DirectoryState checked against the model after every command.

    A twin with another merge_threshold gets the same commands and must give the
    same results and digest; `snapshot` replaces the state by a copy written into a Raft
    snapshot and read back (kvproto.codec), as a pysyncobj snapshot restore would.
    """

    def __init__(self) -> None:
        super().__init__()
        self._setup(1000, 4, 10**6)

    def _setup(self, threshold, max_nodes, max_entries):
        self.state = DirectoryState(max_nodes=max_nodes, max_entries=max_entries, merge_threshold=threshold)
        twin_threshold = 1 if threshold != 1 else 1000
        self.twin = DirectoryState(max_nodes=max_nodes, max_entries=max_entries, merge_threshold=twin_threshold)
        self.model = Model(max_nodes, max_entries)
        self.hist = History()
        self.statuses: set[str] = set()

    @initialize(
        threshold=st.sampled_from([1, 3, 1000]),
        max_nodes=st.sampled_from([3, 4]),
        max_entries=st.sampled_from([14, 10**6]),
        first=st.lists(st.tuples(register_op, publish_op), max_size=4),
    )
    def configure(self, threshold, max_nodes, max_entries, first=()):
        """Start with a few registered nodes holding entries (hypothesis may disable
        some rules in an example, e.g. every registration)."""
        self._setup(threshold, max_nodes, max_entries)
        for reg_op, pub_op in first:
            self._step(reg_op, FIXED_QUERIES[-4:])
            self._step(("publish", reg_op[1], "cur", pub_op[3]), FIXED_QUERIES[-4:])

    def _step(self, op, queries):
        cmd = resolve(op, self.state, self.hist)
        expected = self.model.apply(cmd)
        got = self.state.apply(cmd)
        assert (got.status, got.value) == expected, (cmd, got)
        twin = self.twin.apply(cmd)
        assert (twin.status, twin.value) == expected, (cmd, twin)
        self.hist.note(cmd, got)
        self.statuses.add(got.status)
        check_against_model(self.state, self.model, queries)

    @rule(op=op_strategy, queries=queries_strategy, merge_after=st.booleans())
    def command(self, op, queries, merge_after):
        self._step(op, queries)
        if merge_after:
            # fold into the main level on this replica only: later writes then leave the
            # state with entries in both levels (and tombstones); the twin keeps its own layout
            self.state.index.merge()

    @rule(node_id=st.sampled_from(NODE_IDS), queries=queries_strategy)
    def heartbeat_voids_expire(self, node_id, queries):
        """The leader decides to expire, the node is heard from, then the Expire commits."""
        node = self.state.nodes.get(node_id)
        if node is None:
            return
        seen = node.seen
        self._step(("heartbeat", node_id, "cur"), queries)
        cmd = Expire(node_id, node.epoch, seen)
        assert self.model.apply(cmd) == (OK, False)
        assert tuple(self.state.apply(cmd)[:2]) == (OK, False)
        assert tuple(self.twin.apply(cmd)[:2]) == (OK, False)
        assert node_id in self.state.nodes
        check_against_model(self.state, self.model, queries)

    @rule()
    def snapshot(self):
        self.state = decode_state(encode_state(self.state))

    @rule()
    def merge(self):
        self.state.index.merge()

    @invariant()
    def agrees(self):
        check_against_model(self.state, self.model, FIXED_QUERIES)
        assert self.state.digest() == self.twin.digest()


TestDirectoryMachine = DirectoryMachine.TestCase
TestDirectoryMachine.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# -- sequences of commands: digests and snapshots ----------------------------------------


def run(state: DirectoryState, ops, hist: History, twins=()):
    results = []
    for op in ops:
        cmd = resolve(op, state, hist)
        r = state.apply(cmd)
        hist.note(cmd, r)
        results.append((r.status, r.value))
        for t in twins:
            rt = t.apply(cmd)
            assert (rt.status, rt.value) == (r.status, r.value)
    return results


ops_strategy = st.builds(
    lambda regs, ops: regs + ops,
    st.lists(register_op, min_size=2, max_size=4),
    st.lists(op_strategy, min_size=10, max_size=50),
)


@settings(max_examples=80, derandomize=True, deadline=None)
@given(
    ops=ops_strategy,
    thresholds=st.tuples(st.sampled_from([1, 3, 1000]), st.sampled_from([1, 3, 1000])),
)
def test_same_commands_same_digest(ops, thresholds):
    a = DirectoryState(max_nodes=3, max_entries=20, merge_threshold=thresholds[0])
    b = DirectoryState(max_nodes=3, max_entries=20, merge_threshold=thresholds[1])
    hist = History()
    for op in ops:
        run(a, [op], hist, twins=[b])
        assert a.digest() == b.digest()
        assert a.index.items()[0].tolist() == b.index.items()[0].tolist()
    assert a.epoch_counter == b.epoch_counter


@settings(max_examples=80, derandomize=True, deadline=None)
@given(
    ops=ops_strategy,
    cuts=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    threshold=st.sampled_from([1, 3, 1000]),
)
def test_a_snapshot_midway_gives_same_digest(ops, cuts, threshold):
    plain = DirectoryState(max_nodes=3, max_entries=20, merge_threshold=threshold)
    expected = run(plain, ops, History())

    snap = DirectoryState(max_nodes=3, max_entries=20, merge_threshold=threshold)
    hist = History()
    got = []
    cut_points = sorted({c % (len(ops) + 1) for c in cuts})
    start = 0
    for c in cut_points + [len(ops)]:
        got += run(snap, ops[start:c], hist)
        start = c
        snap = decode_state(encode_state(snap))
    assert got == expected
    assert snap.digest() == plain.digest()
    assert snap.epoch_counter == plain.epoch_counter and snap.applied == plain.applied
    for q in FIXED_QUERIES:
        hs = H([HASHES[i] for i in q])
        assert snap.lookup(hs, True) == plain.lookup(hs, True)
    # the restored state keeps working like the original
    more = [("register", "n3", "inc-b", None), ("publish", "n3", "cur", [(0, 1), (1, 2)])]
    assert run(snap, more, hist) == run(plain, more, History())
    assert snap.digest() == plain.digest()


def test_digest_differs_for_different_commands():
    """The digest is not constant: it tells apart states that differ."""
    base = [("register", "n0", "inc-a", None), ("publish", "n0", "cur", [(0, 1), (1, 2)])]
    variants = [
        base + [("publish", "n0", "cur", [(2, 0)])],
        base + [("remove", "n0", "cur", [1])],
        base + [("register", "n0", "inc-b", None)],
        base + [("register", "n1", "inc-a", None)],
        [("register", "n0", "inc-a", None), ("publish", "n0", "cur", [(0, 1), (1, 3)])],
    ]
    s = DirectoryState()
    run(s, base, History())
    digests = {s.digest()}
    for v in variants:
        t = DirectoryState()
        run(t, v, History())
        digests.add(t.digest())
    assert len(digests) == len(variants) + 1


def test_long_random_sequences_against_model():
    """Long runs (300 commands) beyond the machine's step count; also a guard against a
    vacuous setup: every outcome occurs and the index does fill up."""
    kinds = ["register"] * 2 + ["publish"] * 4 + ["heartbeat", "remove", "clear", "expire", "deregister"]
    statuses = set()
    peak = 0
    for seed in range(6):
        m = DirectoryMachine()
        m.configure(threshold=[1, 3, 1000][seed % 3], max_nodes=3, max_entries=14)
        rng = np.random.default_rng(seed)
        for _ in range(300):
            kind = kinds[rng.integers(len(kinds))]
            node_id = NODE_IDS[rng.integers(4)]
            ep = ["cur", "cur", "cur", "old", int(rng.integers(0, 12))][rng.integers(5)]
            if kind == "register":
                op = (kind, node_id, INCARNATIONS[rng.integers(2)], CAPACITIES[rng.integers(4)])
            elif kind == "publish":
                k = int(rng.integers(0, 7))
                pairs = [(int(rng.integers(12)), int(rng.integers(N_SLOTS))) for _ in range(k)]
                op = (kind, node_id, ep, pairs)
            elif kind == "remove":
                op = (kind, node_id, ep, [int(x) for x in rng.integers(0, 12, size=3)])
            elif kind == "expire":
                op = (kind, node_id, ep, ["cur", "before", "before"][rng.integers(3)])
            elif kind == "deregister":
                op = (kind, node_id, [ep, None][rng.integers(2)])
            else:
                op = (kind, node_id, ep)
            m._step(op, [[int(x) for x in rng.integers(0, 12, size=int(rng.integers(1, 7)))]])
            m.agrees()
            peak = max(peak, len(m.state.index))
        statuses |= m.statuses
    assert statuses == {OK, STALE_EPOCH, UNKNOWN_NODE, NODE_LIMIT, INDEX_FULL, INVALID}
    assert peak >= 10
