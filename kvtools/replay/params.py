"""The replay simulator's parameters (`SimParams`), apart so that the model's modules and the report share them.

`kvtools.replay.sim` re-exports everything here; its docstring describes the
model these parameters drive.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gateway.cost import DEFAULT_COST, CostModel
from kvtools.replay.calibration import EngineCalibration

__all__ = ["DEFAULT_BLOCK_BYTES", "SimParams", "describe_params"]

# Default KV block: 512 tokens of a Llama-3-8B-like model in bf16
# (32 layers * 8 KV heads * 128 dims * 2 (K, V) * 2 bytes = 128 KiB per token).
DEFAULT_BLOCK_BYTES = 512 * 32 * 8 * 128 * 2 * 2


@dataclass(frozen=True, slots=True)
class SimParams:
    """A simulated cluster: sizes, rates, the publish lag, the seed and the policies' options.

    Frozen so that one value can describe a whole comparison of policies (the
    report prints it once and runs every policy on it); validated here so that
    a bad flag fails before any simulation starts.
    """

    nodes: int = 8
    # Data-parallel ranks per node: each an engine of its own (its cache of capacity_blocks, its prefill, its queue),
    # a holder and a routing candidate of its own as in the gateway (docs/protocol.md §2.2).
    dp_ranks: int = 1
    capacity_blocks: int = 3000  # per engine: per node, or per DP rank
    # A host tier per engine: blocks evicted from the device live on there, loaded back on a hit at
    # host_copy_bytes_per_s, readable by peers (0: none).
    host_blocks: int = 0
    host_copy_bytes_per_s: float = 20e9
    block_tokens: int = 512
    prefill_tokens_per_s: float = 10_000.0  # per node, one prefill at a time
    decode_tokens_per_s: float = 80.0  # per request
    max_running: int = 32  # per node
    block_bytes: int = DEFAULT_BLOCK_BYTES  # KV bytes of one block on a node (all TP ranks)
    link_bytes_per_s: float = 12.5e9  # one pull's bandwidth (100 Gb/s)
    pull_setup_s: float = 0.002
    publish_lag_s: float = 0.05  # node stores/evicts -> the router sees it
    evict_scan: int = 64  # eviction looks this far from the cold end for a block another node also holds (0: plain LRU)
    displace_weight: float = DEFAULT_COST.displace_weight  # kvdir's price of what storing a request evicts (gateway.cost)
    gateways: int = 1  # gateway replicas, each routing every gateways-th request with its own policy state
    heartbeat_s: float = 0.0  # engines report their prefill backlog this often, gateways add the others' (0: off)
    # Modeled Dynamo's replica sync (NATS core, fire-and-forget): another replica applies a decision this much later
    # (0: at once, the most generous model; a few ms of delay is a sensitivity, docs/replay.md).
    replica_sync_s: float = 0.0
    # kvdir's gateways send each other a note per routing decision and prefill end (gateway.peers), delayed by
    # `replica_sync_s` like Dynamo's sync (False: each knows only its own requests, the ablation).
    share_decisions: bool = True
    seed: int = 0
    timeline_buckets: int = 200
    # The engines' measured speed under load (kvtools.replay.calibration): batched prefill shared by the running
    # prefills, decode slowed by its batch and by prefills. None: the cost model's own assumptions (FIFO prefill at
    # prefill_tokens_per_s, decode at decode_tokens_per_s in parallel).
    calibration: EngineCalibration | None = None
    # Each gateway learns its engines' TTFT curves from the TTFTs it observes, as the live gateway's
    # --ttft-learn-window (gateway.ttft_learner; 0: off, the flags' rates throughout).
    ttft_learn_window: int = 0
    policy_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # keyword options per policy name, for make_policy

    def __post_init__(self) -> None:
        if min(self.nodes, self.dp_ranks, self.capacity_blocks, self.block_tokens, self.max_running, self.gateways) < 1:
            raise ValueError("nodes, dp_ranks, capacity_blocks, block_tokens, max_running and gateways must be >= 1")
        if min(self.prefill_tokens_per_s, self.decode_tokens_per_s, self.link_bytes_per_s, self.host_copy_bytes_per_s) <= 0:
            raise ValueError("rates must be > 0")
        if self.host_blocks < 0:
            raise ValueError("host_blocks must be >= 0")
        if min(self.block_bytes, self.pull_setup_s, self.publish_lag_s, self.heartbeat_s, self.replica_sync_s) < 0:
            raise ValueError("block_bytes, pull_setup_s, publish_lag_s, heartbeat_s and replica_sync_s must be >= 0")
        if self.evict_scan < 0 or self.displace_weight < 0:
            raise ValueError("evict_scan and displace_weight must be >= 0")
        if self.timeline_buckets < 1:
            raise ValueError("timeline_buckets must be >= 1")
        if self.ttft_learn_window < 0:
            raise ValueError("ttft_learn_window must be >= 0")

    @property
    def engines(self) -> int:
        """The engines routed to: every DP rank of every node."""
        return self.nodes * self.dp_ranks

    def cost_model(self) -> CostModel:
        """The policies' cost model, with this simulation's parameters."""
        return CostModel(
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            block_bytes=self.block_bytes,
            link_bytes_per_s=self.link_bytes_per_s,
            pull_setup_s=self.pull_setup_s,
            max_running=self.max_running,
            decode_tokens_per_s=self.decode_tokens_per_s,
            displace_weight=self.displace_weight,
            host_copy_bytes_per_s=self.host_copy_bytes_per_s,
        )

    def as_dict(self) -> dict[str, Any]:
        """The parameters as plain data, for the report's JSON."""
        return asdict(self)


def describe_params(p: SimParams) -> str:
    """One line with the parameters that matter, for tables."""
    return (
        f"{p.nodes} nodes x "
        + (f"{p.dp_ranks} DP ranks x " if p.dp_ranks > 1 else "")
        + f"{p.capacity_blocks} blocks of {p.block_tokens} tokens"
        + (f" + {p.host_blocks} host blocks ({p.host_copy_bytes_per_s / 1e9:g} GB/s)" if p.host_blocks else "")
        + ", prefill "
        f"{p.prefill_tokens_per_s:g} tok/s, decode {p.decode_tokens_per_s:g} tok/s, max_running {p.max_running}, "
        f"block {p.block_bytes / 2**20:.4g} MiB, link {p.link_bytes_per_s / 1e9:g} GB/s + {p.pull_setup_s * 1e3:g} ms, "
        f"publish lag {p.publish_lag_s * 1e3:g} ms, eviction scan {p.evict_scan}, displace weight {p.displace_weight:g}, {p.gateways} gateway(s), heartbeat {p.heartbeat_s:g} s, replica sync {p.replica_sync_s * 1e3:g} ms"
        + ("" if p.share_decisions or p.gateways == 1 else ", kvdir gateways share no decisions")
        + (f", TTFT learned (window {p.ttft_learn_window})" if p.ttft_learn_window else "")
        + (f"; engines calibrated ({_calibrated(p.calibration)})" if p.calibration is not None else "")
    )


def _calibrated(c: EngineCalibration) -> str:
    rates = ", ".join(f"{n}: {r:.0f}" for n, r in zip(c.prefill_running, c.prefill_tokens_per_s, strict=True))
    return (
        f"prefill tok/s by running prefills {{{rates}}}, overhead {c.overhead_s * 1e3:.0f} ms, decode "
        f"{c.decode_token_s[0] * 1e3:.1f}-{c.decode_token_s[-1] * 1e3:.1f} ms/token, x{c.prefill_slowdown:.2f} beside a prefill"
    )
