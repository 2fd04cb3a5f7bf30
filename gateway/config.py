"""Settings of the gateway (`kvdir gateway`): every field a flag and a KVDIR_* env var."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from gateway.engine_registry import Network, parse_networks, parse_origin
from gateway.policy import POLICIES
from kvproto.addresses import HostPort, is_loopback, parse_hostport, url_list
from kvproto.client_settings import DirectoryClientSettings, read_secret_file
from kvproto.logs import LogLevel

# The routing policies by name: the keys of gateway.policy.POLICIES, spelt out for type checkers.
PolicyName = Literal["kvdir", "round_robin", "least_loaded", "sglang", "dynamo", "local_only"]
if set(get_args(PolicyName)) != set(POLICIES):
    raise RuntimeError(f"PolicyName {get_args(PolicyName)} differs from gateway.policy.POLICIES {tuple(POLICIES)}")


class GatewaySettings(DirectoryClientSettings):
    """The OpenAI-compatible affinity gateway."""

    model_config = SettingsConfigDict(env_prefix="KVDIR_", extra="forbid")

    http: HostPort = Field("127.0.0.1:8100", description="HOST:PORT the OpenAI-compatible API listens on")
    engine: str = Field("", description="comma-separated http(s)://HOST:PORT of engines that do not register with the directory")
    engine_networks: str = Field(
        "",
        description="comma-separated CIDRs engines must be in (e.g. 10.0.0.0/8,127.0.0.0/8); "
        "a host name is resolved once, when learned, and refused if any address is "
        "outside; empty: no restriction",
    )
    policy: PolicyName = Field("kvdir", description="routing policy: " + ", ".join(get_args(PolicyName)))
    tokenizer: str = Field(
        "auto",
        description="the engines' tokenizer: 'auto' (each model's own tokenizer files and chat template, as vLLM "
        "uses them, where this machine has them: the model name or the engine's model path as a directory, or the "
        "Hugging Face cache; never downloaded; else the engine's /tokenize), 'engine' (always an engine's "
        "/tokenize), a model directory (its files for every model), or for worker stubs 'bytes' (UTF-8 bytes) or a "
        "tokenizer.json path (the stub's chat template)",
    )
    tokenize_cache_entries: int = Field(
        256,
        ge=0,
        description="prompts remembered so that a prompt extending one (a chat's next turn, a shared system "
        "prompt) tokenizes only what follows (byte-level BPE tokenizers; others tokenize whole); 0: off",
    )
    namespace: str = Field(
        "",
        description="hash namespace (deployment, tenant; models, adapters and salts are in the KV identity): must match the engines'",
    )
    block_size: int = Field(
        16,
        ge=1,
        le=4096,
        description="tokens per KV block to hash a model's prompts in while no engine serving it registered its own "
        "(otherwise the size most of its engines registered)",
    )
    prefill_tokens_per_s: float = Field(10_000.0, gt=0, description="engines' prefill rate, for the TTFT estimate")
    decode_tokens_per_s: float = Field(
        80.0, gt=0, description="engines' decode rate per running request in tokens/s, for the queueing estimate"
    )
    link_gbps: float = Field(
        2.0,
        gt=0,
        description="pull bandwidth between engines in GB/s (kvdir bench worker), for pulls to an engine while no "
        "engine reports a measured pull_gbps (an engine that reports none is priced at the lowest any reports)",
    )
    pull_setup_ms: float = Field(2.0, ge=0, description="fixed cost of one pull (handshake, lookup)")
    host_copy_gbps: float = Field(
        20.0,
        gt=0,
        description="engines' host-to-device copy rate in GB/s, all ranks together: what loading a cached block from "
        "an engine's host tier costs (docs/protocol.md §2.3)",
    )
    disk_read_gbps: float = Field(
        2.0, gt=0, description="engines' disk-to-device rate in GB/s, all ranks together, for blocks on an engine's disk tier"
    )
    max_running: int = Field(32, ge=1, description="engines' concurrency, for the queueing estimate")
    ttft_learn_window: int = Field(
        64,
        ge=0,
        description="the TTFTs the gateway observes correct each engine's prefill rate (at its load) and fixed "
        "overhead, and the answers' lengths each model's output length, observations decaying by 1 - 1/this per "
        "later one (gateway.ttft_learner); --prefill-tokens-per-s and --output-tokens-prior are the priors; 0: off",
    )
    output_tokens_prior: int = Field(
        256,
        ge=1,
        description="output length of the requests ahead of one, for the queueing estimate, until answers of its "
        "model were observed (and a request's max_tokens, if lower)",
    )
    stay_margin_ms: float = Field(
        100.0,
        ge=0,
        description="kvdir policy: a request leaves the engine holding most of its prefix (a session's history) only "
        "for an option estimated faster by more than this and by more than --stay-margin-ratio",
    )
    stay_margin_ratio: float = Field(
        0.25,
        ge=0,
        description="kvdir policy: the fraction of the home engine's estimated TTFT another option must save to be "
        "taken instead (with --stay-margin-ms)",
    )
    displace_weight: float = Field(
        8.0,
        ge=0,
        description="kvdir policy: weight of the recompute time of what a full engine evicts to store a request "
        "(free space from the directory's node list; 0: ignore evictions)",
    )
    refresh_s: float = Field(0.5, gt=0, le=60, description="how often the engine list and loads are read from the directory")
    load_scrape_s: float = Field(
        0.25,
        ge=0,
        le=60,
        description="how often each engine's own /metrics is read for its running and waiting requests, KV cache "
        "usage and preemptions (vLLM's, SGLang's, the worker stub's): routed on while fresh, else its heartbeat's "
        "figures; 0: off (the heartbeats' figures only)",
    )
    lookup_timeout_s: float = Field(0.25, gt=0, description="a directory lookup slower than this is abandoned (route by load)")
    mirror: bool = Field(
        True,
        description="keep a mirror of the directory (GET /v1/watch) and answer lookups in-process; "
        "off, or with a --tenant, every lookup is a REST call",
    )
    mirror_max_lag_s: float = Field(
        0.5,
        gt=0,
        le=60,
        description="the mirror answers lookups while it was caught up with a fresh replica at most this long ago "
        "(default: the directory's staleness bound, its --raft-max-timeout-s); else REST lookups",
    )
    mirror_stale_lag_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="when the mirror is stale and REST lookups fail too (an election, a partition), the mirror still "
        "answers while it is at most this far behind; past it, routing by load",
    )
    request_timeout_s: float = Field(600.0, gt=0, description="limit for one upstream request")
    unhealthy_s: float = Field(5.0, ge=0, description="how long an engine that refused a connection is skipped")
    seed: int = Field(0, description="seed of the policies' random tie-breaks")
    log_level: LogLevel = Field("info", description="debug, info, warning, error or critical")
    max_prompt_tokens: int = Field(
        131072,
        ge=1,
        description="longest prompt accepted, in tokens (400 above), while no engine "
        "reports its max_model_len; then the largest one reported",
    )
    max_messages: int = Field(2048, ge=1, description="most messages in one chat completion (400 above)")
    max_body_bytes: int = Field(8 << 20, ge=1024, description="largest request body accepted (413 above)")
    peers: str = Field(
        "",
        description="comma-separated http(s)://HOST:PORT of the other gateways: each routing decision is sent to "
        "them as a note (engine, tokens to prefill), and theirs count in this gateway's view of each engine's "
        "pending prefill (gateway.peers)",
    )
    peer_token_file: Path | None = Field(
        None,
        description="file holding the bearer token peer gateways' notes must carry (and this gateway sends "
        "them); required with --peers when --http is off loopback (the gateway does not start without it); "
        "none, on loopback: the notes route is open to local users",
    )
    peer_note_ttl_s: float = Field(
        10.0, gt=0, le=600, description="a peer's note counts this long at most when its done message is lost"
    )
    peer_queue: int = Field(
        1024, ge=1, description="notes waiting to be sent, per peer; more are dropped (kvdir_gateway_peer_dropped_total)"
    )
    peer_timeout_s: float = Field(1.0, gt=0, description="limit for one POST of notes to a peer")

    peer_max_notes: int = Field(
        16384, ge=1, description="peers' notes held at most, all senders together; the oldest is dropped for a new one"
    )
    peer_max_sender_notes: int = Field(4096, ge=1, description="notes one peer (sender) may hold here at once; more are refused")
    peer_max_senders: int = Field(
        64,
        ge=1,
        description="peer senders remembered at once (one per gateway process; a sender is forgotten once it holds "
        "no note and was silent for --peer-note-ttl-s); a new one beyond is refused (429)",
    )
    peer_note_rate: float = Field(
        4096.0, gt=0, description="notes a second one peer may send (bursts of a second's worth, at least 512); 429 above"
    )
    peer_max_engine_tokens: float = Field(
        0.0,
        ge=0,
        description="tokens all peers' notes may hold on one engine; 0: --prefill-tokens-per-s x --peer-note-ttl-s "
        "(peers can make an engine look at most one note TTL busier)",
    )
    _peer_token: SecretStr | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _peer_token_from_file(self) -> GatewaySettings:
        self._peer_token = read_secret_file(self.peer_token_file, "peer token")
        host = parse_hostport(self.http)[0]
        if self.peers.strip() and self._peer_token is None and not is_loopback(host):
            raise ValueError(
                f"--peers is set and --http {self.http} is not on loopback, but there is no peer token: anyone who "
                "reaches the gateway could post peer notes that steer its routing. Give every gateway the same "
                "--peer-token-file (KVDIR_PEER_TOKEN_FILE), or listen on loopback"
            )
        if self.peer_max_sender_notes > self.peer_max_notes:
            raise ValueError(
                f"peer_max_sender_notes ({self.peer_max_sender_notes}) must be at most peer_max_notes ({self.peer_max_notes})"
            )
        return self

    @field_validator("engine")
    @classmethod
    def _engines_are_origins(cls, value: str) -> str:
        for url in url_list(value):
            parse_origin(url)
        return value

    @field_validator("engine_networks")
    @classmethod
    def _networks_parse(cls, value: str) -> str:
        parse_networks(value)
        return value

    @field_validator("peers")
    @classmethod
    def _peers_are_origins(cls, value: str) -> str:
        for url in url_list(value):
            parse_origin(url)
        return value

    @property
    def peer_urls(self) -> list[str]:
        return url_list(self.peers)

    @property
    def peer_token(self) -> SecretStr | None:
        """The token read from `peer_token_file` when the settings were read."""
        return self._peer_token

    @property
    def peer_engine_tokens(self) -> float:
        """The tokens all peers' notes may hold on one engine (`peer_max_engine_tokens`, or its default)."""
        return self.peer_max_engine_tokens or self.prefill_tokens_per_s * self.peer_note_ttl_s

    @property
    def static_engines(self) -> list[str]:
        return url_list(self.engine)

    @property
    def networks(self) -> list[Network]:
        return parse_networks(self.engine_networks)
