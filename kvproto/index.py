"""The block index: which node holds which block hash, at which slot.

Over 400 lines: the arrays, the numba kernels that walk them and the merges that rebuild them share
one layout; split, each half would need the other's invariants restated.

Why this shape: the directory must hold millions of (hash, holder) entries in
well under 100 bytes each and answer 256-block prefix lookups in microseconds.
A dict of Python ints costs ~110 bytes an entry and a numpy pipeline pays
a microsecond or more per call, so the index keeps plain numpy arrays and
walks them with small compiled kernels (numba, released GIL).

Two levels:

- the *main level*, cut into *partitions*: contiguous ranges of hash values,
  each holding its entries sorted by hash in CSR form (each distinct hash
  once in `ukeys`; its holders' node indices and slots in `nodes`/`slots`
  between `starts[j]` and `starts[j+1]`), plus an open-addressing table over
  `ukeys`. Block hashes are uniform, so a hash's home slot is its offset in
  the partition's range scaled to the table; keys sit in sorted order
  (ordered linear probing) and empty slots repeat the next key, which keeps
  the table sorted: a probe walks forward from home while the keys there are
  smaller. One or two cache misses find a hash, instead of a twenty-step
  binary search.
- the *recent level*: entries not merged yet, in three arrays sorted by hash,
  one for the whole index: a put inserts into it with one kernel call (one
  level a partition cost a Python round trip per partition a put touched,
  three times the put's CPU at 8M entries), copying it whole as before (up to
  N/16 entries, ~1 ms at 8M). A partition's share of it is
  merged into that partition once it outgrows both its share of
  `merge_threshold` and 1/16 of the partition, so merging costs O(1)
  amortised per entry.

Why partitions: a merge rebuilds a main level, inside a mutation on every
replica's Raft thread and in every gateway's mirror at once. With one main
level that was O(N): 0.47 s of CPU at 8M entries, which left mirrors stale. A
merge that leaves a partition over `_PART_ENTRIES` entries splits it at
distinct hashes into halves or smaller, so a merge rebuilds at most about that
many entries (5-14 ms of CPU, where one merge at 8M entries took 0.33 s) however
large the index grows, and a small index is one
partition: the one-level layout it had. Cuts at distinct hashes rather than at
hash bits stay balanced for non-uniform hashes too (tests use small integers).
A mutation merges due partitions up to a budget, at least one
(`_rebuild_due`); those that fall due together (after a large drop_node, say)
wait for the next mutations, correct meanwhile: tombstones and a longer recent
level only slow reads a little.

Why raw addresses: a lookup touches a random partition per hash, and numba's
typed lists cost 12-17 ns per array fetched (five per hash), more than a
probe. The kernels instead get a table of each partition's array addresses
and lengths (`_meta`, a row a partition) and view the arrays in place; the
index keeps every array referenced for as long as its address is in the
table, re-points the table (`_publish`, `_relayout`) whenever it replaces
one, and pickles arrays, never addresses.

Why copy-on-write: a watch stream's snapshot must not hold the state lock for O(entries) (the Raft
thread waits for that lock to apply, so 5M entries copied under it stalled heartbeats for 70-240 ms).
`frozen` hands out the arrays themselves in O(partitions) and marks them shared; the one mutation
that writes into arrays in place (slots updated, tombstones marked, `_store` and `_drop`) first copies
the shared arrays it would write (`_own`), so a frozen view never changes under its reader. Every other
mutation builds new arrays anyway.

Removals mark an entry's node as DEAD (a tombstone) in the main level and
delete it from the recent level; tombstones are compacted away when they make
up a quarter of a partition. `digest`, `items` and `entries` depend only on
the live entries, not on where partitions were cut or what is merged. Every
mutation is deterministic (no clocks, randomness or I/O): it runs inside the
Raft state machine, so every replica reaches the same arrays from the same
calls. Not thread-safe: the caller serialises mutations against reads.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash
from numba import njit, types
from numba.extending import intrinsic
from numba.np.numpy_support import carray

DEAD = np.uint32(0xFFFFFFFF)
_U64_MAX = np.uint64(2**64 - 1)
_LOAD = 0.5  # occupancy of the probe table
_PART_ENTRIES = 1 << 17  # a partition a merge leaves larger is split: a merge costs 5-14 ms of CPU
_EMPTY_U64 = np.empty(0, dtype=np.uint64)
_EMPTY_U32 = np.empty(0, dtype=np.uint32)
_NO_MATCH = (np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), np.empty((0, 0), dtype=np.uint32))

# Columns of the address table (`_meta`): the arrays the kernels read, per partition.
_TKEY, _TROW, _STARTS, _NODES, _SLOTS = range(5)
_LEN = 5  # column of the first length in `_meta`: a partition's addresses, then their lengths
# Columns of the parameter table (`_prm`, uint64), per partition.
_LO, _SHIFT, _MUL = range(3)


# -- kernels ------------------------------------------------------------------------


def _pointer_cast(ty: types.Type) -> Any:
    @intrinsic
    def cast(typingctx: Any, addr: Any) -> Any:  # pragma: no cover - compiled
        sig = types.CPointer(ty)(types.int64)  # type: ignore[no-untyped-call]

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return sig, codegen

    return cast


_as_u64 = _pointer_cast(types.uint64)
_as_i64 = _pointer_cast(types.int64)
_as_u32 = _pointer_cast(types.uint32)


@njit(cache=True, nogil=True)
def _u64(meta: np.ndarray, f: int, p: int) -> np.ndarray:  # pragma: no cover - compiled
    return carray(_as_u64(meta[p, f]), meta[p, _LEN + f])


@njit(cache=True, nogil=True)
def _i64(meta: np.ndarray, f: int, p: int) -> np.ndarray:  # pragma: no cover - compiled
    return carray(_as_i64(meta[p, f]), meta[p, _LEN + f])


@njit(cache=True, nogil=True)
def _u32(meta: np.ndarray, f: int, p: int) -> np.ndarray:  # pragma: no cover - compiled
    return carray(_as_u32(meta[p, f]), meta[p, _LEN + f])


@njit(cache=True, nogil=True)
def _home(h: np.uint64, lo: np.uint64, shift: np.uint64, mul: np.uint64) -> np.int64:  # pragma: no cover - compiled
    return np.int64((((h - lo) >> shift) * mul) >> np.uint64(32))


@njit(cache=True, nogil=True)
def _part_of(h: np.uint64, prm: np.ndarray, pmap: np.ndarray, pshift: np.uint64) -> int:  # pragma: no cover - compiled
    """The partition holding hash h: `pmap` names the one holding the lowest hash of h's top bits, which
    for uniform hashes is h's own; otherwise a binary search over the partitions' lower bounds."""
    p = pmap[h >> pshift]
    if p + 1 < prm.shape[0] and prm[p + 1, _LO] <= h:
        p = np.searchsorted(prm[:, _LO], h, side="right") - 1
    return int(p)


@njit(cache=True, nogil=True)
def _main_row(h: np.uint64, p: int, prm: np.ndarray, meta: np.ndarray) -> int:  # pragma: no cover - compiled
    """h's row in partition p's main level, or its empty last row."""
    tkey = _u64(meta, _TKEY, p)
    i = _home(h, prm[p, _LO], prm[p, _SHIFT], prm[p, _MUL])
    while tkey[i] < h:
        i += 1
    return int(_i64(meta, _TROW, p)[i] if tkey[i] == h else meta[p, _LEN + _STARTS] - 2)


@njit(cache=True, nogil=True)
def _locate(
    hashes: np.ndarray,
    node: np.uint32,
    prm: np.ndarray,
    pmap: np.ndarray,
    pshift: np.uint64,
    meta: np.ndarray,
    rkeys: np.ndarray,
    rnodes: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """Where (hashes[i], node) lives: its partition, and its position in that partition's main level,
    or in the recent level, or -1."""
    n = len(hashes)
    part = np.empty(n, np.int64)
    main = np.full(n, -1, np.int64)
    recent = np.full(n, -1, np.int64)
    for i in range(n):
        h = hashes[i]
        p = _part_of(h, prm, pmap, pshift)
        part[i] = p
        r = _main_row(h, p, prm, meta)
        starts = _i64(meta, _STARTS, p)
        nodes = _u32(meta, _NODES, p)
        for e in range(starts[r], starts[r + 1]):
            if nodes[e] == node:
                main[i] = e
                break
        if main[i] < 0:
            j = np.searchsorted(rkeys, h)
            while j < len(rkeys) and rkeys[j] == h:
                if rnodes[j] == node:
                    recent[i] = j
                    break
                j += 1
    return part, main, recent


@njit(cache=True, nogil=True)
def _store(
    meta: np.ndarray, f: int, part: np.ndarray, pos: np.ndarray, values: np.ndarray
) -> None:  # pragma: no cover - compiled
    """Main-level array `f` of partition part[i] gets values[i] at pos[i], where pos[i] >= 0."""
    for i in range(len(pos)):
        if pos[i] >= 0:
            _u32(meta, f, part[i])[pos[i]] = values[i]


@njit(cache=True, nogil=True)
def _drop(node: np.uint32, meta: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """Mark every main-level entry of `node` DEAD; how many were, per partition."""
    n = meta.shape[0]
    dropped = np.zeros(n, np.int64)
    dead = np.uint32(0xFFFFFFFF)
    for p in range(n):
        nodes = _u32(meta, _NODES, p)
        for e in range(len(nodes)):
            if nodes[e] == node:
                nodes[e] = dead
                dropped[p] += 1
    return dropped


@njit(cache=True, nogil=True)
def _prefix_match(
    q: np.ndarray,
    prm: np.ndarray,
    pmap: np.ndarray,
    pshift: np.uint64,
    meta: np.ndarray,
    rkeys: np.ndarray,
    rnodes: np.ndarray,
    rslots: np.ndarray,
    node_bound: int,
    want_slots: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """Per node holding q[0], how many of q[0], q[1], ... it holds in a row (and their slots).

    Walks the query once, following only the nodes still matching, and stops
    at the first hash that advances none of them.
    """
    n = len(q)
    dead = np.uint32(0xFFFFFFFF)
    cand_of = np.full(node_bound, -1, np.int64)
    cand = np.empty(node_bound, np.int64)
    first_slot = np.empty(node_bound, np.uint32)
    c = 0
    p = _part_of(q[0], prm, pmap, pshift)
    r = _main_row(q[0], p, prm, meta)
    starts = _i64(meta, _STARTS, p)
    nodes = _u32(meta, _NODES, p)
    slots = _u32(meta, _SLOTS, p)
    for e in range(starts[r], starts[r + 1]):
        if nodes[e] != dead:
            cand_of[nodes[e]] = c
            cand[c] = nodes[e]
            first_slot[c] = slots[e]
            c += 1
    j = np.searchsorted(rkeys, q[0])
    while j < len(rkeys) and rkeys[j] == q[0]:
        cand_of[rnodes[j]] = c
        cand[c] = rnodes[j]
        first_slot[c] = rslots[j]
        c += 1
        j += 1
    matched = np.ones(c, np.int64)
    out_slots = np.zeros((c, n if want_slots else 0), np.uint32)
    if want_slots:
        for k in range(c):
            out_slots[k, 0] = first_slot[k]
    for i in range(1, n):
        advanced = 0
        h = q[i]
        p = _part_of(h, prm, pmap, pshift)
        r = _main_row(h, p, prm, meta)
        starts = _i64(meta, _STARTS, p)
        nodes = _u32(meta, _NODES, p)
        slots = _u32(meta, _SLOTS, p)
        for e in range(starts[r], starts[r + 1]):
            nd = nodes[e]
            if nd != dead:
                k = cand_of[nd]
                if k >= 0 and matched[k] == i:
                    matched[k] = i + 1
                    if want_slots:
                        out_slots[k, i] = slots[e]
                    advanced += 1
        j = np.searchsorted(rkeys, h)
        while j < len(rkeys) and rkeys[j] == h:
            k = cand_of[rnodes[j]]
            if k >= 0 and matched[k] == i:
                matched[k] = i + 1
                if want_slots:
                    out_slots[k, i] = rslots[j]
                advanced += 1
            j += 1
        if advanced == 0:
            break
    # Longest first, ties by node index: an insertion sort, as c is small.
    order = np.arange(c)
    for a in range(1, c):
        x = order[a]
        b = a - 1
        while b >= 0 and (matched[order[b]] < matched[x] or (matched[order[b]] == matched[x] and cand[order[b]] > cand[x])):
            order[b + 1] = order[b]
            b -= 1
        order[b + 1] = x
    return cand[order], matched[order], out_slots[order]


@njit(cache=True, nogil=True)
def _merge_levels(
    ukeys: np.ndarray,
    starts: np.ndarray,
    nodes: np.ndarray,
    slots: np.ndarray,
    rkeys: np.ndarray,
    rnodes: np.ndarray,
    rslots: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """The main level's live entries and the recent level's, as one CSR level (ukeys, starts, nodes, slots).

    One pass over both, where numpy's repeat, mask, insert and diff made several: 8M entries plus
    500k recent ones took 2.4 s of CPU, on the Raft thread of every replica at once, now 0.5 s.
    A hash's recent entries follow its main ones, as they did.
    """
    dead = np.uint32(0xFFFFFFFF)
    live = 0
    for e in range(len(nodes)):
        if nodes[e] != dead:
            live += 1
    total = live + len(rkeys)
    okeys = np.empty(total, np.uint64)
    ostarts = np.empty(total + 2, np.int64)
    onodes = np.empty(total, np.uint32)
    oslots = np.empty(total, np.uint32)
    o = 0
    u = 0
    j = 0
    nr = len(rkeys)
    for r in range(len(ukeys) + 1):
        k = ukeys[r] if r < len(ukeys) else np.uint64(0)
        while j < nr and (r == len(ukeys) or rkeys[j] < k):
            if u == 0 or rkeys[j] != okeys[u - 1]:
                okeys[u] = rkeys[j]
                ostarts[u] = o
                u += 1
            onodes[o] = rnodes[j]
            oslots[o] = rslots[j]
            o += 1
            j += 1
        if r == len(ukeys):
            break
        for e in range(starts[r], starts[r + 1]):
            if nodes[e] != dead:
                if u == 0 or k != okeys[u - 1]:
                    okeys[u] = k
                    ostarts[u] = o
                    u += 1
                onodes[o] = nodes[e]
                oslots[o] = slots[e]
                o += 1
    ostarts[u] = o
    ostarts[u + 1] = o
    return okeys[:u].copy(), ostarts[: u + 2].copy(), onodes, oslots


@njit(cache=True, nogil=True)
def _probe_table(
    ukeys: np.ndarray, tsize: np.int64, lo: np.uint64, shift: np.uint64, mul: np.uint64
) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """The probe table over sorted `ukeys` (tkey, trow), in one pass: each key at its home slot or the
    first free one after it (ordered linear probing); an empty slot repeats the next key and its row, so
    that a probe stops at the first key not smaller than the one it seeks; a sentinel slot ends it."""
    u = len(ukeys)
    last = np.int64(-1)  # the slot of the previous key
    pos = np.empty(u, np.int64)
    for i in range(u):
        last = max(_home(ukeys[i], lo, shift, mul), last + 1)
        pos[i] = last
    length = max(tsize, last + 1) + 1
    tkey = np.empty(length, np.uint64)
    trow = np.empty(length, np.int64)
    p = 0
    for i in range(u):
        while p <= pos[i]:
            tkey[p] = ukeys[i]
            trow[p] = i
            p += 1
    while p < length:
        tkey[p] = np.uint64(0xFFFFFFFFFFFFFFFF)
        trow[p] = u
        p += 1
    return tkey, trow


@njit(cache=True, nogil=True)
def _insert_sorted(
    keys: np.ndarray, nodes: np.ndarray, slots: np.ndarray, nk: np.ndarray, node: np.uint32, ns: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """The recent level with sorted `nk` (all of `node`, slots `ns`) inserted after equal keys, in one pass
    (np.insert, three times, sorted the positions and copied each array twice; the level reaches N/16)."""
    n, m = len(keys), len(nk)
    okeys = np.empty(n + m, np.uint64)
    onodes = np.empty(n + m, np.uint32)
    oslots = np.empty(n + m, np.uint32)
    i = 0
    o = 0
    for j in range(m):
        while i < n and keys[i] <= nk[j]:
            okeys[o] = keys[i]
            onodes[o] = nodes[i]
            oslots[o] = slots[i]
            i += 1
            o += 1
        okeys[o] = nk[j]
        onodes[o] = node
        oslots[o] = ns[j]
        o += 1
    okeys[o:] = keys[i:]
    onodes[o:] = nodes[i:]
    oslots[o:] = slots[i:]
    return okeys, onodes, oslots


# -- partitions ---------------------------------------------------------------------------


class _Part:
    """The main level of the hashes in [lo, hi): CSR arrays sorted by hash and the probe table over them."""

    __slots__ = ("hi", "lo", "mul", "nodes", "shared", "shift", "slots", "starts", "tkey", "trow", "ukeys")

    def __init__(self, lo: int, hi: int, main: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
        self.lo, self.hi = lo, hi  # hi is exclusive: 2**64 for the last partition
        self.shared = False  # `nodes` and `slots` are in a frozen view: copy them before writing (BlockIndex._own)
        ukeys, starts, nodes, slots = main or (_EMPTY_U64, np.zeros(2, dtype=np.int64), _EMPTY_U32, _EMPTY_U32)
        self.ukeys, self.starts, self.nodes, self.slots = ukeys, starts, nodes, slots
        # A hash's home slot: its offset in [lo, hi), cut to 32 bits, times the table size over the
        # range's size, in fixed point. For the whole hash space this is (h >> 32) * tsize >> 32.
        tsize = max(1, int(np.ceil(len(ukeys) / _LOAD)))
        span = hi - lo - 1
        shift = max(0, span.bit_length() - 32)
        self.shift, self.mul = shift, (tsize << 32) // ((span >> shift) + 1)
        self.tkey, self.trow = _probe_table(ukeys, np.int64(tsize), np.uint64(lo), np.uint64(shift), np.uint64(self.mul))

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The arrays the kernels read, in the rows of the address table."""
        return (self.tkey, self.trow, self.starts, self.nodes, self.slots)

    def live(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Live entries as (hashes, nodes, slots), sorted by hash."""
        return _live(self.ukeys, self.starts, self.nodes, self.slots)


def _live(
    ukeys: np.ndarray, starts: np.ndarray, nodes: np.ndarray, slots: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A CSR level's live entries as (hashes, nodes, slots), sorted by hash."""
    keys = np.repeat(ukeys, np.diff(starts[:-1]))
    live = nodes != DEAD
    return keys[live], nodes[live], slots[live]


class FrozenEntries:
    """The index's entries as they were when `BlockIndex.frozen` was called, readable on any thread
    without the lock: the arrays are the index's own, which it copies before it writes into them."""

    __slots__ = ("_main", "_recent", "size")

    def __init__(self, main: Sequence[tuple[np.ndarray, ...]], recent: tuple[np.ndarray, ...], size: int) -> None:
        self._main, self._recent, self.size = main, recent, size

    def entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All live entries as (hashes, nodes, slots), in no particular order: O(entries), off the lock."""
        levels = [_live(*m) for m in self._main] + [self._recent]
        return tuple(np.concatenate(column) for column in zip(*levels))  # type: ignore[return-value]


def _split(lo: int, hi: int, ukeys: np.ndarray, starts: np.ndarray, nodes: np.ndarray, slots: np.ndarray) -> list[_Part]:
    """Partitions over [lo, hi) holding this CSR level, cut at distinct hashes into pieces of at most
    `_PART_ENTRIES` / 2 entries when it holds more than `_PART_ENTRIES`."""
    total, u = len(nodes), len(ukeys)
    if total <= _PART_ENTRIES:
        return [_Part(lo, hi, (ukeys, starts, nodes, slots))]
    pieces = -(-total // (_PART_ENTRIES // 2))
    cuts = np.searchsorted(starts[:u], np.arange(1, pieces, dtype=np.int64) * total // pieces)
    rows = [0, *sorted({int(c) for c in cuts if 0 < c < u}), u]
    parts = []
    for a, b in itertools.pairwise(rows):
        e0, e1 = int(starts[a]), int(starts[b])
        piece_starts = np.empty(b - a + 2, dtype=np.int64)
        piece_starts[:-1] = starts[a : b + 1] - e0
        piece_starts[-1] = e1 - e0
        piece = (ukeys[a:b].copy(), piece_starts, nodes[e0:e1].copy(), slots[e0:e1].copy())
        parts.append(_Part(lo if a == 0 else int(ukeys[a]), hi if b == u else int(ukeys[b]), piece))
    return parts


# -- the index -------------------------------------------------------------------------


class BlockIndex:
    """A multimap hash -> {node index: slot} with longest-prefix lookup per node."""

    def __init__(self, merge_threshold: int = 16384) -> None:
        self.merge_threshold = merge_threshold
        self._parts = [_Part(0, 2**64)]
        self._dead = np.zeros(1, dtype=np.int64)  # tombstones, per partition
        self._rcount = np.zeros(1, dtype=np.int64)  # recent entries, per partition
        # Recent level, sorted by hash.
        self._rkeys: np.ndarray = _EMPTY_U64
        self._rnodes: np.ndarray = _EMPTY_U32
        self._rslots: np.ndarray = _EMPTY_U32
        self._recent_shared = False  # `_rslots` is in a frozen view (`frozen`): copy it before writing
        self._nshared = 0  # partitions marked shared: none on the hot path unless a view was frozen
        self._size = 0
        self._counts: dict[int, int] = {}
        self._node_bound = 0  # 1 + the largest node index ever stored
        self._relayout()

    # -- layout --------------------------------------------------------------------

    def _relayout(self) -> None:
        """The tables the kernels read, for the current partitions: their bounds and home-slot parameters
        (`_prm`), the addresses and lengths of their arrays (`_meta`), and which partition holds the lowest hash of
        each top-bits bucket (`_pmap`, two buckets or more a partition)."""
        n = len(self._parts)
        self._prm = np.empty((n, 3), dtype=np.uint64)
        self._meta = np.empty((n, 2 * _LEN), dtype=np.int64)  # a row a partition: one or two cache lines
        for i in range(n):
            self._publish(i)
        bits = max(1, (2 * n - 1).bit_length())
        self._pshift = np.uint64(64 - bits)
        lows = np.arange(1 << bits, dtype=np.uint64) << self._pshift
        self._pmap = np.searchsorted(self._prm[:, _LO], lows, side="right").astype(np.int64) - 1

    def _publish(self, i: int) -> None:
        """Point the tables at partition i's current arrays and home-slot parameters."""
        part = self._parts[i]
        self._prm[i] = (part.lo, part.shift, part.mul)
        for f, a in enumerate(part.arrays()):
            self._meta[i, f] = a.ctypes.data
            self._meta[i, _LEN + f] = len(a)

    def _recent_range(self, part: _Part) -> tuple[int, int]:
        """Where the recent level holds the hashes of `part`."""
        a = int(np.searchsorted(self._rkeys, np.uint64(part.lo)))
        b = len(self._rkeys) if part.hi == 2**64 else int(np.searchsorted(self._rkeys, np.uint64(part.hi)))
        return a, b

    def _rebuilt(self, part: _Part, a: int, b: int) -> list[_Part]:
        """`part` with its share of the recent level (`[a, b)`, `_recent_range`) merged in and tombstones
        dropped, split when too large."""
        merged = _merge_levels(
            part.ukeys, part.starts, part.nodes, part.slots, self._rkeys[a:b], self._rnodes[a:b], self._rslots[a:b]
        )
        return _split(part.lo, part.hi, *merged)

    def _rebuild(self, i: int) -> int:
        """Merge partition i (splitting it if it grew too large); returns the entries it rebuilt."""
        part = self._parts[i]
        a, b = self._recent_range(part)
        new = self._rebuilt(part, a, b)
        self._nshared -= part.shared  # replaced by new arrays: a frozen view keeps the old ones
        if b > a:
            self._rkeys, self._rnodes, self._rslots = (
                np.concatenate((r[:a], r[b:])) for r in (self._rkeys, self._rnodes, self._rslots)
            )
        self._parts[i : i + 1] = new
        fresh = np.zeros(len(new), dtype=np.int64)
        self._dead = np.concatenate((self._dead[:i], fresh, self._dead[i + 1 :]))
        self._rcount = np.concatenate((self._rcount[:i], fresh, self._rcount[i + 1 :]))
        if len(new) == 1:
            self._publish(i)
        else:
            self._relayout()
        return sum(len(p.nodes) for p in new)

    def _rebuild_due(self, changed: int) -> None:
        """Rebuild due partitions (`_due`), fullest first, up to `_PART_ENTRIES` rebuilt entries plus 16 for
        each entry the mutation changed (the merge work an entry brings: at most 17), and always one if
        any is due. The rest wait for the next mutations: no mutation pays for many merges, as an O(N)
        merge made it pay when the main level was one."""
        budget = _PART_ENTRIES + 16 * changed
        done = 0
        while True:
            due = self._due()
            if not len(due):
                return
            work = self._rcount[due] + self._dead[due]
            i = int(due[np.argmax(work)])  # the first of the fullest
            if done and done + int(self._meta[i, _LEN + _NODES] + self._rcount[i]) > budget:
                return
            done += self._rebuild(i)

    def _due(self) -> np.ndarray:
        """Partitions whose recent entries outgrew their share of `merge_threshold` and 1/16 of their main
        level (so merging costs O(1) amortised per entry), or whose tombstones are a quarter of it."""
        main = self._meta[:, _LEN + _NODES]
        share = -(-self.merge_threshold // len(self._parts))
        r, d = self._rcount, self._dead
        return np.flatnonzero(((r > 0) & (r >= np.maximum(share, main // 16))) | ((d > 0) & (d * 4 >= main)))

    # -- size ---------------------------------------------------------------

    def __len__(self) -> int:
        return self._size

    def count(self, node: int) -> int:
        """Entries held by `node`."""
        return self._counts.get(node, 0)

    def nbytes(self) -> int:
        """Bytes held in arrays."""
        arrays = (
            self._prm,
            self._pmap,
            self._meta,
            self._dead,
            self._rcount,
            self._rkeys,
            self._rnodes,
            self._rslots,
        )
        return sum(a.nbytes for a in arrays) + sum(a.nbytes for p in self._parts for a in (p.ukeys, *p.arrays()))

    def partitions(self) -> int:
        """How many partitions the hash space is cut into (1 until a merge leaves over `_PART_ENTRIES`)."""
        return len(self._parts)

    # -- mutation -------------------------------------------------------------

    def _locate(self, hashes: np.ndarray, node: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return _locate(np.ascontiguousarray(hashes, dtype=np.uint64), np.uint32(node), *self._probe_tables())

    def _probe_tables(self) -> tuple[np.ndarray, np.ndarray, np.uint64, np.ndarray, np.ndarray, np.ndarray]:
        """What the kernels need to find a hash: the partitions' parameters, map and addresses, and the recent level."""
        return self._prm, self._pmap, self._pshift, self._meta, self._rkeys, self._rnodes

    def missing(self, node: int, hashes: np.ndarray) -> int:
        """How many distinct hashes `node` does not hold yet (what a put would add)."""
        _, main, recent = self._locate(np.unique(hashes), node)
        return int(((main < 0) & (recent < 0)).sum())

    def put(self, node: int, hashes: np.ndarray, slots: np.ndarray) -> int:
        """Record that `node` holds hashes[i] at slots[i]; returns how many entries were new.

        A hash the node already holds gets its slot updated; duplicates in one
        call resolve to the last slot given.
        """
        if len(hashes) > 1:
            hashes, last = np.unique(hashes[::-1], return_index=True)  # sorted, last occurrence wins
            slots = slots[::-1][last]
        slots = np.ascontiguousarray(slots, dtype=np.uint32)
        part, main, recent = self._locate(hashes, node)
        in_recent = recent >= 0
        self._own(part[main >= 0], bool(in_recent.any()))
        _store(self._meta, _SLOTS, part, main, slots)
        self._rslots[recent[in_recent]] = slots[in_recent]
        new = (main < 0) & ~in_recent
        added = int(new.sum())
        if added:
            self._rkeys, self._rnodes, self._rslots = _insert_sorted(
                self._rkeys,
                self._rnodes,
                self._rslots,
                np.ascontiguousarray(hashes[new], dtype=np.uint64),
                np.uint32(node),
                slots[new],
            )
            self._rcount += np.bincount(part[new], minlength=len(self._parts))
            self._size += added
            self._counts[node] = self._counts.get(node, 0) + added
            self._node_bound = max(self._node_bound, node + 1)
        self._rebuild_due(added)
        return added

    def load(self, hashes: np.ndarray, nodes: np.ndarray, slots: np.ndarray) -> None:
        """Replace every entry with these (distinct (hash, node) pairs, as `entries` gives): one sort and one
        merge, where a `put` per node re-sorted the growing index each time (5M entries: 1.6 s, not 4.9 s)."""
        order = np.lexsort((nodes, hashes))
        self.__init__(self.merge_threshold)  # type: ignore[misc]  # a reset: same threshold, empty levels
        self._rkeys = np.ascontiguousarray(hashes[order], dtype=np.uint64)
        self._rnodes = np.ascontiguousarray(nodes[order], dtype=np.uint32)
        self._rslots = np.ascontiguousarray(slots[order], dtype=np.uint32)
        counts = np.bincount(self._rnodes) if len(self._rnodes) else np.zeros(0, dtype=np.int64)
        self._counts = {i: int(c) for i, c in enumerate(counts.tolist()) if c}
        self._node_bound = len(counts)
        self._size = len(self._rkeys)
        if self._size:
            self.merge()

    def remove(self, node: int, hashes: np.ndarray) -> int:
        """Forget that `node` holds these hashes; unknown ones are ignored. Returns entries removed."""
        part, main, recent = self._locate(np.unique(hashes), node)
        in_main, in_recent = main >= 0, recent >= 0
        self._own(part[in_main], False)
        _store(self._meta, _NODES, part, main, np.full(len(main), DEAD, dtype=np.uint32))
        np.add.at(self._dead, part[in_main], 1)
        if in_recent.any():
            gone = recent[in_recent]
            self._rkeys, self._rnodes, self._rslots = (np.delete(r, gone) for r in (self._rkeys, self._rnodes, self._rslots))
            np.subtract.at(self._rcount, part[in_recent], 1)
        removed = int(in_main.sum()) + int(in_recent.sum())
        self._size -= removed
        self._uncount(node, removed)
        self._rebuild_due(removed)
        return removed

    def drop_node(self, node: int) -> int:
        """Forget every entry of `node` (new epoch, expiry, deregistration). Returns entries removed.

        Marks its main-level entries in one pass over all of them (5 ms at 8M entries); the partitions
        this leaves a quarter dead are compacted one a mutation, not all at once."""
        if not self._counts.pop(node, 0):
            return 0
        # Its entries are spread over every partition by hash: the pass below reads all of them anyway.
        self._own(np.arange(len(self._parts)), False)
        dropped = _drop(np.uint32(node), self._meta)
        self._dead += dropped
        gone = self._rnodes == node
        in_recent = int(gone.sum())
        if in_recent:
            np.subtract.at(self._rcount, np.searchsorted(self._prm[:, _LO], self._rkeys[gone], side="right") - 1, 1)
            keep = ~gone
            self._rkeys, self._rnodes, self._rslots = self._rkeys[keep], self._rnodes[keep], self._rslots[keep]
        removed = int(dropped.sum()) + in_recent
        self._size -= removed
        self._rebuild_due(0)
        return removed

    def _own(self, parts: np.ndarray, recent: bool) -> None:
        """Copy the shared arrays an in-place write is about to touch: the main-level `nodes` and `slots` of
        `parts`, the recent level's slots if `recent`; a frozen view (`frozen`) keeps the old ones."""
        for i in np.unique(parts).tolist() if self._nshared and len(parts) else ():
            p = self._parts[i]
            if p.shared:
                p.nodes, p.slots, p.shared = p.nodes.copy(), p.slots.copy(), False
                self._nshared -= 1
                self._publish(i)
        if recent and self._recent_shared:
            self._rslots, self._recent_shared = self._rslots.copy(), False

    def frozen(self) -> FrozenEntries:
        """The entries as they are now, in O(partitions) (under the caller's lock): a watch stream's snapshot
        reads them off the lock while mutations go on (copy-on-write: `_own`)."""
        for p in self._parts:
            p.shared = True
        self._nshared = len(self._parts)
        self._recent_shared = True
        main = [(p.ukeys, p.starts, p.nodes, p.slots) for p in self._parts]
        return FrozenEntries(main, (self._rkeys, self._rnodes, self._rslots), self._size)

    def _uncount(self, node: int, n: int) -> None:
        left = self._counts.get(node, 0) - n
        if left > 0:
            self._counts[node] = left
        else:
            self._counts.pop(node, None)

    def merge(self) -> None:
        """Fold the recent level into the main levels, drop tombstones and rebuild the probe tables: O(N),
        for `load`, tests and benchmarks; mutations merge a partition at a time."""
        self._parts = [q for p in self._parts for q in self._rebuilt(p, *self._recent_range(p))]
        self._rkeys, self._rnodes, self._rslots = _EMPTY_U64, _EMPTY_U32, _EMPTY_U32
        self._nshared = 0
        self._dead = np.zeros(len(self._parts), dtype=np.int64)
        self._rcount = np.zeros(len(self._parts), dtype=np.int64)
        self._relayout()

    # -- pickling (Raft snapshots) ------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """Arrays and numbers: the probe and address tables are rebuilt on load (the addresses would be
        meaningless), and Raft's unpickler builds no other types."""
        return {
            "merge_threshold": self.merge_threshold,
            "parts": [(p.lo, p.hi, p.ukeys, p.starts, p.nodes, p.slots) for p in self._parts],
            "dead": self._dead,
            "recent": (self._rkeys, self._rnodes, self._rslots),
            "size": self._size,
            "counts": self._counts,
            "node_bound": self._node_bound,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a snapshot; one taken before partitions (a single main level) is loaded from its entries."""
        if "parts" not in state:
            self.merge_threshold = state["merge_threshold"]
            keys = np.repeat(state["_ukeys"], np.diff(state["_starts"][:-1]))
            live = state["_nodes"] != DEAD
            self.load(
                np.concatenate([keys[live], state["_rkeys"]]),
                np.concatenate([state["_nodes"][live], state["_rnodes"]]),
                np.concatenate([state["_slots"][live], state["_rslots"]]),
            )
            self._node_bound = max(self._node_bound, state["_node_bound"])
            return
        self.merge_threshold = state["merge_threshold"]
        self._parts = [_Part(int(lo), int(hi), main) for lo, hi, *main in state["parts"]]
        self._dead = state["dead"]
        self._rkeys, self._rnodes, self._rslots = state["recent"]
        self._recent_shared, self._nshared = False, 0
        self._size = state["size"]
        self._counts = state["counts"]
        self._node_bound = state["node_bound"]
        self._relayout()
        where = np.searchsorted(self._prm[:, _LO], self._rkeys, side="right") - 1
        self._rcount = np.bincount(where, minlength=len(self._parts)).astype(np.int64)

    # -- queries ------------------------------------------------------------------

    def lookup(self, hashes: np.ndarray, with_slots: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per node, the longest run hashes[0..k-1] it holds entirely (k >= 1), longest first.

        Returns (node indices, run lengths, slots): slots[j, :k] are the slots of
        holder j's run when `with_slots`, else slots has no columns. Ties are
        ordered by node index so that every replica answers alike.
        """
        if not len(hashes) or not self._node_bound:
            return _NO_MATCH
        return _prefix_match(
            np.ascontiguousarray(hashes, dtype=np.uint64),
            *self._probe_tables(),
            self._rslots,
            self._node_bound,
            with_slots,
        )

    def entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All live entries as (hashes, nodes, slots), copied, in no particular order: cheap enough to
        take under the state lock (a watch stream's snapshot), unlike the sorted `items`."""
        levels = [p.live() for p in self._parts] + [(self._rkeys, self._rnodes, self._rslots)]
        return tuple(np.concatenate(column) for column in zip(*levels))  # type: ignore[return-value]

    def items(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All live entries as (hashes, nodes, slots) sorted by (hash, node): a canonical form."""
        keys, nodes, slots = self.entries()
        order = np.lexsort((nodes, keys))
        return keys[order], nodes[order], slots[order]

    def digest(self, node_names: dict[int, str]) -> str:
        """A hash of the live entries that is equal on replicas holding the same entries.

        Node indices are mapped to `node_names` so that the digest does not depend
        on how indices were assigned.
        """
        keys, nodes, slots = self.items()
        h = xxhash.xxh3_128()
        for node in sorted(set(nodes.tolist()), key=lambda n: node_names.get(n, str(n))):
            mask = nodes == node
            h.update(node_names.get(node, str(node)).encode())
            h.update(keys[mask].astype("<u8").tobytes())
            h.update(slots[mask].astype("<u4").tobytes())
        return h.hexdigest()


def warm_up() -> tuple[int, int]:
    """Compile (or load from numba's cache) every kernel now, for each argument type the index passes.

    A kernel's first call in a process takes 0.3 s on a cache hit and seconds on a fresh compile,
    holding the GIL. Left to the first publish, that ran on the Raft thread of every replica at once,
    stalled heartbeats past the election timeout and set off an election right after each cluster
    start; a replica calls this before it joins Raft. Returns (loaded from the cache, compiled), counted
    in kernel signatures, so that a cache that should be warm (a container image's) can be seen to be.
    """
    ix = BlockIndex()
    hashes = np.array([3, 1, 2], dtype=np.uint64)
    slots = np.array([0, 1, 2], dtype=np.uint32)
    ix.put(0, hashes, slots)
    ix.put(1, hashes[:1], slots[:1])
    ix.missing(0, hashes)
    for with_slots in (True, False):
        ix.lookup(hashes, with_slots)
    ix.merge()
    ix.remove(1, hashes[:1])
    ix.drop_node(0)
    kernels = (
        _locate,
        _store,
        _drop,
        _prefix_match,
        _merge_levels,
        _probe_table,
        _insert_sorted,
    )  # the others are only called from these, and compiled into them
    return (sum(sum(k.stats.cache_hits.values()) for k in kernels), sum(sum(k.stats.cache_misses.values()) for k in kernels))
