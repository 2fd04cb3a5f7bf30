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

A host tier (``host_capacity`` > 0): a block evicted from the device moves to the node's host LRU
(still held: ``holders`` keeps its bit, and peers may pull it), and leaves the node when evicted from there. A
request that finds blocks of its prefix there loads them back (`pin` moves them to the device and says how
many), as the worker stub does; a pull reading them from there pins them in the host tier (`pin(read=True)`).
The directory learns of each move (`Publish.hosted`, `Publish.loaded`) and keeps which nodes hold a block on
their host tier (`DirectoryView.host_masks`), from which the router's candidates get their locations.

Eviction prefers copies: with ``scan`` > 0, `settle` looks through the
``scan`` coldest unused blocks for one that another node also holds (per
``holders``: an exact global view, as the directory's is) and evicts that
first, the coldest such; only when none of them has another copy does it
evict the coldest block. Losing a copy costs a pull later, losing the last one
a recompute.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from kvproto import media

__all__ = ["DirectoryView", "NodeCache", "Publish", "leading_runs"]


def _clear(masks: dict[int, int], b: int, keep: int) -> None:
    """Keep only the bits `keep` of block `b`'s mask, dropping the block when none is left."""
    m = masks.get(b, 0) & keep
    if m:
        masks[b] = m
    else:
        masks.pop(b, None)


class Publish(NamedTuple):
    """One node's change, as the directory will learn of it: blocks stored (``adds``) and evicted (``removes``),
    moved from its device to its host tier (``hosted``) and back (``loaded``)."""

    node: int
    adds: list[int]
    removes: list[int]
    hosted: Sequence[int] = ()
    loaded: Sequence[int] = ()


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

    __slots__ = (
        "_keep",
        "bit",
        "capacity",
        "evictions",
        "holders",
        "host",
        "host_capacity",
        "host_evictions",
        "host_pins",
        "lru",
        "pins",
        "scan",
    )

    def __init__(self, node: int, capacity: int, holders: dict[int, int], scan: int = 0, host_capacity: int = 0) -> None:
        self.bit = 1 << node
        self._keep = ~self.bit
        self.capacity = capacity
        self.scan = scan
        self.holders = holders
        self.lru: OrderedDict[int, None] = OrderedDict()  # held, not in use (cold first)
        self.pins: dict[int, int] = {}  # held, in use: block -> users
        self.evictions = 0
        self.host_capacity = host_capacity
        self.host: OrderedDict[int, None] = OrderedDict()  # in the host tier, not being read (cold first)
        self.host_pins: dict[int, int] = {}  # in the host tier, being read by a peer: block -> reads
        self.host_evictions = 0

    def __len__(self) -> int:
        """Blocks held on the device, pinned or not (may exceed ``capacity`` until `settle`)."""
        return len(self.lru) + len(self.pins)

    def in_host(self, b: int) -> bool:
        """Whether block `b` lies in this node's host tier (not on its device)."""
        return (b in self.host or b in self.host_pins) and b not in self.pins and b not in self.lru

    def pin(self, blocks: Iterable[int], read: bool = False) -> list[int]:
        """Take one more use of each of `blocks`, which this node must hold (KeyError otherwise); the blocks
        loaded from the host tier to the device for it.

        For blocks the node already has: the prefix a request finds locally (a block in the host tier moves to
        the device), or, `read`, the blocks a pull is about to read from this node (one in the host tier is read
        from there, and stays).
        """
        pins = self.pins
        lru = self.lru
        host = self.host
        loaded: list[int] = []
        for b in blocks:
            c = pins.get(b)
            if c is not None:
                pins[b] = c + 1
            elif b in lru:
                del lru[b]
                pins[b] = 1
            elif read:
                host.pop(b, None)
                self.host_pins[b] = self.host_pins.get(b, 0) + 1
            else:
                if b in host:
                    del host[b]
                elif b not in self.host_pins:
                    raise KeyError(b)
                pins[b] = 1  # a peer reading it from the host tier (host_pins) reads its copy still
                loaded.append(b)
        return loaded

    def unpin_read(self, blocks: Iterable[int]) -> None:
        """Undo `pin(read=True)`, in order."""
        host_pins = self.host_pins
        for b in blocks:
            c = host_pins.get(b)
            if c is None:
                self.unpin((b,))
            elif c > 1:
                host_pins[b] = c - 1
            else:
                del host_pins[b]
                if b not in self.pins and b not in self.lru:
                    self.host[b] = None  # back at the host tier's warm end (unless loaded to the device meanwhile)

    def store(self, blocks: Iterable[int]) -> tuple[list[int], list[int]]:
        """Pin `blocks` (a prefill's output), storing those the node lacks; returns the newly stored ones, and those
        that were in the host tier (now on the device).

        The new blocks are added to ``holders`` at once (the node really has
        them now); the caller publishes them to the directory.
        """
        pins = self.pins
        lru = self.lru
        host = self.host
        holders = self.holders
        bit = self.bit
        adds: list[int] = []
        moved: list[int] = []
        for b in blocks:
            c = pins.get(b)
            if c is not None:
                pins[b] = c + 1
            else:
                if b in lru:
                    del lru[b]
                elif b in host or b in self.host_pins:
                    host.pop(b, None)
                    moved.append(b)
                else:
                    holders[b] = holders.get(b, 0) | bit
                    adds.append(b)
                pins[b] = 1
        return adds, moved

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

    def settle(self) -> tuple[list[int], list[int]]:
        """Evict unused blocks down to capacity (as far as unused ones allow), copies first within the ``scan``
        coldest, else the coldest: to the host tier if there is one, which then evicts its coldest unread blocks
        down to its capacity. Returns (the blocks gone from the node, those moved to its host tier), in order."""
        if self.host_capacity > 0:
            return self._settle_tiers()
        return self._evict_device(), []

    def _settle_tiers(self) -> tuple[list[int], list[int]]:
        moved = self._evict_device(keep_holders=True)
        host = self.host
        host.update(dict.fromkeys(moved))
        over = len(host) + len(self.host_pins) - self.host_capacity
        removes: list[int] = []
        holders = self.holders
        keep = self._keep
        while over > 0 and host:
            b = host.popitem(last=False)[0]
            _clear(holders, b, keep)
            removes.append(b)
            over -= 1
        self.host_evictions += len(removes)
        if removes:
            gone = set(removes)
            moved = [b for b in moved if b not in gone]
        return removes, moved

    def _evict_device(self, keep_holders: bool = False) -> list[int]:
        """Take unused blocks off the device down to capacity (see `settle`): dropped from ``holders`` unless
        `keep_holders` (they move to the host tier)."""
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
                if not keep_holders:
                    _clear(holders, b, keep)
                removes.append(b)
                over -= 1
            self.evictions += len(removes)
        return removes


class DirectoryView:
    """The directory as the router sees it: block -> bitmask of the nodes it lists (``masks``), and of those that
    list it in their host tier (``host_masks``), changed only by `publish`."""

    __slots__ = ("host_masks", "masks")

    def __init__(self) -> None:
        self.masks: dict[int, int] = {}
        self.host_masks: dict[int, int] = {}

    def publish(self, change: Publish) -> None:
        """Apply one node's change (its evictions, then its stores and moves; no block is in two of them)."""
        masks = self.masks
        bit = 1 << change.node
        keep = ~bit
        for b in change.removes:
            _clear(masks, b, keep)
        for b in change.adds:
            masks[b] = masks.get(b, 0) | bit
        if change.hosted or change.loaded or change.removes:
            host = self.host_masks
            for b in (*change.removes, *change.loaded):
                _clear(host, b, keep)
            for b in change.hosted:
                host[b] = host.get(b, 0) | bit

    def locations(self, blocks: tuple[int, ...], k: int, node: int) -> tuple[int, ...] | None:
        """Node `node`'s locations (kvproto.media) for the first `k` of `blocks`, as a lookup `with_slots` gives
        them: a host-tier block's in the host medium, a device block's its index; None when none of them is in
        its host tier."""
        host = self.host_masks
        if not host:
            return None
        bit = 1 << node
        get = host.get
        if not any(get(b, 0) & bit for b in blocks[:k]):
            return None
        return tuple(media.location(i, media.HOST) if get(b, 0) & bit else i for i, b in enumerate(blocks[:k]))


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
