"""Routing policies: pure functions of (request, candidates, rng) -> Decision, and their registry.

Each policy is in a module of its own; their inputs, `Decision` and kvdir's
TTFT model are in gateway.cost, what they share beyond it in
gateway.policy_base.

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
``kvdir`` (ours, gateway.kvdir_policy)
    Estimated time to first token (TTFT) per healthy candidate (the model in
    gateway.cost, computed by `gateway.cost.evaluate`), with the option of
    pulling the missing part of the longest cached prefix from its holder
    instead of recomputing it, plus the price of what storing the request
    would evict on a full node; minimum wins, near-ties go to the node with
    the least recent work.

``round_robin``, ``least_loaded``, ``local_only`` (gateway.baseline_policies)
    What a stateless gateway does; ``local_only`` is random routing where each
    node keeps its own cache (no pulls).

``sglang`` (modeled after SGLang's cache-aware router, gateway.sglang_policy)
    Its own approximate tree of what it routed, not the directory.

``dynamo`` (modeled after Dynamo's KV router, gateway.dynamo_policy)
    ``cost = overlap_weight * prefill_blocks + decode_blocks`` over its own
    count of the distinct blocks it has in flight per node.

Every policy fills ``estimated_ttft_s`` with kvdir's model of the chosen
option, so decisions of all policies can be compared on the same scale.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from gateway.baseline_policies import LeastLoadedPolicy, LocalOnlyPolicy, RoundRobinPolicy
from gateway.cost import Candidate, CostModel, Decision, RouteRequest
from gateway.dynamo_policy import DynamoPolicy
from gateway.kvdir_policy import KvdirPolicy
from gateway.sglang_policy import SGLangPolicy

__all__ = ["POLICIES", "Policy", "make_policy"]


@runtime_checkable
class Policy(Protocol):
    name: str
    cost: CostModel

    def choose(self, req: RouteRequest, candidates: Sequence[Candidate], rng: random.Random) -> Decision: ...

    def on_routed(self, req: RouteRequest, decision: Decision) -> None: ...

    def on_finished(self, req: RouteRequest, decision: Decision) -> None: ...

    def on_peer_routed(self, node_id: str, tokens: float) -> None: ...

    def on_engine_gone(self, node_id: str) -> None: ...


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
