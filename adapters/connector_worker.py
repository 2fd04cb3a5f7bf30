"""The vLLM connector's worker half, in each TP rank's worker process (no vLLM or torch import: it sees the KV
through `KvMemory`, so tests drive it with numpy memory and a fake transfer engine; adapters/vllm_connector.py is
the facade vLLM loads).

**Holder.** It registers the rank's KV memory with the transfer engine (kvtransfer.backends), plus a tag array of
16 bytes per block, `(kvdir hash, generation)`, and hands both to the scheduler half in its handshake. Before a step
writes a block (a new allocation, a recompute, a load) the block's tag hash is zeroed and its generation bumped
(`bind`); after the forward pass the hash of each block now complete is set (`wait_for_save`): a seqlock that
readers check, so a block reused between a plan and its read is never taken for the block the plan named.

**Puller.** A pull is asynchronous (adapters/pull_reader.py): `start_loads` checks the plan's source against the
directory's last node list and hands the read to the reader threads, which read tags, pages and tags again into a
staging buffer of the job's own; `get_finished`, on vLLM's thread after the forward pass, lands each finished
job whose request still wants it (copies the staging buffer into the destination blocks, keeps the blocks whose
tags held still, sets their tags) and tells vLLM the request may go on. A failed block goes to
`load_errors` (vLLM recomputes from the first one); a job past its deadline is given up at once (its read goes on
into its own buffers until the transfer engine returns); an aborted request's bytes never land.

**Host tier** (`host_blocks` > 0): a host pool per layer plus its own tags, registered as regions of medium
`host`; every completed block is copied there after the forward pass that completed it, into the slot the
scheduler half chose; loads back from it are synchronous copies before the forward pass.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from adapters.config import ConnectorSettings
from adapters.connector_meta import HostLoad, Load, RankHandshake, StepPlan, WorkerReport, summed
from adapters.connector_peers import PeerCache, Peers, probe_source
from adapters.kv_memory import KvMemory
from adapters.pull_reader import PullJob, PullReader, ReadPlan, unpinned
from adapters.vllm_plan import TAG_BYTES, KvLayout, LayerRegion, PlanError, check_tags, coalesce, page_pieces
from kvproto import media
from kvtransfer.engine import TransferEngine, TransferError

log = logging.getLogger("kvdir.vllm")

PULL_THREADS = 2
"""Reader threads per TP rank: a second read goes on while one waits on a slow or hung source."""

IDLE_WAIT_S = 0.005
"""How long a step that runs no token waits for a pull to end before it reports. While a request waits for its pull
vLLM steps again at once, empty step after empty step, keeping its engine core, worker and API server busy on the
CPUs the requests that do run need; a new request waits this long at most to be scheduled."""

PROBE_TRIES = 3
"""Bandwidth probes that may fail (each after the transfer timeout) before the engine stops probing."""


@dataclass(slots=True)
class _InFlight:
    """A pull handed to the readers: its load and its job."""

    load: Load
    job: PullJob


class WorkerHalf:
    """See the module docstring. `transfer_factory()` makes the transfer engine (in `register`, unpinned);
    `fingerprint_of(layout)` is the engine's KV fingerprint."""

    def __init__(
        self,
        s: ConnectorSettings,
        *,
        node_id: str,
        tp_size: int,
        fingerprint_of: Callable[[KvLayout], str],
        transfer_factory: Callable[[], TransferEngine],
        peers: Peers | None = None,
    ) -> None:
        self.s = s
        self.node_id = node_id
        self.tp_size = tp_size
        self.rank = 0  # this worker's TP rank, once its KV memory is known (register)
        self._fingerprint_of = fingerprint_of
        self._transfer_factory = transfer_factory
        self.fingerprint: str | None = None
        self._memory: KvMemory | None = None
        self._transfer: TransferEngine | None = None
        self._reader: PullReader | None = None
        self._layout: KvLayout | None = None
        self._tags = np.zeros((0, 2), dtype="<u8")
        self._host_pages: list[np.ndarray] = []
        self._host_tags = np.zeros((0, 2), dtype="<u8")
        self._host_layout: KvLayout | None = None
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()  # this step's requests whose host-tier load failed
        self._report = WorkerReport()
        self._stats: dict[str, float] = {}  # pulls ended since vLLM last asked (`take_stats`)
        self._inflight: dict[str, _InFlight] = {}
        self._idle = False  # the bound step runs no token (`StepPlan.idle`)
        # Jobs given up or failed, kept (with their buffers) while a read of theirs may still write into them: until
        # it returned, and the transfer engine has no abandoned read in flight (kvtransfer.mooncake).
        self._orphans: list[PullJob] = []
        self._peers = peers or PeerCache(s, node_id)
        self._stopping = threading.Event()
        self._pulled = False  # a pull's read landed here (the probe is needless)
        self._probed: tuple[int, float] | None = None  # the probe's page bytes and seconds, for the next report
        self._probe_jobs: list[PullJob] = []  # failed probes (at most PROBE_TRIES), kept with their buffers

    def register(self, memory: KvMemory, rank: int) -> None:
        """Register the KV memory and the tag array with the transfer engine; describe them as regions."""
        self.rank = rank
        self._memory = memory
        layers = memory.layers
        self._tags = np.zeros((min(r.num_blocks for r in layers), 2), dtype="<u8")
        self._layout = KvLayout(tuple(layers), self._tags.ctypes.data)
        self.fingerprint = self._fingerprint_of(self._layout)  # what a pull's source must have registered
        with unpinned():  # the transfer engine's threads inherit this thread's CPUs
            self._transfer = self._transfer_factory()
        for addr, length in memory.spans():
            self._transfer.register(addr, length)
        self._transfer.register(self._tags.ctypes.data, self._tags.nbytes)
        if self.s.host_blocks:
            self._register_host_tier(layers)
        self._reader = PullReader(self._transfer, PULL_THREADS)
        self._peers.start()
        if self.s.pull_probe_blocks:
            threading.Thread(target=self._probe, name="kvdir-probe", daemon=True).start()
        log.info(
            "kvdir connector: TP rank %d: %d layers, %d blocks registered at %s",
            rank,
            len(layers),
            self._tags.shape[0],
            self._transfer.session,
        )

    def _register_host_tier(self, layers: tuple[LayerRegion, ...]) -> None:
        """Allocate the host tier (each layer's pages and a tag array) and register it with the transfer engine."""
        assert self._transfer is not None
        n = self.s.host_blocks
        self._host_pages = [np.zeros((n, r.page_bytes), dtype=np.uint8) for r in layers]
        self._host_tags = np.zeros((n, 2), dtype="<u8")
        for a in (*self._host_pages, self._host_tags):
            self._transfer.register(a.ctypes.data, a.nbytes)
        self._host_layout = KvLayout(
            tuple(LayerRegion(a.ctypes.data, r.page_bytes, n) for a, r in zip(self._host_pages, layers)),
            self._host_tags.ctypes.data,
        )

    def handshake(self) -> RankHandshake | None:
        if self._transfer is None or self._layout is None:
            return None
        return RankHandshake(self._transfer.session, self._layout, self._host_layout)

    # ------------------------------------------------------------------ the bandwidth probe

    def _probe(self) -> None:
        """Measure the pull bandwidth before the first pull (a thread of its own): once the directory lists a source
        a plan could name, read `pull_probe_blocks` of its blocks as a pull does (tags, pages, tags, by the reader
        threads, into a staging buffer that never lands), and report the read with the next step's
        (`report`: the scheduler half's `pull_gbps`). A pull that completes first makes it needless."""
        assert self._reader is not None and self._layout is not None
        tries = 0
        while tries < PROBE_TRIES and not self._stopping.wait(self.s.peer_refresh_s):
            if self._pulled:  # a pull's read landed: that is the measure
                return
            known = self._peers.known()
            source = probe_source(known, self.node_id, self.fingerprint, self.tp_size, self.rank)
            if source is None:
                continue
            tries += 1
            n = min(self.s.pull_probe_blocks, self._tags.shape[0], known[source].layouts[self.rank].num_blocks)
            load = Load("kvdir-probe", source[0], source[1], list(range(n)), list(range(n)), [0] * n)
            job = PullJob(load.req_id, time.monotonic() + self.s.transfer_timeout_s, functools.partial(self._prepare, load, 0.0))
            self._reader.submit(job)
            if job.done.wait(self.s.transfer_timeout_s) and job.error is None and job.plan is not None:
                self._probed = (job.plan.page_bytes, job.read_s)
                log.info(
                    "pull probe of %s, rank %d: %d bytes in %.1f ms (%.2f GB/s)",
                    source[0],
                    self.rank,
                    job.plan.page_bytes,
                    job.read_s * 1e3,
                    job.plan.page_bytes / max(job.read_s, 1e-9) / 1e9,
                )
                return
            self._probe_jobs.append(job)  # its read, or one the transfer engine abandoned, may still write into it
            log.info("pull probe of %s, rank %d failed: %s", source[0], self.rank, job.error or "no answer in time")

    # ------------------------------------------------------------------ one step

    def bind(self, plan: StepPlan) -> None:
        """Before the forward pass: blocks about to be written lose their hash and get a new generation."""
        self._idle = plan.idle
        if plan.written:
            idx = np.asarray(plan.written, dtype=np.int64)
            self._tags[idx, 0] = 0
            self._tags[idx, 1] += 1

    def start_loads(self, plan: StepPlan) -> None:
        """Load the host-tier blocks now (the forward pass needs them); hand the pulls to the reader threads."""
        for hl in plan.host_loads:
            bad = self._load_host(hl)
            self._report.host_loaded += hl.dst_blocks
            if bad:
                self._load_errors.update(bad)
                self._failed_reqs.add(hl.req_id)
                self._report.host_failed += bad
        assert self._reader is not None
        for load in plan.loads:
            deadline = time.monotonic() + self.s.transfer_timeout_s
            job = PullJob(load.req_id, deadline, functools.partial(self._prepare, load, time.monotonic()))
            self._reader.submit(job)
            self._inflight[load.req_id] = _InFlight(load, job)

    def _prepare(self, load: Load, asked: float) -> ReadPlan:
        """The load's read (on a reader thread): each block read from the source's tier the plan names, the tiers'
        pieces in one batch per read (docs/protocol.md §2.3). A source missing from the last node list read is
        waited for until a read of the list that started a refresh period after `asked` ended (it may have
        registered since, and the replica read may be a little behind)."""
        assert self._layout is not None
        peer = self._peers.get(load.source_node, load.source_epoch)
        # A read that started a refresh period after the pull was asked for: a replica behind by less has it.
        if peer is None and self._peers.wait(asked + self.s.peer_refresh_s, self.s.transfer_timeout_s):
            peer = self._peers.get(load.source_node, load.source_epoch)
        if peer is None:
            raise PlanError(f"{load.source_node} epoch {load.source_epoch} is not registered (as last seen)")
        sessions, layouts, fingerprint, host, refusal = peer
        if refusal is not None:  # a shared engine reads only shared sources, a tenant's its own and shared ones
            raise PlanError(refusal)
        if fingerprint != self.fingerprint:  # another model's, revision's or layout's KV (docs/protocol.md §2.1)
            raise PlanError(f"{load.source_node} registered KV fingerprint {fingerprint}, not this engine's {self.fingerprint}")
        if len(layouts) != self.tp_size:  # its heads are sliced over another rank count (docs/protocol.md §2.2)
            raise PlanError(f"{load.source_node} has {len(layouts)} TP ranks, this engine {self.tp_size}")
        session = sessions[self.rank]  # rank r reads the holder's rank r
        if session is None:
            raise PlanError(f"{load.source_node}'s rank {self.rank} registered no transfer session")
        n = len(load.src_slots)
        tags = np.zeros((2, n, 2), dtype="<u8")
        by_tier: dict[int, list[int]] = {}
        for i, loc in enumerate(load.src_slots):
            by_tier.setdefault(loc >> media.SHIFT, []).append(i)
        first: tuple[list[int], list[int], list[int]] = ([], [], [])
        again: tuple[list[int], list[int], list[int]] = ([], [], [])
        dst: list[int] = []
        src: list[int] = []
        lengths: list[int] = []
        for code, idx in by_tier.items():
            theirs = layouts[self.rank] if code == media.DEVICE else host[self.rank] if host and code == media.HOST else None
            if theirs is None:
                raise PlanError(f"{load.source_node} registered no tier {code} (docs/protocol.md §2.3) for rank {self.rank}")
            why = self._layout.compatible(theirs)
            if why:
                raise PlanError(f"{load.source_node} has {why}")
            slots = [load.src_slots[i] & media.SLOT_MASK for i in idx]
            if max(slots) >= theirs.num_blocks:
                raise PlanError(f"slot {max(slots)} is outside {load.source_node}'s {theirs.num_blocks} blocks there")
            t_remote = [theirs.tags_base + TAG_BYTES * s for s in slots]
            for k, out in ((0, first), (1, again)):
                pieces = coalesce([tags[k].ctypes.data + TAG_BYTES * i for i in idx], t_remote, [TAG_BYTES] * len(idx))
                for acc, part in zip(out, pieces):
                    acc += part
            d, r, n_ = page_pieces(self._layout, theirs, [load.dst_blocks[i] for i in idx], slots)
            dst += d
            src += r
            lengths += n_
        staging = np.empty(sum(lengths), dtype=np.uint8)
        staged = [staging.ctypes.data + off for off in itertools.accumulate(lengths, initial=0)][:-1]
        return ReadPlan(session, first, coalesce(staged, src, lengths), again, tags, staging, coalesce(dst, staged, lengths))

    def get_finished(self, finished_req_ids: set[str]) -> set[str]:
        """The requests whose pull is over: landed, failed, past its deadline, or aborted (`finished_req_ids`:
        vLLM frees an aborted request's blocks once it is reported here, and nothing of it lands). A step that ran no
        token waits up to `IDLE_WAIT_S` for a read to end first."""
        if self._idle and self._inflight and not finished_req_ids:
            self._wait_for_a_read()
        done: set[str] = set()
        now = time.monotonic()
        for rid, pull in list(self._inflight.items()):
            job, load = pull.job, pull.load
            aborted = rid in finished_req_ids
            if not (job.done.is_set() or aborted or now >= job.deadline):
                continue
            del self._inflight[rid]
            done.add(rid)
            if not job.done.is_set() or job.error is not None:
                self._orphans.append(job)  # its read (or one the transfer engine abandoned) may still write into it
            if aborted:
                log.info("request %s was aborted while its pull from %s ran: its bytes are dropped", rid, load.source_node)
                continue
            if not job.done.is_set() or job.error is not None:
                err = job.error or TimeoutError(f"no answer within {self.s.transfer_timeout_s:.1f} s")
                if isinstance(err, (PlanError, TransferError, TimeoutError)):
                    log.warning("pull of %d blocks from %s failed: %s; recomputing", len(load.dst_blocks), load.source_node, err)
                else:  # a bug in the load path must not take the engine down: the request recomputes
                    log.error("pull of %d blocks from %s failed: %r; recomputing", len(load.dst_blocks), load.source_node, err)
                bad = list(load.dst_blocks)
            else:
                bad = self._land(pull)
            self._load_errors.update(bad)
            self._stats = summed(
                self._stats,
                {
                    "pulls": 1,
                    "pulled_blocks": len(load.dst_blocks) - len(bad),
                    "failed_blocks": len(bad),
                    "read_bytes": job.plan.page_bytes if job.plan is not None and not bad else 0,
                    "read_s": job.read_s if job.plan is not None and not bad else 0.0,
                },
            )
        if self._orphans and not getattr(self._transfer, "abandoned_in_flight", 0):
            self._orphans = [j for j in self._orphans if not j.done.is_set()]
        return done

    def _wait_for_a_read(self) -> None:
        """Until a read in flight ends, its deadline passes, or `IDLE_WAIT_S`."""
        assert self._reader is not None
        self._reader.any_done.clear()  # then check: a read that ends after the check sets it again
        jobs = [pull.job for pull in self._inflight.values()]
        if not any(job.done.is_set() for job in jobs):
            self._reader.any_done.wait(max(0.0, min(IDLE_WAIT_S, min(job.deadline for job in jobs) - time.monotonic())))

    def _land(self, pull: _InFlight) -> list[int]:
        """Copy a finished read into its destination blocks and set the tags of those whose source tags held
        still; the destination blocks that are not known good."""
        assert self._memory is not None and pull.job.plan is not None
        job, load, read = pull.job, pull.load, pull.job.plan
        self._memory.write(*read.land)
        before = [tuple(int(x) for x in row) for row in read.tags[0]]
        after = [tuple(int(x) for x in row) for row in read.tags[1]]
        bad = check_tags(load.hashes, before, after)  # type: ignore[arg-type]
        if bad:
            log.info("pull from %s: %d of %d blocks stale; recomputing them", load.source_node, len(bad), len(load.hashes))
        stale = set(bad)
        good = [(b, h) for i, (b, h) in enumerate(zip(load.dst_blocks, load.hashes)) if i not in stale]
        for b, h in good:  # the bytes are in: the hash last, as after a forward pass
            self._tags[b, 0] = h
        self._report.pulled += [(load.req_id, b, h) for b, h in good]
        self._pulled = True
        self._report.read_s[self.rank] = self._report.read_s.get(self.rank, 0.0) + job.read_s
        self._report.read_bytes[self.rank] = self._report.read_bytes.get(self.rank, 0) + read.page_bytes
        return [load.dst_blocks[i] for i in bad]

    def _load_host(self, hl: HostLoad) -> list[int]:
        """Copy a request's blocks back from the host tier (tags, pages, tags: a peer may be reading, never
        writing; this worker writes host slots only after the forward pass); the destination blocks not known good."""
        assert self._memory is not None
        slots = np.asarray(hl.host_slots, dtype=np.int64)
        before = [tuple(int(x) for x in row) for row in self._host_tags[slots]]
        self._memory.from_host(self._host_pages, hl.host_slots, hl.dst_blocks)
        after = [tuple(int(x) for x in row) for row in self._host_tags[slots]]
        bad = check_tags(hl.hashes, before, after)  # type: ignore[arg-type]
        if bad:
            log.info("host-tier load: %d of %d blocks stale; recomputing them", len(bad), len(slots))
        return [hl.dst_blocks[i] for i in bad]

    def _save_host(self, saves: list[tuple[int, int, int]]) -> None:
        """Copy complete device blocks into their host slots under the seqlock: hash zeroed and generation bumped,
        pages, then the hash."""
        assert self._memory is not None
        slots = np.asarray([s for _, s, _ in saves], dtype=np.int64)
        self._host_tags[slots, 0] = 0
        self._host_tags[slots, 1] += 1
        self._memory.to_host([b for b, _, _ in saves], self._host_pages, slots.tolist())
        self._host_tags[slots, 0] = np.asarray([h for _, _, h in saves], dtype="<u8")

    def wait_for_save(self, plan: StepPlan) -> None:
        """After the forward pass: the blocks complete now get their hash (not those of a request whose host-tier
        load failed), and go to the host tier."""
        done = [(b, h) for rid, b, h in plan.complete if rid not in self._failed_reqs]
        for b, h in done:
            self._tags[b, 0] = h
        self._report.complete += done
        if plan.saves and self._host_pages:
            ok = [(b, slot, h) for rid, b, slot, h in plan.saves if rid not in self._failed_reqs]
            if ok:
                self._save_host(ok)
            self._report.saved += [(h, slot) for _, slot, h in ok]
            self._report.unsaved += [(h, slot) for rid, _, slot, h in plan.saves if rid in self._failed_reqs]
        self._failed_reqs.clear()

    def take_stats(self) -> dict[str, float] | None:
        """The pulls that ended since the last call (vLLM's connector stats: it logs them per interval), or None."""
        stats, self._stats = self._stats, {}
        return stats or None

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def report(self) -> WorkerReport | None:
        report, self._report = self._report, WorkerReport()
        probed, self._probed = self._probed, None
        if probed is not None:  # measured as a pull's read is: the scheduler half's pull_gbps counts it alike
            report.read_bytes[self.rank] = report.read_bytes.get(self.rank, 0) + probed[0]
            report.read_s[self.rank] = report.read_s.get(self.rank, 0.0) + probed[1]
        return report if report else None

    def shutdown(self) -> None:
        self._stopping.set()
        self._peers.stop()
        if self._reader is not None:
            self._reader.close()
        if self._transfer is not None:
            self._transfer.close()
