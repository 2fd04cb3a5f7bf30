"""The vLLM connector's scheduler half, in vLLM's EngineCore process (no vLLM import: it reads vLLM's objects by
their attributes, so tests drive it with stand-ins; adapters/vllm_connector.py is the facade vLLM loads).

It registers the node once every TP rank's worker registered its memory, publishes the blocks the workers report
complete (from a background thread, `NodeSession`, never from the scheduler step), and decides what each request
loads: blocks this engine's host tier holds (loaded back before the forward pass, synchronously: a memory copy),
then the gateway's pull plan (`kv_transfer_params["kvdir_pull"]`), which it checks against the directory's last
node list before vLLM counts a token as loaded. A pull is asynchronous: the request waits in vLLM's
`WAITING_FOR_REMOTE_KVS` while the worker half reads in threads of its own, and other requests' steps go on.

**One pull per prefix.** While a pull of some blocks is under way here, a request whose next block is one of them
waits for it (`get_num_new_matched_tokens` answers None, "ask again next step") instead of reading or computing
the same blocks again: once the pull lands vLLM caches its blocks and the request finds them as a local hit. A wait
is bounded (`_JOIN_GRACE_S` past the pull's own deadline), so a pull that never reports back delays no one forever.

**Publishing a pull.** A pulled block is published once it landed and validated on every TP rank *and* vLLM cached
it: vLLM caches a loaded request's blocks when it takes the request out of `WAITING_FOR_REMOTE_KVS` (the second
`update_state_after_alloc`), and only those before its first failed block.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from adapters.config import ConnectorSettings
from adapters.connector_meta import HostLoad, Load, RankHandshake, StepPlan, WorkerReport
from adapters.connector_metrics import ConnectorMetrics
from adapters.connector_peers import Loop, PeerCache, Peers
from adapters.host_slots import HostSlots
from adapters.kv_identity import mm_extra, request_identity
from adapters.vllm_plan import KvLayout, PlanError, blocks_to_pull, complete_on_every_rank, mirrored, plan_from_params
from kvproto.client import DirectoryClient
from kvproto.hashing import identity_hashes
from kvproto.schemas import PULL_GBPS_LABEL
from kvproto.session import NodeSession
from kvtransfer.bandwidth import PullBandwidth

log = logging.getLogger("kvdir.vllm")

_JOIN_GRACE_S = 2.0
"""How long past a pull's deadline a request joining it still waits (the worker reports a pull that timed out at
its deadline; this covers the steps in between)."""


@dataclass(slots=True)
class _Pull:
    """A pull under way here: its load, when it must have reported back, and the blocks landed so far on each rank."""

    load: Load
    deadline: float
    landed: dict[tuple[int, int], int]  # (block, hash) -> ranks that validated it


class SchedulerHalf:
    """See the module docstring. `fingerprint_of(layout)` is the engine's KV fingerprint (the facade's, which knows
    the model); `model_name` what blocks are hashed under; `peers` the pull sources (default: the directory's, kept
    fresh in a thread)."""

    def __init__(
        self,
        s: ConnectorSettings,
        *,
        node_id: str,
        block_size: int,
        tp_size: int,
        dp_rank: int | None,
        model_name: str,
        fingerprint_of: Callable[[KvLayout], str],
        peers: Peers | None = None,
    ) -> None:
        self.s = s
        self.node_id = node_id
        self.block_size = block_size
        self.tp_size = tp_size
        self.dp_rank = dp_rank
        self.model_name = model_name
        self._fingerprint_of = fingerprint_of
        self.fingerprint: str | None = None  # once the workers' layout is known (registered)
        self.metrics = ConnectorMetrics(tp_size)
        self._pool: Any = None
        self._requests: dict[str, Any] = {}  # req id -> the request, from its first ask for KV until it finished
        self._scheduled: set[str] = set()  # req ids the last step scheduled, less those finished since
        self._hashes: dict[str, list[int]] = {}
        self._pending_loads: dict[str, tuple[Any, int, int]] = {}  # req id -> (plan, first block, count)
        self._joined: set[str] = set()  # req ids waiting for a pull here, their join counted
        self._loads: list[Load] = []
        self._pulls: dict[str, _Pull] = {}  # req id -> its pull under way
        self._unlisted: dict[str, float] = {}  # req id -> when its plan's source was first found unlisted
        self._pulling: dict[int, str] = {}  # kvdir hash -> the req id whose pull brings it
        self._published: dict[int, tuple[int, Any]] = {}  # kvdir hash -> (block id, vLLM block hash)
        self._lock = threading.Lock()  # _published and _host: the scheduler's thread and the publisher's
        self._changes: queue.SimpleQueue[list[tuple[int, int]]] = queue.SimpleQueue()
        # The host tier's slots (adapters.host_slots), and what became of them, for the publisher: ("hosted" (hash,
        # slot): a block only the host tier holds now; "gone" hash: the host tier dropped it).
        self._host = HostSlots(s.host_blocks) if s.host_blocks else None
        self._host_changes: queue.SimpleQueue[tuple[str, int, int]] = queue.SimpleQueue()
        self._pending_host: dict[str, tuple[int, list[int]]] = {}  # req id -> (first block, host slots) to load
        self._host_loads: list[HostLoad] = []
        self._loop: Loop | None = None
        self._session: NodeSession | None = None
        self._session_task: Any = None
        self._bandwidth = PullBandwidth()  # of the workers' completed reads: heartbeats report it
        self._peers = peers or PeerCache(s, node_id)  # pull sources, to refuse a plan before vLLM counts its tokens
        self._peers.start()
        self.metrics.pulls_in_flight.set_function(lambda: len(self._pulls))
        if s.metrics:
            self.metrics.serve(s.metrics)

    # ------------------------------------------------------------------ registration and publishing

    def bind_pool(self, block_pool: Any) -> None:
        """vLLM's block pool: a published block is gone once its block there lost the hash it was published with."""
        self._pool = block_pool

    def register(self, ranks: list[RankHandshake], api_url: str) -> None:
        """Register the node: one registration, each rank's regions behind its own session, the slots mirrored."""
        why = mirrored([h.layout for h in ranks])
        if why:
            raise RuntimeError(f"KvdirConnector: the TP ranks' KV layouts are not mirrored: {why}")
        hs = ranks[0]
        regions = [r for rank, h in enumerate(ranks) for r in h.layout.regions(rank, h.session if rank else None)]
        if self._host is not None:
            hosts = [h.host for h in ranks if h.host is not None]
            why = "a rank has none" if len(hosts) != len(ranks) else mirrored(hosts)
            if why:
                raise RuntimeError(f"KvdirConnector: the TP ranks' host tiers are not mirrored: {why}")
            for rank, (h, layout) in enumerate(zip(ranks, hosts)):
                regions += layout.regions(rank, h.session if rank else None, "host")
        self.fingerprint = self._fingerprint_of(hs.layout)
        self._loop = Loop("kvdir-publisher")
        client = DirectoryClient(self.s.directory_urls, deadline=5.0, token=self.s.directory_token, tenant=self.s.tenant)
        self._session = NodeSession(
            client,
            self.node_id,
            api_url,
            holdings=self._holdings,
            transfer_url=hs.session,
            regions=regions,
            capacity_blocks=hs.layout.num_blocks,
            block_size=self.block_size,
            models=[self.model_name],
            fingerprint=self.fingerprint,
            dp_rank=self.dp_rank,
            load=self._load,
            collect=self._collect,
            on_published=lambda n, _lag: self.metrics.published.inc(n),
            logger=log,
        )
        self._session_task = asyncio.run_coroutine_threadsafe(
            self._session.run(self.s.publish_interval_s, self.s.heartbeat_interval_s, self.metrics.tasks.failed("publish")),
            self._loop.loop,
        )
        log.info(
            "kvdir connector: node %s, transfer %s, %d blocks, %d host blocks, model %s, KV fingerprint %s",
            self.node_id,
            ", ".join(h.session for h in ranks),
            hs.layout.num_blocks,
            self.s.host_blocks,
            self.model_name,
            self.fingerprint,
        )

    def _load(self) -> dict[str, float]:
        """What heartbeats report, for a gateway that cannot read vLLM's /metrics (gateway.engine_load reads vLLM's
        own figures, and routes on them while fresh): `running`, the requests vLLM's last step scheduled that have
        not finished since; `waiting`, those that asked for their KV (vLLM asks as it tries to schedule one) and
        are neither: requests back in the queue (preempted, waiting for a pull, or that did not fit the step).
        A lower bound: vLLM asks only about the head of its queue, so what waits behind it is not seen here. And
        the pull bandwidth. Read from the publisher's thread: two lengths, each read atomically."""
        running = len(self._scheduled)
        return {
            "running": float(running),
            "waiting": float(max(0, len(self._requests) - running)),
            **self._bandwidth.labels(PULL_GBPS_LABEL),
        }

    def shutdown(self) -> None:
        """Stop publishing and deregister the node, so that its entries go now, not when its lease runs out."""
        self._peers.stop()
        if self._loop is None or self._session is None:
            return
        self._session_task.cancel()
        try:
            self._loop.run(self._session.close(), timeout=3.0)
        except Exception as exc:  # shutting down: say so, never raise into vLLM's shutdown
            log.info("kvdir connector: could not deregister %s: %s", self.node_id, exc)

    def _holdings(self) -> Iterator[tuple[int, int, str | None]]:
        with self._lock:
            out: list[tuple[int, int, str | None]] = [(h, b, None) for h, (b, _) in self._published.items()]
            if self._host is not None:  # the device wins: a block vLLM holds is published at its block id
                out += [(h, slot, "host") for h, slot in self._host.items() if h not in self._published]
            return iter(out)

    def _collect(self) -> None:
        """Publisher thread: queue the newly complete blocks; drop the published ones the pool no longer holds."""
        assert self._session is not None
        stored: list[tuple[int, int]] = []
        while True:
            try:
                stored += self._changes.get_nowait()
            except queue.Empty:
                break
        if stored:
            self._session.stored(stored)
        blocks = self._pool.blocks
        news: dict[int, int | None] = {}  # hash -> its host slot now, None: in neither tier
        with self._lock:
            gone = [h for h, (b, vh) in self._published.items() if blocks[b].block_hash != vh]
            for h in gone:
                del self._published[h]
                # Evicted from the device: where the host tier holds it, it lies there now.
                news[h] = self._host.slot_of(h) if self._host is not None else None
            while True:  # the host tier's own news since the last round, in order
                try:
                    what, h, slot = self._host_changes.get_nowait()
                except queue.Empty:
                    break
                if h not in self._published:  # else the device copy is what the directory lists
                    news[h] = slot if what == "hosted" else None
        hosted = [(h, slot) for h, slot in news.items() if slot is not None]
        removed = [h for h, slot in news.items() if slot is None]
        if hosted:
            self._session.stored(hosted, "host")
        if removed:
            self._session.removed(removed)
        if gone:
            self.metrics.removed.inc(len(gone))

    def _publish(self, pairs: list[tuple[int, int]]) -> None:
        """Publish (block, hash) pairs that vLLM's prefix cache holds (a block not in it could not be sent for)."""
        if not pairs or self._pool is None:
            return
        blocks = self._pool.blocks
        fresh = []
        with self._lock:
            for b, h in pairs:
                vh = blocks[b].block_hash
                if vh is not None:
                    self._published[h] = (b, vh)
                    fresh.append((h, b))
        if fresh:
            self._changes.put(fresh)

    # ------------------------------------------------------------------ what a request loads

    def _request_hashes(self, req: Any, n_blocks: int) -> list[int]:
        """The request's first `n_blocks` kvdir hashes under its KV identity (its LoRA adapter, its cache salt, its
        multimodal inputs: as vLLM's own block hashes cover them), extended incrementally."""
        have = self._hashes.setdefault(req.request_id, [])
        if len(have) < n_blocks:
            bs = self.block_size
            lora = req.lora_request
            identity = request_identity(self.s.namespace, self.model_name, lora.lora_name if lora else None, req.cache_salt)
            extra = mm_extra(bs, n_blocks, req.mm_features) if req.mm_features else None
            tokens = list(req.all_token_ids[len(have) * bs : n_blocks * bs])
            have += identity_hashes(tokens, identity, bs, extra, have[-1] if have else None, len(have))
        return have[:n_blocks]

    def _pulled_here(self, request: Any, num_computed_tokens: int) -> bool:
        """Whether the request's next block is one a pull under way here brings (then it waits for that pull)."""
        if not self._pulling:
            return False
        first, most = blocks_to_pull(request.num_prompt_tokens, num_computed_tokens, 1 << 30, self.block_size)
        if most <= 0:
            return False
        owner = self._pulling.get(self._request_hashes(request, first + 1)[first])
        if owner is None or owner == request.request_id:
            return False
        pull = self._pulls.get(owner)
        return pull is not None and time.monotonic() < pull.deadline + _JOIN_GRACE_S

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request
        pull = self._pulls.pop(request.request_id, None)
        if pull is not None:
            # Back after its pull failed from the first block (vLLM freed its blocks): computed now, never pulled
            # again, so a source that keeps failing cannot hold a request in a loop.
            self._end_pull(request.request_id, pull)
            return 0, False
        if self._host is not None:
            # The prompt's blocks past vLLM's own hit that this engine's host tier holds: loaded back, before any pull.
            first, most = blocks_to_pull(request.num_prompt_tokens, num_computed_tokens, 1 << 30, self.block_size)
            if most > 0:
                hashes = self._request_hashes(request, first + most)
                with self._lock:
                    slots = self._host.run(hashes[first:])
                if slots:
                    self._pending_host[request.request_id] = (first, slots)
                    self._pending_loads.pop(request.request_id, None)
                    return len(slots) * self.block_size, False
        try:
            plan = plan_from_params(request.kv_transfer_params)
        except PlanError as exc:
            log.warning("request %s: %s; computing it", request.request_id, exc)
            self.metrics.plans.labels("invalid").inc()
            plan = None
        self._pending_loads.pop(request.request_id, None)
        if self._pulled_here(request, num_computed_tokens):
            if plan is not None and request.request_id not in self._joined:
                self._joined.add(request.request_id)
                self.metrics.plans.labels("joined").inc()
            return None, False
        self._joined.discard(request.request_id)
        if plan is None:
            return 0, False
        outcome = self._refusal(request, plan)
        if outcome == "unlisted":  # the source may have registered since the list was read: ask again after a read
            return None, False
        self._unlisted.pop(request.request_id, None)
        if outcome is not None:
            self.metrics.plans.labels(outcome).inc()
            return 0, False
        first, count = blocks_to_pull(request.num_prompt_tokens, num_computed_tokens, len(plan.slots), self.block_size)
        if count <= 0:
            self.metrics.plans.labels("cached").inc()
            return 0, False
        self._pending_loads[request.request_id] = (plan, first, count)
        return count * self.block_size, True

    def _refusal(self, request: Any, plan: Any) -> str | None:
        """Why this engine will not load the plan (a `PLAN_OUTCOMES` label), or None: refused here, before vLLM
        counts its tokens as loaded, so that a refused plan is a plain recompute with honest usage. "unlisted": the
        source is not in the last node list read, but a read started since the request first asked has not ended
        (the gateway may have seen a registration this engine has not read yet): the request asks again."""
        if plan.source_node == self.node_id:
            return "own"
        if plan.fingerprint is not None and plan.fingerprint != self.fingerprint:
            # Another model's, revision's or layout's KV (docs/protocol.md §2.1): never loaded, computed instead.
            log.warning(
                "request %s: the plan's source %s has KV fingerprint %s, not this engine's %s; computing it",
                request.request_id,
                plan.source_node,
                plan.fingerprint,
                self.fingerprint,
            )
            return "fingerprint"
        peer = self._peers.get(plan.source_node, plan.source_epoch)
        # A read that started a refresh period after the request first asked: a replica behind by less has it.
        since = self._unlisted.setdefault(request.request_id, time.monotonic()) + self.s.peer_refresh_s
        if peer is None and not self._peers.settled(since):
            return "unlisted"
        if peer is None:
            why: str | None = f"{plan.source_node} epoch {plan.source_epoch} is not registered (as last seen)"
        elif peer.fingerprint != self.fingerprint:
            why = f"{plan.source_node} registered KV fingerprint {peer.fingerprint}, not this engine's"
        elif len(peer.layouts) != self.tp_size:
            why = f"{plan.source_node} has {len(peer.layouts)} TP ranks, this engine {self.tp_size}"
        else:
            why = peer.refusal  # a shared engine reads only shared sources, a tenant's its own and shared ones
        if why is not None:
            log.warning("request %s: not pulling: %s; computing it", request.request_id, why)
            return "refused"
        return None

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        pull = self._pulls.pop(rid, None)
        if pull is not None:  # vLLM takes the request out of WAITING_FOR_REMOTE_KVS: its loaded blocks are cached now
            self._end_pull(rid, pull)
            return
        host = self._pending_host.pop(rid, None)
        if host is not None and num_external_tokens:
            first, slots = host
            block_ids = blocks.get_block_ids()[0]
            hashes = self._request_hashes(request, first + len(slots))
            dst = block_ids[first : first + len(slots)]
            self._host_loads.append(HostLoad(rid, dst, slots, hashes[first : first + len(slots)]))
            return
        pending = self._pending_loads.pop(rid, None)
        if pending is None or num_external_tokens == 0:
            return
        plan, first, count = pending
        block_ids = blocks.get_block_ids()[0]
        hashes = self._request_hashes(request, first + count)
        load = Load(
            rid,
            plan.source_node,
            plan.source_epoch,
            block_ids[first : first + count],
            list(plan.slots[first : first + count]),
            hashes[first : first + count],
        )
        self._loads.append(load)
        # The worker gives up on a read at its deadline (transfer timeout) and reports it at the next step.
        self._pulls[rid] = _Pull(load, time.monotonic() + self.s.transfer_timeout_s + 1.0, {})
        for h in load.hashes:
            self._pulling[h] = rid
        self.metrics.plans.labels("pull").inc()

    def _end_pull(self, rid: str, pull: _Pull, *, aborted: bool = False) -> None:
        """The pull is over (landed, failed or its request gone): count it once, over every rank (their reads may end
        in different steps), and publish what landed on every rank and vLLM cached."""
        for h in pull.load.hashes:
            if self._pulling.get(h) == rid:
                del self._pulling[h]
        landed = [pair for pair, ranks in pull.landed.items() if ranks >= self.tp_size]
        if aborted:
            return
        failed = len(pull.load.dst_blocks) - len(landed)
        self.metrics.pulled.inc(len(landed))
        self.metrics.failed.inc(failed)
        if failed:
            self.metrics.failed_pulls.inc()
        self._publish(landed)

    def build_connector_meta(self, scheduler_output: Any, kv_cache_manager: Any) -> StepPlan:
        meta = StepPlan(loads=self._loads, idle=not scheduler_output.total_num_scheduled_tokens)
        self._loads = []
        self._scheduled = set(scheduler_output.num_scheduled_tokens)  # a new set: `_load` reads it from another thread
        bs = self.block_size
        steps: list[tuple[str, int, list[int]]] = [
            (r.req_id, r.num_computed_tokens, r.block_ids[0]) for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        steps += [
            (rid, cached.num_computed_tokens[i], kv_cache_manager.get_block_ids(rid)[0]) for i, rid in enumerate(cached.req_ids)
        ]
        for rid, start, block_ids in steps:
            req = self._requests.get(rid)
            end = start + scheduler_output.num_scheduled_tokens.get(rid, 0)
            if req is None or end <= start:
                continue
            meta.written += block_ids[start // bs : -(-end // bs)]
            done = min(end, len(req.all_token_ids)) // bs
            hashes = self._request_hashes(req, done)
            meta.complete += [(rid, block_ids[k], hashes[k]) for k in range(start // bs, done)]
        for load in meta.loads:  # invalidated now; their tags are set by the worker once their bytes land
            meta.written += load.dst_blocks
        meta.host_loads, self._host_loads = self._host_loads, []
        for hl in meta.host_loads:
            meta.written += hl.dst_blocks
            meta.complete += [(hl.req_id, b, h) for b, h in zip(hl.dst_blocks, hl.hashes)]
        if self._host is not None:
            self._plan_saves(meta)
        return meta

    def _plan_saves(self, meta: StepPlan) -> None:
        """Every block this step completes is saved to the host tier, in the slot chosen here for every rank; a
        block the host tier drops to make room leaves the node unless vLLM still holds it (the publisher's)."""
        assert self._host is not None
        with self._lock:
            for rid, b, h in meta.complete:
                got = self._host.reserve(h)
                if got is None:  # held there already (loaded back from there, say), or no slot free
                    continue
                slot, evicted = got
                meta.saves.append((rid, b, slot, h))
                if evicted is not None:
                    self.metrics.host_evicted.inc()
                    self._host_changes.put(("gone", evicted, slot))

    def update_connector_output(self, report: WorkerReport | None) -> None:
        if report is None:
            return
        m = self.metrics
        for rank, n in report.read_bytes.items():
            m.rank_read_bytes.labels(str(rank)).inc(n)
            m.rank_read_s.labels(str(rank)).inc(report.read_s.get(rank, 0.0))
        read_bytes = sum(report.read_bytes.values())
        read_s = max(report.read_s.values(), default=0.0)  # the ranks read at once: the step's pull took the longest
        m.read_bytes.inc(read_bytes)
        m.read_s.inc(read_s)
        self._bandwidth.add(read_bytes, read_s)
        for rid, b, h in report.pulled:
            pull = self._pulls.get(rid)
            if pull is not None:
                pull.landed[(b, h)] = pull.landed.get((b, h), 0) + 1
        if self._host is not None:
            self._host_saved(report)
        self._publish(complete_on_every_rank(report.complete, self.tp_size))

    def _host_saved(self, report: WorkerReport) -> None:
        """Saves every rank made are usable (a save some rank missed frees its slot); the host loads' outcome."""
        assert self._host is not None
        done = complete_on_every_rank(report.saved, self.tp_size)
        ok = set(done)
        with self._lock:
            for h, slot in done:
                if self._host.confirm(h, slot) and h not in self._published:
                    self._host_changes.put(("hosted", h, slot))  # its device copy went before the save was confirmed
            for h, slot in {*report.saved, *report.unsaved} - ok:
                self._host.fail(h, slot)
        self.metrics.host_saved.inc(len(done))
        bad = set(report.host_failed)
        self.metrics.host_loaded.inc(len(set(report.host_loaded) - bad))
        self.metrics.host_failed.inc(len(bad))

    def request_finished(self, request: Any) -> None:
        rid = request.request_id
        self._requests.pop(rid, None)
        self._scheduled.discard(rid)
        self._hashes.pop(rid, None)
        self._pending_loads.pop(rid, None)
        self._pending_host.pop(rid, None)
        self._unlisted.pop(rid, None)
        self._joined.discard(rid)
        pull = self._pulls.pop(rid, None)
        if pull is not None:  # aborted while its pull ran: nothing of it is cached, so nothing is published
            self._end_pull(rid, pull, aborted=True)
