"""The vLLM connector's host tier as its scheduler half keeps it: which block each host slot holds.

The workers copy every block the engine completes into a host pool of `capacity` slots per TP rank (the
connector's docstring says why at completion); the scheduler decides the slot, so that every rank uses the same
one (mirrored, as device blocks are) and the directory can be told where the block lies once vLLM evicts its
device copy. Pure bookkeeping, no vLLM: a save is *reserved* (`reserve`: the slot goes to the workers with the
step) and becomes usable when every rank reported it done (`confirm`), or its slot is freed (`fail`). Slots are
reused least recently saved or loaded first.

Not thread-safe: the connector holds its lock around every call (the scheduler and its publisher thread share it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence


class HostSlots:
    """`capacity` host slots: confirmed blocks (kvdir hash -> slot) in LRU order, and saves under way."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._held: OrderedDict[int, int] = OrderedDict()  # confirmed: hash -> slot, least recently used first
        self._saving: dict[int, int] = {}  # reserved, not confirmed: hash -> slot
        self._free = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, h: int) -> bool:
        return h in self._held

    def slot_of(self, h: int) -> int | None:
        return self._held.get(h)

    def items(self) -> Iterator[tuple[int, int]]:
        """Every confirmed (hash, slot)."""
        return iter(list(self._held.items()))

    def reserve(self, h: int) -> tuple[int, int | None] | None:
        """A slot to save block `h` into, and the confirmed block evicted to free it (None if a slot was free);
        None when `h` is held or being saved already (it is then the most recently used), or when every slot is
        being saved into."""
        if h in self._held:
            self._held.move_to_end(h)
            return None
        if h in self._saving:
            return None
        evicted = None
        if self._free:
            slot = self._free.pop()
        elif self._held:
            evicted, slot = self._held.popitem(last=False)
        else:
            return None
        self._saving[h] = slot
        return slot, evicted

    def confirm(self, h: int, slot: int) -> bool:
        """Every rank saved `h` into `slot`: it is held there now (False if that was not the save under way)."""
        if self._saving.get(h) != slot:
            return False
        del self._saving[h]
        self._held[h] = slot
        return True

    def fail(self, h: int, slot: int) -> None:
        """The save of `h` into `slot` did not happen on every rank: the slot is free again."""
        if self._saving.get(h) == slot:
            del self._saving[h]
            self._free.append(slot)

    def run(self, hashes: Sequence[int]) -> list[int]:
        """The slots of the leading `hashes` held here (what a request can load back), each now most recently used."""
        out = []
        for h in hashes:
            slot = self._held.get(h)
            if slot is None:
                break
            self._held.move_to_end(h)
            out.append(slot)
        return out
