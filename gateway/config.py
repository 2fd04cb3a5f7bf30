"""Settings of the gateway (`kvdir gateway`): every field a flag and a KVDIR_* env var."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from directory.config import DirectoryClientSettings, HostPort, url_list


class GatewaySettings(DirectoryClientSettings):
    """The OpenAI-compatible affinity gateway."""

    model_config = SettingsConfigDict(env_prefix="KVDIR_", extra="forbid")

    http: HostPort = Field("127.0.0.1:8100", description="HOST:PORT the OpenAI-compatible API listens on")
    engine: str = Field("", description="comma-separated URLs of engines that do not register with the directory")
    policy: str = Field("kvdir", description="kvdir, round_robin, least_loaded, sglang, dynamo or local_only")
    tokenizer: str = Field("bytes", description="the engines' tokenizer: 'bytes' (UTF-8 bytes), a tokenizer.json path, or 'engine' (ask an engine's /tokenize)")
    namespace: str = Field("", description="hash namespace (model, LoRA, tenant): must match the engines'")
    block_size: int = Field(16, ge=1, le=4096, description="tokens per KV block: must match the engines'")
    prefill_tokens_per_s: float = Field(10_000.0, gt=0, description="engines' prefill rate, for the TTFT estimate")
    link_gbps: float = Field(2.0, gt=0, description="measured pull bandwidth between engines in GB/s (kvdir bench worker)")
    pull_setup_ms: float = Field(2.0, ge=0, description="fixed cost of one pull (handshake, lookup)")
    max_running: int = Field(32, ge=1, description="engines' concurrency, for the queueing estimate")
    refresh_s: float = Field(0.5, gt=0, le=60, description="how often the engine list and loads are read from the directory")
    lookup_timeout_s: float = Field(0.25, gt=0, description="a directory lookup slower than this is abandoned (route by load)")
    request_timeout_s: float = Field(600.0, gt=0, description="limit for one upstream request")
    unhealthy_s: float = Field(5.0, ge=0, description="how long an engine that refused a connection is skipped")
    seed: int = Field(0, description="seed of the policies' random tie-breaks")
    log_level: str = Field("info", description="debug, info, warning or error")



    @property
    def static_engines(self) -> list[str]:
        return url_list(self.engine)
