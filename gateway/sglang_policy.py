"""A routing policy modeled after SGLang's cache-aware router: its own approximate tree of what it routed,
not the directory."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from gateway.cost import DEFAULT_COST, Candidate, CostModel, Decision, RouteRequest, estimate_ttft
from gateway.policy_base import PolicyHooks, block_tokens, healthy_candidates, load_of


class SGLangPolicy(PolicyHooks):
    """Modeled after SGLang's cache-aware router (not SGLang itself).

    Keeps its own approximate tree of what it routed and ignores the
    directory's `cached_blocks`. Because sequence hashes are chained, a trie
    over block hashes is a dict hash -> nodes: the match length for node n is
    the leading run of the request's hashes that were routed to n.

    Per request, with load = inflight + running + waiting over healthy candidates:
    1. if max_load - min_load > abs_threshold and max_load > rel_threshold * min_load:
       the least loaded (ties: node_id), reason "balance";
    2. elif max match / len(hashes) > cache_threshold: the best-matching node
       (ties: lower load, then node_id), reason "affinity";
    3. else the node with the smallest tree (fewest hashes routed to it; ties:
       node_id), reason "balance".
    `on_routed` inserts the request's hashes for the chosen node, whatever the
    branch. The tree holds at most `max_tree_size` (hash, node) entries: the
    least recently routed are dropped first, and within one request the
    deepest blocks are the older ones, so eviction trims leaves before the
    prefix they hang from (as a radix tree's LRU does). SGLang trims
    periodically; this model trims at once, which keeps it deterministic.

    `predicted_cached_tokens` is this tree's match for the chosen node (what
    the modeled router believes), not the directory's.
    """

    name = "sglang"

    def __init__(
        self,
        cost: CostModel | None = None,
        *,
        abs_threshold: float = 32,
        rel_threshold: float = 1.1,
        cache_threshold: float = 0.5,
        max_tree_size: int = 1_000_000,
    ) -> None:
        if max_tree_size < 1:
            raise ValueError("max_tree_size must be >= 1")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be in [0, 1]")
        self.cost = cost or DEFAULT_COST
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold
        self.cache_threshold = cache_threshold
        self.max_tree_size = max_tree_size
        self._holders: dict[int, set[str]] = {}
        self._lru: OrderedDict[tuple[int, str], None] = OrderedDict()
        self._sizes: dict[str, int] = {}

    # --- the tree

    def tree_size(self, node_id: str | None = None) -> int:
        """(hash, node) entries held, for one node or in all."""
        if node_id is None:
            return len(self._lru)
        return self._sizes.get(node_id, 0)

    def match_blocks(self, hashes: Sequence[int], node_ids: Sequence[str]) -> dict[str, int]:
        """Leading run of `hashes` routed to each node, per the tree."""
        match = dict.fromkeys(node_ids, 0)
        alive = set(node_ids)
        depth = 0
        holders = self._holders
        for h in hashes:
            s = holders.get(h)
            if not s:
                break
            nxt = alive & s
            if nxt != alive:
                for n in alive - nxt:
                    match[n] = depth
                alive = nxt
            if not alive:
                break
            depth += 1
        for n in alive:
            match[n] = depth
        return match

    def on_engine_gone(self, node_id: str) -> None:
        """Drop a node's entries (it left the cluster)."""
        for key in [k for k in self._lru if k[1] == node_id]:
            self._remove(key)

    def _remove(self, key: tuple[int, str]) -> None:
        del self._lru[key]
        h, n = key
        s = self._holders[h]
        s.discard(n)
        if not s:
            del self._holders[h]
        left = self._sizes[n] - 1
        if left:
            self._sizes[n] = left
        else:
            del self._sizes[n]

    # --- the policy

    def choose(self, req: RouteRequest, candidates: Sequence[Candidate], rng: random.Random) -> Decision:
        healthy = healthy_candidates(candidates)
        loads = [load_of(c) for c in healthy]
        lo, hi = min(loads), max(loads)
        nh = len(req.hashes)
        if hi - lo > self.abs_threshold and hi > self.rel_threshold * lo:
            chosen = min(healthy, key=lambda c: (load_of(c), c.node_id))
            match = self.match_blocks(req.hashes, [chosen.node_id])[chosen.node_id]
            reason = "balance"
            detail = f"imbalanced: max load {hi} - min {lo} > {self.abs_threshold} and {hi} > {self.rel_threshold}*{lo}"
        else:
            matches = self.match_blocks(req.hashes, [c.node_id for c in healthy])
            best = min(healthy, key=lambda c: (-matches[c.node_id], load_of(c), c.node_id))
            match = matches[best.node_id]
            ratio = match / nh if nh else 0.0
            if ratio > self.cache_threshold:
                chosen, reason = best, "affinity"
                detail = f"match {match}/{nh}={ratio:.3f} > {self.cache_threshold}"
            else:
                chosen = min(healthy, key=lambda c: (self._sizes.get(c.node_id, 0), c.node_id))
                match = matches[chosen.node_id]
                reason = "balance"
                detail = f"best match {match}/{nh}={ratio:.3f} <= {self.cache_threshold}: smallest tree ({self._sizes.get(chosen.node_id, 0)})"
        return Decision(
            chosen.node_id,
            reason,
            block_tokens(match, req, chosen),
            estimated_ttft_s=estimate_ttft(req, chosen, self.cost),
            why=detail,
        )

    def on_routed(self, req: RouteRequest, decision: Decision) -> None:
        node = decision.node_id
        lru = self._lru
        holders = self._holders
        added = 0
        # Deepest first, so the prefix is the most recently used part of this request.
        for h in reversed(req.hashes):
            key = (h, node)
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                s = holders.get(h)
                if s is None:
                    holders[h] = {node}
                else:
                    s.add(node)
                added += 1
        if added:
            self._sizes[node] = self._sizes.get(node, 0) + added
        while len(lru) > self.max_tree_size:
            self._remove(next(iter(lru)))
