"""The worker stub's host tier: device blocks the pool evicts live on in a registered host pool.

A stand-in for an engine's CPU offload (vLLM's offloading connector, SGLang's HiCache L2, Dynamo's KVBM G2):
`host_blocks` slots per tensor-parallel rank in host memory of their own, registered with the rank's transfer
engine as a region of medium `host` (docs/protocol.md §2.3), so a peer can read a block from either tier.
What a slot holds is only this tier's business; the pool (worker_stub.pool) moves blocks in on eviction and
out when a request loads them back, and publishes every move as the block's new location.

A block lives in one tier at a time: loading it back to the device moves it (its host slot is freed), so the
directory's one location per (block, node) is always where the node holds it. Slots are evicted least
recently stored first. Nothing pins a host slot: a peer's read of a slot reused meanwhile reads another block's
bytes, which fail the content check (worker_stub.slot_memory) and are recomputed.

Not thread-safe: used from the pool's one asyncio loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

import numpy as np

from worker_stub.slot_memory import SlotMemory


class HostTier(SlotMemory):
    """`capacity_blocks` host slots per rank, LRU; `store` copies a device slot in, `take` hands one back."""

    def __init__(self, capacity_blocks: int, block_bytes: int, tp: int) -> None:
        super().__init__(capacity_blocks, block_bytes, tp)
        self._lru: OrderedDict[int, int] = OrderedDict()  # hash -> host slot, least recently stored first
        self._free: list[int] = list(range(capacity_blocks - 1, -1, -1))
        self.stats = {"stored": 0, "evictions": 0, "loads": 0}

    def __contains__(self, hash: int) -> bool:
        return hash in self._lru

    def slot_of(self, hash: int) -> int | None:
        return self._lru.get(hash)

    def blocks(self) -> list[tuple[int, int]]:
        """Every (hash, host slot) held."""
        return list(self._lru.items())

    @property
    def used_slots(self) -> int:
        return len(self._lru)

    @property
    def full(self) -> bool:
        return not self._free

    def victim(self, protect: Container[int]) -> int | None:
        """The least recently stored hash not in `protect` (blocks a request is loading back): what `store` may
        evict when the tier is full. None: every block here is protected."""
        return next((h for h in self._lru if h not in protect), None)

    def store(self, hash: int, device: SlotMemory, slot: int, evict: int | None = None) -> None:
        """Copy `hash` (not held here: a block lives in one tier) from `device`'s `slot`, every rank, into a free
        host slot, else into `evict`'s (a `victim`, required when `full`). Call before the device slot is reused."""
        if self._free:
            s = self._free.pop()
        else:
            if evict is None:
                raise ValueError("the host tier is full: name the block to evict")
            s = self._lru.pop(evict)
            self.stats["evictions"] += 1
        for rank in range(self.tp):
            self.slot_view(rank, s)[:] = device.slot_view(rank, slot)
        self._lru[hash] = s
        self.stats["stored"] += 1

    def take(self, hash: int) -> list[np.ndarray]:
        """`hash`'s bytes, one copy per rank, its host slot freed: the block moves back to the device (taken out
        first, so that the device block evicted to make room for it can have its host slot)."""
        s = self._lru.pop(hash)
        out = [self.slot_view(rank, s).copy() for rank in range(self.tp)]
        self._free.append(s)
        self.stats["loads"] += 1
        return out
