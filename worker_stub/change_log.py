"""The pool's changes since the worker last published them: per block hash, its net change only.

A block's place is its *location* (kvproto.media): its slot, with the medium in the top bits, so a block the pool
moves from the device to its host tier is one change, a store at the new location.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class ChangeLog:
    """Hashes whose location changed since the last `drain`, each with the location it was published at then.

    Coalesced per hash to its net change, ordered by each hash's last event:
    a hash is in at most one of `drain`'s lists, so the two may be published in
    either order or concurrently. (Uncoalesced, evict-then-store-again and
    store-then-evict would need the exact interleaving to be replayed.) A
    block stored and evicted between two drains, or re-cached in the slot
    it was published at, yields nothing.
    """

    def __init__(self) -> None:
        # hash -> location it was published at (None: absent) when first touched since the last drain
        self._dirty: OrderedDict[int, int | None] = OrderedDict()

    def touch(self, h: int, location: int | None) -> None:
        """Note a change of `h`, held at `location` until now (None: not held), keeping what was true at the last
        drain."""
        before = self._dirty.pop(h, location)
        self._dirty[h] = before

    def drain(self, where: Callable[[int], int | None]) -> tuple[list[tuple[int, int]], list[int]]:
        """(stored (hash, location), removed hashes) since the last call, `where(hash)` being where it is now."""
        stored: list[tuple[int, int]] = []
        removed: list[int] = []
        for h, before in self._dirty.items():
            now = where(h)
            if now == before:
                continue
            if now is None:
                removed.append(h)
            else:
                stored.append((h, now))
        self._dirty.clear()
        return stored, removed
