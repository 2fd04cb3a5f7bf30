"""The index's compiled kernels (numba, released GIL) and the layout of the tables they read (kvproto.index).

Why raw addresses: a lookup touches a random partition per hash, and numba's
typed lists cost 12-17 ns per array fetched (five per hash), more than a
probe. The kernels instead get a table of each partition's array addresses
and lengths (`_meta`, a row a partition) and view the arrays in place; the
index keeps every array referenced for as long as its address is in the
table, re-points the table (`_publish`, `_relayout`) whenever it replaces
one, and pickles arrays, never addresses.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, types
from numba.extending import intrinsic
from numba.np.numpy_support import carray

DEAD = np.uint32(0xFFFFFFFF)

# Columns of the address table (`_meta`): the arrays the kernels read, per partition.
_TKEY, _TROW, _STARTS, _NODES, _SLOTS = range(5)
_LEN = 5  # column of the first length in `_meta`: a partition's addresses, then their lengths
# Columns of the parameter table (`_prm`, uint64), per partition.
_LO, _SHIFT, _MUL = range(3)


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
    cand_of = np.full(node_bound, -1, np.int64)
    cand = np.empty(node_bound, np.int64)
    first_slot = np.empty(node_bound, np.uint32)
    c = _first_holders(q[0], prm, pmap, pshift, meta, rkeys, rnodes, rslots, cand_of, cand, first_slot)
    matched = np.ones(c, np.int64)
    out_slots = np.zeros((c, n if want_slots else 0), np.uint32)
    if want_slots:
        for k in range(c):
            out_slots[k, 0] = first_slot[k]
    dead = np.uint32(0xFFFFFFFF)
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
    order = _longest_first(cand, matched, c)
    return cand[order], matched[order], out_slots[order]


@njit(cache=True, nogil=True)
def _first_holders(
    h: np.uint64,
    prm: np.ndarray,
    pmap: np.ndarray,
    pshift: np.uint64,
    meta: np.ndarray,
    rkeys: np.ndarray,
    rnodes: np.ndarray,
    rslots: np.ndarray,
    cand_of: np.ndarray,
    cand: np.ndarray,
    first_slot: np.ndarray,
) -> int:  # pragma: no cover - compiled
    """The live holders of h, main level first, as `_prefix_match`'s candidates: their nodes in `cand`, each
    node's place in `cand_of`, their slots in `first_slot`. Returns how many."""
    dead = np.uint32(0xFFFFFFFF)
    c = 0
    p = _part_of(h, prm, pmap, pshift)
    r = _main_row(h, p, prm, meta)
    starts = _i64(meta, _STARTS, p)
    nodes = _u32(meta, _NODES, p)
    slots = _u32(meta, _SLOTS, p)
    for e in range(starts[r], starts[r + 1]):
        if nodes[e] != dead:
            cand_of[nodes[e]] = c
            cand[c] = nodes[e]
            first_slot[c] = slots[e]
            c += 1
    j = np.searchsorted(rkeys, h)
    while j < len(rkeys) and rkeys[j] == h:
        cand_of[rnodes[j]] = c
        cand[c] = rnodes[j]
        first_slot[c] = rslots[j]
        c += 1
        j += 1
    return c


@njit(cache=True, nogil=True)
def _longest_first(cand: np.ndarray, matched: np.ndarray, c: int) -> np.ndarray:  # pragma: no cover - compiled
    """The order of the first c candidates: longest run first, ties by node index (an insertion sort, as c is small)."""
    order = np.arange(c)
    for a in range(1, c):
        x = order[a]
        b = a - 1
        while b >= 0 and (matched[order[b]] < matched[x] or (matched[order[b]] == matched[x] and cand[order[b]] > cand[x])):
            order[b + 1] = order[b]
            b -= 1
        order[b + 1] = x
    return order


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
