"""A routing policy modeled after Dynamo's KV router: ``cost = overlap_weight * prefill_blocks +
decode_blocks`` over its own count of the distinct blocks it has in flight per node."""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Sequence

from gateway.cost import DEFAULT_COST, Candidate, CostModel, Decision, RouteRequest, blocks_held
from gateway.policy_base import TIE_EPSILON, PolicyHooks, healthy_candidates, plain_decision

TIER_CREDITS = (1.0, 0.75, 0.25)
"""What a cached block on the device, in host memory and on disk is worth to Dynamo's router (its KVBM tiers G1,
G2, G3: the credits of Dynamo's tier-aware routing, docs/replay.md)."""


class DynamoPolicy(PolicyHooks):
    """Modeled after Dynamo's KV router (not Dynamo itself); its cost function as in ai-dynamo/dynamo
    lib/llm/src/kv_router/scheduler.rs (`DefaultWorkerSelector::select_worker`) and the active-sequence
    tracking of lib/llm/src/kv_router/sequence.rs (docs/replay.md quotes both):

    cost(c) = overlap_weight * prefill_blocks + decode_blocks, with
      prefill_blocks = (prompt_tokens - credited_blocks * block_size + pending_prefill_tokens) / block_size:
          this request's uncached tokens plus those of requests sent there whose prefill has not ended
          (Dynamo's ``new_tokens + active_tokens``; the cached blocks are the directory's view, as
          Dynamo's overlap is from engine events), each cached block credited by its tier as Dynamo's
          KVBM-aware routing does (`tier_credits`: device 1.0, host 0.75, disk 0.25);
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
        tier_credits: tuple[float, float, float] = TIER_CREDITS,
    ) -> None:
        if temperature < 0:
            raise ValueError("temperature must be >= 0")
        self.cost = cost or DEFAULT_COST
        self.overlap_weight = overlap_weight
        self.tier_credits = tier_credits
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
            _, host, disk = self.tier_credits
            held = blocks_held(c, nh) - (1.0 - host) * c.host_blocks - (1.0 - disk) * c.disk_blocks
            uncached = max(0, req.prompt_tokens - held * bs)
            out.append(w * (uncached + c.pending_prefill_tokens) / bs + new_blocks + len(active))
        return out

    def choose(self, req: RouteRequest, candidates: Sequence[Candidate], rng: random.Random) -> Decision:
        healthy = sorted(healthy_candidates(candidates), key=lambda c: c.node_id)
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
        return plain_decision(req, chosen, healthy, self.cost, None, detail)

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

    def on_engine_gone(self, node_id: str) -> None:
        """Its requests in flight count nowhere now."""
        self._seqs.pop(node_id, None)
        self._active.pop(node_id, None)
