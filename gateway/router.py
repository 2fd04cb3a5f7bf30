"""The gateway's routing step, pure: a prompt, the engines and the directory's holders -> a decision.

No I/O and no clock, so it is tested without sockets (tests/unit/test_router.py)
and can be driven by the replay simulator: `make_candidate` is the one rule for
turning what an engine reported and what the gateway has in flight into a
`Candidate`, and `build_candidates` applies it to engines and lookup holders.

The flow for one request (gateway.proxy does the I/O around it):
1. `Router.request` hashes the prompt's tokens into a `RouteRequest`;
2. the caller asks the directory which engines hold how much of it (holders);
3. `Router.route` builds candidates, lets the policy choose and returns a
   `Route`: the decision (reason `fallback` when the lookup failed), the pull
   plan (`directory.schemas.PullPlan`) for the upstream body, and the prompt
   tokens the engine will compute (its pending prefill);
4. `Router.routed` tells the policy where the request went, once it was sent.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from directory.schemas import PULL_PLAN_FIELD, PullPlan
from gateway.config import GatewaySettings
from gateway.cost import Candidate, CostModel, Decision, RouteRequest
from gateway.policy import Policy
from gateway.prefix_hasher import PrefixHasher

__all__ = [
    "EngineView",
    "HolderView",
    "NoEngineAvailable",
    "Route",
    "Router",
    "build_candidates",
    "cost_model",
    "make_candidate",
]

log = logging.getLogger("kvdir.gateway")

DEFAULT_MAX_TOKENS = 16  # a request without max_tokens is assumed this long (OpenAI's default for completions)


class EngineView(Protocol):
    """What routing reads of an engine (gateway.engines.EngineState has it all)."""

    @property
    def node_id(self) -> str: ...
    @property
    def epoch(self) -> int: ...
    @property
    def running(self) -> float: ...  # as the engine reported it: includes this gateway's in-flight requests
    @property
    def waiting(self) -> float: ...
    @property
    def inflight(self) -> int: ...
    @property
    def pending_prefill_tokens(self) -> float: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def can_pull(self) -> bool: ...
    @property
    def block_bytes(self) -> int: ...


class HolderView(Protocol):
    """What routing reads of a lookup answer's holder (directory.schemas.Holder)."""

    @property
    def epoch(self) -> int: ...
    @property
    def matched_blocks(self) -> int: ...
    @property
    def slots(self) -> Sequence[int] | None: ...


class NoEngineAvailable(LookupError):
    """No healthy engine is left to route to (none known, or all excluded or skipped as unhealthy)."""


def cost_model(settings: GatewaySettings) -> CostModel:
    """The policies' cost model from the gateway's settings (block_bytes is learned later: `Router.learn_block_bytes`)."""
    return CostModel(
        prefill_tokens_per_s=settings.prefill_tokens_per_s,
        link_bytes_per_s=settings.link_gbps * 1e9,
        pull_setup_s=settings.pull_setup_ms / 1000,
        max_running=settings.max_running,
        decode_tokens_per_s=settings.decode_tokens_per_s,
    )


def make_candidate(
    node_id: str,
    epoch: int,
    *,
    reported_running: float,
    waiting: float,
    inflight: int,
    pending_prefill_tokens: float,
    cached_blocks: int = 0,
    slots: Sequence[int] = (),
    healthy: bool = True,
    can_pull: bool = True,
) -> Candidate:
    """A candidate from an engine's reported load and the gateway's own count of requests in flight there.

    The engine's `running` includes the requests this gateway has in flight to
    it, which the cost model counts separately (`inflight`): they are counted once.
    """
    return Candidate(
        node_id=node_id,
        epoch=epoch,
        cached_blocks=cached_blocks,
        slots=tuple(slots),
        running=max(0, int(reported_running) - inflight),
        waiting=int(waiting),
        pending_prefill_tokens=pending_prefill_tokens,
        inflight=inflight,
        healthy=healthy,
        can_pull=can_pull,
    )


def build_candidates(
    engines: Iterable[EngineView], holders: Mapping[str, HolderView], exclude: Container[str] = frozenset()
) -> list[Candidate]:
    """One candidate per engine not in `exclude`, in the engines' order, healthy or not.

    An engine holds cached blocks only if the holder's epoch is the engine's
    current one: blocks of an earlier incarnation are gone.
    """
    out = []
    for e in engines:
        if e.node_id in exclude:
            continue
        h = holders.get(e.node_id)
        held = h is not None and h.epoch == e.epoch
        out.append(
            make_candidate(
                e.node_id,
                e.epoch,
                reported_running=e.running,
                waiting=e.waiting,
                inflight=e.inflight,
                pending_prefill_tokens=e.pending_prefill_tokens,
                cached_blocks=h.matched_blocks if h is not None and held else 0,
                slots=(h.slots or ()) if h is not None and held else (),
                healthy=e.healthy,
                can_pull=e.can_pull,
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class Route:
    """Where one request goes, and what the gateway sends with it."""

    decision: Decision
    pull_plan: PullPlan | None  # for an engine that pulls the prefix from a peer
    uncached_tokens: int  # prompt tokens the engine computes: its pending prefill until the first token

    def upstream_body(self, raw: dict[str, Any]) -> dict[str, Any]:
        """The client's body as forwarded: unchanged, plus the pull plan if there is one."""
        if self.pull_plan is None:
            return raw
        return {**raw, PULL_PLAN_FIELD: self.pull_plan.to_json()}


class Router:
    """Hashes prompts, scores engines with a policy and explains the choice; owns the policy's state and its rng.

    Not thread-safe (the policy and the rng are mutated): the gateway calls it
    from its event loop only.
    """

    def __init__(self, policy: Policy, rng: random.Random, hasher: PrefixHasher) -> None:
        self.policy = policy
        self.rng = rng
        self.hasher = hasher

    def hashes(self, tokens: list[int]) -> list[int]:
        """The prompt's full-block sequence hashes, as the engines compute them."""
        return self.hasher.hashes(tokens)

    def request(self, prompt_tokens: int, hashes: Sequence[int], max_tokens: int | None) -> RouteRequest:
        """What the policy sees of a request; no (or zero) `max_tokens` counts as DEFAULT_MAX_TOKENS."""
        return RouteRequest(
            prompt_tokens=prompt_tokens,
            hashes=tuple(hashes),
            block_size=self.hasher.block_size,
            max_tokens=int(max_tokens or DEFAULT_MAX_TOKENS),
        )

    def learn_block_bytes(self, engines: Iterable[EngineView]) -> None:
        """Price pulls by the engines' real block size (all TP ranks), learned from their registered regions.

        The largest among the engines that can pull; nothing is learned while none registered regions.
        """
        block_bytes = max((e.block_bytes for e in engines if e.can_pull), default=0)
        if block_bytes and block_bytes != self.policy.cost.block_bytes:
            self.policy.cost = replace(self.policy.cost, block_bytes=block_bytes)

    def route(
        self,
        req: RouteRequest,
        engines: Iterable[EngineView],
        holders: Mapping[str, HolderView],
        *,
        lookup_failure: str | None = None,
        exclude: Container[str] = frozenset(),
    ) -> Route:
        """The policy's choice among the healthy engines not excluded; NoEngineAvailable when there is none.

        With `lookup_failure` (why the directory did not answer) the holders are
        unknown: the choice is by load and is reported as `fallback`, predicting
        no cached tokens.
        """
        cands = [c for c in build_candidates(engines, holders, exclude) if c.healthy]
        if not cands:
            raise NoEngineAvailable("no engine is available")
        decision = self.policy.choose(req, cands, self.rng)
        if lookup_failure is not None:
            decision = replace(
                decision,
                reason="fallback",
                predicted_cached_tokens=0,
                detail=f"directory lookup failed ({lookup_failure}): routed by load",
            )
        plan = None
        if decision.pull_from is not None and decision.pull_epoch is not None:
            plan = PullPlan(source_node=decision.pull_from, source_epoch=decision.pull_epoch, slots=list(decision.pull_slots))
        return Route(decision, plan, max(0, req.prompt_tokens - decision.predicted_cached_tokens))

    def routed(self, req: RouteRequest, decision: Decision) -> None:
        """The request was sent where `decision` says (a policy with memory of its routing learns it here)."""
        self.policy.on_routed(req, decision)
