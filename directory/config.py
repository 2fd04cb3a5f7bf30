"""Settings of a directory replica: one pydantic-settings class, every field a flag and a KVDIR_* env var."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from directory.auth import TokenTable, load_tokens
from directory.tenancy import Tenancy
from kvproto.addresses import HostPort, is_loopback, parse_hostport
from kvproto.client_settings import read_secret_file
from kvproto.logs import LogLevel
from kvproto.shardmap import ShardMap, ShardMapError
from kvproto.shardmap import load as load_shard_map


class DirectorySettings(BaseSettings):
    """One directory replica (`kvdir directory`)."""

    model_config = SettingsConfigDict(env_prefix="KVDIR_", extra="forbid")

    http: HostPort = Field("127.0.0.1:8101", description="HOST:PORT the REST API listens on")
    advertise_url: str | None = Field(None, description="URL other components reach this replica at (default http://HTTP)")
    raft: HostPort = Field("127.0.0.1:8201", description="HOST:PORT of this replica's Raft endpoint")
    peers: str = Field("", description="comma-separated Raft HOST:PORT of the other replicas")
    data_dir: Path | None = Field(
        None,
        description="directory for the Raft journal and snapshots (default: the journal in memory, snapshots in a "
        "scratch directory under TMPDIR, removed at stop: nothing survives a restart)",
    )
    fsync: bool = Field(
        True,
        description="sync the Raft journal, term and vote to disk before acting on them (survives power loss; with --data-dir)",
    )
    lease_ttl_s: float = Field(10.0, gt=0.2, le=3600, description="a node silent for this long is expired with its entries")
    write_timeout_s: float = Field(
        5.0, gt=0, le=120, description="deadline for a write to commit; then 503 (retry: writes are idempotent)"
    )
    max_body_bytes: int = Field(8 << 20, ge=1024, description="largest request body accepted (413 above)")
    max_blocks_per_publish: int = Field(16384, ge=1, description="most blocks in one publish or remove (422 above)")
    max_hashes_per_lookup: int = Field(16384, ge=1, description="most hashes (or blocks of tokens) in one lookup (422 above)")
    max_tokens_per_lookup: int = Field(1 << 20, ge=1, description="most tokens in one lookup by tokens (422 above)")
    max_regions_per_node: int = Field(
        2048,
        ge=1,
        le=16384,
        description="most memory regions in one registration (422 above): the vLLM connector registers one per layer "
        "and tag array, per TP rank and tier (an 80-layer model at TP 8 with a host tier: 1,296)",
    )
    max_registration_bytes: int = Field(
        512 << 10,
        ge=1024,
        description="largest registration, as the directory stores and lists it (its fields in compact JSON; 422 "
        "too_large above): every replica and gateway keeps each node's, and every node list carries them all "
        "(max_regions_per_node regions of 256 bytes fit)",
    )
    max_transfer_urls_per_node: int = Field(
        64,
        ge=1,
        le=65536,
        description="most distinct transfer sessions in one registration, the node's and its ranks' (422 too_many "
        "above): one per TP rank",
    )
    max_nodes: int = Field(1024, ge=1, description="most registered nodes (429 above)")
    max_entries: int = Field(20_000_000, ge=1, description="most (block, holder) entries in the index (507 above)")
    watch_buffer_bytes: int = Field(
        16 << 20,
        ge=1,
        description="bytes of committed changes kept for watchers (GET /v1/watch), about 12 per block; "
        "a watcher further behind re-snapshots",
    )
    watch_max_streams: int = Field(64, ge=1, description="most watch streams (GET /v1/watch) open on this replica (429 above)")
    watch_max_streams_per_token: int = Field(
        8, ge=1, description="most watch streams one token (one client address with auth off) may hold open (429 above)"
    )
    watch_stall_s: float = Field(
        10.0,
        gt=0,
        description="a watcher that accepts none of the next 256 KiB of its stream for this long is cut off "
        "(a slow consumer: what is buffered for it stays bounded)",
    )
    raft_password: SecretStr | None = Field(None, description="encrypts and authenticates Raft traffic (same on every replica)")
    raft_password_file: Path | None = Field(
        None, description="file holding the Raft password (e.g. a Docker or Kubernetes secret)"
    )
    insecure_raft_without_password: bool = Field(
        False,
        description="DANGEROUS: allow a Raft address off loopback without a Raft password; whoever reaches the port "
        "can then rewrite the directory",
    )
    raft_max_frame_bytes: int = Field(
        64 << 20,
        ge=1 << 20,
        description="largest Raft frame accepted from an authenticated peer (the link is dropped above); "
        "at least 4x max_body_bytes",
    )
    raft_log_compaction_bytes: int = Field(
        16 << 20,
        ge=1 << 20,
        description="compact the Raft log into a snapshot once its entries hold this many bytes "
        "(and more than the last snapshot), besides pysyncobj's 20,000 entries or 300 s",
    )
    raft_max_pending_connections: int = Field(
        16, ge=1, le=1024, description="most Raft connections waiting to identify themselves; the oldest is dropped for a new one"
    )
    auth_tokens_file: Path | None = Field(
        None,
        description="file of bearer tokens, one ROLE[@TENANT]:NODE_PATTERN:TOKEN a line (default: auth off, for loopback and dev only)",
    )
    linearizable_lookups_per_s: float = Field(
        50.0,
        ge=0,
        description="with auth on, linearizable lookups (each appends a Raft entry) each token but an admin's may make "
        "per second on this replica, in bursts of as many (at least 1); above it 429 rate_limited with Retry-After; "
        "0: no limit",
    )
    tenant_secret_file: Path | None = Field(
        None,
        description="file holding the secret that tenants' directory keys derive from (the same on every replica); "
        "needed for tokens confined to a tenant",
    )
    raft_min_timeout_s: float = Field(0.25, gt=0, description="Raft election timeout, lower bound")
    raft_max_timeout_s: float = Field(0.5, gt=0, description="Raft election timeout, upper bound")
    raft_append_period_s: float = Field(0.05, gt=0, description="Raft leader heartbeat period")
    raft_tick_s: float = Field(
        0.05,
        gt=0,
        le=1,
        description="longest the Raft thread waits for a network event between ticks; a single replica, with no "
        "peer to answer, commits a write on its next tick",
    )
    raft_connection_timeout_s: float = Field(
        3.0,
        gt=0,
        description="a Raft link silent this long is dropped and redialled; a replica stalled for less "
        "(GC, slow disk, starved CPU) rejoins without an election",
    )
    shard_map_file: Path | None = Field(
        None,
        description="JSON shard map (docs/scale-out.md): this replica's group is shard --shard of it; committed "
        "into the group when the group has no map yet (later changes: `kvdir shards apply`)",
    )
    shard: str | None = Field(None, description="the name of this replica's shard in --shard-map-file")
    log_level: LogLevel = Field("info", description="debug, info, warning, error or critical")

    _shard_map: ShardMap | None = PrivateAttr(None)
    _auth_tokens: TokenTable | None = PrivateAttr(None)
    _tenancy: Tenancy = PrivateAttr(default_factory=Tenancy)

    @field_validator("peers")
    @classmethod
    def _peers(cls, v: str) -> str:
        for p in filter(None, (x.strip() for x in v.split(","))):
            parse_hostport(p)
        return v

    @model_validator(mode="after")
    def _password_from_file(self) -> DirectorySettings:
        if self.raft_password_file is not None:
            if self.raft_password is not None:
                raise ValueError("give the Raft password or its file, not both")
            try:
                self.raft_password = SecretStr(self.raft_password_file.read_text().strip())
            except OSError as exc:
                raise ValueError(f"cannot read the Raft password file: {exc}") from exc
        return self

    @model_validator(mode="after")
    def _raft_exposure(self) -> DirectorySettings:
        if (
            self.raft_password is None
            and not is_loopback(parse_hostport(self.raft)[0])
            and not self.insecure_raft_without_password
        ):
            raise ValueError(
                f"Raft address {self.raft} is not on loopback and there is no Raft password: anyone who reaches it could "
                "rewrite the directory. Set KVDIR_RAFT_PASSWORD_FILE (the same secret on every replica), or pass "
                "--insecure-raft-without-password if the network itself is trusted"
            )
        if self.raft_max_frame_bytes < 4 * self.max_body_bytes:
            raise ValueError(
                f"raft_max_frame_bytes ({self.raft_max_frame_bytes}) must be at least 4x max_body_bytes "
                f"({self.max_body_bytes}): a Raft entry holds whole requests"
            )
        return self

    @model_validator(mode="after")
    def _auth_from_files(self) -> DirectorySettings:
        if self.auth_tokens_file is not None:
            self._auth_tokens = load_tokens(self.auth_tokens_file)
        secret = read_secret_file(self.tenant_secret_file, "tenant secret")
        if secret is not None:
            self._tenancy = Tenancy(secret.get_secret_value().encode())
        elif self._auth_tokens is not None and self._auth_tokens.confined:
            # With public tenant keys a confined token could compute another tenant's keys (directory.tenancy).
            raise ValueError("tokens confined to a tenant need a tenant secret (tenant_secret_file, the same on every replica)")
        return self

    @model_validator(mode="after")
    def _shard_map_from_file(self) -> DirectorySettings:
        if (self.shard_map_file is None) != (self.shard is None):
            raise ValueError("give both --shard-map-file and --shard (a sharded directory), or neither")
        if self.shard_map_file is not None:
            try:
                self._shard_map = load_shard_map(self.shard_map_file)
            except ShardMapError as exc:
                raise ValueError(str(exc)) from exc
            if self.shard not in self._shard_map.shards:
                raise ValueError(
                    f"shard {self.shard!r} is not in the shard map {self.shard_map_file} ({list(self._shard_map.names)})"
                )
        return self

    @property
    def shard_map(self) -> ShardMap | None:
        """The map read from `shard_map_file` at start: what a group without a map commits first."""
        return self._shard_map

    @property
    def auth_tokens(self) -> TokenTable | None:
        """The tokens read from `auth_tokens_file` when the settings were read; None: auth is off."""
        return self._auth_tokens

    @property
    def tenancy(self) -> Tenancy:
        """Tenants' directory keys, from `tenant_secret_file` when the settings were read (public keys without it)."""
        return self._tenancy

    @property
    def peer_list(self) -> list[str]:
        return [p.strip() for p in self.peers.split(",") if p.strip()]

    @property
    def url(self) -> str:
        return self.advertise_url or f"http://{self.http}"
