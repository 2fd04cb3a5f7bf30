"""A KV pool's memory and what it should hold: one contiguous region per tensor-parallel rank, and the content
function that makes a block's bytes checkable.

A node keeps KV blocks in `capacity_blocks` fixed-size slots per tensor-parallel
rank. Each rank is one contiguous region of host memory (a numpy uint8 array),
so a transfer engine can register it once and a peer can read slot `s` of rank
`r` at `regions[r].base_addr + s * block_bytes` (docs/protocol.md §2). Slots are
mirrored: slot `s` holds the same block on every rank, so a directory entry is
just `(hash -> node, slot)`.

Block content is a pure function of `(block hash, rank)` (`expected`), so a node
that pulled bytes from a peer can check them without trusting the peer, and a
test can tell a mis-addressed read from a good one.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

_xxh3 = xxhash.xxh3_64_intdigest
_hash_rank = struct.Struct("<QQ")
_U64 = np.dtype("<u8")
# SplitMix64 constants: a fixed, numpy-version-independent generator, so that two
# nodes running different numpy releases still agree on a block's bytes.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


@dataclass(frozen=True)
class Region:
    """One rank's KV memory, as registered with a transfer engine and the directory."""

    rank: int
    base_addr: int
    length: int
    block_bytes: int


class SlotMemory:
    """`capacity_blocks` slots of `block_bytes` on each of `tp` ranks, addressable by a peer; which block a
    slot holds is the pool's business (`worker_stub.pool.KVPool`)."""

    def __init__(self, capacity_blocks: int, block_bytes: int, tp: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.tp = tp
        # Touch every page now, as an engine's preallocated KV memory is: np.zeros alone maps
        # pages lazily, and a pull into untouched memory would pay a page fault per 4 KiB.
        self._bufs = [np.empty(capacity_blocks * block_bytes, dtype=np.uint8) for _ in range(tp)]
        for b in self._bufs:
            b.fill(0)
        self._views = [b.reshape(capacity_blocks, block_bytes) for b in self._bufs]
        self.regions: list[Region] = [
            Region(rank=r, base_addr=b.ctypes.data, length=b.nbytes, block_bytes=block_bytes) for r, b in enumerate(self._bufs)
        ]

    # -- memory --------------------------------------------------------------------

    def buffer(self, rank: int) -> np.ndarray:
        """The rank's whole region (a view: writes land in the pool)."""
        return self._bufs[self._rank(rank)]

    def slot_addr(self, rank: int, slot: int) -> int:
        """Address of `slot` on `rank`: what a peer reads or writes over the transfer engine."""
        return self.regions[self._rank(rank)].base_addr + self._slot(slot) * self.block_bytes

    def slot_view(self, rank: int, slot: int) -> np.ndarray:
        """The bytes of one slot on one rank (a view)."""
        view: np.ndarray = self._views[self._rank(rank)][self._slot(slot)]
        return view

    # -- content -------------------------------------------------------------------

    def expected(self, hash: int, rank: int) -> np.ndarray:
        """The content function: SplitMix64 stream seeded by XXH3(le64(hash) || le64(rank)).

        Vectorised and computed afresh each time, so
        verification costs no memory and cannot be fooled by a stale cache.
        """
        seed = np.uint64(_xxh3(_hash_rank.pack(hash, rank)))
        n_words = -(-self.block_bytes // 8)
        z = np.arange(1, n_words + 1, dtype=np.uint64)
        z *= _GOLDEN
        z += seed
        z ^= z >> _S30
        z *= _MIX1
        z ^= z >> _S27
        z *= _MIX2
        z ^= z >> _S31
        return z.astype(_U64, copy=False).view(np.uint8)[: self.block_bytes]

    def fill(self, hash: int, slot: int) -> None:
        """Write `hash`'s content into `slot` on every rank: the stub's "prefill" of a block."""
        slot = self._slot(slot)
        for rank, view in enumerate(self._views):
            view[slot] = self.expected(hash, rank)

    def verify(self, hash: int, slot: int) -> bool:
        """Whether `slot` holds exactly `hash`'s content on every rank (e.g. after a pull)."""
        slot = self._slot(slot)
        return all(np.array_equal(view[slot], self.expected(hash, rank)) for rank, view in enumerate(self._views))

    def _rank(self, rank: int) -> int:
        if not 0 <= rank < self.tp:
            raise IndexError(f"rank {rank} out of range 0..{self.tp - 1}")
        return rank

    def _slot(self, slot: int) -> int:
        if not 0 <= slot < self.capacity_blocks:
            raise IndexError(f"slot {slot} out of range 0..{self.capacity_blocks - 1}")
        return slot
