"""The block index: which node holds which block hash, at which slot.

Why this shape: the directory must hold millions of (hash, holder) entries in
under 100 bytes each and answer 256-block prefix lookups in tens of
microseconds. A dict of Python ints costs ~110 bytes per entry; here the bulk
lives in three parallel numpy arrays sorted by hash (8 + 4 + 4 = 16 bytes an
entry) and new entries land in a small dict (the delta) that is merged into
the arrays once it reaches `merge_threshold` entries. Removals mark the
entry's node as DEAD (a tombstone) and tombstones are compacted away when they
make up a quarter of the arrays. Lookups are vectorised with searchsorted.

Everything here is deterministic (no clocks, no randomness, no I/O): it runs
inside the Raft state machine, so every replica must reach the same layout
from the same sequence of calls. Not thread-safe: the caller serialises
mutations against reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

DEAD = np.uint32(0xFFFFFFFF)
_EMPTY_U64 = np.empty(0, dtype=np.uint64)
_EMPTY_U32 = np.empty(0, dtype=np.uint32)


@dataclass(frozen=True, slots=True)
class Match:
    """One holder of a looked-up prefix: node index, blocks matched from the start, their slots."""

    node: int
    matched: int
    slots: np.ndarray | None


class BlockIndex:
    """A multimap hash -> {node index: slot} with longest-prefix lookup per node."""

    def __init__(self, merge_threshold: int = 16384) -> None:
        self.merge_threshold = merge_threshold
        # Entries sorted by hash, stored as CSR: hash _ukeys[j] is held by
        # _nodes[_starts[j]:_starts[j+1]] at the matching _slots.
        self._nodes = _EMPTY_U32
        self._slots = _EMPTY_U32
        self._ukeys = _EMPTY_U64
        self._starts = np.zeros(1, dtype=np.int64)
        self._dead = 0
        self._delta: dict[int, dict[int, int]] = {}
        self._delta_len = 0
        self._counts: dict[int, int] = {}

    # -- size ---------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._nodes) - self._dead + self._delta_len

    def count(self, node: int) -> int:
        """Entries held by `node`."""
        return self._counts.get(node, 0)

    def nbytes(self) -> int:
        """Bytes in the sorted arrays (the delta is bounded by merge_threshold)."""
        arrays = (self._nodes, self._slots, self._ukeys, self._starts)
        return sum(a.nbytes for a in arrays)

    # -- mutation -------------------------------------------------------------

    def _base_positions(self, hashes: np.ndarray, node: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions in the arrays of live entries (hashes[i], node); returns (query index, position)."""
        ukeys = self._ukeys
        if not len(ukeys) or not len(hashes):
            empty = np.empty(0, dtype=np.intp)
            return empty, empty
        ui = np.searchsorted(ukeys, hashes)
        np.minimum(ui, len(ukeys) - 1, out=ui)
        qi = np.flatnonzero(ukeys[ui] == hashes)
        u = ui[qi]
        qi, pos = _expand(self._starts[u], self._starts[u + 1], qi)
        hit = self._nodes[pos] == node
        return qi[hit], pos[hit]

    def put(self, node: int, hashes: np.ndarray, slots: np.ndarray) -> int:
        """Record that `node` holds hashes[i] at slots[i]; returns how many entries were new.

        A hash the node already holds gets its slot updated; duplicates in one
        call resolve to the last slot given.
        """
        qi, pos = self._base_positions(hashes, node)
        in_base = np.zeros(len(hashes), dtype=bool)
        if len(pos):
            self._slots[pos] = slots[qi]
            in_base[qi] = True
        new = 0
        delta = self._delta
        for h, s in zip(hashes[~in_base].tolist(), slots[~in_base].tolist()):
            holders = delta.get(h)
            if holders is None:
                delta[h] = {node: s}
                new += 1
            else:
                if node not in holders:
                    new += 1
                holders[node] = s
        self._delta_len += new
        self._counts[node] = self._counts.get(node, 0) + new
        if self._delta_len >= self.merge_threshold:
            self.merge()
        return new

    def remove(self, node: int, hashes: np.ndarray) -> int:
        """Forget that `node` holds these hashes; unknown ones are ignored. Returns entries removed."""
        removed = 0
        delta = self._delta
        for h in hashes.tolist():
            holders = delta.get(h)
            if holders is not None and node in holders:
                del holders[node]
                if not holders:
                    del delta[h]
                removed += 1
        self._delta_len -= removed
        _, pos = self._base_positions(hashes, node)
        if len(pos):
            pos = np.unique(pos)
            self._nodes[pos] = DEAD
            self._dead += len(pos)
            removed += len(pos)
        self._uncount(node, removed)
        self._maybe_compact()
        return removed

    def drop_node(self, node: int) -> int:
        """Forget every entry of `node` (new epoch, expiry, deregistration). Returns entries removed."""
        removed = 0
        for h in [h for h, holders in self._delta.items() if node in holders]:
            holders = self._delta[h]
            del holders[node]
            if not holders:
                del self._delta[h]
            removed += 1
        self._delta_len -= removed
        if self._counts.get(node, 0) > removed:
            mask = self._nodes == node
            n = int(mask.sum())
            self._nodes[mask] = DEAD
            self._dead += n
            removed += n
        self._counts.pop(node, None)
        self._maybe_compact()
        return removed

    def _uncount(self, node: int, n: int) -> None:
        left = self._counts.get(node, 0) - n
        if left > 0:
            self._counts[node] = left
        else:
            self._counts.pop(node, None)

    def _maybe_compact(self) -> None:
        if self._dead and self._dead * 4 >= len(self._nodes):
            self.merge()

    def merge(self) -> None:
        """Fold the delta into the sorted arrays and drop tombstones."""
        keys, nodes, slots = self._expanded_keys(), self._nodes, self._slots
        if self._dead:
            live = nodes != DEAD
            keys, nodes, slots = keys[live], nodes[live], slots[live]
        if self._delta_len:
            n = self._delta_len
            dk = np.empty(n, dtype=np.uint64)
            dn = np.empty(n, dtype=np.uint32)
            ds = np.empty(n, dtype=np.uint32)
            i = 0
            for h, holders in self._delta.items():
                for node, slot in holders.items():
                    dk[i], dn[i], ds[i] = h, node, slot
                    i += 1
            order = np.argsort(dk, kind="stable")
            dk, dn, ds = dk[order], dn[order], ds[order]
            at = np.searchsorted(keys, dk, "right")
            keys, nodes, slots = np.insert(keys, at, dk), np.insert(nodes, at, dn), np.insert(slots, at, ds)
        self._nodes, self._slots = nodes, slots
        if len(keys):
            first = np.empty(len(keys), dtype=bool)
            first[0] = True
            np.not_equal(keys[1:], keys[:-1], out=first[1:])
            starts = np.flatnonzero(first)
            self._ukeys = keys[starts]
            self._starts = np.append(starts, len(keys))
        else:
            self._ukeys = _EMPTY_U64
            self._starts = np.zeros(1, dtype=np.int64)
        self._dead = 0
        self._delta = {}
        self._delta_len = 0

    def _expanded_keys(self) -> np.ndarray:
        return np.repeat(self._ukeys, np.diff(self._starts))

    # -- queries ------------------------------------------------------------------

    def lookup(self, hashes: np.ndarray, with_slots: bool = False) -> list[Match]:
        """Per node, the longest run hashes[0..k-1] it holds entirely (k >= 1), longest first.

        Ties are ordered by node index so that every replica answers alike.
        """
        ui, found, n = self._search_prefix(hashes)
        if n == 0:
            return []
        delta_hits: list[tuple[int, dict[int, int]]] = []
        if self._delta:
            get = self._delta.get
            delta_hits = [(i, d) for i, d in enumerate(map(get, hashes[:n].tolist())) if d]
        parts_i: list[np.ndarray] = []
        parts_n: list[np.ndarray] = []
        parts_s: list[np.ndarray] = []
        if len(self._ukeys):
            qi = np.flatnonzero(found[:n])
            u = ui[qi]
            qi, pos = _expand(self._starts[u], self._starts[u + 1], qi)
            if len(pos):
                nd = self._nodes[pos]
                if self._dead:
                    live = nd != DEAD
                    qi, pos, nd = qi[live], pos[live], nd[live]
                parts_i.append(qi)
                parts_n.append(nd)
                if with_slots:
                    parts_s.append(self._slots[pos])
        if delta_hits:
            di = [i for i, holders in delta_hits for _ in holders]
            parts_i.append(np.asarray(di, dtype=np.intp))
            parts_n.append(np.asarray([nd for _, holders in delta_hits for nd in holders], dtype=np.uint32))
            if with_slots:
                parts_s.append(np.asarray([s for _, holders in delta_hits for s in holders.values()], dtype=np.uint32))
        if not parts_i:
            return []
        qi = np.concatenate(parts_i) if len(parts_i) > 1 else parts_i[0]
        nd = np.concatenate(parts_n) if len(parts_n) > 1 else parts_n[0]
        if not len(qi):
            return []
        counts = np.bincount(nd)
        uniq = np.flatnonzero(counts)
        row = np.zeros(len(counts), dtype=np.intp)
        row[uniq] = np.arange(len(uniq))
        inv = row[nd]
        held = np.zeros((len(uniq), n + 1), dtype=bool)
        held[inv, qi] = True
        matched = held.argmin(axis=1)
        slot_rows = None
        if with_slots:
            slot_rows = np.zeros((len(uniq), n), dtype=np.uint32)
            slot_rows[inv, qi] = np.concatenate(parts_s) if len(parts_s) > 1 else parts_s[0]
        order = np.lexsort((uniq, -matched))
        out = []
        for j in order.tolist():
            k = int(matched[j])
            if k == 0:
                break
            out.append(Match(int(uniq[j]), k, slot_rows[j, :k].copy() if slot_rows is not None else None))
        return out

    def _search_prefix(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """Locate hashes in the sorted arrays, stopping at the first hash nobody holds.

        Returns (position in _ukeys, found in the arrays, cut): no node can match
        past `cut`. Searching in growing chunks keeps a query whose prefix ends
        early from paying a cache-missing binary search for every hash.
        """
        total = len(hashes)
        ukeys = self._ukeys
        ui = np.zeros(total, dtype=np.intp)
        found = np.zeros(total, dtype=bool)
        delta = self._delta
        if not len(ukeys):
            if not delta:
                return ui, found, 0
            listed = hashes.tolist()
            return ui, found, next((i for i, h in enumerate(listed) if h not in delta), total)
        last = len(ukeys) - 1
        start, size = 0, 16
        while start < total:
            end = min(total, start + size)
            seg = hashes[start:end]
            u = np.searchsorted(ukeys, seg)
            np.minimum(u, last, out=u)
            f = ukeys[u] == seg
            ui[start:end] = u
            found[start:end] = f
            if not f.all():
                misses = (np.flatnonzero(~f) + start).tolist()
                if not delta:
                    return ui, found, misses[0]
                for m in misses:
                    if int(hashes[m]) not in delta:
                        return ui, found, m
            start = end
            size *= 2
        return ui, found, total

    def items(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All live entries as (hashes, nodes, slots) sorted by (hash, node): a canonical form."""
        keys, nodes, slots = self._expanded_keys(), self._nodes, self._slots
        if self._dead:
            live = nodes != DEAD
            keys, nodes, slots = keys[live], nodes[live], slots[live]
        if self._delta_len:
            extra = [(h, n, s) for h, holders in self._delta.items() for n, s in holders.items()]
            keys = np.concatenate([keys, np.fromiter((e[0] for e in extra), np.uint64, len(extra))])
            nodes = np.concatenate([nodes, np.fromiter((e[1] for e in extra), np.uint32, len(extra))])
            slots = np.concatenate([slots, np.fromiter((e[2] for e in extra), np.uint32, len(extra))])
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


def _expand(lo: np.ndarray, hi: np.ndarray, qi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ranges [lo[j], hi[j]) belonging to query qi[j], every (query, position) pair."""
    cnt = hi - lo
    total = int(cnt.sum())
    if total == 0:
        empty = np.empty(0, dtype=np.intp)
        return empty, empty
    starts = np.repeat(lo - (np.cumsum(cnt) - cnt), cnt)
    return np.repeat(qi, cnt), np.arange(total) + starts
