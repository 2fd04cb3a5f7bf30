"""The replay simulator's parameters (`SimParams`), apart so that the model's modules and the report share them.

`kvdir.replay.sim` re-exports everything here; its docstring describes the
model these parameters drive.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gateway.policy import CostModel

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
    capacity_blocks: int = 3000  # per node
    block_tokens: int = 512
    prefill_tokens_per_s: float = 10_000.0  # per node, one prefill at a time
    decode_tokens_per_s: float = 80.0  # per request
    max_running: int = 32  # per node
    block_bytes: int = DEFAULT_BLOCK_BYTES  # KV bytes of one block on a node (all TP ranks)
    link_bytes_per_s: float = 12.5e9  # one pull's bandwidth (100 Gb/s)
    pull_setup_s: float = 0.002
    publish_lag_s: float = 0.05  # node stores/evicts -> the router sees it
    seed: int = 0
    timeline_buckets: int = 200
    policy_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # keyword options per policy name, for make_policy

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.capacity_blocks < 1 or self.block_tokens < 1 or self.max_running < 1:
            raise ValueError("nodes, capacity_blocks, block_tokens and max_running must be >= 1")
        if min(self.prefill_tokens_per_s, self.decode_tokens_per_s, self.link_bytes_per_s) <= 0:
            raise ValueError("rates must be > 0")
        if self.block_bytes < 0 or self.pull_setup_s < 0 or self.publish_lag_s < 0:
            raise ValueError("block_bytes, pull_setup_s and publish_lag_s must be >= 0")
        if self.timeline_buckets < 1:
            raise ValueError("timeline_buckets must be >= 1")

    def cost_model(self) -> CostModel:
        """The policies' cost model, with this simulation's parameters."""
        return CostModel(
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            block_bytes=self.block_bytes,
            link_bytes_per_s=self.link_bytes_per_s,
            pull_setup_s=self.pull_setup_s,
            max_running=self.max_running,
            decode_tokens_per_s=self.decode_tokens_per_s,
        )

    def as_dict(self) -> dict[str, Any]:
        """The parameters as plain data, for the report's JSON."""
        return asdict(self)


def describe_params(p: SimParams) -> str:
    """One line with the parameters that matter, for tables."""
    return (
        f"{p.nodes} nodes x {p.capacity_blocks} blocks of {p.block_tokens} tokens, prefill "
        f"{p.prefill_tokens_per_s:g} tok/s, decode {p.decode_tokens_per_s:g} tok/s, max_running {p.max_running}, "
        f"block {p.block_bytes / 2**20:.4g} MiB, link {p.link_bytes_per_s / 1e9:g} GB/s + {p.pull_setup_s * 1e3:g} ms, "
        f"publish lag {p.publish_lag_s * 1e3:g} ms"
    )
