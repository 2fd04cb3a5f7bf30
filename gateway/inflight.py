"""Prompts being prefilled right now, by node: what the directory cannot know yet.

A request the gateway routed makes its node hold the whole prompt once its
prefill ends; until then (and until the node publishes the new blocks) the
directory lists nothing, and a burst of requests sharing an uncached prefix
would each see "cached nowhere" and recompute it wherever they land. This
table closes that window: `begin` records the prompt's block hashes against the
node (and epoch) it was sent to, `match` tells, per node, how long a leading run
of another prompt's hashes is being computed there, and `end` closes the entry
when the first token came back (the blocks are on the node: the entry lingers
`linger_s`, the directory's publish delay, then goes) or the request failed
(gone at once).

Engines reuse blocks another running request is computing (vLLM caches a block
as soon as it is scheduled; the worker stub waits for it), so a follower sent
to that node queues behind the computation instead of repeating it: the cost
model counts these blocks as cached there (`Candidate.inflight_blocks`).

Pure: no clock (callers pass `now`, any monotonic seconds) and no I/O. Bounded
in entries, in indexed hashes and in age (an entry whose request never ended
goes after `max_age_s`), so a gateway that loses track of a request cannot
grow the table or keep routing to a phantom.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["InflightPrefixes"]

NodeKey = tuple[str, int]  # (node_id, epoch)


@dataclass(slots=True)
class _Entry:
    node: NodeKey
    hashes: tuple[int, ...]
    expires: float


class InflightPrefixes:
    """Block hashes of prompts being prefilled, per (node, epoch); see the module docstring."""

    def __init__(
        self, *, max_entries: int = 4096, max_blocks: int = 1 << 20, max_age_s: float = 60.0, linger_s: float = 0.5
    ) -> None:
        if max_entries < 1 or max_blocks < 1 or max_age_s <= 0 or linger_s < 0:
            raise ValueError("max_entries and max_blocks must be >= 1, max_age_s > 0 and linger_s >= 0")
        self.max_entries = max_entries
        self.max_blocks = max_blocks
        self.max_age_s = max_age_s
        self.linger_s = linger_s
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # oldest first
        self._index: dict[int, dict[NodeKey, int]] = {}  # hash -> node -> entries holding it
        self._expiry: list[tuple[float, int]] = []  # (expires, key), lazily pruned
        self._blocks = 0
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def blocks(self) -> int:
        """Hashes indexed over all entries."""
        return self._blocks

    def begin(self, hashes: Sequence[int], node_id: str, epoch: int, now: float) -> int:
        """A request with these prompt hashes was sent to `node_id`@`epoch`: its key for `end`.

        Oldest entries make room when the table is full; a prompt longer than
        `max_blocks` is recorded up to that length.
        """
        self._expire(now)
        key = self._next
        self._next += 1
        hs = tuple(hashes[: self.max_blocks])
        while self._entries and (len(self._entries) >= self.max_entries or self._blocks + len(hs) > self.max_blocks):
            self._drop(next(iter(self._entries)))
        node = (node_id, epoch)
        entry = _Entry(node, hs, now + self.max_age_s)
        self._entries[key] = entry
        index = self._index
        for h in hs:
            m = index.get(h)
            if m is None:
                index[h] = {node: 1}
            else:
                m[node] = m.get(node, 0) + 1
        self._blocks += len(hs)
        heapq.heappush(self._expiry, (entry.expires, key))
        return key

    def end(self, key: int, now: float, *, ok: bool) -> None:
        """The request's prefill is over: `ok` (the node holds the blocks) lingers `linger_s`; else gone now."""
        entry = self._entries.get(key)
        if entry is None:
            return
        if not ok or self.linger_s == 0:
            self._drop(key)
            return
        entry.expires = min(entry.expires, now + self.linger_s)
        heapq.heappush(self._expiry, (entry.expires, key))

    def match(self, hashes: Sequence[int], now: float) -> dict[NodeKey, int]:
        """Per (node, epoch): the leading blocks of `hashes` that requests sent there are computing (or just did).

        Hashes are chained (each names its whole prefix), so a node listed for
        hash ``i`` is computing blocks ``[0, i]``; the scan stops at the first
        hash no node is computing.
        """
        self._expire(now)
        out: dict[NodeKey, int] = {}
        index = self._index
        for i, h in enumerate(hashes):
            m = index.get(h)
            if not m:
                break
            for node in m:
                out[node] = i + 1
        return out

    def sharing(self, hashes: Sequence[int], blocks: int, now: float) -> int:
        """Requests in the table (any node) whose prompts begin with the leading `blocks` of `hashes`.

        Hashes are chained, so these are the entries holding hash ``blocks - 1``:
        the requests computing that prefix or queued behind its computation.
        """
        self._expire(now)
        if blocks <= 0 or blocks > len(hashes):
            return 0
        m = self._index.get(hashes[blocks - 1])
        return sum(m.values()) if m else 0

    def _expire(self, now: float) -> None:
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, key = heapq.heappop(heap)
            entry = self._entries.get(key)
            if entry is not None and entry.expires <= now:
                self._drop(key)

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        index = self._index
        node = entry.node
        for h in entry.hashes:
            m = index[h]
            left = m[node] - 1
            if left:
                m[node] = left
            else:
                del m[node]
                if not m:
                    del index[h]
        self._blocks -= len(entry.hashes)
        if not self._entries:
            self._expiry.clear()
