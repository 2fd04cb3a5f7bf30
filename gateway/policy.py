"""Routing policies: pure functions of (request, candidates, rng) -> Decision.

Over 400 lines on purpose: six small policies and their registry, kept in one
file so that the ones compared in a replay report read side by side. What they
share (the inputs, `Decision` and kvdir's TTFT model) is in gateway.cost and
re-exported here.

The same code drives the HTTP gateway (through gateway.router) and the offline
trace-replay simulator, so nothing here does I/O, reads a clock or uses global
randomness: every random choice goes through the `random.Random` passed to
`choose`, and a policy with state (round robin's position, the SGLang-modeled
tree, kvdir's recent work per node, the Dynamo-modeled in-flight sequences)
changes it only in `choose` (round robin; Dynamo-modeled trimming), `on_routed`
or `on_finished` (called when a routed request has ended).
Given the same seed and the same inputs every policy makes the same decisions.

Policies
--------
``kvdir`` (ours)
    Estimated time to first token (TTFT) per healthy candidate (the model in
    gateway.cost, computed by `gateway.cost.evaluate`), with the option of
    pulling the missing part of the longest cached prefix from its holder
    instead of recomputing it, plus the price of what storing the request
    would evict on a full node; minimum wins, near-ties go to the node with
    the least recent work.
    The holder's own load does not enter the pull cost: a pull is a one-sided
    read of the holder's registered memory, it takes no engine place there.
    A pull needs the holder's slots: H can serve blocks
    ``[0, min(H.cached_blocks, len(H.slots)))`` only, so a lookup made without
    slots never yields a pull plan (pass ``slots=()`` for a holder that cannot
    serve reads), and only candidates with ``can_pull`` get the pull option.

``round_robin``, ``least_loaded``, ``local_only``
    What a stateless gateway does; ``local_only`` is random routing where each
    node keeps its own cache (no pulls).

``sglang`` (modeled after SGLang's cache-aware router)
    Its own approximate tree of what it routed, not the directory.

``dynamo`` (modeled after Dynamo's KV router)
    ``cost = overlap_weight * prefill_blocks + decode_blocks`` over its own
    count of the distinct blocks it has in flight per node.

Every policy fills ``estimated_ttft_s`` with kvdir's model of the chosen
option, so decisions of all policies can be compared on the same scale.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from gateway.cost import (
    DEFAULT_COST,
    REASONS,
    Candidate,
    CostModel,
    Decision,
    RouteRequest,
    TTFTBreakdown,
    engine_tokens,
    estimate_ttft,
    evaluate,
    link_rate,
    pull_seconds,
    queue_seconds,
    queued_ahead,
    slot_interval_seconds,
    ttft_breakdown,
)
from gateway.cost import blocks_held as _blocks
from gateway.cost import blocks_ready as _ready

__all__ = [
    "POLICIES",
    "REASONS",
    "Candidate",
    "CostModel",
    "Decision",
    "DynamoPolicy",
    "KvdirPolicy",
    "LeastLoadedPolicy",
    "LocalOnlyPolicy",
    "Policy",
    "RoundRobinPolicy",
    "RouteRequest",
    "SGLangPolicy",
    "TTFTBreakdown",
    "estimate_ttft",
    "evaluate",
    "make_policy",
    "pull_seconds",
    "queue_seconds",
    "slot_interval_seconds",
    "ttft_breakdown",
]

# Two estimates closer than this (seconds, or cost units for dynamo) are a tie.
TIE_EPSILON = 1e-9


@runtime_checkable
class Policy(Protocol):
    name: str
    cost: CostModel

    def choose(self, req: RouteRequest, candidates: Sequence[Candidate], rng: random.Random) -> Decision: ...

    def on_routed(self, req: RouteRequest, decision: Decision) -> None: ...

    def on_finished(self, req: RouteRequest, decision: Decision) -> None: ...


# ---------------------------------------------------------------------------
# Helpers shared by the policies


def _healthy(candidates: Sequence[Candidate]) -> list[Candidate]:
    healthy = [c for c in candidates if c.healthy]
    if not healthy:
        raise ValueError(f"no healthy candidate among {len(candidates)}")
    return healthy


def _longest(healthy: list[Candidate], nh: int) -> tuple[Candidate, int]:
    """The healthy candidate with the most cached blocks (ties: lowest node_id) and its block count."""
    best = healthy[0]
    best_b = _blocks(best, nh)
    for c in healthy[1:]:
        b = _blocks(c, nh)
        if b > best_b or (b == best_b and c.node_id < best.node_id):
            best, best_b = c, b
    return best, best_b


def _cache_reason(blocks: int, longest: int) -> str:
    if longest <= 0:
        return "balance"
    return "affinity" if blocks >= longest else "recompute"


def _tokens(blocks: int, req: RouteRequest, cand: Candidate) -> int:
    """Prompt tokens in `blocks` leading blocks, in the engine's block units (what it will report as cached)."""
    return engine_tokens(min(blocks * req.block_size, req.prompt_tokens), cand)


def _plain(
    req: RouteRequest, chosen: Candidate, healthy: list[Candidate], cost: CostModel, reason: str | None, detail: str
) -> Decision:
    """A decision without a pull, reason by the directory's view unless given."""
    nh = len(req.hashes)
    blocks = _blocks(chosen, nh)
    if reason is None:
        reason = _cache_reason(blocks, _longest(healthy, nh)[1])
    return Decision(
        chosen.node_id, reason, _tokens(blocks, req, chosen), estimated_ttft_s=estimate_ttft(req, chosen, cost), detail=detail
    )


def _load(c: Candidate) -> int:
    return c.inflight + c.running + c.waiting


# ---------------------------------------------------------------------------
# kvdir


class KvdirPolicy:
    """Minimum score over (candidate, recompute | pull from the longest holder): the estimated TTFT plus
    the price of what storing the request would evict on a full node (`TTFTBreakdown.score_s`).

    Each candidate's option and its estimate come from `gateway.cost.evaluate`;
    the same breakdown explains the decision (`detail`).
    An option that recomputes blocks another node is computing (and no node
    holds) pays `dup_weight` times that compute, unless `dup_hot_requests`
    requests are already in flight on that prefix (`RouteRequest.inflight_requests`).
    Near-ties: options within `balance_slack_s` of the best score, and within
    `balance_slack_ratio` of it (short prompts: 7.7 ms is not "about" 5.4 ms), are equally
    good for this request, so the choice among them is made for the cluster:
    the nodes with the least recent work (uncached prompt tokens this policy
    routed there, decaying by ``1 - 1/balance_window`` per routed request: no
    clock), and among those the best score. Ties (within TIE_EPSILON): more
    cached tokens, then fewer inflight, then rng (ordered by node_id). Without it a light load gathers
    whole sessions where a shared system prompt lives, every queue being empty
    when each one arrives. No band when the best option follows a prefix being
    computed there: what the band trades a few ms for is where new state lives,
    and a follower adds none (every node computing the prefix will hold it), so
    it takes the shortest queue. `allow_pull=False` gives the same policy without
    pulls (an ablation).
    """

    name = "kvdir"

    def __init__(
        self,
        cost: CostModel | None = None,
        *,
        allow_pull: bool = True,
        balance_slack_s: float = 0.02,
        balance_slack_ratio: float = 0.25,
        balance_window: int = 64,
        dup_weight: float = 0.15,
        dup_hot_requests: int = 2,
    ) -> None:
        if balance_slack_s < 0 or balance_slack_ratio < 0 or balance_window < 1 or dup_weight < 0 or dup_hot_requests < 1:
            raise ValueError(
                "balance_slack_s, balance_slack_ratio and dup_weight must be >= 0, balance_window and dup_hot_requests >= 1"
            )
        self.dup_weight = dup_weight
        self.dup_hot_requests = dup_hot_requests
        self.cost = cost or DEFAULT_COST
        self.allow_pull = allow_pull
        self.balance_slack_s = balance_slack_s
        self.balance_slack_ratio = balance_slack_ratio
        self.balance_window = balance_window
        self._work: dict[str, float] = {}  # node -> decayed uncached prompt tokens routed there
        self._scale = 1.0  # _work values are stored divided by this (lazy decay: one multiply per request)

    def recent_work(self, node_id: str) -> float:
        """Decayed uncached prompt tokens this policy routed to `node_id`."""
        return self._work.get(node_id, 0.0) * self._scale

    def choose(self, req: RouteRequest, candidates: Sequence[Candidate], rng: random.Random) -> Decision:
        healthy = _healthy(candidates)
        cost = self.cost
        holder, longest = _longest(healthy, len(req.hashes))
        pull_to = min(longest, len(holder.slots)) if self.allow_pull else 0

        # Blocks some node is computing now that no node holds yet: an option that computes them again
        # duplicates that work (a second prefill and a second copy) to save a wait; priced at dup_weight times
        # the duplicate compute, on top of the TTFT. Unless the prefix is hot: dup_hot_requests requests already
        # in flight on it arrived faster than it is computed, so a second copy will serve later ones too, and
        # holding it back only delays the start of a computation the load needs anyway (a burst).
        nh = len(req.hashes)
        ahead = max(c.inflight_blocks for c in healthy)
        priced = ahead > longest and self.dup_weight > 0 and req.inflight_requests < self.dup_hot_requests
        dup_to = min(ahead * req.block_size, req.prompt_tokens) if priced else 0
        best = math.inf
        best_dup = False
        best_follows = False
        options: list[tuple[float, int, int, Candidate, TTFTBreakdown, bool]] = []
        for c in healthy:
            # Only between equal fingerprints: another model's (or weights', or layout's) KV is not this one's.
            br = evaluate(req, c, cost, pull_to_blocks=pull_to if c.kv_fingerprint == holder.kv_fingerprint else 0)
            score = br.score_s
            dup = dup_to > br.cached_tokens
            if dup:
                score += self.dup_weight * (dup_to - br.cached_tokens) / cost.prefill_tokens_per_s
            options.append((score, br.cached_tokens, c.inflight, c, br, dup))
            if score < best:
                best = score
                best_dup = dup
                best_follows = _ready(c, nh) > _blocks(c, nh)

        # A follower of an in-flight prefix leaves no new state to place: the shortest queue, no near-tie band.
        slack = 0.0 if best_follows else min(self.balance_slack_s, self.balance_slack_ratio * best)
        if slack > 0:
            near = [o for o in options if o[0] <= best + slack and (best_dup or not o[5])]
            if len(near) > 1:
                work = self._work
                low = min(work.get(o[3].node_id, 0.0) for o in near)
                near = [o for o in near if work.get(o[3].node_id, 0.0) <= low * (1 + 1e-12)]
                best = min(o[0] for o in near)
            options = near
        tied = [o for o in options if o[0] <= best + TIE_EPSILON]
        if len(tied) > 1:
            top = max(tied, key=lambda o: (o[1], -o[2]))
            tied = [o for o in tied if o[1] == top[1] and o[2] == top[2]]
            if len(tied) > 1:
                tied.sort(key=lambda o: o[3].node_id)
                tied = [rng.choice(tied)]
        _, _, _, chosen, br, _ = tied[0]
        t = br.total_s
        cached = engine_tokens(br.cached_tokens, chosen)
        detail = self._explain(req, chosen, br, holder, longest)

        if br.pulled_blocks:
            return Decision(
                chosen.node_id,
                "pull",
                cached,
                pull_from=holder.node_id,
                pull_epoch=holder.epoch,
                pull_slots=tuple(holder.slots[:pull_to]),
                estimated_ttft_s=t,
                detail=detail,
            )
        held = _blocks(chosen, nh)
        # Reusing what another request is computing there: it queues behind that prefill.
        reason = "inflight" if _ready(chosen, nh) > held else _cache_reason(held, longest)
        return Decision(chosen.node_id, reason, cached, estimated_ttft_s=t, detail=detail)

    def _explain(self, req: RouteRequest, c: Candidate, br: TTFTBreakdown, holder: Candidate, longest: int) -> str:
        """The evaluated option's formula with its values (a debug log line): nothing is recomputed."""
        cost = self.cost
        s = (
            f"ttft={br.total_s:.6f}s = queue {br.queue_s:.6f} [{c.pending_prefill_tokens:g}/{cost.prefill_tokens_per_s:g}"
            f" + (max(0,{c.running}+{c.inflight}-{cost.max_running}+1)={queued_ahead(c, cost)} + {c.waiting})"
            f"*{slot_interval_seconds(req, cost):.6f}]"
        )
        if br.pull_s:
            measured = " (measured by it)" if c.link_bytes_per_s > 0 else ""
            s += (
                f" + pull {br.pull_s:.6f} [{cost.pull_setup_s:g} + {br.pulled_blocks}*{cost.block_bytes}/{link_rate(c, cost):g}"
                f"{measured}] from {holder.node_id}@{holder.epoch}"
            )
        s += (
            f" + compute {br.compute_s:.6f} [({req.prompt_tokens}-{br.cached_tokens})/{cost.prefill_tokens_per_s:g}]"
            f"; longest {holder.node_id}={longest} blocks"
        )
        if c.inflight_blocks > c.cached_blocks:
            s += f"; {c.inflight_blocks} blocks being computed there"
        if br.displace_s:
            s += f"; displaces {br.displace_s:.6f}s [weight {cost.displace_weight:g}, free {c.free_tokens} tokens]"
        return s

    def on_routed(self, req: RouteRequest, decision: Decision) -> None:
        """Count the request's uncached tokens as recent work of its node; decay everyone's by 1 - 1/window."""
        self._add_work(decision.node_id, req.prompt_tokens - decision.predicted_cached_tokens)

    def on_peer_routed(self, node_id: str, tokens: float) -> None:
        """Another gateway's note (gateway.peers): it sent `tokens` uncached prompt tokens to `node_id`. Counted
        like one of ours, so that with several gateways the least recent work is the cluster's, as with one."""
        self._add_work(node_id, tokens)

    def _add_work(self, node_id: str, tokens: float) -> None:
        self._scale *= 1.0 - 1.0 / self.balance_window
        if self._scale < 1e-100:  # renormalise before the stored values overflow
            self._work = {k: v * self._scale for k, v in self._work.items()}
            self._scale = 1.0
        if tokens > 0:
            self._work[node_id] = self._work.get(node_id, 0.0) + tokens / self._scale

    def on_finished(self, req: RouteRequest, decision: Decision) -> None:
        return None


# ---------------------------------------------------------------------------
# Stateless baselines


class RoundRobinPolicy:
    """Cycles over the healthy candidates in node_id order: the next node_id after the last one chosen."""

    name = "round_robin"

    def __init__(self, cost: CostModel | None = None) -> None:
        self.cost = cost or DEFAULT_COST
        self._last: str | None = None

    def choose(self, req: RouteRequest, candidates: Sequence[Candidate], rng: random.Random) -> Decision:
        healthy = _healthy(candidates)
        order = sorted(healthy, key=lambda c: c.node_id)
        chosen = order[0]
        if self._last is not None:
            for c in order:
                if c.node_id > self._last:
                    chosen = c
                    break
        self._last = chosen.node_id
        return _plain(req, chosen, healthy, self.cost, "balance", "round robin")

    def on_routed(self, req: RouteRequest, decision: Decision) -> None:
        return None

    def on_finished(self, req: RouteRequest, decision: Decision) -> None:
        return None


class LeastLoadedPolicy:
    """Fewest inflight + running + waiting; ties by node_id."""

    name = "least_loaded"

    def __init__(self, cost: CostModel | None = None) -> None:
        self.cost = cost or DEFAULT_COST

    def choose(self, req: RouteRequest, candidates: Sequence[Candidate], rng: random.Random) -> Decision:
        healthy = _healthy(candidates)
        chosen = min(healthy, key=lambda c: (_load(c), c.node_id))
        return _plain(req, chosen, healthy, self.cost, "balance", f"load {_load(chosen)}")

    def on_routed(self, req: RouteRequest, decision: Decision) -> None:
        return None

    def on_finished(self, req: RouteRequest, decision: Decision) -> None:
        return None


class LocalOnlyPolicy:
    """A uniformly random healthy candidate (each node only reuses its own cache); 'affinity' when it holds a prefix."""

    name = "local_only"

    def __init__(self, cost: CostModel | None = None) -> None:
        self.cost = cost or DEFAULT_COST

    def choose(self, req: RouteRequest, candidates: Sequence[Candidate], rng: random.Random) -> Decision:
        healthy = _healthy(candidates)
        chosen = rng.choice(sorted(healthy, key=lambda c: c.node_id))
        reason = "affinity" if _blocks(chosen, len(req.hashes)) > 0 else "balance"
        return _plain(req, chosen, healthy, self.cost, reason, "random")

    def on_routed(self, req: RouteRequest, decision: Decision) -> None:
        return None

    def on_finished(self, req: RouteRequest, decision: Decision) -> None:
        return None


# ---------------------------------------------------------------------------
# Modeled after SGLang's cache-aware router


class SGLangPolicy:
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

    def forget_node(self, node_id: str) -> None:
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
        healthy = _healthy(candidates)
        loads = [_load(c) for c in healthy]
        lo, hi = min(loads), max(loads)
        nh = len(req.hashes)
        if hi - lo > self.abs_threshold and hi > self.rel_threshold * lo:
            chosen = min(healthy, key=lambda c: (_load(c), c.node_id))
            match = self.match_blocks(req.hashes, [chosen.node_id])[chosen.node_id]
            reason = "balance"
            detail = f"imbalanced: max load {hi} - min {lo} > {self.abs_threshold} and {hi} > {self.rel_threshold}*{lo}"
        else:
            matches = self.match_blocks(req.hashes, [c.node_id for c in healthy])
            best = min(healthy, key=lambda c: (-matches[c.node_id], _load(c), c.node_id))
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
            _tokens(match, req, chosen),
            estimated_ttft_s=estimate_ttft(req, chosen, self.cost),
            detail=detail,
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

    def on_finished(self, req: RouteRequest, decision: Decision) -> None:
        return None


# ---------------------------------------------------------------------------
# Modeled after Dynamo's KV router


class DynamoPolicy:
    """Modeled after Dynamo's KV router (not Dynamo itself); its cost function as in ai-dynamo/dynamo
    lib/llm/src/kv_router/scheduler.rs (`DefaultWorkerSelector::select_worker`) and the active-sequence
    tracking of lib/llm/src/kv_router/sequence.rs (docs/replay.md quotes both):

    cost(c) = overlap_weight * prefill_blocks + decode_blocks, with
      prefill_blocks = (prompt_tokens - cached_blocks * block_size + pending_prefill_tokens) / block_size:
          this request's uncached tokens plus those of requests sent there whose prefill has not ended
          (Dynamo's ``new_tokens + active_tokens``; ``cached_blocks`` is the directory's view, as
          Dynamo's overlap is from engine events);
      decode_blocks = new_blocks + active_blocks: the distinct blocks of the sequences this router has
          in flight on the node (each shared prefix counted once), plus this request's blocks that
          are not among them.
    The router tracks its in-flight sequences itself, as Dynamo's does: `on_routed` adds one,
    `on_finished` removes it (``track_finished=True``: the caller reports every end, and router
    replicas may share their decisions); without it a node's oldest sequences are trimmed down
    to the candidate's ``inflight`` count at each choice.
    temperature 0: the minimum cost, random ties (rng); temperature T > 0: sample
    p(c) ∝ exp(-((cost(c) - min) / (max - min)) / T) with rng (uniform when all
    costs are equal). Candidates are ordered by node_id first, so the draw does
    not depend on their input order.
    """

    name = "dynamo"

    def __init__(
        self,
        cost: CostModel | None = None,
        *,
        overlap_weight: float = 1.0,
        temperature: float = 0.0,
        track_finished: bool = False,
    ) -> None:
        if temperature < 0:
            raise ValueError("temperature must be >= 0")
        self.cost = cost or DEFAULT_COST
        self.overlap_weight = overlap_weight
        self.temperature = temperature
        self.track_finished = track_finished
        self._seqs: dict[str, OrderedDict[int, RouteRequest]] = {}  # node -> in-flight requests (by id), oldest first
        self._active: dict[str, dict[int, int]] = {}  # node -> block hash -> in-flight sequences holding it

    def active_blocks(self, node_id: str) -> int:
        """Distinct blocks of the sequences in flight on `node_id`, as this router counts them."""
        return len(self._active.get(node_id, ()))

    def _drop(self, node_id: str, key: int) -> None:
        seqs = self._seqs.get(node_id)
        if seqs is None or key not in seqs:
            return
        r = seqs.pop(key)
        active = self._active[node_id]
        for h in set(r.hashes):
            left = active[h] - 1
            if left:
                active[h] = left
            else:
                del active[h]

    def _trim(self, c: Candidate) -> None:
        seqs = self._seqs.get(c.node_id)
        while seqs and len(seqs) > c.inflight:
            self._drop(c.node_id, next(iter(seqs)))

    def costs(self, req: RouteRequest, healthy: Sequence[Candidate]) -> list[float]:
        nh = len(req.hashes)
        bs = req.block_size
        w = self.overlap_weight
        out = []
        for c in healthy:
            if not self.track_finished:
                self._trim(c)
            active = self._active.get(c.node_id, {})
            new_blocks = sum(1 for h in req.hashes if h not in active)
            uncached = max(0, req.prompt_tokens - _blocks(c, nh) * bs)
            out.append(w * (uncached + c.pending_prefill_tokens) / bs + new_blocks + len(active))
        return out

    def choose(self, req: RouteRequest, candidates: Sequence[Candidate], rng: random.Random) -> Decision:
        healthy = sorted(_healthy(candidates), key=lambda c: c.node_id)
        costs = self.costs(req, healthy)
        lo, hi = min(costs), max(costs)
        if self.temperature == 0.0 or hi - lo <= TIE_EPSILON:
            tied = [c for c, x in zip(healthy, costs) if x <= lo + TIE_EPSILON]
            i = healthy.index(tied[0] if len(tied) == 1 else rng.choice(tied))
            how = "argmin"
        else:
            span = hi - lo
            t = self.temperature
            weights = [math.exp(-((x - lo) / span) / t) for x in costs]
            r = rng.random() * sum(weights)
            i = len(weights) - 1
            acc = 0.0
            for j, w in enumerate(weights):
                acc += w
                if r < acc:
                    i = j
                    break
            how = f"softmax T={t:g}"
        chosen = healthy[i]
        detail = (
            f"{how}: cost {costs[i]:.3f} = {self.overlap_weight:g}*prefill_blocks + decode_blocks "
            f"(active {self.active_blocks(chosen.node_id)}); min {lo:.3f} max {hi:.3f}"
        )
        return _plain(req, chosen, healthy, self.cost, None, detail)

    def on_routed(self, req: RouteRequest, decision: Decision) -> None:
        """The request's sequence is in flight on its node: its blocks count as active there."""
        node = decision.node_id
        seqs = self._seqs.setdefault(node, OrderedDict())
        key = id(req)
        if key in seqs:
            return
        seqs[key] = req
        active = self._active.setdefault(node, {})
        for h in set(req.hashes):
            active[h] = active.get(h, 0) + 1

    def on_finished(self, req: RouteRequest, decision: Decision) -> None:
        """The request ended (Dynamo's ``free``): its blocks no longer count as active."""
        self._drop(decision.node_id, id(req))


# ---------------------------------------------------------------------------
# Registry

POLICIES: dict[str, Callable[..., Policy]] = {
    "kvdir": KvdirPolicy,
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
    "sglang": SGLangPolicy,
    "dynamo": DynamoPolicy,
    "local_only": LocalOnlyPolicy,
}


def make_policy(name: str, cost: CostModel | None = None, **options: Any) -> Policy:
    """A new policy object by name; options are the policy's keyword arguments."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; valid: {', '.join(sorted(POLICIES))}")
    try:
        return factory(cost, **options)
    except TypeError as exc:
        raise ValueError(f"bad options for policy {name!r}: {exc}") from None
