"""The replay simulator's engine: one `ClusterSim` object holds a simulated cluster and runs its events.

The model and the figures are described in `kvtools.replay.sim`'s docstring;
this module implements them. Its shape:

- the state is plain objects: a `_Node` per engine (its `NodeCache` and its
  load: running, waiting, link and prefill-server availability), a `_Flight`
  per routed request (where it went, what it found, its pull), a `Tally` of
  the figures' counters, and the directory's lagged `DirectoryView`;
- time advances by a heap of ``(time, seq, kind, payload)`` events; ``seq``
  (a counter) orders events at equal times by when they were scheduled, so a
  run is deterministic, and ``kind`` indexes the table of handler methods
  (``_handlers``) that dispatch them;
- arrivals are not events: `ClusterSim.run` takes the requests in arrival
  order and first handles every event due by then, which is what the
  gateway sees (the state of the cluster at the moment a request arrives).

Speed matters (the report runs every policy over traces of ~10^4 requests), so
the per-request and per-event paths bind attributes to locals and keep the
cache work inside `NodeCache`'s loops.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.cost import Decision, RouteRequest
from gateway.inflight import InflightPrefixes
from gateway.policy import make_policy
from gateway.prefix_hasher import PrefixHasher
from gateway.router import Route, Router
from gateway.ttft_learner import TtftLearner
from kvtools.replay.cache import DirectoryView, NodeCache, Publish, leading_runs
from kvtools.replay.figures import Tally, load_timeline, tokens_of_blocks
from kvtools.replay.params import SimParams
from kvtools.replay.trace import TraceRequest
from kvtools.replay.views import SIM_EPOCH, SimEngine, SimHolder

__all__ = ["ClusterSim"]

# Event kinds, the indices of ClusterSim._handlers.
_PULL_DONE, _PREFILL_DONE, _DECODE_DONE, _PUBLISH, _HEARTBEAT, _SYNC, _NOTE, _ENGINE, _PREFILL_START = range(9)
_DONE_EPS = 1e-6  # tokens: a calibrated engine's prefill or decode with less left is over (float rounding)


@dataclass(slots=True, eq=False)
class _Flight:
    """A routed request until its decode ends; the payload of its pull, prefill and decode events."""

    index: int  # in arrival order
    req: TraceRequest
    node: int
    local: int  # leading blocks found on the node (pinned at arrival)
    shared: int = 0  # leading blocks after `local` that other requests were computing there at arrival (reused)
    after: _Flight | None = None  # the request computing the last of those: this prefill starts after its end
    followers: list[_Flight] = field(default_factory=list)  # requests waiting for this one's prefill to be scheduled
    prefill_end: float = -1.0  # when its prefill ends, once scheduled
    computed_from: int = 0  # blocks [computed_from, n) are computed (or pulled) by this request
    inflight_key: int = -1  # its gateway's gateway.inflight entry
    uncached: int = 0  # prompt tokens to prefill
    pred_uncached: int = 0  # what the gateway counts in the node's pending prefill tokens
    ready: float = 0.0  # when its prefix's host-tier blocks are on the device (its arrival if none): prefill no sooner
    pull_src: int = -1
    pull_n: int = 0  # blocks pulled (pinned on the source until the pull is done)
    pull_pending: bool = False
    admitted: bool = False
    gw: int = 0  # the gateway that routed it
    rreq: RouteRequest | None = None  # what its gateway's policy saw (handed back to it when the request ends)
    decision: Decision | None = None
    route: Route | None = None  # its gateway's routing, learned from at its first token (ttft_learn_window)


@dataclass(slots=True, eq=False)
class _Node:
    """One engine: its cache, and the load the gateway sees or the model's queues need."""

    cache: NodeCache
    running: int = 0  # admitted (prefill or decode)
    inflight: list[int] = field(default_factory=list)  # per gateway: requests it sent here, not finished
    pending: list[float] = field(
        default_factory=list
    )  # per gateway: its predicted uncached prompt tokens without a first token yet
    waitq: deque[_Flight] = field(default_factory=deque)  # waiting for a running place, FIFO
    computing: dict[int, _Flight] = field(default_factory=dict)  # block -> the request computing it here now
    backlog: float = 0.0  # uncached prompt tokens of the requests here without a first token (all gateways')
    reported: float = 0.0  # `backlog` at its last heartbeat (what the directory's node list says)
    own_reported: list[float] = field(default_factory=list)  # per gateway: what it knew of `backlog` at that heartbeat
    peer_pending: list[float] = field(default_factory=list)  # per gateway: the other gateways' notes it has received
    prefill_free: float = 0.0  # when the prefill server is next free
    link_in_free: float = 0.0
    link_out_free: float = 0.0
    busy: float = 0.0  # prefill-busy seconds
    spans: list[tuple[float, float]] = field(default_factory=list)  # prefill intervals, for the timeline
    # A calibrated engine (params.calibration): the prefills and decodes under way, each with its tokens left, all
    # advanced to `advanced_at`; `version` voids the completion event scheduled before the last change.
    prefilling: dict[_Flight, float] = field(default_factory=dict)
    decoding: dict[_Flight, float] = field(default_factory=dict)
    advanced_at: float = 0.0
    version: int = 0
    busy_since: float = 0.0  # when `prefilling` last became non-empty

    @property
    def queued(self) -> int:
        return len(self.waitq)

    @property
    def cached(self) -> int:
        """Blocks held in any tier (what the directory lists for the node)."""
        return len(self.cache) + len(self.cache.host) + len(self.cache.host_pins)


class ClusterSim:
    """One policy's run over one list of requests (sorted by arrival): `run`, then `figures`.

    Single use: the state is consumed by the run.
    """

    def __init__(self, reqs: list[TraceRequest], policy_name: str, params: SimParams) -> None:
        p = params
        self.reqs = reqs
        self.params = p
        self.policy_name = policy_name
        # One gateway Router per gateway, as the live gateway builds it: its own policy state (SGLang-modeled tree,
        # kvdir's recent work, Dynamo-modeled in-flight sequences), rng and in-flight prefixes (gateway.inflight,
        # in simulated seconds); the directory they read is the one shared view.
        options = dict(p.policy_options.get(policy_name, {}))
        if policy_name == "dynamo":
            options.setdefault("track_finished", True)  # this simulation reports every request's end
        self.routers = [
            Router(
                make_policy(policy_name, p.cost_model(), **options),
                random.Random(p.seed if g == 0 else f"{p.seed}/{g}"),
                PrefixHasher(p.block_tokens),
                InflightPrefixes(),
                TtftLearner(p.prefill_tokens_per_s, p.ttft_learn_window),
            )
            for g in range(p.gateways)
        ]
        self.cal = p.calibration
        # Dynamo's router replicas share their routing decisions and request ends (--router-replica-sync, NATS core
        # messages: the others apply them `replica_sync_s` later); the other policies see only their own.
        self.sync = policy_name == "dynamo" and p.gateways > 1
        # kvdir's gateways send each other a note per routing decision (engine, pending prefill tokens) and per
        # prefill end (gateway.peers), with the same delay: each folds the others' into the engine's pending prefill.
        self.notes = policy_name == "kvdir" and p.gateways > 1 and p.share_decisions
        n = p.engines
        width = len(str(p.nodes - 1))
        # Zero padded: they sort in order. A node's DP ranks are engines of their own, named as the connector does.
        self.ids = [f"n{j // p.dp_ranks:0{width}d}" + (f"-dp{j % p.dp_ranks}" if p.dp_ranks > 1 else "") for j in range(n)]
        self.index = {nid: j for j, nid in enumerate(self.ids)}
        self.full = (1 << n) - 1
        self.holders: dict[int, int] = {}  # block -> bitmask of the nodes really holding it
        k = p.gateways
        self.nodes = [
            _Node(
                NodeCache(j, p.capacity_blocks, self.holders, p.evict_scan, p.host_blocks),
                inflight=[0] * k,
                pending=[0.0] * k,
                own_reported=[0.0] * k,
                peer_pending=[0.0] * k,
            )
            for j in range(n)
        ]
        self.directory = DirectoryView()
        self.per_block_s = p.block_bytes / p.link_bytes_per_s
        self.tally = Tally()
        self.ttft = np.zeros(len(reqs))
        self.last_end = 0.0  # the latest decode end
        self.copies_sum = 0.0  # sum over arrivals of (blocks held on all nodes / distinct blocks held)
        self.copies_n = 0  # arrivals that found anything held
        self.dup_tokens = 0  # prompt tokens computed while another node was computing the same block
        self.report_time = 0.0  # the engines' last heartbeat
        self.now = 0.0  # the arrival being routed (the views' clock)
        # Each gateway's view of each engine, read by its Router.
        self.views = [
            [
                SimEngine(
                    self.ids[j],
                    nd,
                    g,
                    self,
                    block_size=0,  # the trace's blocks, the gateway's size: a prompt's last, partial block is cached too
                    block_bytes=p.block_bytes,
                    capacity_blocks=p.capacity_blocks + p.host_blocks,  # both tiers, as the gateway counts them
                    prefill_tokens_per_s=p.prefill_tokens_per_s,
                )
                for j, nd in enumerate(self.nodes)
            ]
            for g in range(k)
        ]
        self._hb_next: float | None = None  # the next heartbeat not yet scheduled
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._slot_cache: list[tuple[int, ...]] = [()]
        self._handlers: tuple[Callable[[float, Any], None], ...] = (
            self._on_pull_done,
            self._on_prefill_done,
            self._on_decode_done,
            self._on_publish,
            self._on_heartbeat,
            self._on_sync,
            self._on_note,
            self._on_engine,
            self._on_prefill_start,
        )

    # -- the loop

    def run(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Route every request at its arrival, then run the cluster until every event is handled; check the books."""
        heap = self._heap
        pop = heapq.heappop
        handlers = self._handlers
        total = len(self.reqs)
        step = max(1, total // 100)
        hb = self.params.heartbeat_s
        for i, r in enumerate(self.reqs):
            t = r.arrival_s
            if hb > 0:  # the engines' heartbeats up to this arrival (none after the last: nobody reads them)
                nxt = t if self._hb_next is None else self._hb_next
                while nxt <= t:
                    self._push(nxt, _HEARTBEAT, None)
                    nxt += hb
                self._hb_next = nxt
            while heap and heap[0][0] <= t:
                et, _, kind, x = pop(heap)
                handlers[kind](et, x)
            self._arrive(i, r)
            if progress is not None and (i + 1) % step == 0 and i + 1 < total:
                progress(i + 1, total)
        while heap:
            et, _, kind, x = pop(heap)
            handlers[kind](et, x)
        if progress is not None:
            progress(total, total)
        self._check()

    def _push(self, t: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    def _slots_of(self, k: int) -> tuple[int, ...]:
        """Dummy slots ``(0, .., k-1)`` for a candidate's cached blocks, shared between calls."""
        cache = self._slot_cache
        while len(cache) <= k:
            cache.append(tuple(range(len(cache))))
        return cache[k]

    # -- arrival: route, pin what is found, start the pull, admit or queue

    def _arrive(self, i: int, r: TraceRequest) -> None:
        t = r.arrival_s
        gw = i % len(self.routers)  # a round-robin load balancer in front of the gateways
        blocks = r.blocks
        prompt = r.input_tokens
        nodes = self.nodes
        n_nodes = len(nodes)
        ids = self.ids
        slots_of = self._slots_of
        bt = self.params.block_tokens
        view, _ = leading_runs(blocks, self.directory.masks, self.full, n_nodes)
        held = 0
        for nd in nodes:
            held += len(nd.cache)
        if self.holders:
            self.copies_sum += held / len(self.holders)
            self.copies_n += 1
        # The gateway's own routing step (gateway.router.Router.route) over the simulated engines (views.SimEngine).
        router = self.routers[gw]
        self.now = t
        locations = self.directory.locations
        holders = {ids[j]: SimHolder(k, locations(blocks, k, j) or slots_of(k)) for j, k in enumerate(view) if k}
        rreq = router.request(prompt, blocks, r.output_tokens)
        route = router.route(rreq, self.views[gw], holders, now=t)
        d = route.decision
        router.routed(rreq, d)
        if self.sync:
            self._share(t, gw, True, rreq, d)
        reasons = self.tally.reasons
        reasons[d.reason] = reasons.get(d.reason, 0) + 1
        n = self.index[d.node_id]
        node = nodes[n]

        have, longest = leading_runs(blocks, self.holders, self.full, n_nodes)
        local = have[n]
        f = _Flight(i, r, n, local, gw=gw, rreq=rreq, decision=d, ready=t, route=route)
        if local:
            loaded = node.cache.pin(blocks[:local])
            if loaded:  # the prefix's host-tier blocks, copied to the device before the prefill
                f.ready = t + len(loaded) * self.params.block_bytes / self.params.host_copy_bytes_per_s
                moved = set(loaded)
                self.tally.host_tokens += sum(min(bt, prompt - j * bt) for j, b in enumerate(blocks[:local]) if b in moved)
                self._settle(n, t, [], loaded)
        # The engine reuses blocks another request is computing there (vLLM, the worker stub): it waits for them.
        comp = node.computing
        nb = len(blocks)
        k = local
        while k < nb and blocks[k] in comp:
            k += 1
        if k > local:
            f.shared = k - local
            f.after = comp[blocks[k - 1]]
        got = self._maybe_pull(f, d, have, t)
        f.computed_from = k
        for b in blocks[k:]:
            comp.setdefault(b, f)
        f.inflight_key = router.prefilling(rreq, d.node_id, SIM_EPOCH, t)
        # Blocks this request computes that another node is computing at the same time: a hot prefix recomputed.
        dup = got
        while dup < nb and any(blocks[dup] in nd.computing for j, nd in enumerate(nodes) if j != n):
            dup += 1
        if dup > got:
            self.dup_tokens += tokens_of_blocks(dup, prompt, bt) - tokens_of_blocks(got, prompt, bt)
        cached = self.tally.count(prompt, nb, k, got, longest, d.predicted_cached_tokens, bt)

        f.uncached = prompt - cached
        node.backlog += f.uncached
        unc = prompt - d.predicted_cached_tokens
        f.pred_uncached = unc if unc > 0 else 0
        node.pending[gw] += f.pred_uncached
        node.inflight[gw] += 1
        if self.notes:
            self._note(t, gw, n, f.pred_uncached, 1)
        if node.running < self.params.max_running:
            self._admit(f, t)
        else:
            node.waitq.append(f)

    def _maybe_pull(self, f: _Flight, d: Decision, have: list[int], t: float) -> int:
        """Start the pull `d` plans, as far as the source really holds it; the blocks the request will have cached.

        The source's blocks are pinned until the pull is done; the pull waits
        for the destination's inbound and the source's outbound link.
        """
        local = f.local + f.shared
        if d.pull_from is None or d.pull_from == d.node_id:
            return local
        src = self.index[d.pull_from]
        plan = len(d.pull_slots)
        reach = have[src] if have[src] < plan else plan
        tally = self.tally
        if reach < plan:
            tally.pulls_short += 1
        npull = reach - local
        if npull <= 0:
            return local
        source = self.nodes[src]
        dest = self.nodes[f.node]
        source.cache.pin(f.req.blocks[local:reach], read=True)
        start = t
        if dest.link_in_free > start:
            start = dest.link_in_free
        if source.link_out_free > start:
            start = source.link_out_free
        done = start + self.params.pull_setup_s + npull * self.per_block_s
        dest.link_in_free = source.link_out_free = done
        f.pull_src = src
        f.pull_n = npull
        f.pull_pending = True
        self._push(done, _PULL_DONE, f)
        tally.pulls += 1
        tally.pull_blocks += npull
        return reach

    def _admit(self, f: _Flight, now: float) -> None:
        """Give `f` a running place; its prefill starts now unless its pull is still under way."""
        self.nodes[f.node].running += 1
        f.admitted = True
        if not f.pull_pending:
            self._start_prefill(f, now)

    def _start_prefill(self, f: _Flight, now: float) -> None:
        """Queue `f`'s prefill on its node's single FIFO prefill server, behind the request computing what it reuses;
        on a calibrated engine, join the batch of prefills under way (after the engine's overhead, counted from
        the arrival, and whatever it waits for)."""
        a = f.after
        if a is not None and a.prefill_end < 0:
            a.followers.append(f)  # scheduled when `a` is (calibrated: when `a` ends)
            return
        if self.cal is not None:
            s = f.req.arrival_s + self.cal.overhead_s
            self._push(max(s, now, f.ready), _PREFILL_START, f)
            return
        node = self.nodes[f.node]
        s = node.prefill_free
        if s < now:
            s = now
        if a is not None and s < a.prefill_end:
            s = a.prefill_end
        if s < f.ready:
            s = f.ready
        e = s + f.uncached / self.params.prefill_tokens_per_s
        node.prefill_free = e
        f.prefill_end = e
        if e > s:
            node.busy += e - s
            node.spans.append((s, e))
        self._push(e, _PREFILL_DONE, f)
        if f.followers:
            waiting, f.followers = f.followers, []
            for x in waiting:
                self._start_prefill(x, now)

    def _share(self, now: float, gw: int, routed: bool, rreq: RouteRequest, d: Decision) -> None:
        """Gateway `gw`'s decision (`routed`) or request end reaches the other replicas after the sync delay."""
        lag = self.params.replica_sync_s
        change = (gw, routed, rreq, d)
        if lag > 0:
            self._push(now + lag, _SYNC, change)
        else:
            self._on_sync(now, change)

    def _note(self, now: float, gw: int, n: int, tokens: float, sign: int) -> None:
        """Gateway `gw`'s note to its peers, after the sync delay: `sign` 1, it sent a request with `tokens` pending
        prefill to node `n`; -1, that prefill is over."""
        lag = self.params.replica_sync_s
        note = (gw, n, tokens, sign)
        if lag > 0:
            self._push(now + lag, _NOTE, note)
        else:
            self._on_note(now, note)

    def _settle(self, n: int, now: float, adds: list[int], loaded: list[int] | None = None) -> None:
        """Evict node `n` down to capacity; publish its stores `adds`, the blocks it `loaded` from its host tier,
        its evictions and its moves to its host tier (after the lag, if any)."""
        removes, hosted = self.nodes[n].cache.settle()
        if adds or removes or hosted or loaded:
            change = Publish(n, adds, removes, hosted, loaded or ())
            lag = self.params.publish_lag_s
            if lag > 0:
                self._push(now + lag, _PUBLISH, change)
            else:
                self.directory.publish(change)

    # -- event handlers (the table self._handlers, indexed by kind)

    def _on_pull_done(self, t: float, f: _Flight) -> None:
        """The source releases the pulled blocks (deepest first); the prefill may start."""
        b0 = f.local + f.shared
        self.nodes[f.pull_src].cache.unpin_read(reversed(f.req.blocks[b0 : b0 + f.pull_n]))
        self._settle(f.pull_src, t, [])
        f.pull_pending = False
        if f.admitted:
            self._start_prefill(f, t)

    def _on_prefill_done(self, t: float, f: _Flight) -> None:
        """First token: the node stores (and pins) the whole prompt; the decode starts; its gateway learns the TTFT."""
        node = self.nodes[f.node]
        r = f.req
        self.ttft[f.index] = t - r.arrival_s
        router = self.routers[f.gw]
        if router.learner.learning:
            assert f.route is not None and f.rreq is not None
            router.observe(f.route, f.rreq, t - r.arrival_s, r.input_tokens - f.uncached)
        node.pending[f.gw] -= f.pred_uncached
        node.backlog -= f.uncached
        if self.notes:
            self._note(t, f.gw, f.node, f.pred_uncached, -1)
        comp = node.computing
        for b in r.blocks[f.computed_from :]:
            if comp.get(b) is f:
                del comp[b]
        router.prefilled(f.inflight_key, t, ok=True)
        self._settle(f.node, t, *node.cache.store(r.blocks[f.local :]))
        if self.cal is None:
            self._push(t + r.output_tokens / self.params.decode_tokens_per_s, _DECODE_DONE, f)
            return
        f.prefill_end = t  # its followers' prefills may start now
        node.decoding[f] = float(max(r.output_tokens - 1, 0))  # the first token came with the prefill
        if f.followers:
            waiting, f.followers = f.followers, []
            for x in waiting:
                self._start_prefill(x, t)

    def _on_decode_done(self, t: float, f: _Flight) -> None:
        """The request finishes: its blocks are released deepest first, the next waiting request is admitted."""
        node = self.nodes[f.node]
        node.cache.unpin(reversed(f.req.blocks))
        self._settle(f.node, t, [])
        node.running -= 1
        node.inflight[f.gw] -= 1
        assert f.rreq is not None and f.decision is not None
        router = self.routers[f.gw]
        router.policy.on_finished(f.rreq, f.decision)
        if router.learner.learning:
            router.learner.outputs.observe("", f.req.output_tokens)
        if self.sync:
            self._share(t, f.gw, False, f.rreq, f.decision)
        self.last_end = t
        q = node.waitq
        if q and node.running < self.params.max_running:
            self._admit(q.popleft(), t)

    def _on_publish(self, t: float, change: Publish) -> None:
        """The directory learns of a node's stores and evictions."""
        self.directory.publish(change)

    def _on_sync(self, t: float, change: tuple[int, bool, RouteRequest, Decision]) -> None:
        """The other router replicas apply a shared decision or request end."""
        gw, routed, rreq, d = change
        for g, router in enumerate(self.routers):
            if g != gw:
                if routed:
                    router.policy.on_routed(rreq, d)
                else:
                    router.policy.on_finished(rreq, d)

    def _on_note(self, t: float, note: tuple[int, int, float, int]) -> None:
        """The other gateways fold a peer's note into the node's pending prefill."""
        gw, n, tokens, sign = note
        pp = self.nodes[n].peer_pending
        for g in range(len(pp)):
            if g != gw:
                pp[g] += sign * tokens
                if sign > 0:  # a peer's routed work counts in its recent work (kvdir's near-tie balance)
                    self.routers[g].policy.on_peer_routed(self.ids[n], tokens)

    # -- a calibrated engine (params.calibration): prefills and decodes share its speed as the calibration says

    def _advance(self, nd: _Node, t: float) -> None:
        """Every prefill and decode under way on `nd` progresses from `nd.advanced_at` to `t` at the current rates."""
        dt = t - nd.advanced_at
        nd.advanced_at = t
        if dt <= 0:
            return
        cal = self.cal
        assert cal is not None
        pf, dc = nd.prefilling, nd.decoding
        if pf:
            step = cal.prefill_rate(len(pf)) / len(pf) * dt
            for f in pf:
                pf[f] -= step
        if dc:
            step = dt / cal.decode_token_seconds(len(dc), bool(pf))
            for f in dc:
                dc[f] -= step

    def _reschedule(self, n: int, t: float) -> None:
        """Schedule node `n`'s next prefill or decode end at the current rates (voiding the one scheduled before)."""
        nd = self.nodes[n]
        cal = self.cal
        assert cal is not None
        nd.version += 1
        pf, dc = nd.prefilling, nd.decoding
        nxt = -1.0
        if pf:
            nxt = t + max(min(pf.values()), 0.0) * len(pf) / cal.prefill_rate(len(pf))
        if dc:
            e = t + max(min(dc.values()), 0.0) * cal.decode_token_seconds(len(dc), bool(pf))
            nxt = e if nxt < 0 or e < nxt else nxt
        if nxt >= 0:
            self._push(nxt, _ENGINE, (n, nd.version))

    def _on_prefill_start(self, t: float, f: _Flight) -> None:
        """`f`'s prefill joins its calibrated engine's batch."""
        nd = self.nodes[f.node]
        self._advance(nd, t)
        if not nd.prefilling:
            nd.busy_since = t
        nd.prefilling[f] = float(f.uncached)
        self._reschedule(f.node, t)

    def _on_engine(self, t: float, x: tuple[int, int]) -> None:
        """A calibrated engine's prefills and decodes that are over by now end (a stale event does nothing)."""
        n, version = x
        nd = self.nodes[n]
        if version != nd.version:
            return
        self._advance(nd, t)
        pf, dc = nd.prefilling, nd.decoding
        prefilled = [f for f, left in pf.items() if left <= _DONE_EPS]
        decoded = [f for f, left in dc.items() if left <= _DONE_EPS]
        for f in prefilled:
            del pf[f]
        for f in decoded:
            del dc[f]
        if prefilled and not pf and t > nd.busy_since:
            nd.busy += t - nd.busy_since
            nd.spans.append((nd.busy_since, t))
        for f in prefilled:
            self._on_prefill_done(t, f)
        for f in decoded:
            self._on_decode_done(t, f)
        self._reschedule(n, t)

    def _on_heartbeat(self, t: float, _: None) -> None:
        """Every engine reports its backlog; each gateway notes what it knows of it (its own, its peers' notes)."""
        self.report_time = t
        for nd in self.nodes:
            nd.reported = nd.backlog
            nd.own_reported[:] = [a + b for a, b in zip(nd.pending, nd.peer_pending, strict=True)]

    # -- the end

    def _check(self) -> None:
        """Bookkeeping checks (cheap): everything finished and released, and the directory caught up with the caches."""
        nodes = self.nodes
        if (
            any(nd.cache.pins for nd in nodes)
            or any(nd.running for nd in nodes)
            or any(any(nd.inflight) for nd in nodes)
            or any(nd.waitq for nd in nodes)
            or any(nd.computing for nd in nodes)
            or any(nd.prefilling or nd.decoding for nd in nodes)
            or any(abs(x) > 1e-6 for nd in nodes for x in nd.pending)
            or any(abs(x) > 1e-6 for nd in nodes for x in nd.peer_pending)
        ):
            raise AssertionError("replay bookkeeping leak: requests or pins left at the end")
        if self.directory.masks != self.holders or sum(len(nd.cache.lru) + len(nd.cache.host) for nd in nodes) != sum(
            m.bit_count() for m in self.holders.values()
        ):
            raise AssertionError("replay bookkeeping: the directory view or the block index disagrees with the caches")
        in_host: dict[int, int] = {}
        for j, nd in enumerate(nodes):
            for b in nd.cache.host:
                in_host[b] = in_host.get(b, 0) | 1 << j
        if self.directory.host_masks != in_host or any(nd.cache.host_pins for nd in nodes):
            raise AssertionError("replay bookkeeping: the directory's host tiers disagree with the caches")
        p = self.params
        if any(len(nd.cache.lru) > p.capacity_blocks or len(nd.cache.host) > p.host_blocks for nd in nodes):
            raise AssertionError("replay bookkeeping: a cache holds more than its capacity at rest")

    def figures(self) -> dict[str, Any]:
        """The run's figures (the keys are described in `kvtools.replay.sim`), without ``wall_s``."""
        reqs = self.reqs
        total = len(reqs)
        tally = self.tally
        prompt_total = tally.prompt_tokens
        busy = [nd.busy for nd in self.nodes]
        first = reqs[0].arrival_s if reqs else 0.0
        end = max(self.last_end, first)
        span = end - first
        mean_busy = sum(busy) / len(busy)
        if total:
            p50, p90, p99 = (float(x) for x in np.percentile(self.ttft, [50, 90, 99]))
            mean_ttft = float(self.ttft.mean())
        else:
            p50 = p90 = p99 = mean_ttft = 0.0
        return {
            "policy": self.policy_name,
            "requests": total,
            "prompt_tokens": prompt_total,
            "hit_rate": tally.hit_tokens / prompt_total if prompt_total else 0.0,
            "local_hit_rate": (tally.hit_tokens - tally.pulled_tokens) / prompt_total if prompt_total else 0.0,
            "host_hit_rate": tally.host_tokens / prompt_total if prompt_total else 0.0,
            "pulled_hit_rate": tally.pulled_tokens / prompt_total if prompt_total else 0.0,
            "block_hit_rate": tally.hit_blocks / tally.blocks if tally.blocks else 0.0,
            "redundant_prefill": tally.redundant / prompt_total if prompt_total else 0.0,
            "inflight_dup_prefill": self.dup_tokens / prompt_total if prompt_total else 0.0,
            "ttft_p50_s": p50,
            "ttft_p90_s": p90,
            "ttft_p99_s": p99,
            "ttft_mean_s": mean_ttft,
            "throughput_rps": total / span if span > 0 else 0.0,
            "span_s": span,
            "imbalance": max(busy) / mean_busy if mean_busy > 0 else 1.0,
            "busy_s": busy,
            "pulls": tally.pulls,
            "pulls_short": tally.pulls_short,
            "pull_blocks": tally.pull_blocks,
            "bytes_moved": tally.pull_blocks * self.params.block_bytes,
            "evictions": sum(nd.cache.evictions for nd in self.nodes),
            "host_evictions": sum(nd.cache.host_evictions for nd in self.nodes),
            "copies_per_block": self.copies_sum / self.copies_n if self.copies_n else 0.0,
            "prediction_error": tally.pred_err / prompt_total if prompt_total else 0.0,
            "prediction_exact": tally.pred_exact / total if total else 1.0,
            "reasons": dict(sorted(tally.reasons.items())),
            "load_timeline": load_timeline([nd.spans for nd in self.nodes], first, end, self.params.timeline_buckets),
        }
