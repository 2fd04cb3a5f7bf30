"""The pool's changes since the worker last published them: per block hash, its net change only."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping


class ChangeLog:
    """Hashes whose slot changed since the last `drain`, each with the slot it was published at then.

    Coalesced per hash to its net change, ordered by each hash's last event:
    a hash is in at most one of `drain`'s lists, so the two may be published in
    either order or concurrently. (Uncoalesced, evict-then-store-again and
    store-then-evict would need the exact interleaving to be replayed.) A
    block stored and evicted between two drains, or re-cached in the slot
    it was published at, yields nothing.
    """

    def __init__(self) -> None:
        # hash -> slot it was published at (None: absent) when first touched since the last drain
        self._dirty: OrderedDict[int, int | None] = OrderedDict()

    def touch(self, h: int, slot: int | None) -> None:
        """Note a change of `h`, cached at `slot` until now (None: not cached), keeping what was true at the last drain."""
        before = self._dirty.pop(h, slot)
        self._dirty[h] = before

    def drain(self, slot_of: Mapping[int, int]) -> tuple[list[tuple[int, int]], list[int]]:
        """(stored (hash, slot), removed hashes) since the last call, `slot_of` being where each cached hash is now."""
        stored: list[tuple[int, int]] = []
        removed: list[int] = []
        for h, before in self._dirty.items():
            now = slot_of.get(h)
            if now == before:
                continue
            if now is None:
                removed.append(h)
            else:
                stored.append((h, now))
        self._dirty.clear()
        return stored, removed
