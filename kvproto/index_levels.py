"""The block index's levels (kvproto.index): the main level of each partition (`_Part`), the recent level,
the tables through which the kernels read both (kvproto.index_kernels), and every read of them.

`_Levels` holds the arrays and answers queries; `BlockIndex` adds the mutations, which keep them merged,
copy-on-write and deterministic. A frozen view (`FrozenEntries`) reads arrays the index no longer writes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from kvproto.index_kernels import _LEN, _LO, DEAD, _locate, _prefix_match, _probe_table

_LOAD = 0.5  # occupancy of the probe table
_EMPTY_U64 = np.empty(0, dtype=np.uint64)
_EMPTY_U32 = np.empty(0, dtype=np.uint32)
_NO_MATCH = (np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), np.empty((0, 0), dtype=np.uint32))


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


class _Levels:
    """The index's arrays and the reads of them; `BlockIndex` is the whole index."""

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

    def _probe_tables(self) -> tuple[np.ndarray, np.ndarray, np.uint64, np.ndarray, np.ndarray, np.ndarray]:
        """What the kernels need to find a hash: the partitions' parameters, map and addresses, and the recent level."""
        return self._prm, self._pmap, self._pshift, self._meta, self._rkeys, self._rnodes

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

    # -- queries ------------------------------------------------------------------

    def _locate(self, hashes: np.ndarray, node: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return _locate(np.ascontiguousarray(hashes, dtype=np.uint64), np.uint32(node), *self._probe_tables())

    def missing(self, node: int, hashes: np.ndarray) -> int:
        """How many distinct hashes `node` does not hold yet (what a put would add)."""
        _, main, recent = self._locate(np.unique(hashes), node)
        return int(((main < 0) & (recent < 0)).sum())

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
