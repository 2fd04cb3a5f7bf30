"""DirectoryState.apply: every command type, epochs, fencing, expiry, limits."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np
import pytest

from kvproto.codec import decode_state, encode_state
from kvproto.schemas import Region
from kvproto.shardmap import SHARD_BITS
from kvproto.state import (
    EPOCH_BASE_BITS,
    EPOCH_OFFSET_BITS,
    EPOCH_RANDOM_BITS,
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
        (h.node_id, h.epoch, h.matched_blocks, h.slots) if with_slots else (h.node_id, h.epoch, h.matched_blocks)
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
    regions = (Region(rank=0, base_addr=4096, length=1 << 20, rkey="k0", block_bytes=4096),)
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
    regions = tuple(Region(rank=r, base_addr=0, length=1, block_bytes=1, rkey="k" * 256) for r in range(256))
    for k in range(1000):
        e = st.apply(Register("a", f"i{k}", "http://a", regions=regions)).value
        assert pub(st, "a", e, [k, k + 1]).ok
    assert list(st.nodes) == ["a"] and list(st.by_idx) == [st.nodes["a"].idx] and st.nodes["a"].incarnation == "i999"
    assert st._next_idx == 1 and st._free_idx == []
    assert len(st.index) == 2 and view(st, [999, 1000]) == [("a", e, 2)]
    assert len(encode_state(st)) < len(msgspec.msgpack.encode(regions)) + 64 * 1024


def test_epochs_strictly_increase_globally_across_reuse(st):
    epochs = []
    for i in range(3):
        epochs.append(reg(st, "a", f"i{i}"))
        epochs.append(reg(st, "b", f"i{i}"))
        st.apply(Deregister("a", None))
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


def test_epoch_base_stays_an_int64_for_2_to_the_30_registrations():
    top = new_epoch_base((1 << 64) - 1, (1 << SHARD_BITS) - 1)
    assert top + (1 << 30) < 1 << 63
    assert new_epoch_base(0) == 0 and new_epoch_base(1) == 1 << (EPOCH_BASE_BITS + SHARD_BITS)
    assert new_epoch_base(1 << (63 - EPOCH_BASE_BITS - SHARD_BITS)) == 1  # past the high part's: the offset


def test_epoch_bases_use_every_random_bit_the_int64_format_leaves():
    """Issue #29 item 7a: bases had 23 random bits (the shard index took 8 of the high part's 31, and the low
    part was always 0). Every one of the EPOCH_RANDOM_BITS now changes the base, and none touches the shard
    index's bits."""
    assert EPOCH_RANDOM_BITS == 54 == 63 - EPOCH_BASE_BITS - SHARD_BITS + EPOCH_OFFSET_BITS
    shard_bits = ((1 << SHARD_BITS) - 1) << EPOCH_BASE_BITS
    bases = {new_epoch_base(1 << k, 3) for k in range(EPOCH_RANDOM_BITS)}
    assert len(bases) == EPOCH_RANDOM_BITS and new_epoch_base(0, 3) not in bases
    for b in bases:
        assert b & shard_bits == 3 << EPOCH_BASE_BITS
        assert b < 1 << 63
    assert new_epoch_base(1 << EPOCH_RANDOM_BITS, 3) == new_epoch_base(0, 3)  # more bits are ignored
    # The counter starts within the low half of its part: 2**30 registrations never reach the high part.
    assert (new_epoch_base((1 << EPOCH_RANDOM_BITS) - 1, 3) & ((1 << EPOCH_BASE_BITS) - 1)) < 1 << EPOCH_OFFSET_BITS


# -- fencing ---------------------------------------------------------------------------


def test_stale_epoch_writes_change_nothing(st):
    e1 = reg(st, "a", "i1")
    pub(st, "a", e1, [1, 2, 3], [5, 6, 7])
    e2 = reg(st, "a", "i2")
    pub(st, "a", e2, [1, 2], [8, 9])
    before = st.digest()
    seen = st.nodes["a"].seen
    load = dict(st.nodes["a"].load)
    for cmd in (
        Publish("a", e1, H(3, 4), S(0, 0)),
        Remove("a", e1, H(1, 2)),
        Clear("a", e1),
        Heartbeat("a", e1, {"gpu": 0.9}),
        Publish("a", e2 + 1, H(3), S(0)),  # a future epoch is not current either
        Heartbeat("a", e1 - 1),
    ):
        r = st.apply(cmd)
        assert r.status == STALE_EPOCH, cmd
        assert r.value == e2
        assert not r.ok and r.detail
    assert st.digest() == before
    assert view(st, [1, 2, 3], True) == [("a", e2, 2, [8, 9])]
    assert st.nodes["a"].seen == seen  # a stale write does not count as being heard from
    assert st.nodes["a"].load == load


def test_unknown_node(st):
    e = reg(st, "a")
    for cmd in (
        Publish("zz", e, H(1), S(0)),
        Remove("zz", e, H(1)),
        Clear("zz", e),
        Heartbeat("zz", e),
        Deregister("zz", None),
    ):
        r = st.apply(cmd)
        assert r.status == UNKNOWN_NODE and r.detail, cmd
    assert len(st.index) == 0 and set(st.nodes) == {"a"}


def test_writes_after_deregister_are_unknown(st):
    e = reg(st, "a")
    pub(st, "a", e, [1])
    assert st.apply(Deregister("a", None)).ok
    assert st.apply(Publish("a", e, H(2), S(0))).status == UNKNOWN_NODE
    assert st.apply(Heartbeat("a", e)).status == UNKNOWN_NODE
    assert len(st.index) == 0


# -- Publish / Remove / Clear ------------------------------------------------------------


def test_publish_and_lookup(st):
    ea = reg(st, "a")
    eb = reg(st, "b")
    r = pub(st, "a", ea, [10, 11, 12], [0, 1, 2])
    assert r.ok and r.value == 3
    assert pub(st, "b", eb, [10, 12], [4, 5]).value == 2
    assert pub(st, "a", ea, [10, 13], [7, 3]).value == 1  # 10 re-published: slot update
    assert view(st, [10, 11, 12, 13], True) == [("a", ea, 4, [7, 1, 2, 3]), ("b", eb, 1, [4])]
    assert view(st, [10, 11]) == [("a", ea, 2), ("b", eb, 1)]
    got = st.lookup(H(10))
    assert all(isinstance(h, Holder) and h.slots is None for h in got)
    assert st.blocks_held(st.nodes["a"]) == 4 and st.blocks_held(st.nodes["b"]) == 2
    assert len(st.index) == 6
    assert view(st, [99, 10]) == []


def test_publish_is_idempotent(st):
    e = reg(st, "a")
    cmd = Publish("a", e, H(1, 2, 3), S(0, 1, 2))
    assert st.apply(cmd).value == 3
    d = st.digest()
    assert st.apply(cmd).value == 0
    assert st.digest() == d and len(st.index) == 3


def test_publish_empty(st):
    e = reg(st, "a")
    r = st.apply(Publish("a", e, H(), S()))
    assert r.ok and r.value == 0
    assert len(st.index) == 0


def test_publish_medium_accepted(st):
    e = reg(st, "a")
    assert pub(st, "a", e, [1], medium="cpu").ok


def test_remove(st):
    ea = reg(st, "a")
    eb = reg(st, "b")
    pub(st, "a", ea, [1, 2, 3])
    pub(st, "b", eb, [1, 2, 3])
    r = st.apply(Remove("a", ea, H(2, 42)))
    assert r.ok and r.value == 1
    assert view(st, [1, 2, 3]) == [("b", eb, 3), ("a", ea, 1)]
    d = st.digest()
    assert st.apply(Remove("a", ea, H(2))).value == 0  # idempotent
    assert st.digest() == d
    assert st.blocks_held(st.nodes["a"]) == 2 and len(st.index) == 5


def test_clear(st):
    ea = reg(st, "a")
    eb = reg(st, "b")
    pub(st, "a", ea, [1, 2, 3])
    pub(st, "b", eb, [1])
    r = st.apply(Clear("a", ea))
    assert r.ok and r.value == 3
    assert view(st, [1, 2, 3]) == [("b", eb, 1)]
    assert st.nodes["a"].epoch == ea  # still registered, same epoch
    assert pub(st, "a", ea, [1]).ok
    assert st.apply(Clear("a", ea)).value == 1
    assert st.apply(Clear("a", ea)).value == 0
    assert len(st.index) == 1


def test_slot_beyond_capacity_is_invalid(st):
    e = reg(st, "a", capacity_blocks=4)
    pub(st, "a", e, [1], [0])
    d = st.digest()
    r = pub(st, "a", e, [2, 3], [3, 4])
    assert r.status == INVALID and not r.ok and r.detail
    assert st.digest() == d  # nothing of the batch applied
    assert view(st, [1, 2]) == [("a", e, 1)]
    r = pub(st, "a", e, [2, 3], [0, 3])  # slot capacity-1 is fine
    assert r.ok and r.value == 2
    # without a capacity, any slot below 2^30 goes (the top bits name the medium: kvproto.media)
    e2 = reg(st, "b")
    assert pub(st, "b", e2, [1], [2**30 - 1]).ok
    r = pub(st, "b", e2, [2], [2**30])
    assert r.status == INVALID and "2^30" in r.detail


def test_node_limit():
    st = DirectoryState(max_nodes=2)
    ea = reg(st, "a")
    reg(st, "b")
    r = st.apply(Register("c", "i1", "http://c"))
    assert r.status == NODE_LIMIT and r.detail
    assert "c" not in st.nodes and len(st.nodes) == 2
    # a known node may still re-register (same or new incarnation) at the limit
    assert st.apply(Register("a", "i1", "http://a")).value == ea
    assert st.apply(Register("a", "i2", "http://a")).ok
    # a freed place can be taken
    assert st.apply(Deregister("b", None)).ok
    assert st.apply(Register("c", "i1", "http://c")).ok
    assert st.apply(Register("d", "i1", "http://d")).status == NODE_LIMIT


def test_node_limit_does_not_consume_epoch():
    st = DirectoryState(max_nodes=1)
    e = reg(st, "a")
    assert st.apply(Register("b", "i", "http://b")).status == NODE_LIMIT
    st.apply(Deregister("a", None))
    assert reg(st, "b") == e + 1


def test_index_full():
    st = DirectoryState(max_entries=5, merge_threshold=2)
    ea = reg(st, "a")
    eb = reg(st, "b")
    assert pub(st, "a", ea, [1, 2, 3]).ok
    d = st.digest()
    r = pub(st, "b", eb, [1, 2, 3])
    assert r.status == INDEX_FULL and r.detail
    assert st.digest() == d and len(st.index) == 3
    assert view(st, [1]) == [("a", ea, 1)]
    assert pub(st, "b", eb, [1, 2]).ok  # exactly at the limit
    assert len(st.index) == 5
    assert pub(st, "b", eb, [9]).status == INDEX_FULL
    # A full index still takes a retried publish or a slot update: they add no entry.
    assert pub(st, "b", eb, [1, 2]).ok and pub(st, "a", ea, [1, 2, 3]).ok
    assert pub(st, "b", eb, [1, 9]).status == INDEX_FULL
    # room comes back after a removal
    st.apply(Remove("a", ea, H(3)))
    assert pub(st, "b", eb, [9]).ok
    assert len(st.index) == 5


# -- Heartbeat / Expire ---------------------------------------------------------------------


def test_heartbeat(st):
    e = reg(st, "a")
    r = st.apply(Heartbeat("a", e, {"gpu": 0.5}))
    assert r.ok and r.value == e
    assert st.nodes["a"].load == {"gpu": 0.5}
    assert st.apply(Heartbeat("a", e)).ok
    assert st.nodes["a"].load == {"gpu": 0.5}  # no load given: unchanged


def test_expire_drops_node_when_epoch_and_seen_match(st):
    ea = reg(st, "a")
    eb = reg(st, "b")
    pub(st, "a", ea, [1, 2])
    pub(st, "b", eb, [1])
    seen = st.nodes["a"].seen
    r = st.apply(Expire("a", ea, seen))
    assert r.ok and r.value is True
    assert "a" not in st.nodes
    assert view(st, [1, 2]) == [("b", eb, 1)]
    assert len(st.index) == 1
    assert st.apply(Heartbeat("a", ea)).status == UNKNOWN_NODE
    # expiring again is harmless
    r = st.apply(Expire("a", ea, seen))
    assert r.ok and r.value is False


def test_expire_voided_by_heartbeat(st):
    e = reg(st, "a")
    pub(st, "a", e, [1, 2])
    seen = st.nodes["a"].seen  # what the leader saw when it decided to expire
    assert st.apply(Heartbeat("a", e)).ok  # the node is heard from before Expire commits
    r = st.apply(Expire("a", e, seen))
    assert r.ok and r.value is False
    assert "a" in st.nodes and view(st, [1, 2]) == [("a", e, 2)]
    # an Expire with the current count works
    assert st.apply(Expire("a", e, st.nodes["a"].seen)).value is True
    assert "a" not in st.nodes and len(st.index) == 0


@pytest.mark.parametrize(
    "between",
    [
        lambda e: Publish("a", e, H(5), S(0)),
        lambda e: Remove("a", e, H(5)),
        lambda e: Clear("a", e),
        lambda e: Register("a", "i1", "http://a"),  # same incarnation re-register
    ],
)
def test_expire_voided_by_any_accepted_command(st, between):
    e = reg(st, "a", "i1")
    pub(st, "a", e, [1])
    seen = st.nodes["a"].seen
    assert st.apply(between(e)).ok
    assert st.apply(Expire("a", e, seen)).value is False
    assert "a" in st.nodes


def test_expire_wrong_epoch_is_void(st):
    e1 = reg(st, "a", "i1")
    e2 = reg(st, "a", "i2")
    pub(st, "a", e2, [1])
    seen = st.nodes["a"].seen
    r = st.apply(Expire("a", e1, seen))  # seen matches, the epoch does not
    assert r.ok and r.value is False
    assert view(st, [1]) == [("a", e2, 1)]
    assert st.apply(Expire("zz", 1, 0)).value is False  # unknown node


def test_stale_write_does_not_void_expire(st):
    e1 = reg(st, "a", "i1")
    e2 = reg(st, "a", "i2")
    seen = st.nodes["a"].seen
    assert st.apply(Heartbeat("a", e1)).status == STALE_EPOCH
    assert st.apply(Expire("a", e2, seen)).value is True


# -- Deregister and index reuse -----------------------------------------------------


def test_deregister(st):
    ea = reg(st, "a")
    eb = reg(st, "b")
    pub(st, "a", ea, [1, 2, 3])
    pub(st, "b", eb, [1, 2])
    r = st.apply(Deregister("a", None))
    assert r.ok and r.value == 3
    assert "a" not in st.nodes
    assert view(st, [1, 2, 3]) == [("b", eb, 2)]
    assert st.apply(Deregister("a", None)).status == UNKNOWN_NODE


def test_deregister_names_the_epoch_it_ends(st):
    e1 = reg(st, "a", "inc-1")
    pub(st, "a", e1, [1, 2, 3])
    r = st.apply(Deregister("a", e1))
    assert r.ok and r.value == 3 and "a" not in st.nodes


def test_a_delayed_deregister_of_an_old_epoch_spares_the_new_registration(st):
    """Issue #29 item 6: register e1, its deregistration is delayed (a retry, a watchdog's resend), the node
    registers again (e2) and publishes; when the old deregistration finally applies it is refused, and e2's
    registration and acknowledged entries remain."""
    e1 = reg(st, "a", "inc-1")
    pub(st, "a", e1, [1, 2])
    late = Deregister("a", e1)  # sent now, committed only after what follows
    e2 = reg(st, "a", "inc-2")
    assert e2 > e1
    assert pub(st, "a", e2, [1, 2, 3], [5, 6, 7]).ok
    before = st.digest()
    r = st.apply(late)
    assert r.status == STALE_EPOCH and r.value == e2
    assert st.nodes["a"].epoch == e2
    assert view(st, [1, 2, 3], with_slots=True) == [("a", e2, 3, [5, 6, 7])]
    assert st.digest() == before
    assert st.apply(late).status == STALE_EPOCH  # and again, if resent once more: idempotent
    assert st.apply(Deregister("a", e2)).ok  # e2's own deregistration still works
    assert "a" not in st.nodes


def test_deregistered_index_reused_without_leaking(st):
    ea = reg(st, "a")
    eb = reg(st, "b")
    pub(st, "a", ea, [1, 2, 3], [7, 8, 9])
    pub(st, "b", eb, [1], [0])
    idx_a = st.nodes["a"].idx
    st.apply(Deregister("a", None))
    ec = reg(st, "c")
    assert st.nodes["c"].idx == idx_a  # the freed index is reused
    assert ec > eb
    assert view(st, [1, 2, 3]) == [("b", eb, 1)]
    assert st.blocks_held(st.nodes["c"]) == 0
    assert len(st.index) == 1
    pub(st, "c", ec, [1, 2], [4, 5])
    assert view(st, [1, 2, 3], True) == [("c", ec, 2, [4, 5]), ("b", eb, 1, [0])]
    # coming back, "a" gets a fresh index and epoch and nothing of its old entries
    ea2 = reg(st, "a")
    assert ea2 > ec and st.nodes["a"].idx not in (st.nodes["b"].idx, st.nodes["c"].idx)
    assert view(st, [1, 2, 3]) == [("c", ec, 2), ("b", eb, 1)]


def test_expired_index_reused_without_leaking(st):
    ea = reg(st, "a")
    pub(st, "a", ea, [1, 2])
    st.apply(Expire("a", ea, st.nodes["a"].seen))
    eb = reg(st, "b")
    assert view(st, [1, 2]) == []
    pub(st, "b", eb, [1])
    assert view(st, [1, 2]) == [("b", eb, 1)]


# -- other commands ------------------------------------------------------------------


def test_announce_replica(st):
    d = st.digest()
    r = st.apply(AnnounceReplica("10.0.0.1:7000", "http://10.0.0.1:8000"))
    assert r.ok
    assert st.replicas == {"10.0.0.1:7000": "http://10.0.0.1:8000"}
    st.apply(AnnounceReplica("10.0.0.1:7000", "http://10.0.0.1:9000"))
    st.apply(AnnounceReplica("10.0.0.2:7000", "http://10.0.0.2:8000"))
    assert st.replicas == {"10.0.0.1:7000": "http://10.0.0.1:9000", "10.0.0.2:7000": "http://10.0.0.2:8000"}
    assert st.digest() == d


def test_noop(st):
    reg(st, "a")
    d = st.digest()
    applied = st.applied
    r = st.apply(Noop())
    assert r.ok and r.status == OK
    assert st.digest() == d and st.applied == applied + 1


def test_unknown_command_type_is_invalid(st):
    @dataclass(frozen=True)
    class Bogus:
        node_id: str

    reg(st, "a")
    d = st.digest()
    for cmd in (Bogus("a"), "register", None, {"node_id": "a"}):
        r = st.apply(cmd)
        assert r.status == INVALID and not r.ok and r.detail
    assert st.digest() == d


def test_applied_counts_every_command(st):
    e = reg(st, "a")
    st.apply(Heartbeat("a", e + 5))  # rejected, still applied
    st.apply(Noop())
    st.apply("garbage")
    assert st.applied == 4


# -- digest and snapshots --------------------------------------------------------------


def test_digest_tracks_nodes_and_entries():
    s1, s2 = DirectoryState(), DirectoryState(merge_threshold=1)
    for s in (s1, s2):
        reg(s, "a")
        reg(s, "b")
    assert s1.digest() == s2.digest()
    pub(s1, "a", 1, [1, 2])
    assert s1.digest() != s2.digest()
    pub(s2, "a", 1, [1, 2])
    assert s1.digest() == s2.digest()
    s1.apply(Register("b", "i2", "http://b"))  # new epoch, no entries: digest differs
    assert s1.digest() != s2.digest()


def test_digest_independent_of_index_assignment():
    s1, s2 = DirectoryState(), DirectoryState(merge_threshold=1)
    # s1: a gets idx 0, b idx 1; s2: b gets idx 0 (via a placeholder), a idx 1
    reg(s1, "x")
    reg(s1, "a")
    reg(s1, "b")
    reg(s2, "x")
    reg(s2, "b")
    reg(s2, "a")
    # align epochs: re-register to give both the same epochs in the same order
    for s in (s1, s2):
        s.apply(Register("a", "i2", "http://a"))
        s.apply(Register("b", "i2", "http://b"))
        pub(s, "a", s.nodes["a"].epoch, [1, 2], [3, 4])
        pub(s, "b", s.nodes["b"].epoch, [1], [5])
    assert s1.nodes["a"].idx != s2.nodes["a"].idx
    assert s1.digest() == s2.digest()


def test_raft_snapshot_roundtrip_state(st):
    ea = reg(st, "a", capacity_blocks=100)
    eb = reg(st, "b")
    pub(st, "a", ea, [1, 2, 3], [1, 2, 3])
    pub(st, "b", eb, [1, 2], [9, 9])
    st.apply(Remove("a", ea, H(3)))
    st.apply(AnnounceReplica("r1", "http://r1"))
    clone = decode_state(encode_state(st))
    assert clone.digest() == st.digest()
    assert clone.replicas == st.replicas and clone.epoch_counter == st.epoch_counter
    assert view(clone, [1, 2, 3], True) == view(st, [1, 2, 3], True)
    for s in (st, clone):
        s.apply(Deregister("a", None))
        reg(s, "c")
        pub(s, "c", s.nodes["c"].epoch, [1], [0])
        assert pub(s, "b", eb, [3], [1]).ok
    assert clone.digest() == st.digest()
    assert clone.nodes["c"].idx == st.nodes["c"].idx
