"""`KvdirConnector`: a vLLM (v1) KV connector that publishes block slots to kvdir and pulls prefixes from peers.

Load it with ``--kv-transfer-config '{"kv_connector": "KvdirConnector", "kv_connector_module_path":
"adapters.vllm_connector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
"kv_connector_extra_config": {"node_id": ..., "api_url": ..., "directory": ...}}'`` (keys: `ConnectorSettings`;
docs/engines.md). Only this module imports vLLM and torch.

A thin facade, as vLLM's own connectors are: vLLM builds it once per role, and it hands every call to the half of
that role. The scheduler half (adapters/connector_scheduler.py, in the EngineCore process) registers the node,
publishes and decides each request's loads; the worker half (adapters/connector_worker.py, in each TP rank's
worker process) holds the rank's KV memory and tags and runs the pulls in threads of its own. They share only what
vLLM passes between them, defined in adapters/connector_meta.py and wrapped here in vLLM's metadata classes:

* worker -> scheduler, once per TP rank: `get_handshake_metadata` carries the rank's transfer session and KV
  layout, which the scheduler half registers with the directory, every rank in one registration
  (`set_xfer_handshake_metadata`, keyed by TP rank): vLLM's own channel for exactly this, so the scheduler
  registers only once the memory it describes is registered with the transfer engines.
* scheduler -> worker, per step: a `StepPlan` (blocks written, blocks complete after it, loads, host saves).
* worker -> scheduler, per step: a `WorkerReport` per rank, merged by vLLM, and the requests whose pull is over
  (`get_finished`).

**Tensor parallelism** (docs/protocol.md §2.2). Every rank's worker holds its share of the heads at the same block
ids, so one slot list locates a block on every rank. Every rank gets the same plan: a load makes rank r read the
holder's rank r, all ranks at once, each validating its own tags. vLLM lets a loading request go on once every rank
reported it done, recomputes the union of the ranks' failed blocks on every rank, and the scheduler half publishes
only blocks every rank validated, so no rank keeps a block the others lack. Data-parallel ranks are nodes of their
own (`NODE_ID-dpR`).

**Stale slots: validation after the read** (a seqlock), not holder-side pinning: pinning would need the holder's
scheduler thread (`touch`/`free_blocks` are not thread-safe), a side channel to reach it, and keeping an idle
engine stepping, and a reader that dies would leave blocks pinned until a lease ran out. The worker half's
docstring says how the tags work. Removals come from the connector too (the scheduler half compares the published
blocks with the block pool's hashes): KV events carry no block ids, and a second registrant (`kvdir events`) would
fight over the node id, so do not run `kvdir events` for an engine with this connector.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.v1.metrics.utils import create_metric_per_engine

from adapters.config import ConnectorSettings
from adapters.connector_meta import RankHandshake, StepPlan, WorkerReport, reduce_pull_stats, summed
from adapters.connector_metrics import VLLM_COUNTERS
from adapters.connector_scheduler import SchedulerHalf
from adapters.connector_worker import WorkerHalf
from adapters.kv_identity import engine_fingerprint, served_name
from adapters.kv_memory import HostKvMemory
from adapters.vllm_plan import KvLayout
from kvtransfer.backends import create_engine

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass(slots=True)
class KvdirHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]  # vLLM is untyped for mypy here (not installed beside it)
    """A TP rank's worker, for the scheduler half to register."""

    rank: RankHandshake


@dataclass(slots=True)
class KvdirMeta(KVConnectorMetadata):  # type: ignore[misc]  # vLLM is untyped for mypy here (not installed beside it)
    """Scheduler -> worker, one step."""

    plan: StepPlan


@dataclass(slots=True)
class KvdirWorkerMeta(KVConnectorWorkerMetadata):  # type: ignore[misc]  # vLLM is untyped for mypy here (not installed beside it)
    """Worker -> scheduler, one step, of one TP rank or (aggregated by vLLM) of all."""

    report: WorkerReport

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvdirWorkerMeta)
        return KvdirWorkerMeta(self.report.merge(other.report))


@dataclass
class KvdirConnectorStats(KVConnectorStats):  # type: ignore[misc]  # vLLM is untyped for mypy here (not installed beside it)
    """The pulls that ended, as vLLM's own stats carry them: vLLM sums the TP ranks' and logs each interval's
    ("KV Transfer metrics: pulls=..., pulled_blocks=..., read_GB_per_s=...") beside its throughput line."""

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        return KvdirConnectorStats(data=summed(self.data, other.data))

    def reduce(self) -> dict[str, int | float]:
        return reduce_pull_stats(self.data)

    def is_empty(self) -> bool:
        return not self.data.get("pulls")


class KvdirPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]  # vLLM is untyped for mypy here
    """The pulls' counts on vLLM's own /metrics, a counter per `VLLM_COUNTERS` entry labelled as vLLM labels each
    engine's series, fed from the stats vLLM gathers (`KvdirConnectorStats`): what an operator who scrapes vLLM
    sees without the connector's own metrics port."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames), per_engine_labelvalues
            )
            for key, name, doc in VLLM_COUNTERS
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value > 0 and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)


def host_memory(kv_caches: dict[str, torch.Tensor]) -> HostKvMemory:
    """vLLM's CPU KV cache as byte views, one (blocks, page bytes) array per layer (no copy)."""
    pages = []
    for name, t in kv_caches.items():
        page = t[0].numel() * t.element_size()
        stride = t.stride(0) * t.element_size()
        if stride != page or not t[0].is_contiguous():
            raise RuntimeError(f"KvdirConnector: layer {name}'s blocks are not contiguous pages ({stride} vs {page} B)")
        pages.append(t.view(torch.uint8).reshape(t.shape[0], -1).numpy())
    return HostKvMemory(pages)


class KvdirConnector(KVConnectorBase_V1):  # type: ignore[misc]  # vLLM is untyped for mypy here (not installed beside it)
    """See the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        s = ConnectorSettings(**dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        self.s = s
        self.block_size = vllm_config.cache_config.block_size
        pc = vllm_config.parallel_config
        self.tp_size = pc.tensor_parallel_size
        # Each data-parallel rank is an engine core with its own cache: a node of its own (docs/protocol.md §2.2).
        # Behind one API server (vLLM's internal load balancing) the gateway names the rank in a header.
        dp = pc.data_parallel_size > 1
        rank = getattr(pc, "data_parallel_index", pc.data_parallel_rank)
        node_id = f"{s.node_id}-dp{rank}" if dp else s.node_id
        mc = vllm_config.model_config
        self._model = (mc.model, mc.revision, str(mc.dtype), str(vllm_config.cache_config.cache_dtype))
        self.scheduler: SchedulerHalf | None = None
        self.worker: WorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerHalf(
                s,
                node_id=node_id,
                block_size=self.block_size,
                tp_size=self.tp_size,
                dp_rank=rank if dp and not pc.data_parallel_external_lb else None,
                # Blocks are hashed under (namespace, this model, the request's LoRA adapter and cache salt).
                model_name=s.model or served_name(mc.served_model_name, mc.model),
                fingerprint_of=self.kv_fingerprint,
            )
        else:
            self.worker = WorkerHalf(
                s,
                node_id=node_id,
                tp_size=self.tp_size,
                fingerprint_of=self.kv_fingerprint,
                transfer_factory=lambda: create_engine(s.transfer, s.transfer_host, timeout_s=s.transfer_timeout_s),
            )

    def kv_fingerprint(self, layout: KvLayout) -> str:
        """This engine's KV fingerprint (docs/protocol.md §2.1): the setting, else a digest of its model and layout.
        Both halves compute it (the worker from its own layout), so each refuses another engine's KV."""
        if self.s.fingerprint is not None:
            return self.s.fingerprint
        model, revision, dtype, kv_dtype = self._model
        return engine_fingerprint(
            model=model,
            revision=revision,
            dtype=dtype,
            kv_cache_dtype=kv_dtype,
            block_size=self.block_size,
            page_bytes=[r.page_bytes for r in layout.layers],
            tp_size=self.tp_size,
        )

    @property
    def _sched(self) -> SchedulerHalf:
        assert self.scheduler is not None, "a scheduler-side call on the worker's connector"
        return self.scheduler

    @property
    def _work(self) -> WorkerHalf:
        assert self.worker is not None, "a worker-side call on the scheduler's connector"
        return self.worker

    # ------------------------------------------------------------------ scheduler side

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._sched.bind_pool(gpu_block_pool)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Register the node once every TP rank's worker registered its KV memory with its transfer engine."""
        handshakes = [metadata.get(rank) for rank in range(self.tp_size)]
        if sorted(metadata) != list(range(self.tp_size)) or not all(isinstance(h, KvdirHandshake) for h in handshakes):
            raise RuntimeError(
                f"KvdirConnector: a handshake from each of TP ranks 0..{self.tp_size - 1} is due, got {sorted(metadata)}"
            )
        self._sched.register([h.rank for h in handshakes], self.s.api_url)  # type: ignore[union-attr]  # checked above

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KvdirMeta(self._sched.build_connector_meta(scheduler_output, self._kv_cache_manager))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        wm = connector_output.kv_connector_worker_meta
        self._sched.update_connector_output(wm.report if isinstance(wm, KvdirWorkerMeta) else None)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._sched.request_finished(request)
        return False, None  # vLLM itself keeps a loading request's blocks until `get_finished` reports it

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work.register(host_memory(kv_caches), get_tensor_model_parallel_rank())

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        rank = self._work.handshake()
        return None if rank is None else KvdirHandshake(rank)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KvdirMeta)
        self._work.bind(connector_metadata.plan)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvdirMeta)
        self._work.start_loads(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, KvdirMeta)
            self._work.wait_for_save(meta.plan)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self._work.get_finished(finished_req_ids) or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work.load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        stats = self._work.take_stats() if self.worker is not None else None
        return None if stats is None else KvdirConnectorStats(data=stats)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvdirConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KvdirPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report = self._work.report()
        return None if report is None else KvdirWorkerMeta(report)

    # ------------------------------------------------------------------ both

    def shutdown(self) -> None:
        """The scheduler half deregisters the node (its entries go now, not when the lease ends); the worker half
        stops its readers and closes the transfer engine."""
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if self.worker is not None:
            self.worker.shutdown()
