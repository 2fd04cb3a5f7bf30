"""The simulated engine: queueing, prefix reuse, peer pulls, prefill and decode time.

A request's life: wait for one of `max_running` places; wait for the blocks of
its prefix another request here is computing or pulling; take a lease on the
KV pool (the cached prefix is pinned, slots are reserved for the rest); pull
blocks from a peer when the request carries a pull plan (real bytes through
the transfer engine, each block verified, any failure falling back to
recomputation); "prefill" the remaining blocks (simulated time proportional to
uncached tokens, then the blocks' deterministic content is written); decode
(simulated time per output token, streamed); release the lease. New and
evicted blocks reach the directory through the Publisher, off the request path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter

from kvproto import media
from kvproto.client import DirectoryClient
from kvproto.errors import DirectoryError
from kvproto.hashing import KvIdentity, identity_hashes
from kvproto.pull_tenancy import tenancy_refusal
from kvproto.ranks import rank_sessions, tp_size
from kvproto.schemas import PULL_GBPS_LABEL, NodeInfo, PullPlan
from kvtransfer.bandwidth import PullBandwidth
from kvtransfer.engine import TransferEngine, TransferError
from worker_stub.config import WorkerSettings
from worker_stub.pool import KVPool, Lease, PoolFull

log = logging.getLogger("kvdir.worker")

_WORDS = b"the quick brown fox jumps over the lazy dog "
_ADDRESS_SPACE = 1 << 64  # a region a peer registered must lie within it: transfer engines address memory in 64 bits


class QueueFull(Exception):
    """More requests wait than `max_queue` allows."""


@dataclass(slots=True)
class RequestStats:
    prompt_tokens: int = 0
    local_cached_tokens: int = 0
    host_cached_tokens: int = 0  # of local_cached_tokens: loaded from the host tier (host_load_s)
    pulled_tokens: int = 0
    completion_tokens: int = 0
    queue_s: float = 0.0
    pull_s: float = 0.0
    pull_transfer_s: float = 0.0
    pull_bytes: int = 0
    pull_rank_s: list[float] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    pull_failures: list[str] = field(default_factory=list)
    host_load_s: float = 0.0

    @property
    def cached_tokens(self) -> int:
        return self.local_cached_tokens + self.pulled_tokens


@dataclass(slots=True)
class _Claim:
    """A request's new blocks in `Engine._computing`: those its pull plan covers wait on `read` (set once the read
    has landed or failed), the others on `done` (set once they are committed)."""

    read: asyncio.Event
    done: asyncio.Event


class EngineCounts:
    """What the engine counts, as the worker's Prometheus counters (`kvdir_worker_<name>_total`), at zero from the start."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, help_text: str) -> Counter:
            return Counter(f"kvdir_worker_{name}", help_text, registry=registry)

        self.pulled_blocks = counter("pulled_blocks", "Blocks pulled from peers and verified")
        self.pull_failed_blocks = counter(
            "pull_failed_blocks", "Pulled blocks that failed (transfer error or verification): recomputed"
        )
        self.pull_errors = counter("pull_errors", "Pulls that failed as a whole")
        self.pull_refused = counter(
            "pull_refused", "Pull plans refused: the source's KV fingerprint, TP size or tenant rules it out (recomputed)"
        )
        self.pool_full = counter("pool_full", "Requests served uncached because every slot was pinned")


class Engine:
    """One worker's request execution. Use from a single asyncio loop."""

    def __init__(
        self,
        settings: WorkerSettings,
        pool: KVPool,
        transfers: Sequence[TransferEngine],
        directory: DirectoryClient,
        node_id: str,
        counts: EngineCounts,
    ) -> None:
        """`transfers`: one transfer engine per TP rank, rank order (empty: this engine never pulls); `node_id`: the
        directory node it is, whose registered tenant decides which sources it may pull from; `counts`: where its
        pulls and full-pool requests are counted (the worker's registry)."""
        self.s = settings
        self.node_id = node_id
        self.pool = pool
        self.transfers = list(transfers)
        self.directory = directory
        self.running = 0
        self.waiting = 0
        self._slots = asyncio.Semaphore(settings.max_running)
        self._peers: dict[tuple[str, int], NodeInfo] = {}
        self._me: NodeInfo | None = None  # this engine's registration, as the directory's node list last showed it
        self._computing: dict[int, asyncio.Event] = {}  # block hash -> set when the request computing or pulling it is done
        self.counts = counts
        self.pull_bandwidth = PullBandwidth()  # of completed reads; heartbeats report it (PULL_GBPS_LABEL)

    def load(self) -> dict[str, float]:
        return {
            "running": self.running,
            "waiting": self.waiting,
            "free_slots": self.pool.free_slots,
            "capacity_slots": self.pool.capacity_blocks,
            **self.pull_bandwidth.labels(PULL_GBPS_LABEL),
        }

    async def _sleep(self, seconds: float) -> float:
        seconds *= self.s.time_scale
        if seconds > 0:
            await asyncio.sleep(seconds)
        return seconds

    async def generate(
        self, tokens: list[int], max_tokens: int, pull: PullPlan | None, stats: RequestStats, identity: KvIdentity
    ) -> AsyncGenerator[bytes, None]:
        """Serve one request under its KV `identity`; yields each output token's bytes as it is decoded and
        fills `stats`."""
        if self.waiting >= self.s.max_queue and self._slots.locked():
            raise QueueFull(f"{self.waiting} requests are waiting already (max_queue {self.s.max_queue})")
        stats.prompt_tokens = len(tokens)
        t0 = time.perf_counter()
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        stats.queue_s = time.perf_counter() - t0
        try:
            hashes = identity_hashes(tokens, identity, self.s.block_size)
            await self._reuse_computing(hashes)
            lease = self._acquire(hashes)
            claim = self._claim(hashes, lease, pull)
            try:
                await self._prefill(hashes, lease, len(tokens), pull, stats, claim)
                self._unclaim(lease, claim)
                t1 = time.perf_counter()
                per_token = 1.0 / self.s.decode_tokens_per_s
                for i in range(max_tokens):
                    await self._sleep(per_token)
                    stats.completion_tokens += 1
                    yield _WORDS[i % len(_WORDS) : i % len(_WORDS) + 1]
                stats.decode_s = time.perf_counter() - t1
            finally:
                self._unclaim(lease, claim)
                if lease is not None:
                    self.pool.release(lease)
        finally:
            self.running -= 1
            self._slots.release()

    async def _reuse_computing(self, hashes: list[int]) -> None:
        """Wait while the first block of this prompt not cached here is being computed or pulled by another request
        here.

        As vLLM reuses a block another running request computes, rather than
        computing it twice: a burst sharing an uncached prefix computes it once
        per node (the gateway routes followers here for that: gateway.inflight).
        A block being pulled is waited for until its read lands (bounded by the
        transfer's own timeout): one read per block per node, whichever request
        carrying a plan for it came first; if the read fails, the puller computes it.
        """
        while True:
            n = self.pool.lookup_prefix(hashes)
            done = self._computing.get(hashes[n]) if n < len(hashes) else None
            if done is None:
                return
            await done.wait()

    def _claim(self, hashes: list[int], lease: Lease | None, plan: PullPlan | None) -> _Claim | None:
        """Mark the lease's new blocks as on their way here (`_reuse_computing`), those its plan covers as being
        read; None if it has none."""
        if lease is None or not lease.new_slots:
            return None
        claim = _Claim(asyncio.Event(), asyncio.Event())
        covered = len(plan.slots) if plan is not None and self.transfers else 0
        index = {h: i for i, h in enumerate(hashes)}
        for h, _ in lease.new_slots:
            self._computing.setdefault(h, claim.read if index[h] < covered else claim.done)
        return claim

    def _landed(self, lease: Lease, claim: _Claim, pulled: set[int]) -> None:
        """The read is over: cache its verified blocks now, so that a request waiting for them goes on while this
        one computes the rest, which includes the blocks the read did not bring; wake the read's waiters."""
        if pulled:
            self.pool.commit(lease, pulled, final=False)
        for h, _ in lease.new_slots:
            if self._computing.get(h) is claim.read:
                if h in pulled:
                    del self._computing[h]
                else:
                    self._computing[h] = claim.done
        claim.read.set()

    def _unclaim(self, lease: Lease | None, claim: _Claim | None) -> None:
        """The lease's new blocks are committed (or failed): wake whoever waits for them (idempotent)."""
        if lease is None or claim is None or claim.done.is_set():
            return
        for h, _ in lease.new_slots:
            event = self._computing.get(h)
            if event is claim.read or event is claim.done:
                del self._computing[h]
        claim.read.set()
        claim.done.set()

    def _acquire(self, hashes: list[int]) -> Lease | None:
        try:
            return self.pool.acquire(hashes)
        except PoolFull:
            # Every slot is pinned by running requests: serve without caching this prompt.
            self.counts.pool_full.inc()
            return None

    async def _prefill(
        self,
        hashes: list[int],
        lease: Lease | None,
        n_tokens: int,
        pull: PullPlan | None,
        stats: RequestStats,
        claim: _Claim | None,
    ) -> None:
        bs = self.s.block_size
        cached = lease.cached if lease is not None else 0
        loaded = {h for h, _ in lease.loaded} if lease is not None else set()
        if loaded:
            # Copied back from the host tier already (worker_stub.pool); the copy's modeled time, all ranks at once.
            t = time.perf_counter()
            await self._sleep(len(loaded) * self.pool.block_bytes * self.pool.tp / (self.s.host_copy_gbps * 1e9))
            stats.host_load_s = time.perf_counter() - t
        host_run = cached
        while host_run < len(hashes) and hashes[host_run] in loaded:
            host_run += 1
        stats.local_cached_tokens = host_run * bs
        stats.host_cached_tokens = (host_run - cached) * bs
        pulled: set[int] = set()
        if lease is not None and pull is not None and lease.new_slots:
            t = time.perf_counter()
            pulled = await self._pull(hashes, lease, pull, stats)
            stats.pull_s = time.perf_counter() - t
        if lease is not None and claim is not None:
            self._landed(lease, claim, pulled)
        # The prefix served without compute: local hits (device, then host), then pulled blocks continuing the run.
        run = host_run
        while run < len(hashes) and (hashes[run] in pulled or hashes[run] in loaded):
            run += 1
        stats.pulled_tokens = (run - host_run) * bs
        t = time.perf_counter()
        others = max(0, self.running - 1)
        await self._sleep((n_tokens - run * bs) / self.s.prefill_tokens_per_s * (1 + self.s.prefill_contention * others))
        if lease is not None:
            for h, slot in lease.new_slots:
                if h not in pulled:
                    self.pool.fill(h, slot)
            # The computed blocks (the pulled ones are cached already) and the loaded ones: commit caches those.
            self.pool.commit(lease, [h for h, _ in lease.new_slots if h not in pulled])
        stats.prefill_s = time.perf_counter() - t

    async def _peer(self, node_id: str, epoch: int) -> NodeInfo | None:
        """The source at `epoch` as the directory lists it (kept per epoch), None if not listed so; the same list
        gives this engine's own registration (`_me`), read until it is listed."""
        key = (node_id, epoch)
        peer = self._peers.get(key)
        if peer is None or self._me is None:
            nodes = {n.node_id: n for n in await self.directory.nodes()}
            self._me = nodes.get(self.node_id) or self._me  # a list taken while its lease had lapsed lacks it
            peer = nodes.get(node_id)
            if peer is None or peer.epoch != epoch:
                return None
            self._peers = {k: v for k, v in self._peers.items() if k[0] != node_id}
            self._peers[key] = peer
        return peer

    async def _pull(self, hashes: list[int], lease: Lease, plan: PullPlan, stats: RequestStats) -> set[int]:
        """Read the planned blocks from the peer into this lease's new slots, every rank from the peer's same rank
        through its own transfer engine, all ranks at once; returns the blocks verified on every rank."""
        if not self.transfers:
            stats.pull_failures.append("no transfer engine")
            return set()
        index = {h: i for i, h in enumerate(hashes)}
        wanted = [(h, s, plan.slots[index[h]]) for h, s in lease.new_slots if index[h] < len(plan.slots)]
        if not wanted:
            return set()
        try:
            peer = await self._peer(plan.source_node, plan.source_epoch)
        except DirectoryError as exc:
            peer = None
            stats.pull_failures.append(f"directory: {exc}")
        if peer is None or not peer.transfer_url:
            self.counts.pull_errors.inc()
            stats.pull_failures.append(
                f"source {plan.source_node} epoch {plan.source_epoch} is not registered with a transfer URL"
            )
            return set()
        why = self._refusal(plan, peer)
        if why:
            # Another model's, revision's or layout's KV, heads sliced over another rank count (docs/protocol.md
            # §2.1, §2.2), or a source of a tenant this engine's users do not trust (kvproto.pull_tenancy): never
            # read, recomputed.
            self.counts.pull_refused.inc()
            stats.pull_failures.append(why)
            log.warning("pull plan from %s refused: %s", plan.source_node, why)
            return set()
        sessions = rank_sessions(peer.regions, peer.transfer_url)
        regions = {(r.rank, r.medium): r for r in peer.regions}
        reads = []
        for mine in self.pool.regions:
            session = sessions[mine.rank]
            if session is None:
                self.counts.pull_errors.inc()
                stats.pull_failures.append(f"source has no transfer session for rank {mine.rank}")
                return set()
            local, remote = [], []
            for _, slot, loc in wanted:
                code, src = media.split(loc)  # the plan's location: the source's slot in one of its media
                if code >= len(media.MEDIA):
                    self.counts.pull_errors.inc()
                    stats.pull_failures.append(f"location {loc} lies in no medium (docs/protocol.md §2.3)")
                    return set()
                theirs = regions.get((mine.rank, media.tier(code)))
                if theirs is None or theirs.block_bytes != mine.block_bytes:
                    self.counts.pull_errors.inc()
                    stats.pull_failures.append(f"source has no matching {media.MEDIA[code]} region for rank {mine.rank}")
                    return set()
                if theirs.base_addr < 0 or theirs.base_addr + theirs.length > _ADDRESS_SPACE:
                    # No transfer engine can address it (a 64-bit address space): nothing is read, every rank recomputes.
                    self.counts.pull_errors.inc()
                    stats.pull_failures.append(
                        f"source's rank {mine.rank} {media.MEDIA[code]} region [{theirs.base_addr}, +{theirs.length}) lies "
                        "outside the 64-bit address space"
                    )
                    return set()
                if src >= (slots := theirs.length // theirs.block_bytes):
                    # Past that rank's registered memory: no rank reads (a partial load would leave the ranks unequal).
                    self.counts.pull_errors.inc()
                    stats.pull_failures.append(
                        f"slot {src} is outside rank {mine.rank}'s {slots} {media.MEDIA[code]} slots on {plan.source_node}"
                    )
                    return set()
                local.append(mine.base_addr + slot * mine.block_bytes)
                remote.append(theirs.base_addr + src * theirs.block_bytes)
            reads.append((mine.rank, session, local, remote, [mine.block_bytes] * len(wanted)))
        t = time.perf_counter()
        outcomes = await asyncio.gather(*(self._read_rank(*r) for r in reads))
        stats.pull_transfer_s = time.perf_counter() - t
        stats.pull_rank_s = [s for s, _ in outcomes]
        errors = [f"rank {r[0]}: {e}" for r, (_, e) in zip(reads, outcomes) if e is not None]
        if errors:
            # One rank's read failed: every rank recomputes (no rank may keep a block the others lack).
            self.counts.pull_errors.inc()
            self.counts.pull_failed_blocks.inc(len(wanted))
            stats.pull_failures.append(f"transfer: {'; '.join(errors)}")
            log.warning("pull from %s failed: %s; recomputing", plan.source_node, "; ".join(errors))
            return set()
        stats.pull_bytes = sum(sum(r[4]) for r in reads)
        self.pull_bandwidth.add(stats.pull_bytes, stats.pull_transfer_s)
        good = {h for h, slot, _ in wanted if self.pool.verify(h, slot)}
        bad = len(wanted) - len(good)
        self.counts.pulled_blocks.inc(len(good))
        if bad:
            self.counts.pull_failed_blocks.inc(bad)
            stats.pull_failures.append(f"{bad} blocks failed verification (slot reused on the source?)")
            log.info("pull from %s: %d of %d blocks failed verification; recomputing them", plan.source_node, bad, len(wanted))
        return good

    def _refusal(self, plan: PullPlan, peer: NodeInfo) -> str | None:
        """Why this engine must not read `peer`'s KV for `plan` (None: it may)."""
        if plan.fingerprint not in (None, self.s.kv_fingerprint):
            return f"the plan names KV fingerprint {plan.fingerprint!r}, not this engine's {self.s.kv_fingerprint!r}"
        return source_refusal(self.s, self.node_id, self._me, peer)

    async def _read_rank(
        self, rank: int, session: str, local: list[int], remote: list[int], lengths: list[int]
    ) -> tuple[float, TransferError | None]:
        return await read_rank(self.transfers[rank], session, local, remote, lengths)


async def read_rank(
    transfer: TransferEngine, session: str, local: list[int], remote: list[int], lengths: list[int]
) -> tuple[float, TransferError | None]:
    """One rank's read (seconds, error): on a thread, so that every rank's read runs at once."""
    t = time.perf_counter()
    try:
        await asyncio.to_thread(transfer.read, session, local, remote, lengths)
    except TransferError as exc:
        return time.perf_counter() - t, exc
    return time.perf_counter() - t, None


def source_refusal(settings: WorkerSettings, node_id: str, me: NodeInfo | None, peer: NodeInfo) -> str | None:
    """Why the engine `node_id` (its registration as listed: `me`) must not read `peer`'s KV (None: it may): a pull
    plan's source and a bandwidth probe's are held to the same rules."""
    if peer.fingerprint != settings.kv_fingerprint:
        return f"source {peer.node_id} has KV fingerprint {peer.fingerprint!r}, not this engine's {settings.kv_fingerprint!r}"
    theirs = tp_size(peer.regions)
    if theirs != settings.tp:
        return f"source {peer.node_id} has {theirs} TP ranks, this engine {settings.tp}: its KV heads are sliced otherwise"
    if me is None:
        return f"this engine ({node_id}) is not in the directory's node list yet: its tenant is unknown"
    return tenancy_refusal(
        tenant=me.tenant, shared=me.shared, source=peer.node_id, source_tenant=peer.tenant, source_shared=peer.shared
    )
