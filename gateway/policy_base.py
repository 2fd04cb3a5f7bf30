"""What the routing policies share beyond gateway.cost: the hooks a policy may leave alone, the healthy
candidates, the longest holder, the reason a cache state gives, and a decision without a pull."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.cost import Candidate, CostModel, Decision, RouteRequest, blocks_held, engine_tokens, estimate_ttft

# Two estimates closer than this (seconds, or cost units for dynamo) are a tie.
TIE_EPSILON = 1e-9


class PolicyHooks:
    """What the gateway and the replay tell every policy, as no-ops: a policy overrides the events it keeps state
    on, and its callers never ask which policy they hold."""

    def on_routed(self, req: RouteRequest, decision: Decision) -> None:
        """`decision` was sent to its engine."""

    def on_finished(self, req: RouteRequest, decision: Decision) -> None:
        """The request of `decision` ended."""

    def on_peer_routed(self, node_id: str, tokens: float) -> None:
        """Another gateway sent `tokens` uncached prompt tokens to `node_id` (its note, gateway.peers)."""

    def on_engine_gone(self, node_id: str) -> None:
        """`node_id` left the directory: what the policy keeps about it is stale (a restart is a new engine)."""


def healthy_candidates(candidates: Sequence[Candidate]) -> list[Candidate]:
    healthy = [c for c in candidates if c.healthy]
    if not healthy:
        raise ValueError(f"no healthy candidate among {len(candidates)}")
    return healthy


def longest_holder(healthy: list[Candidate], nh: int) -> tuple[Candidate, int]:
    """The healthy candidate with the most cached blocks (ties: lowest node_id) and its block count."""
    best = healthy[0]
    best_b = blocks_held(best, nh)
    for c in healthy[1:]:
        b = blocks_held(c, nh)
        if b > best_b or (b == best_b and c.node_id < best.node_id):
            best, best_b = c, b
    return best, best_b


def cache_reason(blocks: int, longest: int) -> str:
    if longest <= 0:
        return "balance"
    return "affinity" if blocks >= longest else "recompute"


def block_tokens(blocks: int, req: RouteRequest, cand: Candidate) -> int:
    """Prompt tokens in `blocks` leading blocks, in the engine's block units (what it will report as cached)."""
    return engine_tokens(min(blocks * req.block_size, req.prompt_tokens), cand)


def plain_decision(
    req: RouteRequest, chosen: Candidate, healthy: list[Candidate], cost: CostModel, reason: str | None, detail: str
) -> Decision:
    """A decision without a pull, reason by the directory's view unless given."""
    nh = len(req.hashes)
    blocks = blocks_held(chosen, nh)
    if reason is None:
        reason = cache_reason(blocks, longest_holder(healthy, nh)[1])
    return Decision(
        chosen.node_id,
        reason,
        block_tokens(blocks, req, chosen),
        estimated_ttft_s=estimate_ttft(req, chosen, cost),
        why=detail,
    )


def load_of(c: Candidate) -> int:
    return c.inflight + c.running + c.waiting
