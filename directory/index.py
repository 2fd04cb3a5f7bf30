"""The block index: which node holds which block hash, at which slot.

Over 400 lines: the arrays, the numba kernels that walk them and the merge that rebuilds them share
one layout; split, each half would need the other's invariants restated.

Why this shape: the directory must hold millions of (hash, holder) entries in
well under 100 bytes each and answer 256-block prefix lookups in microseconds.
A dict of Python ints costs ~110 bytes an entry and a numpy pipeline pays
a microsecond or more per call, so the index keeps plain numpy arrays and
walks them with two small compiled kernels (numba, released GIL):

- the *main level*: entries sorted by hash in CSR form (each distinct hash
  once in `_ukeys`; its holders' node indices and slots in `_nodes`/`_slots`
  between `_starts[j]` and `_starts[j+1]`), plus an open-addressing table over
  `_ukeys`. Block hashes are uniform, so a hash's home slot is its value
  scaled to the table; keys sit in sorted order (ordered linear probing) and
  empty slots repeat the next key, which keeps the table sorted: a probe
  walks forward from home while the keys there are smaller. One or two cache
  misses find a hash, instead of a twenty-step binary search.
- the *recent level*: entries not merged yet, in three small arrays sorted by
  hash. It is merged into the main level once it outgrows `merge_threshold`
  and 1/16 of the main level, so merging costs O(1) amortised per entry.

Removals mark an entry's node as DEAD (a tombstone) in the main level and
delete it from the recent level; tombstones are compacted away when they make
up a quarter of the main level. Every mutation is deterministic (no clocks,
randomness or I/O): it runs inside the Raft state machine, so every replica
reaches the same arrays from the same calls. Not thread-safe: the caller
serialises mutations against reads.
"""

from __future__ import annotations

import numpy as np
import xxhash
from numba import njit

DEAD = np.uint32(0xFFFFFFFF)
_U64_MAX = np.uint64(2**64 - 1)
_LOAD = 0.5  # occupancy of the probe table
_EMPTY_U64 = np.empty(0, dtype=np.uint64)
_EMPTY_U32 = np.empty(0, dtype=np.uint32)
_NO_MATCH = (np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), np.empty((0, 0), dtype=np.uint32))


# -- kernels ------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _home(h: np.uint64, tsize: np.uint64) -> np.int64:  # pragma: no cover - compiled
    return np.int64(((h >> np.uint64(32)) * tsize) >> np.uint64(32))


@njit(cache=True, nogil=True)
def _main_row(
    h: np.uint64, tkey: np.ndarray, trow: np.ndarray, tsize: np.uint64, empty_row: int
) -> np.int64 | int:  # pragma: no cover - compiled
    p = _home(h, tsize)
    while tkey[p] < h:
        p += 1
    return trow[p] if tkey[p] == h else empty_row


@njit(cache=True, nogil=True)
def _locate(
    hashes: np.ndarray,
    node: np.uint32,
    tkey: np.ndarray,
    trow: np.ndarray,
    tsize: np.uint64,
    starts: np.ndarray,
    nodes: np.ndarray,
    rkeys: np.ndarray,
    rnodes: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """Where (hashes[i], node) lives: position in the main level, or in the recent level, or -1."""
    n = len(hashes)
    main = np.full(n, -1, np.int64)
    recent = np.full(n, -1, np.int64)
    empty_row = len(starts) - 2
    for i in range(n):
        h = hashes[i]
        r = _main_row(h, tkey, trow, tsize, empty_row)
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
    return main, recent


@njit(cache=True, nogil=True)
def _prefix_match(
    q: np.ndarray,
    tkey: np.ndarray,
    trow: np.ndarray,
    tsize: np.uint64,
    starts: np.ndarray,
    nodes: np.ndarray,
    slots: np.ndarray,
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
    empty_row = len(starts) - 2
    dead = np.uint32(0xFFFFFFFF)
    cand_of = np.full(node_bound, -1, np.int64)
    cand = np.empty(node_bound, np.int64)
    first_slot = np.empty(node_bound, np.uint32)
    c = 0
    r = _main_row(q[0], tkey, trow, tsize, empty_row)
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
        r = _main_row(h, tkey, trow, tsize, empty_row)
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
def _probe_table(ukeys: np.ndarray, tsize: np.uint64) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """The probe table over sorted `ukeys` (tkey, trow), in one pass: each key at its home slot or the
    first free one after it (ordered linear probing); an empty slot repeats the next key and its row, so
    that a probe stops at the first key not smaller than the one it seeks; a sentinel slot ends it."""
    u = len(ukeys)
    size = np.int64(tsize)
    last = np.int64(-1)  # the slot of the previous key
    pos = np.empty(u, np.int64)
    for i in range(u):
        last = max(_home(ukeys[i], tsize), last + 1)
        pos[i] = last
    length = max(size, last + 1) + 1
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


# -- the index -------------------------------------------------------------------------


class BlockIndex:
    """A multimap hash -> {node index: slot} with longest-prefix lookup per node."""

    def __init__(self, merge_threshold: int = 16384) -> None:
        self.merge_threshold = merge_threshold
        # Main level (CSR); _starts has one more row than _ukeys: an empty row that
        # probes for absent hashes land on.
        self._ukeys = _EMPTY_U64
        self._starts = np.zeros(2, dtype=np.int64)
        self._nodes = _EMPTY_U32
        self._slots = _EMPTY_U32
        self._tsize = np.uint64(1)
        self._tkey = np.full(2, _U64_MAX, dtype=np.uint64)
        self._trow = np.zeros(2, dtype=np.int64)
        self._dead = 0
        # Recent level, sorted by hash.
        self._rkeys = _EMPTY_U64
        self._rnodes = _EMPTY_U32
        self._rslots = _EMPTY_U32
        self._counts: dict[int, int] = {}
        self._node_bound = 0  # 1 + the largest node index ever stored

    # -- size ---------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._nodes) - self._dead + len(self._rkeys)

    def count(self, node: int) -> int:
        """Entries held by `node`."""
        return self._counts.get(node, 0)

    def nbytes(self) -> int:
        """Bytes held in arrays."""
        arrays = (
            self._ukeys,
            self._starts,
            self._nodes,
            self._slots,
            self._tkey,
            self._trow,
            self._rkeys,
            self._rnodes,
            self._rslots,
        )
        return sum(a.nbytes for a in arrays)

    # -- mutation -------------------------------------------------------------

    def _locate(self, hashes: np.ndarray, node: int) -> tuple[np.ndarray, np.ndarray]:
        return _locate(
            hashes, np.uint32(node), self._tkey, self._trow, self._tsize, self._starts, self._nodes, self._rkeys, self._rnodes
        )

    def missing(self, node: int, hashes: np.ndarray) -> int:
        """How many distinct hashes `node` does not hold yet (what a put would add)."""
        main, recent = self._locate(np.unique(hashes), node)
        return int(((main < 0) & (recent < 0)).sum())

    def put(self, node: int, hashes: np.ndarray, slots: np.ndarray) -> int:
        """Record that `node` holds hashes[i] at slots[i]; returns how many entries were new.

        A hash the node already holds gets its slot updated; duplicates in one
        call resolve to the last slot given.
        """
        if len(hashes) > 1:
            hashes, last = np.unique(hashes[::-1], return_index=True)  # sorted, last occurrence wins
            slots = slots[::-1][last]
        main, recent = self._locate(hashes, node)
        in_main = main >= 0
        in_recent = recent >= 0
        self._slots[main[in_main]] = slots[in_main]
        self._rslots[recent[in_recent]] = slots[in_recent]
        new = ~(in_main | in_recent)
        added = int(new.sum())
        if added:
            self._rkeys, self._rnodes, self._rslots = _insert_sorted(
                self._rkeys,
                self._rnodes,
                self._rslots,
                hashes[new].astype(np.uint64),
                np.uint32(node),
                slots[new].astype(np.uint32),
            )
            self._counts[node] = self._counts.get(node, 0) + added
            self._node_bound = max(self._node_bound, node + 1)
            if len(self._rkeys) >= max(self.merge_threshold, len(self._nodes) // 16):
                self.merge()
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
        if len(self._rkeys):
            self.merge()

    def remove(self, node: int, hashes: np.ndarray) -> int:
        """Forget that `node` holds these hashes; unknown ones are ignored. Returns entries removed."""
        main, recent = self._locate(hashes, node)
        main = np.unique(main[main >= 0])
        recent = np.unique(recent[recent >= 0])
        self._nodes[main] = DEAD
        self._dead += len(main)
        if len(recent):
            self._rkeys = np.delete(self._rkeys, recent)
            self._rnodes = np.delete(self._rnodes, recent)
            self._rslots = np.delete(self._rslots, recent)
        removed = len(main) + len(recent)
        self._uncount(node, removed)
        self._maybe_compact()
        return removed

    def drop_node(self, node: int) -> int:
        """Forget every entry of `node` (new epoch, expiry, deregistration). Returns entries removed."""
        if not self._counts.pop(node, 0):
            return 0
        mask = self._nodes == node
        in_main = int(mask.sum())
        self._nodes[mask] = DEAD
        self._dead += in_main
        keep = self._rnodes != node
        in_recent = len(keep) - int(keep.sum())
        if in_recent:
            self._rkeys, self._rnodes, self._rslots = self._rkeys[keep], self._rnodes[keep], self._rslots[keep]
        self._maybe_compact()
        return in_main + in_recent

    def _uncount(self, node: int, n: int) -> None:
        left = self._counts.get(node, 0) - n
        if left > 0:
            self._counts[node] = left
        else:
            self._counts.pop(node, None)

    def _maybe_compact(self) -> None:
        if self._dead and self._dead * 4 >= len(self._nodes):
            self.merge()

    def _main_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Live entries of the main level as (hashes, nodes, slots), sorted by hash."""
        keys = np.repeat(self._ukeys, np.diff(self._starts[:-1]))
        nodes, slots = self._nodes, self._slots
        if self._dead:
            live = nodes != DEAD
            keys, nodes, slots = keys[live], nodes[live], slots[live]
        return keys, nodes, slots

    def merge(self) -> None:
        """Fold the recent level into the main level, drop tombstones and rebuild the probe table."""
        self._ukeys, self._starts, self._nodes, self._slots = _merge_levels(
            self._ukeys, self._starts, self._nodes, self._slots, self._rkeys, self._rnodes, self._rslots
        )
        self._dead = 0
        self._rkeys, self._rnodes, self._rslots = _EMPTY_U64, _EMPTY_U32, _EMPTY_U32
        self._tsize = np.uint64(max(1, int(np.ceil(len(self._ukeys) / _LOAD))))
        self._tkey, self._trow = _probe_table(self._ukeys, self._tsize)

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
            self._tkey,
            self._trow,
            self._tsize,
            self._starts,
            self._nodes,
            self._slots,
            self._rkeys,
            self._rnodes,
            self._rslots,
            self._node_bound,
            with_slots,
        )

    def entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All live entries as (hashes, nodes, slots), copied, in no particular order: cheap enough to
        take under the state lock (a watch stream's snapshot), unlike the sorted `items`."""
        keys, nodes, slots = self._main_arrays()
        return (
            np.concatenate([keys, self._rkeys]),
            np.concatenate([nodes, self._rnodes]),
            np.concatenate([slots, self._rslots]),
        )

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
    kernels = (
        _locate,
        _prefix_match,
        _merge_levels,
        _probe_table,
        _insert_sorted,
    )  # the others are only called from these, and compiled into them
    return (sum(sum(k.stats.cache_hits.values()) for k in kernels), sum(sum(k.stats.cache_misses.values()) for k in kernels))
