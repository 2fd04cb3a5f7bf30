"""The worker stub's paged KV pool: memory layout, content function, leases, LRU, events.

The property test drives random acquire/commit/release/pin/unpin/drain sequences
over a tiny universe (8 hashes, 4 slots) against a list-based reference model,
so that evictions, PoolFull, duplicate hashes and racing leases happen often.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvproto import media
from kvproto.hashing import block_hashes
from worker_stub.pool import KVPool, Lease, PoolFull
from worker_stub.slot_memory import Region

M64 = 2**64 - 1


def splitmix_ref(hash_: int, rank: int, n: int) -> bytes:
    """The content function written out in plain integers, independent of numpy."""
    seed = xxhash.xxh3_64_intdigest(struct.pack("<QQ", hash_, rank))
    out = bytearray()
    for i in range(1, -(-n // 8) + 1):
        z = (seed + i * 0x9E3779B97F4A7C15) & M64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        out += (z ^ (z >> 31)).to_bytes(8, "little")
    return bytes(out[:n])


def stored_in(pool: KVPool, hashes) -> Lease:
    """Acquire, fill, commit and release: the blocks end up cached and unpinned."""
    lease = pool.acquire(hashes)
    for h, s in lease.new_slots:
        pool.fill(h, s)
    pool.commit(lease, [h for h, _ in lease.new_slots])
    pool.release(lease)
    return lease


# -- memory layout and content ---------------------------------------------------------


def test_regions_describe_each_ranks_buffer():
    pool = KVPool(capacity_blocks=5, block_bytes=256, tp=3)
    assert [r.rank for r in pool.regions] == [0, 1, 2]
    for r, region in enumerate(pool.regions):
        buf = pool.buffer(r)
        assert isinstance(region, Region)
        assert buf.dtype == np.uint8 and buf.nbytes == region.length == 5 * 256
        assert region.base_addr == buf.ctypes.data and region.block_bytes == 256
        assert pool.slot_addr(r, 0) == region.base_addr
        assert pool.slot_addr(r, 4) == region.base_addr + 4 * 256
        assert pool.slot_view(r, 3).ctypes.data == pool.slot_addr(r, 3)
    assert len({r.base_addr for r in pool.regions}) == 3  # separate memory per rank
    with pytest.raises(IndexError):
        pool.slot_addr(3, 0)
    with pytest.raises(IndexError):
        pool.slot_addr(0, 5)
    with pytest.raises(ValueError):
        KVPool(0)
    with pytest.raises(ValueError):
        KVPool(4, tp=0)


def test_content_function_is_pinned_and_independent_of_numpy():
    pool = KVPool(2)
    assert pool.expected(1, 0)[:8].tobytes().hex() == "30806ccfaa5f5363"
    assert pool.expected(M64, 3)[:8].tobytes().hex() == "97e4bbf1187e1eb3"
    for h, r in [(0, 0), (12466389667045779788, 1), (M64, 7)]:
        assert pool.expected(h, r).tobytes() == splitmix_ref(h, r, 16384)
    odd = KVPool(2, block_bytes=13)  # not a multiple of 8
    assert odd.expected(5, 2).tobytes() == splitmix_ref(5, 2, 13)
    # another node (another pool) computes the same bytes
    assert np.array_equal(KVPool(9, tp=2).expected(42, 1), pool.expected(42, 1))


def test_fill_verify_round_trip_on_several_ranks_and_a_corrupt_byte_fails():
    pool = KVPool(capacity_blocks=4, block_bytes=4096, tp=4)
    hashes = block_hashes(list(range(1, 65)))  # 4 real chained hashes
    lease = pool.acquire(hashes)
    assert not any(pool.verify(h, s) for h, s in lease.new_slots)  # zeros are not content
    for h, s in lease.new_slots:
        pool.fill(h, s)
    assert all(pool.verify(h, s) for h, s in zip(hashes, lease.slots))
    assert not pool.verify(hashes[0], lease.slots[1])  # right bytes, wrong block
    pool.slot_view(3, lease.slots[2])[4095] ^= 1  # one bit, last byte, last rank
    assert not pool.verify(hashes[2], lease.slots[2])
    assert pool.verify(hashes[3], lease.slots[3])  # neighbours untouched
    pool.fill(hashes[2], lease.slots[2])
    assert pool.verify(hashes[2], lease.slots[2])


def test_mirrored_slots_hold_one_block_with_per_rank_content():
    tp, bb = 3, 512
    pool = KVPool(capacity_blocks=6, block_bytes=bb, tp=tp)
    lease = stored_in(pool, [11, 22, 33])
    for h, s in zip([11, 22, 33], lease.slots):
        assert pool.slot_of(h) == s and pool.hash_at(s) == h
        per_rank = [pool.buffer(r)[s * bb : (s + 1) * bb] for r in range(tp)]
        for r in range(tp):
            assert np.array_equal(per_rank[r], pool.expected(h, r))  # same slot index on every rank
        assert len({p.tobytes() for p in per_rank}) == tp  # but each rank's bytes differ
    # the address arithmetic of docs/protocol.md §2 points at those bytes
    s = lease.slots[1]
    for r in range(tp):
        off = pool.slot_addr(r, s) - pool.regions[r].base_addr
        assert np.array_equal(pool.buffer(r)[off : off + bb], pool.expected(22, r))


# -- prefix lookup and lease accounting ------------------------------------------------


def test_lookup_prefix_counts_leading_cached_hashes():
    pool = KVPool(16)
    toks = list(range(1, 81))
    hs = block_hashes(toks)  # 5 blocks
    assert pool.lookup_prefix(hs) == 0 and pool.lookup_prefix([]) == 0
    stored_in(pool, hs[:3])
    assert pool.lookup_prefix(hs) == 3
    assert pool.lookup_prefix(hs[:2]) == 2
    assert pool.lookup_prefix(block_hashes(toks[:48] + [999] * 32)) == 3  # diverges after 3 blocks
    assert pool.lookup_prefix(block_hashes(toks, namespace="other")) == 0
    assert pool.lookup_prefix([12345] + hs) == 0  # nothing after a miss counts


def test_lease_accounting_hits_misses_and_commit_of_a_subset():
    pool = KVPool(8, block_bytes=64)
    stored_in(pool, [1, 2])
    pool.drain_events()
    lease = pool.acquire([1, 2, 3, 4, 5])
    assert lease.cached == 2
    assert lease.slots[:2] == [pool.slot_of(1), pool.slot_of(2)]
    assert [h for h, _ in lease.new_slots] == [3, 4, 5]
    assert [s for _, s in lease.new_slots] == lease.slots[2:]
    assert len(set(lease.slots)) == 5
    assert pool.used_slots == 5 and pool.free_slots == 3
    assert all(pool.refcount(s) == 1 for s in lease.slots)
    assert 3 not in pool and pool.hash_at(lease.slots[2]) == 3  # reserved, not yet cached
    assert pool.lookup_prefix([1, 2, 3]) == 2

    pool.fill(3, lease.slots[2])
    pool.fill(4, lease.slots[3])
    pool.commit(lease, [3, 4])  # 5 was never filled (say its pull failed): freed now
    assert 3 in pool and 4 in pool and 5 not in pool
    assert pool.used_slots == 4 and pool.hash_at(lease.slots[4]) is None
    assert pool.drain_events() == ([(3, lease.slots[2]), (4, lease.slots[3])], [])
    pool.release(lease)
    assert pool.used_slots == 4 and all(pool.refcount(pool.slot_of(h)) == 0 for h in [1, 2, 3, 4])
    assert pool.lookup_prefix([1, 2, 3, 4, 5]) == 4
    st_ = pool.stats
    assert (st_["hits"], st_["misses"], st_["stored"], st_["dropped"], st_["evictions"]) == (2, 5, 4, 1, 0)


def test_release_without_commit_frees_reserved_slots_and_publishes_nothing():
    pool = KVPool(4)
    lease = pool.acquire([1, 2, 3])
    pool.release(lease)
    assert pool.free_slots == 4 and pool.cached_blocks == 0
    assert pool.drain_events() == ([], [])
    with pytest.raises(ValueError):
        pool.release(lease)
    with pytest.raises(ValueError):
        pool.commit(lease, [])


def test_commit_rejects_hashes_that_are_not_new_in_this_lease():
    pool = KVPool(4)
    stored_in(pool, [1])
    lease = pool.acquire([1, 2])
    with pytest.raises(ValueError):
        pool.commit(lease, [1, 2])  # 1 was cached, not allocated
    with pytest.raises(ValueError):
        KVPool(4).commit(lease, [])  # another pool's lease
    assert 2 not in pool  # the failed commit changed nothing
    pool.fill(2, lease.slots[1])
    pool.commit(lease, [2])
    assert 2 in pool


def test_a_partial_commit_caches_its_blocks_and_leaves_the_rest_to_the_final_one():
    """What a pull's blocks go through: cached as soon as they land, while the lease still computes the rest."""
    pool = KVPool(8, block_bytes=64)
    lease = pool.acquire([1, 2, 3, 4])
    for h, s in lease.new_slots[:2]:
        pool.fill(h, s)
    pool.commit(lease, [1, 2], final=False)
    assert pool.lookup_prefix([1, 2, 3, 4]) == 2  # another request finds them now
    assert pool.drain_events() == ([(1, lease.slots[0]), (2, lease.slots[1])], [])
    assert all(pool.refcount(s) == 1 for s in lease.slots)  # all still the lease's
    with pytest.raises(ValueError):
        pool.commit(lease, [2])  # committed already
    pool.fill(3, lease.slots[2])
    pool.commit(lease, [3])  # 4 was never filled: freed now
    assert pool.lookup_prefix([1, 2, 3, 4]) == 3 and pool.hash_at(lease.slots[3]) is None
    pool.release(lease)
    assert pool.used_slots == 3 and pool.stats["stored"] == 3 and pool.stats["dropped"] == 1


def test_zero_length_duplicates_and_late_hits():
    pool = KVPool(4)
    empty = pool.acquire([])
    assert (empty.slots, empty.cached, empty.new_slots) == ([], 0, [])
    pool.commit(empty, [])
    pool.release(empty)
    assert pool.free_slots == 4

    lease = pool.acquire([7, 8, 7, 7])  # duplicates share one slot and one refcount
    assert lease.slots[0] == lease.slots[2] == lease.slots[3] != lease.slots[1]
    assert [h for h, _ in lease.new_slots] == [7, 8]
    assert pool.used_slots == 2 and pool.refcount(lease.slots[0]) == 1
    for h, s in lease.new_slots:
        pool.fill(h, s)
    pool.commit(lease, [7, 8])
    pool.release(lease)
    assert pool.refcount(pool.slot_of(7)) == 0

    again = pool.acquire([7, 7, 8])
    assert again.cached == 3 and again.new_slots == []
    pool.release(again)

    # a cached block after a miss is reused (its bytes are valid), not duplicated
    late = pool.acquire([9, 8])
    assert late.cached == 0 and late.new_slots == [(9, late.slots[0])]
    assert late.slots[1] == pool.slot_of(8) and pool.refcount(late.slots[1]) == 1
    assert pool.stats["late_hits"] == 1
    pool.release(late)


def test_more_blocks_than_capacity_raise_pool_full_and_change_nothing():
    pool = KVPool(3)
    stored_in(pool, [1])
    pool.drain_events()
    before = (pool.blocks(), pool.evictable(), pool.free_slots)
    with pytest.raises(PoolFull) as err:
        pool.acquire([10, 11, 12, 13])
    assert err.value.needed == 4 and err.value.available == 3
    assert (pool.blocks(), pool.evictable(), pool.free_slots) == before
    assert pool.drain_events() == ([], [])
    assert pool.stats["pool_full"] == 1
    # its own cached blocks cannot make room for a request: 1 is pinned first
    with pytest.raises(PoolFull):
        pool.acquire([1, 20, 21, 22])
    lease = pool.acquire([1, 20, 21])  # exactly fits
    assert lease.cached == 1 and pool.used_slots == 3
    pool.release(lease)


def test_racing_leases_for_one_hash_keep_one_slot_in_the_index():
    pool = KVPool(4)
    a = pool.acquire([5])
    b = pool.acquire([5])  # 5 is reserved by a, not cached: b gets its own slot
    assert a.slots != b.slots and pool.used_slots == 2
    pool.fill(5, a.slots[0])
    pool.fill(5, b.slots[0])
    pool.commit(b, [5])
    pool.commit(a, [5])  # lost the race: its copy stays a's until release
    assert pool.slot_of(5) == b.slots[0]
    assert pool.drain_events() == ([(5, b.slots[0])], [])
    assert pool.verify(5, a.slots[0])  # a may still read its copy
    pool.release(a)
    assert pool.used_slots == 1 and pool.hash_at(a.slots[0]) is None
    pool.release(b)
    assert pool.evictable() == [5]


# -- LRU and refcounts -----------------------------------------------------------------


def test_lru_evicts_least_recently_released_first():
    pool = KVPool(3)
    for h in [1, 2, 3]:
        stored_in(pool, [h])
    assert pool.evictable() == [1, 2, 3]
    stored_in(pool, [1])  # a hit makes 1 the most recent
    assert pool.evictable() == [2, 3, 1]
    lookups = pool.lookup_prefix([2])  # a lookup is not a use
    assert lookups == 1 and pool.evictable() == [2, 3, 1]
    pool.drain_events()
    lease = pool.acquire([4])
    assert 2 not in pool and lease.slots == [1]  # 2 lived in slot 1; its slot is reused
    assert pool.evictable() == [3, 1]
    assert pool.stats["evictions"] == 1


def test_eviction_takes_a_block_a_peer_has_read_ahead_of_colder_ones():
    pool = KVPool(3, copy_scan=2)
    for h in [1, 2, 3]:
        stored_in(pool, [h])
    s2 = pool.slot_of(2)
    pool.pin([s2])  # a peer reads block 2: it now has a copy
    pool.unpin([s2])
    assert pool.copied(2) and not pool.copied(1)
    assert pool.evictable() == [1, 3, 2]  # the read made 2 the most recent ...
    stored_in(pool, [4])
    assert 1 not in pool and 2 in pool  # ... and outside the 2 coldest, so 1 goes
    s3 = pool.slot_of(3)
    pool.pin([s3])
    pool.unpin([s3])
    assert pool.evictable() == [2, 4, 3]
    stored_in(pool, [5])
    assert 2 not in pool and 4 in pool  # 2 is among the 2 coldest and has a copy: it goes before 4
    assert pool.stats["copy_evictions"] == 1 and not pool.copied(2)
    plain = KVPool(2, copy_scan=0)  # the hint off: plain LRU
    stored_in(plain, [1])
    stored_in(plain, [2])
    s1 = plain.slot_of(1)
    plain.pin([s1])
    plain.unpin([s1])
    stored_in(plain, [3])
    assert 2 not in plain and 1 in plain
    with pytest.raises(ValueError):
        KVPool(2, copy_scan=-1)


def test_release_queues_a_prefix_tail_first():
    pool = KVPool(4)
    stored_in(pool, [1, 2, 3, 4])
    assert pool.evictable() == [4, 3, 2, 1]  # eviction trims the prefix from its end
    pool.drain_events()
    stored_in(pool, [10, 11])
    assert pool.lookup_prefix([1, 2, 3, 4]) == 2  # the head survives
    assert pool.drain_events()[1] == [4, 3]


def test_blocks_in_use_by_a_request_are_never_evicted():
    pool = KVPool(4)
    running = pool.acquire([1, 2])
    for h, s in running.new_slots:
        pool.fill(h, s)
    pool.commit(running, [1, 2])
    stored_in(pool, [3, 4])
    stored_in(pool, [5, 6])  # evicts 4 and 3, never the running request's 1 and 2
    assert {1, 2, 5, 6} == {h for h, _ in pool.blocks()}
    with pytest.raises(PoolFull):
        pool.acquire([7, 8, 9])
    assert all(pool.verify(h, pool.slot_of(h)) for h in [1, 2])
    pool.release(running)
    assert pool.evictable() == [6, 5, 2, 1]


def test_pinned_blocks_are_never_evicted_and_unpin_is_checked():
    pool = KVPool(2)
    stored_in(pool, [1, 2])
    s1 = pool.slot_of(1)
    pool.pin([s1, s1])  # two outgoing transfers read block 1
    assert pool.refcount(s1) == 2 and pool.evictable() == [2]
    lease = pool.acquire([3])  # can only evict 2
    assert 2 not in pool and 1 in pool
    with pytest.raises(PoolFull):
        pool.acquire([4])
    pool.unpin([s1])
    with pytest.raises(PoolFull):
        pool.acquire([4])  # still pinned once
    pool.unpin([s1])
    assert pool.evictable() == [1]
    with pytest.raises(ValueError):
        pool.unpin([s1])  # not pinned any more
    with pytest.raises(ValueError):
        pool.unpin([lease.slots[0]])  # held by a lease, which is not a pin
    with pytest.raises(ValueError):
        pool.pin([lease.slots[0]])  # reserved, no valid content to serve
    with pytest.raises(ValueError):
        pool.pin([s1, lease.slots[0]])  # all or nothing
    assert pool.refcount(s1) == 0
    pool.release(lease)


def test_eviction_emits_removals_and_a_later_store_emits_its_new_slot():
    pool = KVPool(2)
    stored_in(pool, [1])
    stored_in(pool, [2])
    assert pool.drain_events() == ([(1, 0), (2, 1)], [])
    stored_in(pool, [3])  # evicts 1 from slot 0
    assert pool.drain_events() == ([(3, 0)], [1])
    stored_in(pool, [1])  # evicts 2 from slot 1: 1 comes back in slot 1
    assert pool.drain_events() == ([(1, 1)], [2])
    assert pool.drain_events() == ([], [])


def test_drained_events_are_coalesced_per_hash():
    pool = KVPool(1)
    stored_in(pool, [1])
    assert pool.drain_events() == ([(1, 0)], [])
    stored_in(pool, [2])  # evicts 1
    stored_in(pool, [1])  # evicts 2: 1 is back in the slot it was published at
    assert pool.drain_events() == ([], [])  # nothing changed for the directory
    stored_in(pool, [3])
    stored_in(pool, [4])  # 3 came and went between drains: never published
    assert pool.drain_events() == ([(4, 0)], [1])


# -- property: random operations against a reference model -----------------------------

HASHES = list(range(10))
CAPACITY = 6


class MLease:
    def __init__(self, lease: Lease, order: list[int], pending: list[int]) -> None:
        self.lease = lease
        self.order = order  # distinct hashes held, request order
        self.pending = pending  # new, uncommitted
        self.reserved: set[int] = set(pending)  # hashes whose slot is the lease's own
        self.committed = False


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = KVPool(CAPACITY, block_bytes=24, tp=2, copy_scan=2)
        self.ref: dict[int, int] = {}  # cached hash -> holds
        self.copied: set[int] = set()  # cached hashes a peer has read (unpinned after a pin)
        self.lru: list[int] = []  # cached, no holds, LRU first
        self.reserved = 0  # slots reserved by leases, not in the index
        self.leases: list[MLease] = []
        self.pins: list[int] = []  # slots pinned
        self.published: dict[int, int] = {}  # what the directory would hold

    def _free(self) -> int:
        return CAPACITY - len(self.ref) - self.reserved

    def _hold(self, h: int) -> None:
        if self.ref[h] == 0:
            self.lru.remove(h)
        self.ref[h] += 1

    def _drop(self, h: int) -> None:
        self.ref[h] -= 1
        if self.ref[h] == 0:
            self.lru.append(h)

    def _acquire(self, hashes) -> MLease | None:
        distinct = list(dict.fromkeys(hashes))
        missing = [h for h in distinct if h not in self.ref]
        available = self._free() + len(self.lru) - sum(h in self.lru for h in distinct)
        if len(missing) > available:
            with pytest.raises(PoolFull):
                self.pool.acquire(hashes)
            return None
        lease = self.pool.acquire(hashes)
        cached = 0
        while cached < len(hashes) and hashes[cached] in self.ref:
            cached += 1
        assert lease.cached == cached
        assert [h for h, _ in lease.new_slots] == missing
        for h in distinct:
            if h in self.ref:
                self._hold(h)
        for _ in missing:
            if self._free() == 0:
                # a block a peer has read goes first among the 2 coldest (copy_scan), else the coldest
                victim = next((h for h in self.lru[:2] if h in self.copied), self.lru[0])
                self.lru.remove(victim)
                self.copied.discard(victim)
                del self.ref[victim]
            self.reserved += 1
        m = MLease(lease, distinct, missing)
        self.leases.append(m)
        return m

    def _commit(self, m: MLease, valid: list[int]) -> None:
        slot = dict(m.lease.new_slots)
        for h in valid:
            self.pool.fill(h, slot[h])
        self.pool.commit(m.lease, valid)
        m.committed = True
        for h in m.pending:
            if h not in valid:
                self.reserved -= 1
                m.reserved.discard(h)
                m.order.remove(h)
            elif h not in self.ref:
                self.reserved -= 1
                m.reserved.discard(h)
                self.ref[h] = 1
            # else: another lease cached h first; this copy stays reserved until release
        m.pending = []

    @staticmethod
    def _valid(m: MLease, data) -> list[int]:
        """Which new blocks were filled: usually all, sometimes a subset (a failed pull)."""
        if not m.pending or data.draw(st.booleans()):
            return list(m.pending)
        return data.draw(st.lists(st.sampled_from(m.pending), unique=True))

    def _release(self, m: MLease) -> None:
        self.pool.release(m.lease)
        self.leases.remove(m)
        for h in reversed(m.order):
            if h in m.reserved:
                self.reserved -= 1
            else:
                self._drop(h)

    @precondition(lambda self: len(self.leases) < 3)
    @rule(hashes=st.lists(st.sampled_from(HASHES), max_size=4))
    def acquire(self, hashes):
        """Start a request that stays running (its blocks stay held)."""
        self._acquire(hashes)

    @precondition(lambda self: len(self.leases) < 3 and any(m.pending for m in self.leases))
    @rule(data=st.data())
    def same_prompt_again(self, data):
        """A second request for blocks another running request is still computing."""
        m = data.draw(st.sampled_from([m for m in self.leases if m.pending]))
        self._acquire(list(m.order))

    @rule(hashes=st.lists(st.sampled_from(HASHES), max_size=4), data=st.data())
    def request(self, hashes, data):
        """A whole request: acquire, fill and commit some or all new blocks, release."""
        m = self._acquire(hashes)
        if m is not None:
            self._commit(m, self._valid(m, data))
            self._release(m)

    @precondition(lambda self: any(not m.committed for m in self.leases))
    @rule(data=st.data())
    def commit(self, data):
        m = data.draw(st.sampled_from([m for m in self.leases if not m.committed]))
        self._commit(m, self._valid(m, data))

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data):
        self._release(data.draw(st.sampled_from(self.leases)))

    @precondition(lambda self: self.ref and len(self.pins) < 2)
    @rule(data=st.data())
    def pin(self, data):
        h = data.draw(st.sampled_from(sorted(self.ref)))
        s = self.pool.slot_of(h)
        self.pool.pin([s])
        self.pins.append(s)
        self._hold(h)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        s = data.draw(st.sampled_from(self.pins))
        h = self.pool.hash_at(s)
        self.pool.unpin([s])
        self.pins.remove(s)
        self.copied.add(h)
        self._drop(h)

    @rule()
    def drain(self):
        stored, removed = self.pool.drain_events()
        assert not ({h for h, _ in stored} & set(removed))
        for h in removed:
            assert h in self.published
            del self.published[h]
        for h, s in stored:
            assert self.published.get(h) != s
            self.published[h] = s
        assert self.published == dict(self.pool.blocks())

    @invariant()
    def agrees_with_model(self):
        pool = self.pool
        assert pool.used_slots == len(self.ref) + self.reserved <= CAPACITY
        assert pool.free_slots == CAPACITY - pool.used_slots
        assert pool.evictable() == self.lru
        assert {h for h in self.ref if pool.copied(h)} == self.copied
        blocks = dict(pool.blocks())
        assert set(blocks) == set(self.ref)
        assert len(set(blocks.values())) == len(blocks)  # one slot per block
        for h, s in blocks.items():
            assert pool.hash_at(s) == h
            assert pool.refcount(s) == self.ref[h]
            assert pool.verify(h, s)  # never overwritten while cached


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# -- the host tier (issue #32) ------------------------------------------------------------


def test_an_evicted_block_moves_to_the_host_tier_and_a_hit_loads_it_back() -> None:
    pool = KVPool(2, block_bytes=32, tp=2, host_blocks=2)
    stored_in(pool, [1, 2])
    pool.drain_events()
    stored_in(pool, [3, 4])  # evicts 2 then 1 (a prefix is eaten from its end) into the host tier
    assert pool.host is not None and sorted(h for h, _ in pool.host_blocks()) == [1, 2]
    assert all(pool.host.verify(h, s) for h, s in pool.host_blocks())  # the bytes came along, every rank
    stored, removed = pool.drain_events()
    assert removed == [] and {h: media.split(loc)[0] for h, loc in stored} == {1: media.HOST, 2: media.HOST, 3: 0, 4: 0}
    lease = pool.acquire([1, 2])
    assert (lease.cached, [h for h, _ in lease.loaded], lease.new_slots) == (0, [1, 2], [])
    assert all(pool.verify(h, s) for h, s in lease.loaded)  # copied back into device slots
    pool.commit(lease, [1, 2])
    pool.release(lease)
    assert pool.location(1) == pool.slot_of(1) and pool.host.stats["loads"] == 2
    # 3 and 4 went to the host tier to make room: one location per block, wherever it is now.
    assert sorted(h for h, _ in pool.host_blocks()) == [3, 4]


def test_a_block_evicted_from_the_host_tier_is_gone_from_the_node() -> None:
    pool = KVPool(1, block_bytes=16, host_blocks=1)
    for h in (1, 2, 3):
        stored_in(pool, [h])
    stored, removed = pool.drain_events()
    assert removed == [] or removed == [1]  # 1 was stored and evicted between drains, or published then removed
    assert {h for h, _ in stored} == {2, 3} and pool.location(1) is None
    assert pool.host is not None and pool.host.stats["evictions"] == 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(st.integers(1, 12), min_size=1, max_size=3), min_size=1, max_size=30))
def test_published_locations_follow_every_move_between_the_tiers(prompts: list[list[int]]) -> None:
    """Whatever the prompts, a hash is in one tier at most, its bytes check out there, and what the drained
    events built (a directory's view of this node) is exactly where each block is."""
    pool = KVPool(3, block_bytes=16, tp=2, host_blocks=2)
    assert pool.host is not None
    published: dict[int, int] = {}
    for p in prompts:
        stored_in(pool, p)
        stored, removed = pool.drain_events()
        for h in removed:
            del published[h]
        published.update(stored)
        device, host = dict(pool.blocks()), dict(pool.host_blocks())
        assert not device.keys() & host.keys()
        assert all(pool.verify(h, s) for h, s in device.items()) and all(pool.host.verify(h, s) for h, s in host.items())
        assert published == {**device, **{h: media.location(s, media.HOST) for h, s in host.items()}}
