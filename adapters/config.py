"""Settings of an engine adapter (`kvdir events`): one pydantic-settings class, every field a flag and a KVDIR_* env var."""

from __future__ import annotations

import json
from operator import attrgetter
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from kvproto.addresses import HostPort
from kvproto.client_settings import DirectoryClientSettings
from kvproto.logs import LogLevel
from kvproto.schemas import NODE_ID_MAX_LEN, NODE_ID_PATTERN


class EngineSpec(BaseModel):
    """One engine of `--engines`: unset `bind`, `topic` and `model` take the process's `--bind`, `--topic` and `--model`."""

    model_config = ConfigDict(extra="forbid")

    engine_url: str = Field(min_length=1)
    zmq: str = Field(min_length=1)
    bind: bool | None = None
    replay: str | None = None
    topic: str | None = None
    node_id: str | None = Field(None, min_length=1, max_length=NODE_ID_MAX_LEN, pattern=NODE_ID_PATTERN)
    model: str | None = Field(None, min_length=1, max_length=256)


_SPECS = TypeAdapter(list[EngineSpec])


def read_engines(value: str) -> list[EngineSpec]:
    """`--engines`: a JSON list, inline (it starts with '[') or in the file it names, with messages that say what is wrong."""
    where = ""
    if not value.lstrip().startswith("["):
        where = f"in the file {value}: "
        try:
            value = Path(value).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the engines file: {exc}") from exc
    try:
        raw = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}not JSON ({exc})") from exc
    try:
        specs = _SPECS.validate_python(raw)
    except ValidationError as exc:
        problems = "; ".join(f"engine {'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"{where}{problems}") from None
    if not specs:
        raise ValueError(f"{where}an empty list (give at least one engine)")
    for i, spec in enumerate(specs):
        if not _node_of(spec):
            raise ValueError(f"{where}engine {i}: cannot derive a node id from engine_url {spec.engine_url!r}; give node_id")
    return specs


def _node_of(spec: EngineSpec) -> str:
    return spec.node_id or urlparse(spec.engine_url).netloc


class EventsSettings(DirectoryClientSettings):
    """The KV-events subscriber of one engine (`kvdir events`), or of several (`--engines`) sharing the other settings."""

    model_config = SettingsConfigDict(env_prefix="KVDIR_", extra="forbid")

    engine_url: str = Field(
        "http://127.0.0.1:8000",
        min_length=1,
        description="the engine's HTTP API: registered as the node's api_url; its /health gates heartbeats",
    )
    zmq: str = Field("tcp://127.0.0.1:5557", min_length=1, description="the engine's KV events ZMQ endpoint")
    bind: bool = Field(True, description="bind the SUB socket (vLLM connects when its endpoint has no '*'); --no-bind connects")
    replay: str | None = Field(
        None, description="the engine's ZMQ replay endpoint (ROUTER), to fetch missed batches; without it a gap means a resync"
    )
    topic: str = Field("", description="ZMQ topic to subscribe to (the engine's kv-events-config topic)")
    block_size: int = Field(
        16,
        ge=1,
        le=4096,
        description="our tokens per block: must match the gateway's; the engine's block size must equal it or be a multiple",
    )
    namespace: str = Field("", max_length=200, description="hash namespace (tenant, deployment): must match the gateway's")
    model: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="the engine's model name, as requests name it: blocks are hashed under it and the node registers it "
        "(default: none, namespace-only hashes)",
    )
    node_id: str | None = Field(
        None,
        min_length=1,
        max_length=NODE_ID_MAX_LEN,
        pattern=NODE_ID_PATTERN,
        description="the engine's node id in the directory (default: ENGINE_URL's host:port)",
    )
    metrics: HostPort | None = Field(None, description="HOST:PORT to serve Prometheus metrics on (default: none)")
    heartbeat_interval_s: float = Field(
        1.0, gt=0, le=60, description="heartbeat and /health probe period (keep well under the lease TTL)"
    )
    batch_window_s: float = Field(
        0.05,
        ge=0,
        le=10,
        description="changes are gathered this long before they are sent (each request costs the directory more than 500 blocks)",
    )
    batch_max_blocks: int = Field(
        4096,
        ge=1,
        le=16384,
        description="a round carries at most this many changes, and is sent at once, before the window ends, when this many are pending",
    )
    replay_timeout_s: float = Field(2.0, gt=0, le=60, description="a replay that has not ended by then counts as failed")
    max_message_bytes: int = Field(
        32 << 20,
        ge=4096,
        le=1 << 31,
        description="the largest ZMQ message part taken from the engine (its events and replay sockets): a larger one is "
        "dropped and its sender disconnected (the engine reconnects; the batch is a gap, replayed or resynced)",
    )
    max_entries: int = Field(1 << 20, ge=1, description="engine blocks remembered (LRU): more than the engine's pool")
    log_level: LogLevel = Field("info", description="debug, info, warning, error or critical")
    engines: str | None = Field(
        None,
        description="follow several engines in this process: a JSON list (inline, or the path of a file holding it) of "
        '{"engine_url", "zmq", and optionally "replay", "node_id", "topic", "bind", "model"}; the other settings are shared. '
        "Instead of --engine-url, --zmq, --replay and --node-id",
    )

    @field_validator("engines")
    @classmethod
    def _check_engines(cls, value: str | None) -> str | None:
        """Refuse, at start, engines that would share a node id or an endpoint (each must be a node of its own)."""
        if value is None:
            return None
        specs = read_engines(value)
        for what, key in (("node id", _node_of), ("ZMQ endpoint", attrgetter("zmq")), ("replay endpoint", attrgetter("replay"))):
            seen: dict[str, int] = {}
            for i, spec in enumerate(specs):
                got = key(spec)
                if not got:
                    continue
                if got in seen:
                    hint = " (give each engine its own node_id: engines behind one URL need one)" if what == "node id" else ""
                    raise ValueError(f"engines {seen[got]} and {i} have the same {what} {got!r}{hint}")
                seen[got] = i
        return value

    @model_validator(mode="after")
    def _check(self) -> EventsSettings:
        if not self.directory_urls:
            raise ValueError("directory: at least one replica URL")
        if self.engines is None:
            if not self.node:
                raise ValueError("node_id: cannot derive one from engine_url; give --node-id")
            return self
        clash = sorted(f for f in ("engine_url", "zmq", "replay", "node_id") if f in self.model_fields_set)
        if clash:
            flags = ", ".join("--" + f.replace("_", "-") for f in clash)
            raise ValueError(f"give the engines either in --engines or with {flags}, not both")
        return self

    def per_engine(self) -> list[EventsSettings]:
        """The settings of each engine this process follows: this one, or one per `--engines` entry."""
        if self.engines is None:
            return [self]
        return [
            self.model_copy(update={"engines": None, "replay": None, "node_id": None, **spec.model_dump(exclude_none=True)})
            for spec in read_engines(self.engines)
        ]

    @property
    def node(self) -> str:
        return self.node_id or urlparse(self.engine_url).netloc

    @property
    def api_url(self) -> str:
        return self.engine_url.rstrip("/")


class ConnectorSettings(DirectoryClientSettings):
    """The vLLM connector (adapters/vllm_connector.py): `kv_connector_extra_config` keys, or KVDIR_* env vars."""

    model_config = SettingsConfigDict(env_prefix="KVDIR_", extra="forbid")

    node_id: str = Field(min_length=1, max_length=NODE_ID_MAX_LEN, pattern=NODE_ID_PATTERN, description="the engine's node id")
    api_url: str = Field(min_length=1, description="the engine's HTTP API origin (what the gateway sends requests to)")
    namespace: str = Field("", max_length=200, description="hash namespace (model, tenant): must match the gateway's")
    model: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="the model name blocks are hashed under (default: vLLM's first served name)",
    )
    fingerprint: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="KV fingerprint to register (default: a digest of the model, revision, weight files, dtypes and KV layout)",
    )
    transfer: Literal["mooncake", "tcp"] = Field("mooncake", description="KV transfer engine (kvtransfer.backends)")
    transfer_host: str = Field(
        "127.0.0.1", min_length=1, description="address the transfer engine serves this engine's KV memory on (a private one)"
    )
    transfer_timeout_s: float = Field(5.0, gt=0, le=60, description="a pull that has not finished by then fails (recompute)")
    peer_refresh_s: float = Field(
        0.5,
        gt=0,
        le=60,
        description="how often the worker re-reads the directory's node list of pull sources (off the engine step)",
    )
    pull_probe_blocks: int = Field(
        64,
        ge=0,
        le=4096,
        description="blocks a probe read of a peer's KV takes once the engine is registered, to measure its pull "
        "bandwidth before its first pull (reported from the engine's next step on; the gateway prices pulls with it); "
        "0: no probe",
    )
    heartbeat_interval_s: float = Field(1.0, gt=0, le=60, description="heartbeat period (keep well under the lease TTL)")
    publish_interval_s: float = Field(0.05, gt=0, le=10, description="new and evicted blocks are sent this often")
    metrics: HostPort | None = Field(None, description="HOST:PORT to serve the connector's Prometheus metrics on")
    host_blocks: int = Field(
        0,
        ge=0,
        le=2**30,
        description="blocks per TP rank of a host tier (0: none): every block the engine completes is copied there, "
        "published with medium host once vLLM evicts it, loaded back for the engine's own requests and readable by "
        "peers (docs/engines.md)",
    )
