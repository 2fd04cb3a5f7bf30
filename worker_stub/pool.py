"""The worker stub's paged KV pool: a stand-in for an engine's GPU block pool.

Its memory (one region per tensor-parallel rank, mirrored slots) and the content
function that makes blocks checkable are `worker_stub.slot_memory`'s; which block
each slot holds, and for whom, is this module's.

Lifecycle of a request's blocks::

    lease = pool.acquire(hashes)          # pin the cached ones, reserve slots for the rest
    for h, s in lease.new_slots:          # prefill, or pull from a peer and verify
        pool.fill(h, s)
    pool.commit(lease, valid=[h for h, _ in lease.new_slots])
    ...                                   # decode
    pool.release(lease)                   # unpin; the blocks stay cached, evictable (LRU)

Eviction prefers copies: a block a peer has read (`pin`/`unpin` around an
outgoing transfer) is known to have a second copy on that peer, the one place
the pool learns of other nodes' caches without asking anyone. When a slot is
needed, the coldest such block among the `copy_scan` coldest evictable ones
goes first; only the reading side marks its block, so the two copies are never
both preferred victims. The mark is a hint (the peer may have evicted its copy
since): it reorders eviction within that window and nothing else.

With a host tier (`host_blocks`, worker_stub.host_tier) an evicted block is copied there instead of dropped,
and `acquire` loads the missing blocks of a prompt that lie there back into device slots (`Lease.loaded`): a
block moves between the tiers, so its published location (kvproto.media) is always the one place it is held.

Not thread-safe: the worker drives it from one asyncio loop, and no method awaits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field

from kvproto import media
from worker_stub.change_log import ChangeLog
from worker_stub.host_tier import HostTier
from worker_stub.slot_memory import SlotMemory

__all__ = ["DEFAULT_BLOCK_BYTES", "DEFAULT_COPY_SCAN", "KVPool", "Lease", "PoolFull"]


DEFAULT_BLOCK_BYTES = 16384
DEFAULT_COPY_SCAN = 64  # eviction looks this far from the cold end for a block a peer has read


class PoolFull(RuntimeError):
    """Not enough free or evictable (unpinned) slots for the blocks a request is missing."""

    def __init__(self, needed: int, available: int, capacity: int) -> None:
        super().__init__(f"need {needed} slots, {available} free or evictable (capacity {capacity})")
        self.needed = needed
        self.available = available
        self.capacity = capacity


@dataclass(eq=False)
class Lease:
    """A request's hold on its blocks, from `acquire` until `release`.

    `slots[i]` is the slot of `hashes[i]` (a hash repeated in one request maps to
    one slot). `cached` counts the leading hashes whose content was already valid:
    the prefix hit. `loaded` are the (hash, slot) pairs of the missing blocks the
    host tier held, copied back into device slots (`commit` caches them): those
    right after the hit continue it. `new_slots` are the (hash, slot) pairs reserved for missing
    blocks; their bytes are garbage until filled or pulled, and `commit` decides
    which of them become cached. After a final `commit`, uncommitted slots are no
    longer the lease's to write.
    """

    slots: list[int]
    cached: int
    new_slots: list[tuple[int, int]]
    _pool: KVPool = field(repr=False)
    _held: list[int] = field(repr=False)  # distinct slots this lease holds a refcount on, in order
    _pending: dict[int, int] = field(repr=False)  # new hash -> slot, not yet committed
    _private: set[int] = field(default_factory=set, repr=False)  # filled slots that lost a race
    loaded: list[tuple[int, int]] = field(default_factory=list)
    released: bool = False


class KVPool(SlotMemory):
    """Fixed-capacity, LRU-evicting, refcounted block pool with mirrored TP ranks.

    Invariants: a slot is free, reserved by a lease (content not yet valid), or
    holds a cached block (in the prefix index). A slot with a non-zero refcount
    (held by a lease or pinned for an outgoing transfer) is never evicted; only
    cached blocks with refcount 0 are, least recently used first.
    """

    def __init__(
        self,
        capacity_blocks: int,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        tp: int = 1,
        copy_scan: int = DEFAULT_COPY_SCAN,
        host_blocks: int = 0,
    ) -> None:
        if copy_scan < 0:
            raise ValueError(f"copy_scan must be >= 0, got {copy_scan}")
        super().__init__(capacity_blocks, block_bytes, tp)
        self.copy_scan = copy_scan
        self.host = HostTier(host_blocks, block_bytes, tp) if host_blocks > 0 else None
        self._slot_of: dict[int, int] = {}  # the local prefix index: cached hash -> slot
        self._hash_at: list[int | None] = [None] * capacity_blocks  # cached or reserved hash per slot
        self._ref: list[int] = [0] * capacity_blocks  # lease holds + pins
        self._pins: dict[int, int] = {}  # slot -> pins by outgoing transfers (a subset of _ref)
        self._lru: OrderedDict[int, int] = OrderedDict()  # evictable (cached, refcount 0): hash -> slot, LRU first
        self._free: list[int] = list(range(capacity_blocks - 1, -1, -1))  # pop() hands out low slots first
        self._copied: set[int] = set()  # cached hashes a peer has read: a copy exists elsewhere
        self._changes = ChangeLog()
        self.stats: dict[str, int] = {
            "acquires": 0,
            "hits": 0,  # blocks of a cached prefix found by acquire
            "late_hits": 0,  # cached blocks found after a miss (reused, not in `cached`)
            "misses": 0,  # slots reserved for missing blocks
            "stored": 0,  # blocks committed into the cache
            "dropped": 0,  # reserved slots freed without being committed, or that lost a race
            "evictions": 0,
            "copy_evictions": 0,  # evictions of a block a peer had read, ahead of colder ones
            "pool_full": 0,
        }

    # -- the prefix index ----------------------------------------------------------

    def lookup_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading hashes are cached here (each chained hash names its whole prefix)."""
        n = 0
        for h in hashes:
            if h not in self._slot_of:
                break
            n += 1
        return n

    def slot_of(self, hash: int) -> int | None:
        """The slot of a cached block, or None (reserved, uncommitted blocks are not cached)."""
        return self._slot_of.get(hash)

    def hash_at(self, slot: int) -> int | None:
        """The hash cached in or reserved for `slot`, or None if the slot is free."""
        return self._hash_at[self._slot(slot)]

    def __contains__(self, hash: int) -> bool:
        return hash in self._slot_of

    def blocks(self) -> list[tuple[int, int]]:
        """Every cached (hash, slot) on the device: what to publish again after re-registering under a new epoch,
        with `host_blocks`."""
        return list(self._slot_of.items())

    def host_blocks(self) -> list[tuple[int, int]]:
        """Every (hash, host slot) of the host tier (none without one)."""
        return self.host.blocks() if self.host is not None else []

    def location(self, hash: int) -> int | None:
        """Where `hash` is held (kvproto.media: a device slot, or a host slot in the host medium); None: nowhere."""
        s = self._slot_of.get(hash)
        if s is not None:
            return s
        h = self.host.slot_of(hash) if self.host is not None else None
        return None if h is None else media.location(h, media.HOST)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> int:
        """Slots cached or reserved: never more than capacity_blocks."""
        return self.capacity_blocks - len(self._free)

    @property
    def held_slots(self) -> int:
        """Slots a request or a pin holds: what vLLM counts as its KV cache in use (to it a cached block nobody
        holds is free: its `kv_cache_usage_perc`)."""
        return self.capacity_blocks - len(self._free) - len(self._lru)

    @property
    def cached_blocks(self) -> int:
        return len(self._slot_of)

    def evictable(self) -> list[int]:
        """Cached hashes with no holds, coldest first: the LRU order eviction follows, copies aside (`copied`)."""
        return list(self._lru)

    def copied(self, hash: int) -> bool:
        """Whether a peer has read this cached block (so eviction takes it ahead of colder ones)."""
        return hash in self._copied

    def refcount(self, slot: int) -> int:
        """Holds on `slot`: leases using it plus pins; evictable only at 0."""
        return self._ref[self._slot(slot)]

    # -- leases --------------------------------------------------------------------

    def acquire(self, hashes: Sequence[int]) -> Lease:
        """Pin a request's cached blocks and reserve slots for its missing ones.

        All or nothing: if the missing blocks need more slots than are free or
        evictable (after pinning this request's own cached blocks), raise
        PoolFull and change nothing. Evicts least recently used unpinned blocks
        only when no slot is free. A hash already cached after a miss is reused
        rather than duplicated (it is valid), but `cached` counts only the
        leading run, since an engine recomputes everything after the first miss.
        """
        self.stats["acquires"] += 1
        hashes = [int(h) for h in hashes]
        slot_of = self._slot_of
        cached = self.lookup_prefix(hashes)
        distinct = list(dict.fromkeys(hashes))
        missing = [h for h in distinct if h not in slot_of]
        # Every missing block the host tier holds moves back (a block lives in one tier), the leading ones
        # continuing the hit, any later one at least not computed twice.
        from_host = {h for h in missing if h in self.host} if self.host is not None else set()
        if missing:
            # this request's own cached blocks are about to be pinned: they cannot make room
            own_evictable = sum(1 for h in distinct if h in self._lru)
            available = len(self._free) + len(self._lru) - own_evictable
            if len(missing) > available:
                self.stats["pool_full"] += 1
                raise PoolFull(len(missing), available, self.capacity_blocks)
        for h in distinct:  # pin first, so that making room cannot evict this request's blocks
            if h in slot_of:
                self._incref(slot_of[h], h)
        pending: dict[int, int] = {}
        loaded: list[tuple[int, int]] = []
        for h in missing:
            saved = None
            if h in from_host and self.host is not None:  # moving back: out of the host tier first
                self._touch_event(h)
                saved = self.host.take(h)
            s = self._take_slot(protect=from_host)
            self._hash_at[s] = h
            self._ref[s] = 1
            pending[h] = s
            if saved is not None:
                for rank, data in enumerate(saved):
                    self.slot_view(rank, s)[:] = data
                loaded.append((h, s))
        held = [pending[h] if h in pending else slot_of[h] for h in distinct]
        prefix_hits = len(set(hashes[:cached]))
        self.stats["hits"] += prefix_hits
        self.stats["late_hits"] += len(distinct) - len(missing) - prefix_hits
        self.stats["misses"] += len(missing)
        loaded_set = {h for h, _ in loaded}
        return Lease(
            slots=[pending[h] if h in pending else slot_of[h] for h in hashes],
            cached=cached,
            new_slots=[(h, s) for h, s in pending.items() if h not in loaded_set],
            _pool=self,
            _held=held,
            _pending=pending,
            loaded=loaded,
        )

    def commit(self, lease: Lease, valid: Iterable[int], *, final: bool = True) -> None:
        """Cache the lease's new blocks named in `valid` (filled, or pulled and verified) and those it loaded from
        the host tier; free the rest.

        Emits a store event per block cached. If another lease cached the same
        hash first (two requests missed it at once), this copy stays with the
        lease until release and is then freed: one hash, one slot in the index.
        Not `final`: only the blocks in `valid` are cached, the others stay the lease's to fill and commit later
        (a pull's blocks serve other requests while the rest of the prompt is still computed).
        """
        self._check_lease(lease)
        valid_set = set(valid)
        if final:
            valid_set |= {h for h, _ in lease.loaded}  # loaded from the host tier: valid bytes already
        unknown = valid_set.difference(lease._pending)
        if unknown:
            raise ValueError(f"not uncommitted new blocks of this lease: {sorted(unknown)[:8]}")
        if not final:
            for h in valid_set:
                self._store(lease, h, lease._pending.pop(h))
            return
        for h, s in lease._pending.items():
            if h not in valid_set:
                # the lease keeps no claim on an unfilled slot: hand it back now
                self._ref[s] -= 1
                lease._held.remove(s)
                self._hash_at[s] = None
                self._free.append(s)
                self.stats["dropped"] += 1
            else:
                self._store(lease, h, s)
        lease._pending = {}

    def release(self, lease: Lease) -> None:
        """Drop the lease's hold; its cached blocks stay, now evictable and most recently used.

        Blocks are queued tail first, so the head of the request's prefix is the
        most recent: eviction eats a prefix from its end (as vLLM does) instead of
        dropping the head block and orphaning every block chained after it.
        Uncommitted reserved slots are freed.
        """
        self._check_lease(lease)
        self.stats["dropped"] += len(lease._pending) + len(lease._private)
        for s in reversed(lease._held):
            self._decref(s)
        for s in list(lease._pending.values()) + list(lease._private):
            self._hash_at[s] = None
            self._free.append(s)
        lease._pending = {}
        lease._private = set()
        lease._held = []
        lease.released = True

    # -- pins for outgoing transfers -----------------------------------------------

    def pin(self, slots: Iterable[int]) -> None:
        """Hold cached blocks while a peer reads them: pinned blocks are never evicted.

        All or nothing; every slot must hold a cached block. Counts per
        occurrence, so unpin the same list.
        """
        slots = [self._slot(s) for s in slots]
        for s in slots:
            h = self._hash_at[s]
            if h is None or self._slot_of.get(h) != s:
                raise ValueError(f"slot {s} holds no cached block")
        for s in slots:
            self._incref(s, self._hash_at[s])
            self._pins[s] = self._pins.get(s, 0) + 1

    def unpin(self, slots: Iterable[int]) -> None:
        """Undo `pin`; a block whose last hold goes becomes the most recently used (a read is a use)."""
        slots = [self._slot(s) for s in slots]
        need: dict[int, int] = {}
        for s in slots:
            need[s] = need.get(s, 0) + 1
        for s, n in need.items():
            if self._pins.get(s, 0) < n:
                raise ValueError(f"slot {s} is not pinned {n} time(s)")
        for s in slots:
            n = self._pins[s] - 1
            if n:
                self._pins[s] = n
            else:
                del self._pins[s]
            h = self._hash_at[s]
            if h is not None:
                self._copied.add(h)
            self._decref(s)

    # -- events --------------------------------------------------------------------

    def drain_events(self) -> tuple[list[tuple[int, int]], list[int]]:
        """(stored (hash, location), removed hashes) since the last call, for publishing to the directory: each
        hash's net change (`worker_stub.change_log`), a hash in at most one list."""
        return self._changes.drain(self.location)

    # -- internals -----------------------------------------------------------------

    def _check_lease(self, lease: Lease) -> None:
        if lease._pool is not self:
            raise ValueError("lease belongs to another pool")
        if lease.released:
            raise ValueError("lease already released")

    def _store(self, lease: Lease, h: int, s: int) -> None:
        """Cache a committed block of `lease`, unless another lease cached `h` first (then the copy is private)."""
        if h in self._slot_of:
            lease._private.add(s)
        else:
            self._touch_event(h)
            self._slot_of[h] = s
            self.stats["stored"] += 1

    def _touch_event(self, h: int) -> None:
        """Note a change of `h` for drain_events (call it before the change), keeping what was true at the last
        drain."""
        self._changes.touch(h, self.location(h))

    def _incref(self, s: int, h: int | None) -> None:
        if self._ref[s] == 0:
            assert h is not None  # both callers pass the hash of a cached block (pin checks it first)
            del self._lru[h]
        self._ref[s] += 1

    def _decref(self, s: int) -> None:
        self._ref[s] -= 1
        if self._ref[s] == 0:
            h = self._hash_at[s]
            if h is not None and self._slot_of.get(h) == s:
                self._lru[h] = s

    def _take_slot(self, protect: Container[int] = ()) -> int:
        """A free slot, else the coldest evictable one's (copies first), its block moved to the host tier if there
        is one, making room there by evicting its least recently stored block not in `protect`."""
        if self._free:
            return self._free.pop()
        victim: int | None = None
        if self._copied and self.copy_scan:
            for i, x in enumerate(self._lru):
                if i == self.copy_scan:
                    break
                if x in self._copied:
                    victim = x
                    break
        if victim is None:
            h, s = self._lru.popitem(last=False)
        else:
            h, s = victim, self._lru.pop(victim)
            self.stats["copy_evictions"] += 1
        self._copied.discard(h)
        self._touch_event(h)
        del self._slot_of[h]
        host = self.host
        if host is not None:
            # The block lives on in the host tier: its bytes are copied before the slot is reused. With every block
            # there protected (a request is loading them back), it is dropped instead.
            victim = host.victim(protect) if host.full else None
            if not host.full or victim is not None:
                if victim is not None:
                    self._touch_event(victim)
                host.store(h, self, s, victim)
        self._hash_at[s] = None
        self.stats["evictions"] += 1
        return s
