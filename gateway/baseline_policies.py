"""What a stateless gateway does: round robin, least loaded, and random routing where each node keeps its own
cache (no pulls). Baselines for the replay's comparison."""

from __future__ import annotations

import random
from collections.abc import Sequence

from gateway.cost import DEFAULT_COST, Candidate, CostModel, Decision, RouteRequest, blocks_held
from gateway.policy_base import PolicyHooks, healthy_candidates, load_of, plain_decision


class RoundRobinPolicy(PolicyHooks):
    """Cycles over the healthy candidates in node_id order: the next node_id after the last one chosen."""

    name = "round_robin"

    def __init__(self, cost: CostModel | None = None) -> None:
        self.cost = cost or DEFAULT_COST
        self._last: str | None = None

    def choose(self, req: RouteRequest, candidates: Sequence[Candidate], rng: random.Random) -> Decision:
        healthy = healthy_candidates(candidates)
        order = sorted(healthy, key=lambda c: c.node_id)
        chosen = order[0]
        if self._last is not None:
            for c in order:
                if c.node_id > self._last:
                    chosen = c
                    break
        self._last = chosen.node_id
        return plain_decision(req, chosen, healthy, self.cost, "balance", "round robin")


class LeastLoadedPolicy(PolicyHooks):
    """Fewest inflight + running + waiting; ties by node_id."""

    name = "least_loaded"

    def __init__(self, cost: CostModel | None = None) -> None:
        self.cost = cost or DEFAULT_COST

    def choose(self, req: RouteRequest, candidates: Sequence[Candidate], rng: random.Random) -> Decision:
        healthy = healthy_candidates(candidates)
        chosen = min(healthy, key=lambda c: (load_of(c), c.node_id))
        return plain_decision(req, chosen, healthy, self.cost, "balance", f"load {load_of(chosen)}")


class LocalOnlyPolicy(PolicyHooks):
    """A uniformly random healthy candidate (each node only reuses its own cache); 'affinity' when it holds a prefix."""

    name = "local_only"

    def __init__(self, cost: CostModel | None = None) -> None:
        self.cost = cost or DEFAULT_COST

    def choose(self, req: RouteRequest, candidates: Sequence[Candidate], rng: random.Random) -> Decision:
        healthy = healthy_candidates(candidates)
        chosen = rng.choice(sorted(healthy, key=lambda c: c.node_id))
        reason = "affinity" if blocks_held(chosen, len(req.hashes)) > 0 else "balance"
        return plain_decision(req, chosen, healthy, self.cost, reason, "random")
