"""kvdir's routing policy: the minimum estimated TTFT (gateway.cost's model) over recomputing the prompt or
pulling the missing part of the longest cached prefix from its holder, near-ties going to the node with the
least recent work.

The holder's own load does not enter the pull cost: a pull is a one-sided
read of the holder's registered memory, it takes no engine place there.
A pull needs the holder's slots: H can serve blocks
``[0, min(H.cached_blocks, len(H.slots)))`` only, so a lookup made without
slots never yields a pull plan (pass ``slots=()`` for a holder that cannot
serve reads), and only candidates with ``can_pull`` get the pull option.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Sequence

from gateway.cost import (
    DEFAULT_COST,
    Candidate,
    CostModel,
    Decision,
    RouteRequest,
    TTFTBreakdown,
    blocks_held,
    blocks_ready,
    engine_tokens,
    evaluate,
    link_rate,
    queued_ahead,
    slot_interval_seconds,
)
from gateway.policy_base import TIE_EPSILON, PolicyHooks, cache_reason, healthy_candidates, longest_holder
from kvproto.pull_tenancy import tenancy_refusal

_Option = tuple[float, int, int, Candidate, TTFTBreakdown, bool]
"""(score, cached tokens, inflight, candidate, its breakdown, whether it duplicates in-flight work)."""


class KvdirPolicy(PolicyHooks):
    """Minimum score over (candidate, recompute | pull from the longest holder): the estimated TTFT plus
    the price of what storing the request would evict on a full node (`TTFTBreakdown.score_s`).

    Each candidate's option and its estimate come from `gateway.cost.evaluate`;
    the same breakdown explains the decision (`detail`).
    An option that recomputes blocks another node is computing (and no node
    holds) duplicates that work (a second prefill and a second copy) to save a
    wait: it pays `dup_weight` times that compute on top of its TTFT, unless the
    prefix is hot: `dup_hot_requests` requests already in flight on it
    (`RouteRequest.inflight_requests`) arrived faster than it is computed, so a
    second copy will serve later ones too, and holding it back only delays the
    start of a computation the load needs anyway (a burst).
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
    it takes the shortest queue.
    Stickiness: where some engines hold (or are computing) more of the prompt than the others, the request
    stays among those "homes" unless another option's score is lower than the best home's by more than
    `stay_margin_s` and by more than `stay_margin_ratio` of it; the near-tie band then applies among the homes
    only. Without it a session's next turn moved on a few ms of estimated imbalance (each request ahead priced at a
    whole slot), leaving its history to be recomputed elsewhere. Off by default here (the model alone, as the
    replay runs it); the gateway's --stay-margin-ms and --stay-margin-ratio turn it on. `allow_pull=False` gives the same policy without
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
        stay_margin_s: float = 0.0,
        stay_margin_ratio: float = 0.0,
    ) -> None:
        if min(balance_slack_s, balance_slack_ratio, dup_weight, stay_margin_s, stay_margin_ratio) < 0:
            raise ValueError("balance_slack_s, balance_slack_ratio, dup_weight and the stay margins must be >= 0")
        if balance_window < 1 or dup_hot_requests < 1:
            raise ValueError("balance_window and dup_hot_requests must be >= 1")
        self.stay_margin_s = stay_margin_s
        self.stay_margin_ratio = stay_margin_ratio
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
        healthy = healthy_candidates(candidates)
        cost = self.cost
        holder, longest = longest_holder(healthy, len(req.hashes))
        pull_to = min(longest, len(holder.slots)) if self.allow_pull else 0

        # Blocks some node is computing now that no node holds yet: computing them again is priced (unless hot).
        nh = len(req.hashes)
        ahead = max(c.inflight_blocks for c in healthy)
        priced = ahead > longest and self.dup_weight > 0 and req.inflight_requests < self.dup_hot_requests
        dup_to = min(ahead * req.block_size, req.prompt_tokens) if priced else 0
        best = math.inf
        best_dup = False
        best_follows = False
        options: list[_Option] = []
        for c in healthy:
            br = evaluate(req, c, cost, pull_to_blocks=pull_to if pullable(holder, c) is None else 0)
            score = br.score_s
            dup = dup_to > br.cached_tokens
            if dup:
                score += self.dup_weight * (dup_to - br.cached_tokens) / cost.prefill_tokens_per_s
            options.append((score, br.cached_tokens, c.inflight, c, br, dup))
            if score < best:
                best = score
                best_dup = dup
                best_follows = blocks_ready(c, nh) > blocks_held(c, nh)

        # A request stays with its history (the engines holding, or computing, the most of its prefix) unless
        # leaving saves more than the margin: the estimate is a model, and a session that moves leaves its
        # history behind for the turns after this one.
        ready_by = [blocks_ready(o[3], nh) for o in options]
        most = max(ready_by)
        if most > 0 and self.stay_margin_s + self.stay_margin_ratio > 0:
            homes = [o for o, r in zip(options, ready_by, strict=True) if r == most]
            home_best = min(o[0] for o in homes)
            saving = home_best - best
            if saving <= max(self.stay_margin_s, self.stay_margin_ratio * home_best):
                if best < home_best:
                    best = home_best
                    best_o = next(o for o in homes if o[0] == home_best)
                    best_dup = best_o[5]
                    best_follows = blocks_ready(best_o[3], nh) > blocks_held(best_o[3], nh)
                options = homes
        # A follower of an in-flight prefix leaves no new state to place: the shortest queue, no near-tie band.
        slack = 0.0 if best_follows else min(self.balance_slack_s, self.balance_slack_ratio * best)
        if slack > 0:
            near = [o for o in options if o[0] <= best + slack and (best_dup or not o[5])]
            if len(near) > 1:
                near = self._least_worked(near)
                best = min(o[0] for o in near)
            options = near
        tied = [o for o in options if o[0] <= best + TIE_EPSILON]
        if len(tied) > 1:
            tied = [_break_tie(tied, rng)]
        _, _, _, chosen, br, _ = tied[0]
        t = br.total_s
        cached = engine_tokens(br.cached_tokens, chosen)
        detail = functools.partial(self._explain, req, chosen, br, holder, longest)

        if br.pulled_blocks:
            return Decision(
                chosen.node_id,
                "pull",
                cached,
                pull_from=holder.node_id,
                pull_epoch=holder.epoch,
                pull_slots=tuple(holder.slots[:pull_to]),
                estimated_ttft_s=t,
                why=detail,
            )
        held = blocks_held(chosen, nh)
        ready = blocks_ready(chosen, nh)
        if ready <= held:
            return Decision(chosen.node_id, cache_reason(held, longest), cached, estimated_ttft_s=t, why=detail)
        # Reusing what another request is computing there: it queues behind that prefill. Where a holder can serve
        # that prefix the follower carries the plan a pull there carries (the prefix may be that pull's), since it
        # may reach the engine first: the engine reads the blocks once, for whichever comes first.
        share = min(pull_to, ready) if chosen.can_pull and pullable(holder, chosen) is None else 0
        if share <= held:
            return Decision(chosen.node_id, "inflight", cached, estimated_ttft_s=t, why=detail)
        return Decision(
            chosen.node_id,
            "inflight",
            cached,
            pull_from=holder.node_id,
            pull_epoch=holder.epoch,
            pull_slots=tuple(holder.slots[:share]),
            estimated_ttft_s=t,
            why=detail,
        )

    def _least_worked(self, near: list[_Option]) -> list[_Option]:
        """The options on the nodes with the least recent work."""
        work = self._work
        low = min(work.get(o[3].node_id, 0.0) for o in near)
        return [o for o in near if work.get(o[3].node_id, 0.0) <= low * (1 + 1e-12)]

    def _explain(self, req: RouteRequest, c: Candidate, br: TTFTBreakdown, holder: Candidate, longest: int) -> str:
        """The evaluated option's formula with its values (a debug log line): nothing is recomputed."""
        cost = self.cost
        s = (
            f"ttft={br.total_s:.6f}s = queue {br.queue_s:.6f} [{c.pending_prefill_tokens:g}/{cost.prefill_tokens_per_s:g}"
            f" + (max(0,{c.running}+{c.inflight}-{cost.max_running}+1)={queued_ahead(c, cost)} + {c.waiting})"
            f"*{slot_interval_seconds(req, cost):.6f}]"
        )
        if br.load_s:
            s += (
                f" + load {br.load_s:.6f} [{c.host_blocks} host + {c.disk_blocks} disk of {c.cached_blocks} cached blocks"
                f" *{cost.block_bytes} at {cost.host_copy_bytes_per_s:g} / {cost.disk_read_bytes_per_s:g}]"
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
        if longest > c.cached_blocks and c.node_id != holder.node_id and not br.pulled_blocks:
            why = pullable(holder, c)
            if why:
                s += f"; no pull from {holder.node_id}: {why}"
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

    def on_engine_gone(self, node_id: str) -> None:
        """A restarted engine starts with no recent work."""
        self._work.pop(node_id, None)

    def _add_work(self, node_id: str, tokens: float) -> None:
        self._scale *= 1.0 - 1.0 / self.balance_window
        if self._scale < 1e-100:  # renormalise before the stored values overflow
            self._work = {k: v * self._scale for k, v in self._work.items()}
            self._scale = 1.0
        if tokens > 0:
            self._work[node_id] = self._work.get(node_id, 0.0) + tokens / self._scale


def _break_tie(tied: list[_Option], rng: random.Random) -> _Option:
    """Among options of the same score: more cached tokens, then fewer inflight, then rng (ordered by node_id)."""
    top = max(tied, key=lambda o: (o[1], -o[2]))
    tied = [o for o in tied if o[1] == top[1] and o[2] == top[2]]
    if len(tied) > 1:
        tied.sort(key=lambda o: o[3].node_id)
        return rng.choice(tied)
    return tied[0]


def pullable(holder: Candidate, to: Candidate) -> str | None:
    """Why `to` may not read `holder`'s KV (None: it may): another model's, weights' or layout's KV is not this
    one's (fingerprints differ), heads sliced over another TP rank count do not fit its ranks' pages, and a
    shared engine reads no tenant's KV, nor a tenant's engine another tenant's (kvproto.pull_tenancy)."""
    if to.kv_fingerprint != holder.kv_fingerprint:
        return f"KV fingerprint {holder.kv_fingerprint} there, {to.kv_fingerprint} here"
    if to.tp_size != holder.tp_size:
        return f"{holder.tp_size} TP ranks there, {to.tp_size} here"
    return tenancy_refusal(
        tenant=to.tenant, shared=to.shared, source=holder.node_id, source_tenant=holder.tenant, source_shared=holder.shared
    )
