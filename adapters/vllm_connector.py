"""`KvdirConnector`: a vLLM (v1) KV connector that publishes block slots to kvdir and pulls prefixes from peers.

Load it with ``--kv-transfer-config '{"kv_connector": "KvdirConnector", "kv_connector_module_path":
"adapters.vllm_connector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
"kv_connector_extra_config": {"node_id": ..., "api_url": ..., "directory": ...}}'`` (keys: `ConnectorSettings`;
docs/engines.md). Only this module imports vLLM. vLLM runs the *scheduler* half in the EngineCore process and
the *worker* half in the worker process; they share only what vLLM passes between them:

* worker -> scheduler, once per TP rank: `get_handshake_metadata` carries the rank's transfer session and KV
  layout, which the scheduler half registers with the directory, every rank in one registration
  (`set_xfer_handshake_metadata`, keyed by TP rank). That is vLLM's own channel for exactly this, so no file
  or directory round trip is needed and the scheduler registers only once the memory it describes is
  registered with the transfer engines.
* scheduler -> worker, per step: `KvdirMeta` (blocks written this step, blocks complete after it, loads).
* worker -> scheduler, per step: `KvdirWorkerMeta` (blocks whose KV is now complete, load failures), each
  rank's aggregated by vLLM.

**Tensor parallelism** (docs/protocol.md §2.2). Every rank's worker holds its share of the heads at the same
block ids, so one slot list locates a block on every rank. Every rank gets the same per-step metadata: a load
makes rank r read the holder's rank r (its session and layout), all ranks at once, each validating its own
tags. vLLM recomputes the union of the ranks' failed blocks on every rank, and the scheduler publishes only
blocks every rank reported complete, so no rank keeps a block the others lack. A holder of another rank count
has another fingerprint (the TP size is in it) and is refused. Data-parallel ranks are nodes of their own
(`NODE_ID-dpR`).

**Holder.** The worker registers the KV allocation with the transfer engine (kvtransfer.backends) plus a tag
array of 16 bytes per block, `(kvdir hash, generation)`, per TP rank. One registration per engine: the scheduler half
registers the node (a fresh incarnation per start, so a restart gets a new epoch), heartbeats it and
publishes `(kvdir chained XXH3 hash, vLLM block id)` for each block the worker reports complete, from a
background thread (`NodeSession`), never from the scheduler step. Removals come from the connector too: the
background thread compares the published blocks with the block pool's hashes (an evicted or reset block
loses its hash), since KV events carry no block ids and a second registrant (`kvdir events`) would fight
over the node id. Do not run `kvdir events` for an engine with this connector.

**Puller.** The gateway's plan arrives in `kv_transfer_params["kvdir_pull"]` (`kvproto.schemas.PullPlan`).
`get_num_new_matched_tokens` claims the planned blocks past the local hit, never the prompt's last token;
`update_state_after_alloc` pairs them with their destination blocks; `start_load_kv` reads every layer's
pages of them in one batched transfer (runs of consecutive blocks as one piece per layer) into a staging
buffer and copies them into those blocks, before the forward pass. A failed or stale read reports its blocks
in `get_block_ids_with_load_errors`; with `kv_load_failure_policy="recompute"` vLLM discards that step's
output for the request and recomputes from the first bad block.

**Host tier** (`host_blocks` > 0, docs/protocol.md §2.3, issue #32). Each rank's worker keeps a host pool of
`host_blocks` slots per layer, plus its own tag array, registered with its transfer engine as regions of medium
`host`. Every block the engine completes is copied there after the forward pass that completed it
(`wait_for_save`), into the slot the scheduler chose (adapters.host_slots: the same on every rank, reused least
recently used first). Saved at completion, not when vLLM frees or evicts the block: at completion the worker
knows the block's bytes are whole and that nothing writes them until the next step, where vLLM tells a
connector nothing of an eviction (the scheduler learns of it afterwards, when the block's hash is gone, by
which time the block may hold another request's KV) and saving at `request_finished` would mean holding every
finished request's blocks (`delay_free`) until a copy reported back. The cost is one device-to-host copy per
computed block, which a GPU overlaps with compute on a copy stream. While vLLM holds a block the node publishes
its device block id; once vLLM evicted it, its host slot (medium `host`), until the host tier reuses the slot.
A request whose prefix continues in the host tier past vLLM's own hit loads those blocks back
(`get_num_new_matched_tokens`, then `start_load_kv`, before any pull), through the same tag check as a pull;
a peer's plan may name host slots, which it reads from the host regions. A host slot is written under the same
seqlock as a device block (hash zeroed and generation bumped first, the hash set last).

**Stale slots: validation after the read** (a seqlock), not holder-side pinning. Before a step writes into
a block (new allocation, recompute, a load), the holder's worker zeroes the block's tag hash and bumps its
generation; after the forward pass it sets the hash of each block that is now complete. A reader reads the
tags, then the pages, then the tags again, and keeps a block only if both tag reads are equal and hold the
block's expected kvdir hash. A block reused between plan and read fails that check whatever the directory
still says, and the check costs the holder no scheduler work: pinning would need the holder's scheduler
thread (`touch`/`free_blocks` are not thread-safe), a side channel to reach it, and keeping an idle engine
stepping, and a reader that dies would leave blocks pinned until a lease ran out.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from prometheus_client import CollectorRegistry, Counter, start_http_server
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

from adapters.config import ConnectorSettings
from adapters.host_slots import HostSlots
from adapters.kv_identity import engine_fingerprint, mm_extra, request_identity, served_name
from adapters.vllm_plan import (
    TAG_BYTES,
    KvLayout,
    LayerRegion,
    PlanError,
    PullSource,
    Standing,
    blocks_to_pull,
    check_tags,
    coalesce,
    complete_on_every_rank,
    mirrored,
    page_pieces,
    plan_from_params,
    pull_outcome,
    pull_sources,
    standing,
)
from kvproto import media
from kvproto.client import DirectoryClient
from kvproto.errors import DirectoryError
from kvproto.hashing import identity_hashes
from kvproto.schemas import PULL_GBPS_LABEL, NodeInfo
from kvproto.session import NodeSession
from kvtransfer.backends import create_engine
from kvtransfer.bandwidth import PullBandwidth
from kvtransfer.engine import TransferEngine, TransferError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvdir.vllm")


@dataclass(slots=True)
class KvdirHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]  # vLLM is untyped for mypy here (not installed beside it)
    """A worker's transfer session and KV layout (its TP rank's), and its host tier's, for the scheduler half to
    register."""

    session: str
    layout: KvLayout
    host: KvLayout | None = None


@dataclass(slots=True)
class Load:
    """One request's pull: destination blocks here, the source's slots, the blocks' kvdir hashes."""

    req_id: str
    source_node: str
    source_epoch: int
    dst_blocks: list[int]
    src_slots: list[int]
    hashes: list[int]


@dataclass(slots=True)
class HostLoad:
    """One request's blocks loaded back from this engine's host tier: destination blocks, host slots, hashes."""

    req_id: str
    dst_blocks: list[int]
    host_slots: list[int]
    hashes: list[int]


@dataclass(slots=True)
class KvdirMeta(KVConnectorMetadata):  # type: ignore[misc]  # vLLM is untyped for mypy here (not installed beside it)
    """Scheduler -> worker, one step: blocks written, blocks complete after it (req id, block, hash), loads from
    peers and from the host tier, and the complete blocks to save to the host tier (req id, block, slot, hash)."""

    written: list[int] = field(default_factory=list)
    complete: list[tuple[str, int, int]] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    host_loads: list[HostLoad] = field(default_factory=list)
    saves: list[tuple[str, int, int, int]] = field(default_factory=list)


@dataclass(slots=True)
class KvdirWorkerMeta(KVConnectorWorkerMetadata):  # type: ignore[misc]  # vLLM is untyped for mypy here (not installed beside it)
    """Worker -> scheduler, one step, of one TP rank or (`aggregate`d by vLLM) of all: blocks now complete
    (block, hash) as each rank reports them, the destination blocks of its loads and those that failed, the
    requests whose pull failed, and per rank the page bytes and seconds of its reads that completed (tags,
    pages, tags: the pull bandwidth; the ranks read at once)."""

    complete: list[tuple[int, int]] = field(default_factory=list)
    loaded: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    failed_reqs: list[str] = field(default_factory=list)
    read_bytes: dict[int, int] = field(default_factory=dict)
    read_s: dict[int, float] = field(default_factory=dict)
    saved: list[tuple[int, int]] = field(default_factory=list)  # (hash, host slot) saved to the host tier
    unsaved: list[tuple[int, int]] = field(default_factory=list)  # (hash, host slot) not saved (its request failed)
    host_loaded: list[int] = field(default_factory=list)  # destination blocks loaded from the host tier
    host_failed: list[int] = field(default_factory=list)  # those of them that failed the tag check

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvdirWorkerMeta)
        return KvdirWorkerMeta(
            self.complete + other.complete,
            self.loaded + other.loaded,
            self.failed + other.failed,
            self.failed_reqs + other.failed_reqs,
            _add(self.read_bytes, other.read_bytes),
            _add(self.read_s, other.read_s),
            self.saved + other.saved,
            self.unsaved + other.unsaved,
            self.host_loaded + other.host_loaded,
            self.host_failed + other.host_failed,
        )

    def pulled(self) -> tuple[int, int, int]:
        """(blocks pulled, blocks failed, pulls failed) over every rank (vllm_plan.pull_outcome)."""
        return pull_outcome(self.loaded, self.failed, self.failed_reqs)


def _add(a: dict[int, Any], b: dict[int, Any]) -> dict[int, Any]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in a.keys() | b.keys()}


@contextlib.contextmanager
def _unpinned() -> Iterator[None]:
    """Let the calling thread, and the threads it starts meanwhile, run on every CPU.

    vLLM's CPU worker pins its main thread (and so every thread it starts) to its compute cores, the same
    cores in every engine on a machine. Mooncake's service threads, started in `register_kv_caches`, and its
    synchronous read, which busy-waits on the thread that calls it, then share one core with the peer's
    service threads: reads were measured stalling for over 5 s (timed out: recomputed) on two busy cores,
    and a few hundred ms when they completed. Off the compute cores the same reads take milliseconds.
    """
    try:
        pinned = os.sched_getaffinity(0)
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError as exc:  # no such call here, or a cpuset that refuses: keep vLLM's binding
        log.debug("cannot unpin the transfer threads: %s", exc)
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)


class _Loop:
    """An asyncio loop on a daemon thread: the directory client runs there, off vLLM's threads."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name=name, daemon=True).start()

    def run(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


class _PeerCache:
    """The directory's nodes as pull sources, refreshed in the background, so that no engine step waits on the
    directory: a load whose source epoch is not in the last list is recomputed at once.

    The list is read every `peer_refresh_s` and at once after a miss; while the directory does not answer,
    the last list stays (a source that restarted has a new epoch, so a stale entry is never its memory).
    """

    def __init__(self, s: ConnectorSettings, node_id: str) -> None:
        """`node_id`: the engine's own node, whose registered tenant decides which sources it may read."""
        self.s = s
        self.node_id = node_id
        self._known: dict[tuple[str, int], PullSource] = {}
        self._me: Standing | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvdir-peers", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def get(self, node_id: str, epoch: int) -> PullSource | None:
        """The source if the last list has it at `epoch`; else None, and a refresh is asked for (never waited for)."""
        peer = self._known.get((node_id, epoch))
        if peer is None:
            self._wake.set()
        return peer

    def _run(self) -> None:
        asyncio.run(self._loop())

    async def _loop(self) -> None:
        async with DirectoryClient(
            self.s.directory_urls, deadline=self.s.peer_refresh_s * 4, token=self.s.directory_token, tenant=self.s.tenant
        ) as client:
            while not self._stop.is_set():
                try:
                    nodes: list[NodeInfo] = await client.nodes()
                except DirectoryError as exc:
                    log.debug("directory node list unavailable (%s): pull sources as last seen", exc)
                else:
                    # A list taken while this engine's lease had lapsed (it registers again) lacks it: its standing
                    # (the tenant its token gave it) is kept from the last list that had it.
                    self._me = standing(nodes, self.node_id) or self._me
                    self._known = pull_sources(nodes, self.node_id, self._me)  # replaced whole: readers see one list or the next
                await asyncio.to_thread(self._wake.wait, self.s.peer_refresh_s)
                self._wake.clear()


class KvdirConnector(KVConnectorBase_V1):  # type: ignore[misc]  # vLLM is untyped for mypy here (not installed beside it)
    """See the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.s = ConnectorSettings(**extra)
        self.block_size = vllm_config.cache_config.block_size
        pc = vllm_config.parallel_config
        self.tp_size = pc.tensor_parallel_size
        # Each data-parallel rank is an engine core with its own cache: a node of its own (docs/protocol.md §2.2).
        # Behind one API server (vLLM's internal load balancing) the gateway names the rank in a header.
        dp = pc.data_parallel_size > 1
        rank = getattr(pc, "data_parallel_index", pc.data_parallel_rank)
        self.node_id = f"{self.s.node_id}-dp{rank}" if dp else self.s.node_id
        self.dp_rank = rank if dp and not pc.data_parallel_external_lb else None
        mc = vllm_config.model_config
        # Blocks are hashed under (namespace, this model, the request's LoRA adapter and cache salt): docs/protocol.md §1.1.
        self.model_name = self.s.model or served_name(mc.served_model_name, mc.model)
        self._model = (mc.model, mc.revision, str(mc.dtype), str(vllm_config.cache_config.cache_dtype))
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    # ------------------------------------------------------------------ scheduler half

    def _init_scheduler(self) -> None:
        self._pool: Any = None
        self.fingerprint: str | None = None  # once the worker's layout is known (set_xfer_handshake_metadata)
        self._requests: dict[str, Request] = {}
        self._hashes: dict[str, list[int]] = {}
        self._pending_loads: dict[str, tuple[Any, int, int]] = {}  # req id -> (plan, first block, count)
        self._loads: list[Load] = []
        self._published: dict[int, tuple[int, Any]] = {}  # kvdir hash -> (block id, vLLM block hash)
        self._lock = threading.Lock()  # _published and _host: the scheduler's thread and the publisher's
        self._changes: queue.SimpleQueue[list[tuple[int, int]]] = queue.SimpleQueue()
        # The host tier's slots (adapters.host_slots), and what became of them, for the publisher: ("hosted" (hash,
        # slot): a block only the host tier holds now; "gone" hash: the host tier dropped it).
        self._host = HostSlots(self.s.host_blocks) if self.s.host_blocks else None
        self._host_changes: queue.SimpleQueue[tuple[str, int, int]] = queue.SimpleQueue()
        self._pending_host: dict[str, tuple[int, list[int]]] = {}  # req id -> (first block, host slots) to load
        self._host_loads: list[HostLoad] = []
        self._session: NodeSession | None = None
        self._bandwidth = PullBandwidth()  # of the worker's completed reads (KvdirWorkerMeta): heartbeats report it
        r = self.registry = CollectorRegistry()
        self.m_pulled = Counter("kvdir_connector_pulled_blocks_total", "Blocks pulled from peers and validated", registry=r)
        self.m_failed = Counter(
            "kvdir_connector_pull_failed_blocks_total", "Pulled blocks that failed (transfer or stale): recomputed", registry=r
        )
        self.m_failed_pulls = Counter("kvdir_connector_pull_failures_total", "Pulls with at least one failed block", registry=r)
        self.m_read_bytes = Counter(
            "kvdir_connector_pull_page_bytes_total", "KV page bytes read from peers (reads that completed)", registry=r
        )
        self.m_read_s = Counter(
            "kvdir_connector_pull_read_seconds_total",
            "Time in those reads: tags, pages, tags again (page bytes / this = the pull bandwidth)",
            registry=r,
        )
        self.m_rank_read_bytes = Counter(
            "kvdir_connector_pull_rank_page_bytes_total", "KV page bytes read from peers, by TP rank", ["rank"], registry=r
        )
        self.m_rank_read_s = Counter(
            "kvdir_connector_pull_rank_read_seconds_total", "Time in those reads, by TP rank", ["rank"], registry=r
        )
        self.m_plans = Counter(
            "kvdir_connector_plans_total", "Requests that carried a pull plan, by outcome", ["outcome"], registry=r
        )
        self.m_published = Counter("kvdir_connector_published_blocks_total", "Blocks published to the directory", registry=r)
        self.m_host_saved = Counter("kvdir_connector_host_saved_blocks_total", "Blocks saved to the host tier", registry=r)
        self.m_host_loaded = Counter(
            "kvdir_connector_host_loaded_blocks_total", "Blocks loaded back from the host tier and validated", registry=r
        )
        self.m_host_failed = Counter(
            "kvdir_connector_host_load_failed_blocks_total", "Host-tier loads that failed the tag check: recomputed", registry=r
        )
        self.m_host_evicted = Counter(
            "kvdir_connector_host_evicted_blocks_total", "Blocks the host tier dropped to make room", registry=r
        )
        self.m_removed = Counter("kvdir_connector_removed_blocks_total", "Published blocks found evicted", registry=r)
        if self.s.metrics:
            host, _, port = self.s.metrics.rpartition(":")
            start_http_server(int(port), host.strip("[]"), registry=r)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._pool = gpu_block_pool

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Register the node once every TP rank's worker registered its KV memory with its transfer engine: one
        registration, each rank's regions behind its own session, the slots mirrored on every rank."""
        handshakes = [metadata.get(rank) for rank in range(self.tp_size)]
        if sorted(metadata) != list(range(self.tp_size)) or not all(isinstance(h, KvdirHandshake) for h in handshakes):
            raise RuntimeError(
                f"KvdirConnector: a handshake from each of TP ranks 0..{self.tp_size - 1} is due, got {sorted(metadata)}"
            )
        ranks: list[KvdirHandshake] = handshakes  # type: ignore[assignment]  # checked just above
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
        self.fingerprint = self.kv_fingerprint(hs.layout)
        loop = _Loop("kvdir-publisher")
        client = DirectoryClient(self.s.directory_urls, deadline=5.0, token=self.s.directory_token, tenant=self.s.tenant)
        self._session = NodeSession(
            client,
            self.node_id,
            self.s.api_url,
            holdings=self._holdings,
            transfer_url=hs.session,
            regions=regions,
            capacity_blocks=hs.layout.num_blocks,
            block_size=self.block_size,
            models=[self.model_name],
            fingerprint=self.fingerprint,
            dp_rank=self.dp_rank,
            load=lambda: {"running": float(len(self._requests)), "waiting": 0.0, **self._bandwidth.labels(PULL_GBPS_LABEL)},
            collect=self._collect,
            on_published=lambda n, _lag: self.m_published.inc(n),
            logger=log,
        )
        asyncio.run_coroutine_threadsafe(self._session.run(self.s.publish_interval_s, self.s.heartbeat_interval_s), loop.loop)
        log.info(
            "kvdir connector: node %s, transfer %s, %d blocks, %d host blocks, model %s, KV fingerprint %s",
            self.node_id,
            ", ".join(h.session for h in ranks),
            hs.layout.num_blocks,
            self.s.host_blocks,
            self.model_name,
            self.fingerprint,
        )

    def kv_fingerprint(self, layout: KvLayout) -> str:
        """This engine's KV fingerprint (docs/protocol.md §2.1): the setting, else a digest of its model and layout.
        Both halves compute it (the worker from its own layout), so each refuses another engine's KV."""
        if self.s.fingerprint is not None:
            return self.s.fingerprint
        model, revision, dtype, kv_dtype = self._model
        pages = [r.page_bytes for r in layout.layers]
        return engine_fingerprint(
            model=model,
            revision=revision,
            dtype=dtype,
            kv_cache_dtype=kv_dtype,
            block_size=self.block_size,
            page_bytes=pages,
            tp_size=self.tp_size,
        )

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
            self.m_removed.inc(len(gone))

    def _request_hashes(self, req: Request, n_blocks: int) -> list[int]:
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

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request
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
            self.m_plans.labels("invalid").inc()
            return 0, False
        if plan is None:
            return 0, False
        if plan.source_node == self.node_id:
            self.m_plans.labels("own").inc()
            return 0, False
        if plan.fingerprint is not None and plan.fingerprint != self.fingerprint:
            # Another model's, revision's or layout's KV (docs/protocol.md §2.1): never loaded, computed instead.
            log.warning(
                "request %s: the plan's source %s has KV fingerprint %s, not this engine's %s; computing it",
                request.request_id,
                plan.source_node,
                plan.fingerprint,
                self.fingerprint,
            )
            self.m_plans.labels("fingerprint").inc()
            return 0, False
        first, count = blocks_to_pull(request.num_prompt_tokens, num_computed_tokens, len(plan.slots), self.block_size)
        if count <= 0:
            self.m_plans.labels("cached").inc()
            return 0, False
        self._pending_loads[request.request_id] = (plan, first, count)
        return count * self.block_size, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        host = self._pending_host.pop(request.request_id, None)
        if host is not None and num_external_tokens:
            first, slots = host
            block_ids = blocks.get_block_ids()[0]
            hashes = self._request_hashes(request, first + len(slots))
            dst = block_ids[first : first + len(slots)]
            self._host_loads.append(HostLoad(request.request_id, dst, slots, hashes[first : first + len(slots)]))
            return
        pending = self._pending_loads.pop(request.request_id, None)
        if pending is None or num_external_tokens == 0:
            return
        plan, first, count = pending
        block_ids = blocks.get_block_ids()[0]
        hashes = self._request_hashes(request, first + count)
        self._loads.append(
            Load(
                request.request_id,
                plan.source_node,
                plan.source_epoch,
                block_ids[first : first + count],
                list(plan.slots[first : first + count]),
                hashes[first : first + count],
            )
        )
        self.m_plans.labels("pull").inc()

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvdirMeta(loads=self._loads)
        self._loads = []
        bs = self.block_size
        steps: list[tuple[str, int, list[int]]] = [
            (r.req_id, r.num_computed_tokens, r.block_ids[0]) for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        assert self._kv_cache_manager is not None
        steps += [
            (rid, cached.num_computed_tokens[i], self._kv_cache_manager.get_block_ids(rid)[0])
            for i, rid in enumerate(cached.req_ids)
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
        for load in meta.loads:
            meta.written += load.dst_blocks
            meta.complete += [(load.req_id, b, h) for b, h in zip(load.dst_blocks, load.hashes)]
        meta.host_loads, self._host_loads = self._host_loads, []
        for hl in meta.host_loads:
            meta.written += hl.dst_blocks
            meta.complete += [(hl.req_id, b, h) for b, h in zip(hl.dst_blocks, hl.hashes)]
        if self._host is not None:
            self._plan_saves(meta)
        return meta

    def _plan_saves(self, meta: KvdirMeta) -> None:
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
                    self.m_host_evicted.inc()
                    self._host_changes.put(("gone", evicted, slot))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        wm = connector_output.kv_connector_worker_meta
        if not isinstance(wm, KvdirWorkerMeta):
            return
        pulled, failed, failed_pulls = wm.pulled()
        self.m_pulled.inc(pulled)
        self.m_failed.inc(failed)
        self.m_failed_pulls.inc(failed_pulls)
        for rank, n in wm.read_bytes.items():
            self.m_rank_read_bytes.labels(str(rank)).inc(n)
            self.m_rank_read_s.labels(str(rank)).inc(wm.read_s.get(rank, 0.0))
        read_bytes = sum(wm.read_bytes.values())
        read_s = max(wm.read_s.values(), default=0.0)  # the ranks read at once: the step's pull took the longest
        self.m_read_bytes.inc(read_bytes)
        self.m_read_s.inc(read_s)
        self._bandwidth.add(read_bytes, read_s)
        if self._host is not None:
            self._host_saved(wm)
        complete = complete_on_every_rank(wm.complete, self.tp_size)  # a block only some ranks hold is no block
        if not complete or self._pool is None:
            return
        blocks = self._pool.blocks
        fresh = []
        with self._lock:
            for b, h in complete:
                vh = blocks[b].block_hash
                if vh is not None:  # not in the prefix cache (caching off): nothing a peer could be sent for
                    self._published[h] = (b, vh)
                    fresh.append((h, b))
        self._changes.put(fresh)

    def _host_saved(self, wm: KvdirWorkerMeta) -> None:
        """Saves every rank made are usable (a save some rank missed frees its slot); the host loads' outcome."""
        assert self._host is not None
        done = complete_on_every_rank(wm.saved, self.tp_size)
        ok = set(done)
        with self._lock:
            for h, slot in done:
                if self._host.confirm(h, slot) and h not in self._published:
                    self._host_changes.put(("hosted", h, slot))  # its device copy went before the save was confirmed
            for h, slot in {*wm.saved, *wm.unsaved} - ok:
                self._host.fail(h, slot)
        self.m_host_saved.inc(len(done))
        bad = set(wm.host_failed)
        self.m_host_loaded.inc(len(set(wm.host_loaded) - bad))
        self.m_host_failed.inc(len(bad))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._requests.pop(rid, None)
        self._hashes.pop(rid, None)
        self._pending_loads.pop(rid, None)
        self._pending_host.pop(rid, None)
        return False, None

    # ------------------------------------------------------------------ worker half

    def _init_worker(self) -> None:
        self.rank = 0  # this worker's TP rank, once its KV memory is known (register_kv_caches)
        self._transfer: TransferEngine | None = None
        self._layout: KvLayout | None = None
        self.fingerprint = None  # once the KV layout is known (register_kv_caches)
        self._tags = np.zeros((0, 2), dtype="<u8")
        # The host tier (host_blocks > 0): per layer, host_blocks pages; its own tag array; its layout.
        self._host_pages: list[np.ndarray] = []
        self._host_tags = np.zeros((0, 2), dtype="<u8")
        self._host_layout: KvLayout | None = None
        self._device_pages: list[np.ndarray] = []  # each layer's KV as a (blocks, page bytes) view, for host copies
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._report = KvdirWorkerMeta()
        self._peers = _PeerCache(self.s, self.node_id)  # the sources' sessions and layouts, kept fresh off the engine step
        self._orphans: list[np.ndarray] = []  # destinations of abandoned reads (see `_pull`)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register the KV memory and the tag array with the transfer engine; describe them as regions."""
        layers = []
        spans = []
        for name, t in kv_caches.items():
            page = t[0].numel() * t.element_size()
            stride = t.stride(0) * t.element_size()
            if stride != page or not t[0].is_contiguous():
                raise RuntimeError(f"KvdirConnector: layer {name}'s blocks are not contiguous pages ({stride} vs {page} B)")
            layers.append(LayerRegion(t.data_ptr(), page, t.shape[0]))
            spans.append((t.data_ptr(), t.data_ptr() + page * t.shape[0]))
        self.rank = get_tensor_model_parallel_rank()
        self._tags = np.zeros((min(r.num_blocks for r in layers), 2), dtype="<u8")
        self._layout = KvLayout(tuple(layers), self._tags.ctypes.data)
        self.fingerprint = self.kv_fingerprint(self._layout)  # what a pull's source must have registered
        with _unpinned():  # the transfer engine's threads inherit this thread's CPUs
            self._transfer = create_engine(self.s.transfer, self.s.transfer_host, timeout_s=self.s.transfer_timeout_s)
        spans.sort()
        merged = [list(spans[0])]
        for lo, hi in spans[1:]:
            if lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        for lo, hi in merged:
            self._transfer.register(lo, hi - lo)
        self._transfer.register(self._tags.ctypes.data, self._tags.nbytes)
        if self.s.host_blocks:
            self._register_host_tier(list(kv_caches.values()), layers)
        self._peers.start()
        log.info(
            "kvdir connector: TP rank %d: %d layers, %d blocks registered at %s",
            self.rank,
            len(layers),
            self._tags.shape[0],
            self._transfer.session,
        )

    def _register_host_tier(self, tensors: list[torch.Tensor], layers: list[LayerRegion]) -> None:
        """Allocate the host tier (each layer's pages and a tag array, pages touched now as the device's are) and
        register it with the transfer engine; the device's pages as byte views, to copy blocks out and back."""
        assert self._transfer is not None
        n = self.s.host_blocks
        self._device_pages = [t.view(torch.uint8).reshape(t.shape[0], -1).numpy() for t in tensors]
        self._host_pages = [np.zeros((n, r.page_bytes), dtype=np.uint8) for r in layers]
        self._host_tags = np.zeros((n, 2), dtype="<u8")
        for a in (*self._host_pages, self._host_tags):
            self._transfer.register(a.ctypes.data, a.nbytes)
        self._host_layout = KvLayout(
            tuple(LayerRegion(a.ctypes.data, r.page_bytes, n) for a, r in zip(self._host_pages, layers)),
            self._host_tags.ctypes.data,
        )

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._transfer is None or self._layout is None:
            return None
        return KvdirHandshake(self._transfer.session, self._layout, self._host_layout)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward pass: blocks about to be written lose their hash and get a new generation."""
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KvdirMeta)
        if connector_metadata.written:
            idx = np.asarray(connector_metadata.written, dtype=np.int64)
            self._tags[idx, 0] = 0
            self._tags[idx, 1] += 1

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvdirMeta)
        for hl in meta.host_loads:
            bad = self._load_host(hl)
            self._report.host_loaded += hl.dst_blocks
            if bad:
                self._load_errors.update(bad)
                self._failed_reqs.add(hl.req_id)
                self._report.host_failed += bad
        for load in meta.loads:
            try:
                bad = self._pull(load)
            except Exception:  # a bug in the load path (not a failed read: `_pull` handles those) must not kill the
                # worker, which would take the engine and every request on it down: recompute this request instead
                log.exception(
                    "pull of %d blocks from %s failed unexpectedly; recomputing", len(load.dst_blocks), load.source_node
                )
                bad = list(load.dst_blocks)
            self._report.loaded += load.dst_blocks
            if bad:
                self._load_errors.update(bad)
                self._failed_reqs.add(load.req_id)
                self._report.failed += bad
                self._report.failed_reqs.append(load.req_id)

    def _pull(self, load: Load) -> list[int]:
        """Read the load's pages (tags, pages, tags) into a staging buffer, copy them into the destination
        blocks; the destination blocks that are not known good.

        Staged, because a read the transfer engine's watchdog abandoned may still write into its destination
        until Mooncake gives up (kvtransfer.mooncake.MooncakeEngine): written into the KV blocks, it could land
        after vLLM recomputed them. The buffers of an abandoned read are kept alive until none is in flight.
        """
        assert self._transfer is not None and self._layout is not None
        if self._orphans and not getattr(self._transfer, "abandoned_in_flight", 0):
            self._orphans.clear()
        n = len(load.src_slots)
        tags = np.zeros((2, n, 2), dtype="<u8")
        staging = np.empty(0, dtype=np.uint8)
        try:
            peer = self._peers.get(load.source_node, load.source_epoch)
            if peer is None:
                raise PlanError(f"{load.source_node} epoch {load.source_epoch} is not registered (as last seen)")
            sessions, layouts, fingerprint, host, refusal = peer
            if refusal is not None:  # a shared engine reads only shared sources, a tenant's its own and shared ones
                raise PlanError(refusal)
            if fingerprint != self.fingerprint:  # another model's, revision's or layout's KV (docs/protocol.md §2.1)
                raise PlanError(
                    f"{load.source_node} registered KV fingerprint {fingerprint}, not this engine's {self.fingerprint}"
                )
            if len(layouts) != self.tp_size:  # its heads are sliced over another rank count (docs/protocol.md §2.2)
                raise PlanError(f"{load.source_node} has {len(layouts)} TP ranks, this engine {self.tp_size}")
            session = sessions[self.rank]  # rank r reads the holder's rank r
            if session is None:
                raise PlanError(f"{load.source_node}'s rank {self.rank} registered no transfer session")
            # The plan's locations (docs/protocol.md §2.3): each block read from the source's tier it names, the
            # tiers' pieces in one batch per read.
            by_tier: dict[int, list[int]] = {}
            for i, loc in enumerate(load.src_slots):
                by_tier.setdefault(loc >> media.SHIFT, []).append(i)
            first: tuple[list[int], list[int], list[int]] = ([], [], [])
            again: tuple[list[int], list[int], list[int]] = ([], [], [])
            dst, src, lengths = [], [], []
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
                    for acc, part in zip(
                        out, coalesce([tags[k].ctypes.data + TAG_BYTES * i for i in idx], t_remote, [TAG_BYTES] * len(idx))
                    ):
                        acc += part
                d, r, n_ = page_pieces(self._layout, theirs, [load.dst_blocks[i] for i in idx], slots)
                dst += d
                src += r
                lengths += n_
            staging = np.empty(sum(lengths), dtype=np.uint8)
            staged = [staging.ctypes.data + off for off in itertools.accumulate(lengths, initial=0)][:-1]
            t0 = time.perf_counter()
            with _unpinned():  # each read runs (and busy-waits) on a thread started from this one
                self._transfer.read(session, *first)
                self._transfer.read(session, staged, src, lengths)
                self._transfer.read(session, *again)
            rank = self.rank
            self._report.read_s[rank] = self._report.read_s.get(rank, 0.0) + time.perf_counter() - t0
            self._report.read_bytes[rank] = self._report.read_bytes.get(rank, 0) + sum(lengths)
        except Exception as exc:  # any failure, expected (these four) or not, is a recompute (start_load_kv)
            if getattr(self._transfer, "abandoned_in_flight", 0):
                self._orphans += [tags, staging]
            if isinstance(exc, (TransferError, PlanError, DirectoryError, TimeoutError)):
                log.warning("pull of %d blocks from %s failed: %s; recomputing", len(load.dst_blocks), load.source_node, exc)
            else:
                log.exception("pull of %d blocks from %s failed: %r; recomputing", len(load.dst_blocks), load.source_node, exc)
            return list(load.dst_blocks)
        for to, frm, size in zip(dst, staged, lengths):
            ctypes.memmove(to, frm, size)
        before = [tuple(int(x) for x in row) for row in tags[0]]
        after = [tuple(int(x) for x in row) for row in tags[1]]
        bad = check_tags(load.hashes, before, after)  # type: ignore[arg-type]
        if bad:
            log.info("pull from %s: %d of %d blocks stale; recomputing them", load.source_node, len(bad), n)
        return [load.dst_blocks[i] for i in bad]

    def _load_host(self, hl: HostLoad) -> list[int]:
        """Copy a request's blocks back from the host tier (tags, pages, tags: a peer may be reading, never
        writing; this worker writes host slots only after the forward pass); the destination blocks not known good."""
        slots = np.asarray(hl.host_slots, dtype=np.int64)
        before = [tuple(int(x) for x in row) for row in self._host_tags[slots]]
        for dev, host in zip(self._device_pages, self._host_pages):
            dev[hl.dst_blocks] = host[slots]
        after = [tuple(int(x) for x in row) for row in self._host_tags[slots]]
        bad = check_tags(hl.hashes, before, after)  # type: ignore[arg-type]
        if bad:
            log.info("host-tier load: %d of %d blocks stale; recomputing them", len(bad), len(slots))
        return [hl.dst_blocks[i] for i in bad]

    def _save_host(self, saves: list[tuple[int, int, int]]) -> None:
        """Copy complete device blocks into their host slots under the seqlock: hash zeroed and generation bumped,
        pages, then the hash."""
        blocks = np.asarray([b for b, _, _ in saves], dtype=np.int64)
        slots = np.asarray([s for _, s, _ in saves], dtype=np.int64)
        self._host_tags[slots, 0] = 0
        self._host_tags[slots, 1] += 1
        for dev, host in zip(self._device_pages, self._host_pages):
            host[slots] = dev[blocks]
        self._host_tags[slots, 0] = np.asarray([h for _, _, h in saves], dtype="<u8")

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        """After the forward pass: the blocks complete now get their hash (not those of a request whose pull failed)."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvdirMeta)
        done = [(b, h) for rid, b, h in meta.complete if rid not in self._failed_reqs]
        for b, h in done:
            self._tags[b, 0] = h
        self._report.complete += done
        if meta.saves and self._host_pages:
            ok = [(b, slot, h) for rid, b, slot, h in meta.saves if rid not in self._failed_reqs]
            if ok:
                self._save_host(ok)
            self._report.saved += [(h, slot) for _, slot, h in ok]
            self._report.unsaved += [(h, slot) for rid, _, slot, h in meta.saves if rid in self._failed_reqs]
        self._failed_reqs.clear()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report, self._report = self._report, KvdirWorkerMeta()
        if not (report.complete or report.loaded or report.saved or report.unsaved or report.host_loaded):
            return None
        return report

    def shutdown(self) -> None:
        if getattr(self, "_peers", None) is not None:
            self._peers.stop()
        if getattr(self, "_transfer", None) is not None:
            assert self._transfer is not None
            self._transfer.close()
