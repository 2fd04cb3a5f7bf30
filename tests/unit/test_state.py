"""DirectoryState.apply: every command type, epochs, fencing, expiry, limits."""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import numpy as np
import pytest

from directory.shardmap import SHARD_BITS
from directory.state import (
    EPOCH_BASE_BITS,
    INDEX_FULL,
    INVALID,
    NODE_LIMIT,
    OK,
    STALE_EPOCH,
    UNKNOWN_NODE,
    AnnounceReplica,
    Clear,
    Deregister,
    DirectoryState,
    Expire,
    Heartbeat,
    Holder,
    Noop,
    Publish,
    Register,
    Remove,
    Result,
    new_epoch_base,
)


def H(*xs) -> np.ndarray:
    return np.asarray(xs, dtype=np.uint64)


def S(*xs) -> np.ndarray:
    return np.asarray(xs, dtype=np.uint32)


def reg(st: DirectoryState, node_id: str, inc: str = "i1", **kw) -> int:
    r = st.apply(Register(node_id, inc, f"http://{node_id}", **kw))
    assert r.status == OK, r
    return r.value


def pub(st, node_id, epoch, hashes, slots=None, **kw) -> Result:
    slots = list(range(len(hashes))) if slots is None else slots
    return st.apply(Publish(node_id, epoch, H(*hashes), S(*slots), **kw))


def view(st, hashes, with_slots=False):
    return [
        (h.node_id, h.epoch, h.matched, h.slots) if with_slots else (h.node_id, h.epoch, h.matched)
        for h in st.lookup(H(*hashes), with_slots)
    ]


@pytest.fixture(params=[1, 4, 10**9], ids=["t1", "t4", "delta"])
def st(request) -> DirectoryState:
    return DirectoryState(merge_threshold=request.param)


# -- Register -------------------------------------------------------------------------


def test_register_returns_increasing_epochs(st):
    e_a = reg(st, "a")
    e_b = reg(st, "b")
    e_c = reg(st, "c")
    assert 0 < e_a < e_b < e_c
    assert st.nodes["a"].epoch == e_a and st.epoch_counter == e_c
    node = st.nodes["b"]
    assert node.api_url == "http://b" and node.incarnation == "i1"


def test_register_stores_fields(st):
    regions = ({"rank": 0, "base_addr": 4096, "length": 1 << 20, "rkey": "k0", "block_bytes": 4096},)
    r = st.apply(Register("a", "i1", "http://a", "tcp://a:1", regions, 256, 16))
    assert r.ok and isinstance(r.value, int)
    node = st.nodes["a"]
    assert node.transfer_url == "tcp://a:1"
    assert node.regions == regions and isinstance(node.regions, tuple)
    assert node.capacity_blocks == 256 and node.block_size == 16


def test_register_same_incarnation_is_idempotent(st):
    e1 = reg(st, "a", "inc-1")
    reg(st, "b")
    assert pub(st, "a", e1, [1, 2, 3]).ok
    counter = st.epoch_counter
    e1_again = reg(st, "a", "inc-1")
    assert e1_again == e1
    assert st.epoch_counter == counter  # no epoch consumed
    assert view(st, [1, 2, 3]) == [("a", e1, 3)]
    assert st.blocks_held(st.nodes["a"]) == 3
    assert pub(st, "a", e1, [4]).ok  # old epoch still current


def test_register_new_incarnation_new_epoch_drops_entries(st):
    e1 = reg(st, "a", "inc-1")
    e_b = reg(st, "b")
    assert pub(st, "a", e1, [1, 2, 3]).ok
    assert pub(st, "b", e_b, [1]).ok
    e2 = reg(st, "a", "inc-2")
    assert e2 > e_b > e1
    assert view(st, [1, 2, 3]) == [("b", e_b, 1)]
    assert st.blocks_held(st.nodes["a"]) == 0
    assert len(st.index) == 1
    # the old epoch is fenced off
    r = pub(st, "a", e1, [1, 2, 3])
    assert r.status == STALE_EPOCH and r.value == e2
    assert view(st, [1, 2, 3]) == [("b", e_b, 1)]
    # the new one works, and the node keeps its index
    assert pub(st, "a", e2, [1, 2]).ok
    assert view(st, [1, 2, 3]) == [("a", e2, 2), ("b", e_b, 1)]
    # going back to the first incarnation is a new registration too
    e3 = reg(st, "a", "inc-1")
    assert e3 > e2
    assert view(st, [1, 2, 3]) == [("b", e_b, 1)]


def test_reregistration_updates_fields(st):
    reg(st, "a", "i1")
    st.apply(Register("a", "i2", "http://a2", capacity_blocks=8))
    assert st.nodes["a"].api_url == "http://a2"
    assert st.nodes["a"].capacity_blocks == 8


def test_reregistrations_replace_the_old_one_and_leak_nothing(st):
    """Issue #12 item 7: the state holds one registration per node, whatever the churn; only the Raft
    log grows with re-registrations (compacted by size in the replica)."""
    regions = tuple(
        {"rank": r, "base_addr": 0, "length": 1, "block_bytes": 1, "rkey": "k" * 256, "layer": None} for r in range(256)
    )
    for k in range(1000):
        e = st.apply(Register("a", f"i{k}", "http://a", regions=regions)).value
        assert pub(st, "a", e, [k, k + 1]).ok
    assert list(st.nodes) == ["a"] and list(st.by_idx) == [st.nodes["a"].idx] and st.nodes["a"].incarnation == "i999"
    assert st._next_idx == 1 and st._free_idx == []
    assert len(st.index) == 2 and view(st, [999, 1000]) == [("a", e, 2)]
    assert len(pickle.dumps(st)) < len(pickle.dumps(regions)) + 64 * 1024


def test_epochs_strictly_increase_globally_across_reuse(st):
    epochs = []
    for i in range(3):
        epochs.append(reg(st, "a", f"i{i}"))
        epochs.append(reg(st, "b", f"i{i}"))
        st.apply(Deregister("a"))
        epochs.append(reg(st, "a", "same"))  # after deregistration, a fresh epoch
        st.apply(Expire("a", epochs[-1], st.nodes["a"].seen))
    assert epochs == sorted(epochs) and len(set(epochs)) == len(epochs)


def test_epoch_counter_starts_at_the_first_registrations_base(st):
    base = new_epoch_base(12345)
    assert st.apply(Register("a", "i1", "http://a", epoch_base=base)).value == base + 1
    # Later bases are ignored: the counter only ever moves forward from the first one.
    assert st.apply(Register("b", "i1", "http://b", epoch_base=new_epoch_base(7))).value == base + 2


def test_a_rebuilt_directory_does_not_reuse_the_old_ones_epochs():
    # A directory whose state was lost (every replica wiped) starts from a new random base, so a
    # zombie write carrying an epoch of the old directory is refused instead of matching a new node.
    old, new = DirectoryState(), DirectoryState()
    e_old = old.apply(Register("a", "i1", "http://a", epoch_base=new_epoch_base(1))).value
    e_new = new.apply(Register("a", "i2", "http://a", epoch_base=new_epoch_base(2))).value
    assert e_old != e_new
    assert pub(new, "a", e_old, [1]).status == STALE_EPOCH
    assert view(new, [1]) == []


def test_epoch_base_stays_below_2_to_the_62():
    assert new_epoch_base((1 << 64) - 1) < 1 << 62
    assert new_epoch_base(0) == 0 and new_epoch_base(1) == 1 << (EPOCH_BASE_BITS + SHARD_BITS)

