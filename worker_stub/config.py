"""Settings of a worker stub (`kvdir worker`): every field a flag and a KVDIR_* env var.

Time-model defaults are grounded in public figures for an 8B model on one
H100 with vLLM: prefill runs at roughly 10-20k tokens/s on long prompts, so
10,000 tokens/s here; a single sequence decodes at roughly 60-100 tokens/s,
so 80 tokens/s; engines batch a few dozen sequences, so 32 run at once.
"""

from __future__ import annotations

import json
from typing import Literal, get_args

import xxhash
from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from kvproto.addresses import HostPort, is_wildcard
from kvproto.client_settings import DirectoryClientSettings
from kvproto.logs import LogLevel
from kvproto.schemas import NODE_ID_MAX_LEN, NODE_ID_PATTERN
from kvtransfer.backends import ENGINES

# The KV transfer engines by name: the keys of kvtransfer.backends.ENGINES, spelt out for type checkers.
TransferName = Literal["mooncake", "tcp"]
if set(get_args(TransferName)) != set(ENGINES):
    raise RuntimeError(f"TransferName {get_args(TransferName)} differs from kvtransfer.backends.ENGINES {tuple(ENGINES)}")


class WorkerSettings(DirectoryClientSettings):
    """One stand-in GPU engine."""

    model_config = SettingsConfigDict(env_prefix="KVDIR_", extra="forbid")

    node_id: str = Field(
        "worker-1",
        min_length=1,
        max_length=NODE_ID_MAX_LEN,
        pattern=NODE_ID_PATTERN,
        description="this node's id in the directory",
    )
    http: HostPort = Field("127.0.0.1:8111", description="HOST:PORT the OpenAI-compatible API listens on")
    advertise_url: str | None = Field(None, description="URL the gateway reaches this worker at (default http://HTTP)")
    model: str = Field("kvdir-stub", min_length=1, max_length=256, description="the model name served")
    adapters: str = Field(
        "", description="comma-separated LoRA adapter names served besides the model (each its own KV identity)"
    )
    shared: bool = Field(False, description="register as shared: every tenant's gateway routes to it (a token of no tenant)")
    model_revision: str = Field(
        "", max_length=128, description="the weights' revision: a new one is a new KV fingerprint (its old KV is never pulled)"
    )
    fingerprint: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="KV fingerprint to register (default: a digest of model, revision, block size, block bytes and tp)",
    )
    max_model_len: int = Field(131072, ge=16, description="longest prompt + completion, in tokens")
    max_body_bytes: int = Field(8 << 20, ge=1024, description="largest request body accepted (413 above)")
    tokenizer: str = Field("bytes", description="'bytes' (UTF-8 bytes as tokens) or a tokenizer.json path")
    namespace: str = Field(
        "",
        description="hash namespace (deployment, tenant; models, adapters and salts are in the KV identity): must match the gateway's",
    )
    block_size: int = Field(16, ge=1, le=4096, description="tokens per KV block: must match the gateway's")
    capacity_blocks: int = Field(4096, ge=1, le=2**30, description="KV slots per TP rank")
    block_bytes: int = Field(16384, ge=64, description="bytes of one block on one rank")
    host_blocks: int = Field(
        0,
        ge=0,
        le=2**30,
        description="slots per TP rank of a host tier: blocks evicted from the device pool are kept there, published "
        "with medium host, loaded back on a hit and readable by peers (0: none)",
    )
    host_copy_gbps: float = Field(
        20.0,
        gt=0,
        description="simulated host-to-device copy rate of a block loaded from the host tier, all ranks together, GB/s "
        "(gigabytes): match the gateway's --host-copy-gbps",
    )
    tp: int = Field(
        1, ge=1, le=64, description="tensor-parallel ranks (one memory region and transfer engine each, mirrored slots)"
    )
    dp: int = Field(
        1,
        ge=1,
        le=64,
        description="data-parallel ranks behind this API, each an engine, pool and node of its own (NODE_ID-dpR, "
        "named by X-data-parallel-rank)",
    )
    prefill_tokens_per_s: float = Field(10_000.0, gt=0, description="simulated prefill rate of uncached tokens")
    decode_tokens_per_s: float = Field(80.0, gt=0, description="simulated decode rate of one sequence")
    prefill_contention: float = Field(
        0.0,
        ge=0,
        description="each other request running here slows a prefill by this fraction, as an engine that batches "
        "prefills with decodes does (0: the full rate whatever the load)",
    )
    max_running: int = Field(32, ge=1, description="requests served at once; more wait in a queue")
    max_queue: int = Field(1024, ge=0, description="requests waiting beyond max_running (429 above)")
    time_scale: float = Field(1.0, ge=0, description="multiplies every simulated duration (0: no waiting)")
    transfer: TransferName = Field("mooncake", description="KV transfer engine: " + " or ".join(get_args(TransferName)))
    transfer_host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="address (or name) the transfer engine listens on "
        "and advertises: whoever reaches it can read this worker's KV memory (mooncake: also overwrite)",
    )
    pull_probe_blocks: int = Field(
        64,
        ge=0,
        le=4096,
        description="blocks per TP rank a probe read of a peer's KV memory takes, to measure this engine's pull "
        "bandwidth before its first pull (the gateway prices pulls with it); 0: no probe, the first pull is priced "
        "at the gateway's --link-gbps or its peers' figures",
    )
    publish_interval_s: float = Field(0.01, gt=0, le=10, description="how often new and evicted blocks are published")
    heartbeat_interval_s: float = Field(1.0, gt=0, description="heartbeat period (keep well under the lease TTL)")
    log_level: LogLevel = Field("info", description="debug, info, warning, error or critical")

    @field_validator("transfer_host")
    @classmethod
    def _specific_transfer_host(cls, v: str) -> str:
        """Peers are told this address: a wildcard would reach nobody, and would serve the KV pool on every interface."""
        if is_wildcard(v):
            raise ValueError(f"{v!r} is a wildcard address: give the one address peers reach this worker's transfer engine at")
        return v

    @property
    def url(self) -> str:
        return self.advertise_url or f"http://{self.http}"

    @property
    def adapter_names(self) -> list[str]:
        return [a.strip() for a in self.adapters.split(",") if a.strip()]

    @property
    def kv_fingerprint(self) -> str:
        """What makes this stub's KV interchangeable with a peer's (docs/protocol.md §2.1): equal only between
        stubs of the same model, revision and layout."""
        if self.fingerprint is not None:
            return self.fingerprint
        parts = [self.model, self.model_revision, self.block_size, self.block_bytes, self.tp]
        return "stub-" + xxhash.xxh3_64_hexdigest(json.dumps(parts).encode())

    @field_validator("adapters")
    @classmethod
    def _adapter_names(cls, v: str) -> str:
        names = [a.strip() for a in v.split(",") if a.strip()]
        if any(len(a) > 256 for a in names):
            raise ValueError("adapter names are at most 256 characters")
        return v

    @model_validator(mode="after")
    def _rank_node_ids_fit(self) -> WorkerSettings:
        """With `--dp N` each rank is node `NODE_ID-dpR`: that id must be a valid node id too."""
        if self.dp > 1 and len(self.node_id) + len(f"-dp{self.dp - 1}") > NODE_ID_MAX_LEN:
            raise ValueError(f"node_id: at most {NODE_ID_MAX_LEN - len(f'-dp{self.dp - 1}')} characters with dp {self.dp}")
        return self
