"""The block index: which node holds which block hash, at which slot.

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
  level a partition would cost a Python round trip per partition a put touches),
  copying it whole (up to N/16 entries). A partition's share of it is
  merged into that partition once it outgrows both its share of
  `merge_threshold` and 1/16 of the partition, so merging costs O(1)
  amortised per entry.

Why partitions: a merge rebuilds a main level, inside a mutation on every
replica's Raft thread and in every gateway's mirror at once. With one main
level that is O(N), which at millions of entries leaves mirrors stale. A
merge that leaves a partition over `_PART_ENTRIES` entries splits it at
distinct hashes into halves or smaller, so a merge rebuilds at most about that
many entries however large the index grows, and a small index is one
partition: the one-level layout it had. Cuts at distinct hashes rather than at
hash bits stay balanced for non-uniform hashes too (tests use small integers).
A mutation merges due partitions up to a budget, at least one
(`_rebuild_due`); those that fall due together (after a large drop_node, say)
wait for the next mutations, correct meanwhile: tombstones and a longer recent
level only slow reads a little.

Why copy-on-write: a watch stream's snapshot must not hold the state lock for O(entries) (the Raft
thread waits for that lock to apply, so a copy of millions of entries under it stalls its heartbeats).
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

The kernels and the layout of their tables are in kvproto.index_kernels; the levels and the reads of them
in kvproto.index_levels; the mutations, merges and snapshots here.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from kvproto.index_kernels import (
    _LEN,
    _LO,
    _NODES,
    _SLOTS,
    DEAD,
    _drop,
    _insert_sorted,
    _locate,
    _merge_levels,
    _prefix_match,
    _probe_table,
    _store,
)
from kvproto.index_levels import _EMPTY_U32, _EMPTY_U64, FrozenEntries, _Levels, _Part

__all__ = ["BlockIndex", "warm_up"]

_PART_ENTRIES = 1 << 17  # a partition a merge leaves larger is split: that bounds what one merge rebuilds


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


class BlockIndex(_Levels):
    """A multimap hash -> {node index: slot} with longest-prefix lookup per node."""

    # -- merges --------------------------------------------------------------------

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

    def merge(self) -> None:
        """Fold the recent level into the main levels, drop tombstones and rebuild the probe tables: O(N),
        for `load`, tests and benchmarks; mutations merge a partition at a time."""
        self._parts = [q for p in self._parts for q in self._rebuilt(p, *self._recent_range(p))]
        self._rkeys, self._rnodes, self._rslots = _EMPTY_U64, _EMPTY_U32, _EMPTY_U32
        self._nshared = 0
        self._dead = np.zeros(len(self._parts), dtype=np.int64)
        self._rcount = np.zeros(len(self._parts), dtype=np.int64)
        self._relayout()

    # -- mutation -------------------------------------------------------------

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

        Marks its main-level entries in one pass over all of them (one kernel call); the partitions
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

    def _uncount(self, node: int, n: int) -> None:
        left = self._counts.get(node, 0) - n
        if left > 0:
            self._counts[node] = left
        else:
            self._counts.pop(node, None)

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

    # -- Raft snapshots (kvproto.codec) ---------------------------------------------------

    def export(self) -> dict[str, Any]:
        """The index as arrays and numbers, partitioned as it is (kvproto.codec.encode_state): the probe and
        address tables are rebuilt by `restore` (addresses would be meaningless in another process). A partition's
        `hi` is written inclusive: the last one's exclusive bound, 2**64, is no msgpack integer."""
        return {
            "merge_threshold": self.merge_threshold,
            "parts": [[p.lo, p.hi - 1, p.ukeys, p.starts, p.nodes, p.slots] for p in self._parts],
            "dead": self._dead,
            "recent": [self._rkeys, self._rnodes, self._rslots],
            "size": self._size,
            "counts": sorted(self._counts.items()),
            "node_bound": self._node_bound,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Replace this index by what `export` gave (a snapshot from this replica's disk or its leader)."""
        self.merge_threshold = state["merge_threshold"]
        self._parts = [
            _Part(int(lo), int(last) + 1, (ukeys, starts, nodes, slots))
            for lo, last, ukeys, starts, nodes, slots in state["parts"]
        ]
        self._dead = state["dead"]
        self._rkeys, self._rnodes, self._rslots = state["recent"]
        self._recent_shared, self._nshared = False, 0
        self._size = state["size"]
        self._counts = {int(node): int(n) for node, n in state["counts"]}
        self._node_bound = state["node_bound"]
        self._relayout()
        where = np.searchsorted(self._prm[:, _LO], self._rkeys, side="right") - 1
        self._rcount = np.bincount(where, minlength=len(self._parts)).astype(np.int64)


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
