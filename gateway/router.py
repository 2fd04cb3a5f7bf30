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
   plan (`kvproto.schemas.PullPlan`) for the upstream body, and the prompt
   tokens the engine will compute (its pending prefill);
4. `Router.routed` tells the policy where the request went, once it was sent.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from gateway.config import GatewaySettings
from gateway.cost import Candidate, CostModel, Decision, RouteRequest, evaluate, link_rate, prefill_rate, pull_seconds
from gateway.inflight import InflightPrefixes
from gateway.policy import Policy
from gateway.prefix_hasher import PrefixHasher
from gateway.ttft_learner import Observation, TtftLearner
from kvproto import media
from kvproto.hashing import KvIdentity
from kvproto.schemas import KV_TRANSFER_PARAMS_FIELD, PULL_PLAN_FIELD, PullPlan

__all__ = [
    "EngineView",
    "HolderView",
    "NoEngineAvailable",
    "Route",
    "Router",
    "build_candidates",
    "cost_model",
    "make_candidate",
    "reported_link",
]

log = logging.getLogger("kvdir.gateway")

DEFAULT_MAX_TOKENS = 16  # a request without max_tokens is assumed this long (OpenAI's default for completions)
# A reported pull bandwidth is clamped to this range (GB/s): a figure outside it says more about the measurement
# (a read timed around a stall, a copy that never left the host) than about the link.
REPORTED_GBPS_MIN = 0.001
REPORTED_GBPS_MAX = 1000.0


class EngineView(Protocol):
    """What routing reads of an engine (gateway.engine_registry.EngineState has it all)."""

    @property
    def node_id(self) -> str: ...
    @property
    def epoch(self) -> int: ...
    @property
    def running(self) -> float: ...  # as the engine reported it: includes this gateway's in-flight requests
    @property
    def waiting(self) -> float: ...  # the same
    @property
    def inflight(self) -> int: ...
    @property
    def reported_inflight(self) -> int: ...  # this gateway's requests in flight there when running/waiting were taken
    @property
    def pending_prefill_tokens(self) -> float: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def can_pull(self) -> bool: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def block_size(self) -> int: ...  # the engine's KV block in tokens, as registered (0: unknown)
    @property
    def capacity_blocks(self) -> int | None: ...  # KV blocks it can hold, as registered (None: unknown)
    @property
    def blocks(self) -> int: ...  # blocks the directory lists for it
    @property
    def pull_gbps(self) -> float: ...  # pull bandwidth it measured, GB/s (its PULL_GBPS_LABEL load label; 0: none)
    @property
    def fingerprint(self) -> str | None: ...  # its registered KV fingerprint (None: never a pull source nor destination)
    @property
    def tp_size(self) -> int: ...  # its tensor-parallel ranks, as registered (a pull needs as many on both ends)
    @property
    def tenant(self) -> str: ...  # its registered tenant
    @property
    def shared(self) -> bool: ...  # registered shared: it pulls only from shared engines (kvproto.pull_tenancy)


class HolderView(Protocol):
    """What routing reads of a lookup answer's holder (kvproto.schemas.Holder)."""

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
        host_copy_bytes_per_s=settings.host_copy_gbps * 1e9,
        disk_read_bytes_per_s=settings.disk_read_gbps * 1e9,
        max_running=settings.max_running,
        decode_tokens_per_s=settings.decode_tokens_per_s,
        displace_weight=settings.displace_weight,
    )


def reported_link(pull_gbps: float) -> float:
    """Bytes/s to price pulls to an engine that reported `pull_gbps`, clamped to the sane range; 0 (use the
    configured --link-gbps) when it reported none, or nothing positive."""
    if not pull_gbps > 0:  # also NaN
        return 0.0
    return min(max(pull_gbps, REPORTED_GBPS_MIN), REPORTED_GBPS_MAX) * 1e9


def make_candidate(
    node_id: str,
    epoch: int,
    *,
    reported_running: float,
    waiting: float,
    inflight: int,
    pending_prefill_tokens: float,
    reported_inflight: int | None = None,
    cached_blocks: int = 0,
    slots: Sequence[int] = (),
    healthy: bool = True,
    can_pull: bool = True,
    free_tokens: int | None = None,
    engine_block_size: int = 0,
    inflight_blocks: int = 0,
    link_bytes_per_s: float = 0.0,
    kv_fingerprint: str | None = None,
    tp_size: int = 1,
    tenant: str = "",
    shared: bool = False,
) -> Candidate:
    """A candidate from an engine's reported load and the gateway's own count of requests in flight there.

    The rule that counts this gateway's requests once: they are the candidate's `inflight` (the cost model's own
    term for them); the engine's `reported_running` and `waiting` include those of them it held when it took the
    figures, `reported_inflight` (the gateway's in-flight count then: when a read of its /metrics began; None for
    a heartbeat's, taken at an unknown moment: as if now). The candidate's `running` and `waiting` are the rest,
    the engine's other requests (other gateways', direct clients'): its figures less `reported_inflight`, taken
    from its running first, then from its waiting (the cost model queues `running + inflight` past
    `max_running`: a request of ours the engine holds queued is queued there, never also `waiting`); never below
    0. So `running + waiting + inflight` = the engine's figures + our requests sent since it took them - ours
    finished since. One approximation is left: a request of ours not yet in the engine's scheduler when it took
    them (in transit, being tokenized) is taken as counted, so for that moment its other requests look fewer.
    `slots` are the holder's locations (kvproto.media): how many of the first `cached_blocks` lie in its host
    tier or on its disk is read from them; the holder is taken to hold only the blocks before a location in no
    medium (an answer the directory cannot have given: nothing after it is known). A negative `reported_running`
    or `waiting` (outside input) counts as none.
    """
    ours = inflight if reported_inflight is None else reported_inflight
    reported_running, waiting = max(0.0, reported_running), max(0.0, waiting)
    slots = tuple(slots)
    lower = [0] * len(media.MEDIA)
    if slots and max(slots[:cached_blocks], default=0) > media.SLOT_MASK:  # some lie in a lower tier
        for i, loc in enumerate(slots[:cached_blocks]):
            code = loc >> media.SHIFT
            if not 0 <= code < len(media.MEDIA):
                cached_blocks, slots = i, slots[:i]
                break
            lower[code] += 1
    return Candidate(
        node_id=node_id,
        epoch=epoch,
        cached_blocks=cached_blocks,
        slots=slots,
        running=max(0, int(reported_running) - ours),
        waiting=max(0, int(waiting) - max(0, ours - int(reported_running))),
        pending_prefill_tokens=pending_prefill_tokens,
        inflight=inflight,
        healthy=healthy,
        can_pull=can_pull,
        free_tokens=free_tokens,
        engine_block_size=engine_block_size,
        inflight_blocks=inflight_blocks,
        link_bytes_per_s=link_bytes_per_s,
        kv_fingerprint=kv_fingerprint,
        tp_size=tp_size,
        tenant=tenant,
        shared=shared,
        host_blocks=lower[media.HOST],
        disk_blocks=lower[media.DISK],
    )


def free_tokens(e: EngineView, block_size: int) -> int | None:
    """Tokens the engine can store without evicting: (capacity - blocks listed) in its block size, or
    `block_size` when it registered none; None when it registered no capacity (no displacement priced)."""
    cap = e.capacity_blocks
    if cap is None:
        return None
    return max(0, cap - e.blocks) * (e.block_size or block_size)


def build_candidates(
    engines: Iterable[EngineView],
    holders: Mapping[str, HolderView],
    exclude: Container[str] = frozenset(),
    *,
    inflight: Mapping[tuple[str, int], int] | None = None,
    block_size: int = 16,
) -> list[Candidate]:
    """One candidate per engine not in `exclude`, in the engines' order, healthy or not.

    An engine holds cached blocks only if the holder's epoch is the engine's
    current one: blocks of an earlier incarnation are gone. `inflight` is
    `InflightPrefixes.match` for this prompt: blocks being computed per (node,
    epoch). `block_size` (the gateway's) sizes free space of engines that
    registered no block size. A pull to an engine is priced with the bandwidth it reported (`reported_link`), or
    before its first read with the lowest any engine reported (its first pull is not priced at `--link-gbps`
    while its peers measured less: the link is the same kind of link); an engine without a registered KV
    fingerprint never pulls.
    """
    inflight = inflight or {}
    engines = list(engines)
    measured = [link for e in engines if (link := reported_link(e.pull_gbps)) > 0]
    unmeasured = min(measured, default=0.0)  # 0: none measured yet, the configured --link-gbps
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
                reported_inflight=e.reported_inflight,
                pending_prefill_tokens=e.pending_prefill_tokens,
                cached_blocks=h.matched_blocks if h is not None and held else 0,
                slots=(h.slots or ()) if h is not None and held else (),
                healthy=e.healthy,
                can_pull=e.can_pull and e.fingerprint is not None,
                free_tokens=free_tokens(e, block_size),
                engine_block_size=e.block_size,
                inflight_blocks=inflight.get((e.node_id, e.epoch), 0),
                link_bytes_per_s=reported_link(e.pull_gbps) or unmeasured,
                kv_fingerprint=e.fingerprint,
                tp_size=e.tp_size,
                tenant=e.tenant,
                shared=e.shared,
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class Route:
    """Where one request goes, and what the gateway sends with it."""

    decision: Decision
    pull_plan: PullPlan | None  # for an engine that pulls the prefix from a peer
    uncached_tokens: int  # prompt tokens the engine computes: its pending prefill until the first token
    chosen: Candidate  # the engine chosen, as the policy saw it (what the TTFT it then shows is learned against)

    def upstream_body(self, raw: dict[str, Any]) -> dict[str, Any]:
        """The client's body as forwarded: unchanged, plus the pull plan if there is one.

        The plan goes in twice: top-level for the worker stub, and inside `kv_transfer_params` (merged with
        the client's) for the vLLM connector, the one field vLLM passes to connectors.
        """
        if self.pull_plan is None:
            return raw
        plan = self.pull_plan.to_json()
        params = raw.get(KV_TRANSFER_PARAMS_FIELD)
        params = {**params, PULL_PLAN_FIELD: plan} if isinstance(params, dict) else {PULL_PLAN_FIELD: plan}
        return {**raw, PULL_PLAN_FIELD: plan, KV_TRANSFER_PARAMS_FIELD: params}


class Router:
    """Hashes prompts, scores engines with a policy and explains the choice; owns the policy's state and its rng.

    Not thread-safe (the policy and the rng are mutated): the gateway calls it
    from its event loop only.
    """

    def __init__(
        self,
        policy: Policy,
        rng: random.Random,
        hasher: PrefixHasher,
        inflight: InflightPrefixes | None = None,
        learner: TtftLearner | None = None,
    ) -> None:
        self.policy = policy
        self.rng = rng
        self.hasher = hasher
        self._hashers = {hasher.block_size: hasher}  # one per block size: checkpoints of two sizes never meet
        self.inflight = inflight if inflight is not None else InflightPrefixes()
        self.learner = learner if learner is not None else TtftLearner(policy.cost.prefill_tokens_per_s, window=0)

    def hashes(self, tokens: list[int], identity: KvIdentity | None = None, block_size: int = 0) -> list[int]:
        """The prompt's full-block sequence hashes under its KV identity, as the engines compute them, in blocks of
        `block_size` tokens (the engines', EngineRegistry.hash_block_size; 0: the hasher's)."""
        hasher = self._hashers.get(block_size or self.hasher.block_size)
        if hasher is None:  # block sizes come from engines' registrations: a handful
            hasher = self._hashers[block_size] = PrefixHasher(block_size, self.hasher.namespace)
        return hasher.hashes(tokens, identity)

    def request(
        self, prompt_tokens: int, hashes: Sequence[int], max_tokens: int | None, model: str = "", block_size: int = 0
    ) -> RouteRequest:
        """What the policy sees of a request; no (or zero) `max_tokens` counts as DEFAULT_MAX_TOKENS. The requests
        ahead of it are priced at the output length observed for `model` (the learner's), not at its `max_tokens`.
        `block_size`: the tokens per block `hashes` were hashed in (0: the hasher's)."""
        cap = int(max_tokens or DEFAULT_MAX_TOKENS)
        return RouteRequest(
            prompt_tokens=prompt_tokens,
            hashes=tuple(hashes),
            block_size=block_size or self.hasher.block_size,
            max_tokens=cap,
            output_tokens=self.learner.output_tokens(model, cap),
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
        unhashed: str | None = None,
        exclude: Container[str] = frozenset(),
        now: float = 0.0,
    ) -> Route:
        """The policy's choice among the healthy engines not excluded; NoEngineAvailable when there is none.

        With `lookup_failure` (why the directory did not answer) the holders are
        unknown: the choice is by load and is reported as `fallback`, predicting
        no cached tokens, unless it follows a prefix the gateway itself sent there (`inflight`). With
        `unhashed` (why the prompt could not be hashed as the engine hashes it: `req` then has no hashes) it is
        by load too, reported as `unhashed`, and never with a pull plan. `now` (monotonic seconds) ages the
        in-flight prefixes.
        """
        inflight = self.inflight.match(req.hashes, now)
        if inflight:
            req = replace(req, inflight_requests=self.inflight.sharing(req.hashes, max(inflight.values()), now))
        cands = [
            c
            for c in build_candidates(
                engines,
                holders,
                exclude,
                inflight=inflight,
                block_size=self.hasher.block_size,
            )
            if c.healthy
        ]
        if not cands:
            raise NoEngineAvailable("no engine is available")
        cands = [self._learned(c) for c in cands]
        decision = self.policy.choose(req, cands, self.rng)
        if unhashed is not None:
            decision = replace(
                decision,
                reason="unhashed",
                predicted_cached_tokens=0,
                pull_from=None,
                pull_epoch=None,
                pull_slots=(),
                why=f"{unhashed}: the gateway cannot hash it as the engine does, so routed by load without a pull",
            )
        elif lookup_failure is not None and decision.reason != "inflight":  # "inflight": the gateway's own knowledge
            decision = replace(
                decision,
                reason="fallback",
                predicted_cached_tokens=0,
                why=f"directory lookup failed ({lookup_failure}): routed by load",
            )
        plan = None
        if decision.pull_from is not None and decision.pull_epoch is not None:
            source = next(c for c in cands if c.node_id == decision.pull_from)
            plan = PullPlan(
                source_node=decision.pull_from,
                source_epoch=decision.pull_epoch,
                slots=list(decision.pull_slots),
                fingerprint=source.kv_fingerprint,
            )
        chosen = next(c for c in cands if c.node_id == decision.node_id)
        return Route(decision, plan, max(0, req.prompt_tokens - decision.predicted_cached_tokens), chosen)

    def _learned(self, c: Candidate) -> Candidate:
        """`c` with the prefill rate (at its load) and overhead learned from its observed TTFTs, if any."""
        learned = self.learner.learned(c.node_id, c.running + c.inflight)
        if learned is None:
            return c
        rate, overhead = learned
        return replace(c, prefill_tokens_per_s=rate, overhead_s=overhead)

    def observe(self, route: Route, req: RouteRequest, observed_s: float, reported_cached: int | None) -> Observation:
        """The request `route` sent showed its first byte `observed_s` after it was sent: learn from it. Its
        prefill is the prompt less the cached tokens the engine reported, where it did (else as predicted)."""
        c = route.chosen
        uncached = route.uncached_tokens if reported_cached is None else max(0, req.prompt_tokens - reported_cached)
        br = evaluate(req, c, self.policy.cost, pull_to_blocks=0)
        slot_s = br.queue_s - c.pending_prefill_tokens / prefill_rate(c, self.policy.cost)
        pull_s = 0.0
        if route.decision.pull_from is not None:
            pulled = len(route.decision.pull_slots) - c.cached_blocks
            pull_s = pull_seconds(pulled, self.policy.cost, link_rate(c, self.policy.cost))
        o = Observation(
            observed_s=observed_s,
            predicted_s=route.decision.estimated_ttft_s,
            work_tokens=c.pending_prefill_tokens + uncached,
            running=c.running + c.inflight,
            fixed_s=max(0.0, slot_s) + br.load_s + pull_s,
        )
        self.learner.observe(c.node_id, o)
        return o

    def prefilling(self, req: RouteRequest, node_id: str, epoch: int, now: float) -> int:
        """The request is being sent to `node_id`@`epoch`: its prompt is computed there from now on; a key for `prefilled`."""
        return self.inflight.begin(req.hashes, node_id, epoch, now)

    def prefilled(self, key: int, now: float, *, ok: bool) -> None:
        """The request's prefill is over: `ok` (first token back: the node holds its prompt) or not (it failed)."""
        self.inflight.end(key, now, ok=ok)

    def routed(self, req: RouteRequest, decision: Decision) -> None:
        """The request was sent where `decision` says (a policy with memory of its routing learns it here)."""
        self.policy.on_routed(req, decision)
