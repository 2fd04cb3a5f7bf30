"""The replay simulator's caches: each node's real KV cache, and the directory's lagged view of all of them.

Two block -> node-bitmask maps describe the cluster (bit ``j`` set: node ``j``):

- the *real* one (``holders``), shared by every `NodeCache` and kept exact by
  them as they store and evict; the simulator reads it to know what a node
  really holds when a request arrives or a pull reads from it;
- the *directory's* one (`DirectoryView`), which changes only when a node's
  stores and evictions are published (``publish_lag_s`` later); the router
  builds its candidates from this one, as the gateway builds them from the
  directory's lookups.

Bitmasks rather than per-node sets because the one question asked per request
is "how long a leading run of these blocks does each node hold", and
`leading_runs` answers it for all nodes in one pass over the blocks.

The rules of a node's cache (the model is in `kvtools.replay.sim`'s docstring)
live in `NodeCache` alone: a block is either *pinned* (in use, with a count of
its users) or in the LRU list (held, unused, cold end first); only LRU blocks
are evicted, so a node whose blocks are all pinned briefly holds more than its
capacity, and `NodeCache.settle` brings it back down once blocks are released.

Eviction prefers copies: with ``scan`` > 0, `settle` looks through the
``scan`` coldest unused blocks for one that another node also holds (per
``holders``: an exact global view, as the directory's is) and evicts that
first, the coldest such; only when none of them has another copy does it
evict the coldest block. Losing a copy costs a pull later, losing the last one
a recompute.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["DirectoryView", "NodeCache", "Publish", "leading_runs"]


class Publish(NamedTuple):
    """One node's change, as the directory will learn of it: blocks stored (``adds``) and evicted (``removes``)."""

    node: int
    adds: list[int]
    removes: list[int]


class NodeCache:
    """One node's KV cache: at most ``capacity`` blocks at rest, pinned blocks never evicted.

    ``holders`` is the cluster's real block -> node-bitmask map, shared by all
    the nodes' caches: this cache sets and clears its own bit in it as it
    stores and evicts, so the map always says who really holds what.
    ``evictions`` counts the blocks this cache has evicted.

    Release order matters: `unpin` appends each fully released block at the
    warm end of the LRU list, so callers release a request's blocks deepest
    first and a prefix outlives the blocks that hang from it (as vLLM's
    free-block queue does).
    """

    __slots__ = ("_keep", "bit", "capacity", "evictions", "holders", "lru", "pins", "scan")

    def __init__(self, node: int, capacity: int, holders: dict[int, int], scan: int = 0) -> None:
        self.bit = 1 << node
        self._keep = ~self.bit
        self.capacity = capacity
        self.scan = scan
        self.holders = holders
        self.lru: OrderedDict[int, None] = OrderedDict()  # held, not in use (cold first)
        self.pins: dict[int, int] = {}  # held, in use: block -> users
        self.evictions = 0

    def __len__(self) -> int:
        """Blocks held, pinned or not (may exceed ``capacity`` until `settle`)."""
        return len(self.lru) + len(self.pins)

    def pin(self, blocks: Iterable[int]) -> None:
        """Take one more use of each of `blocks`, which this node must hold (KeyError otherwise).

        For blocks the node already has: the prefix a request finds locally, or
        the blocks a pull is about to read from this node.
        """
        pins = self.pins
        lru = self.lru
        for b in blocks:
            c = pins.get(b)
            if c is None:
                del lru[b]
                pins[b] = 1
            else:
                pins[b] = c + 1

    def store(self, blocks: Iterable[int]) -> list[int]:
        """Pin `blocks` (a prefill's output), storing those the node lacks; returns the newly stored ones.

        The new blocks are added to ``holders`` at once (the node really has
        them now); the caller publishes them to the directory.
        """
        pins = self.pins
        lru = self.lru
        holders = self.holders
        bit = self.bit
        adds: list[int] = []
        for b in blocks:
            c = pins.get(b)
            if c is not None:
                pins[b] = c + 1
            else:
                if b in lru:
                    del lru[b]
                else:
                    holders[b] = holders.get(b, 0) | bit
                    adds.append(b)
                pins[b] = 1
        return adds

    def unpin(self, blocks: Iterable[int]) -> None:
        """Give back one use of each of `blocks`, in order; a block nobody uses joins the LRU's warm end."""
        pins = self.pins
        lru = self.lru
        for b in blocks:
            c = pins[b] - 1
            if c:
                pins[b] = c
            else:
                del pins[b]
                lru[b] = None

    def settle(self) -> list[int]:
        """Evict unused blocks down to capacity (as far as unused ones allow), copies first within the ``scan``
        coldest, else the coldest; returns them in eviction order."""
        lru = self.lru
        over = len(lru) + len(self.pins) - self.capacity
        removes: list[int] = []
        if over > 0:
            holders = self.holders
            keep = self._keep
            scan = self.scan
            while over > 0 and lru:
                copy: int | None = None
                if scan:
                    for i, x in enumerate(lru):
                        if i == scan:
                            break
                        if holders[x] & keep:
                            copy = x
                            break
                if copy is None:
                    b = lru.popitem(last=False)[0]
                else:
                    b = copy
                    del lru[b]
                m = holders[b] & keep
                if m:
                    holders[b] = m
                else:
                    del holders[b]
                removes.append(b)
                over -= 1
            self.evictions += len(removes)
        return removes


class DirectoryView:
    """The directory as the router sees it: block -> bitmask of the nodes it lists, changed only by `publish`."""

    __slots__ = ("masks",)

    def __init__(self) -> None:
        self.masks: dict[int, int] = {}

    def publish(self, change: Publish) -> None:
        """Apply one node's change (its evictions, then its stores; no block is in both, new blocks being pinned)."""
        masks = self.masks
        bit = 1 << change.node
        for b in change.removes:
            m = masks.get(b, 0) & ~bit
            if m:
                masks[b] = m
            else:
                masks.pop(b, None)
        for b in change.adds:
            masks[b] = masks.get(b, 0) | bit


def leading_runs(blocks: tuple[int, ...], masks: dict[int, int], full: int, n: int) -> tuple[list[int], int]:
    """Leading run of `blocks` each of `n` nodes holds per `masks` (block -> bitmask of nodes), and the longest.

    `full` is the mask of all nodes. One pass: it stops as soon as no node still
    holds the run.
    """
    res = [0] * n
    alive = full
    i = 0
    get = masks.get
    for b in blocks:
        m = get(b, 0) & alive
        if m != alive:
            gone = alive ^ m
            while gone:
                low = gone & -gone
                res[low.bit_length() - 1] = i
                gone ^= low
            alive = m
            if not alive:
                return res, i
        i += 1
    j = 0
    while alive:
        if alive & 1:
            res[j] = i
        alive >>= 1
        j += 1
    return res, i
