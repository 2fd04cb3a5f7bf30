"""Everything a running gateway holds between its start and its stop, as one typed object.

`GatewayRuntime.start` builds it when the app starts (its lifespan) and
`stop` closes it when the app stops; in between it is `app.state.runtime`,
which the routes read through `runtime(request)`, never attribute by attribute.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx
from fastapi import Request

from gateway.config import GatewaySettings
from gateway.engine_load import LoadScraper
from gateway.engine_registry import EngineRegistry
from gateway.metrics import GatewayMetrics
from gateway.mirror import Mirror
from gateway.models_list import ModelsList
from gateway.peers import PeerBounds, PeerNotes
from gateway.policy import Policy
from gateway.proxy import Proxy
from gateway.router import Router
from gateway.status import StatusBoard
from gateway.tokenizer_parity import ParityProbe
from gateway.tokenizers import GatewayTokenizer, Local
from gateway.upstream import Upstream
from kvproto.client import DirectoryClient
from kvproto.index import warm_up

log = logging.getLogger("kvdir.gateway")


@dataclass(frozen=True, slots=True)
class GatewayRuntime:
    """The gateway's clients, background tasks and request path, built once per app start."""

    settings: GatewaySettings
    directory: DirectoryClient
    http: httpx.AsyncClient  # the engines' /v1/models and /tokenize (the forward uses `upstream`)
    registry: EngineRegistry
    metrics: GatewayMetrics
    mirror: Mirror | None
    peers: PeerNotes
    status: StatusBoard
    upstream: Upstream
    proxy: Proxy
    models: ModelsList
    tokenizer: GatewayTokenizer
    parity: ParityProbe
    loads: LoadScraper  # the engines' /metrics (not started with --load-scrape-s 0)

    @classmethod
    async def start(cls, settings: GatewaySettings, router: Router, policy: Policy, local: Local | None) -> GatewayRuntime:
        """Connect to the directory and the engines and start the background tasks; `local` is the tokenizer
        `--tokenizer` names for every model (None: "auto" or "engine", gateway.tokenizers.GatewayTokenizer)."""
        directory = DirectoryClient(
            settings.directory_urls,
            timeout=1.0,
            deadline=settings.lookup_timeout_s,
            token=settings.directory_token,
            tenant=settings.tenant,
        )
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=32)
        http = httpx.AsyncClient(timeout=httpx.Timeout(settings.request_timeout_s, connect=2.0), limits=limits)
        registry = EngineRegistry(
            directory,
            http,
            settings.static_engines,
            settings.refresh_s,
            settings.unhealthy_s,
            settings.networks,
            settings.tenant,
            settings.block_size,
        )
        registry.on_gone = policy.on_engine_gone
        metrics = GatewayMetrics(registry)
        await registry.refresh()
        registry.start(metrics.tasks.failed("engine_refresh"))
        loads = LoadScraper(registry.engines, http, settings.load_scrape_s)
        if settings.load_scrape_s > 0:
            loads.start(metrics.tasks.failed("engine_load"))
        mirror = await _start_mirror(settings, directory)
        metrics.watch_mirror(mirror)
        peers = _peer_notes(settings, registry, metrics, policy)
        peers.start(metrics.tasks.failed("peer_expiry"))
        status = StatusBoard(metrics, registry, directory, settings.policy, mirror, peers, learner=router.learner)
        status.start()
        # An idle connection is dropped after 4 s, before an engine's server drops it (uvicorn, and vLLM on it:
        # 5 s): one closed by the engine as a request goes out would fail a request the engine never saw.
        upstream = Upstream(keepalive_s=4.0)
        proxy = Proxy(
            router=router,
            registry=registry,
            directory=directory,
            upstream=upstream,
            request_timeout_s=settings.request_timeout_s,
            metrics=metrics,
            lookup_timeout_s=settings.lookup_timeout_s,
            mirror=mirror,
            peers=peers,
            mirror_stale_lag_s=settings.mirror_stale_lag_s,
        )
        tokenizer = GatewayTokenizer(settings.tokenizer, registry, http, local, settings.tokenize_cache_entries)
        parity = ParityProbe(registry, tokenizer, metrics.registry, settings.refresh_s)
        parity.start(metrics.tasks.failed("tokenizer_parity"))
        models = ModelsList(registry, http)
        log.info("gateway on %s, policy %s, %d engines known", settings.http, settings.policy, len(registry.engines))
        return cls(
            settings, directory, http, registry, metrics, mirror, peers, status, upstream, proxy, models, tokenizer, parity, loads
        )

    async def stop(self) -> None:
        """Stop the background tasks, then close the connections they used."""
        await self.parity.stop()
        await self.loads.stop()
        await self.status.stop()
        await self.peers.stop()
        if self.mirror is not None:
            await self.mirror.stop()
        await self.registry.stop()
        await self.upstream.aclose()
        await self.http.aclose()
        await self.directory.aclose()

    def max_prompt_tokens(self) -> int:
        """The longest prompt taken: the largest `max_model_len` the engines report, else `--max-prompt-tokens`."""
        return self.registry.max_model_len or self.settings.max_prompt_tokens


async def _start_mirror(settings: GatewaySettings, directory: DirectoryClient) -> Mirror | None:
    """The directory mirror, started (None when it is off, or when the gateway serves a tenant)."""
    if not settings.mirror:
        return None
    if settings.tenant:
        log.info("directory mirror off: keys of tenant %r are known to the replicas only (REST lookups)", settings.tenant)
        return None
    # The index kernels the mirror runs, loaded now: startup's end freezes what they built (kvproto.heap).
    await asyncio.to_thread(warm_up)
    # One feed per shard of a sharded directory (the map is read with `directory`), else one on these URLs.
    mirror = Mirror(settings.directory_urls, settings.directory_token, settings.mirror_max_lag_s, directory=directory)
    mirror.start()
    return mirror


def _peer_notes(settings: GatewaySettings, registry: EngineRegistry, metrics: GatewayMetrics, policy: Policy) -> PeerNotes:
    """The notes this gateway exchanges with its peers (gateway.peers; none without `--peers`), not started."""
    return PeerNotes(
        registry,
        settings.peer_urls,
        token=settings.peer_token,
        bounds=PeerBounds(
            ttl_s=settings.peer_note_ttl_s,
            max_notes=settings.peer_max_notes,
            max_sender_notes=settings.peer_max_sender_notes,
            max_senders=settings.peer_max_senders,
            note_rate=settings.peer_note_rate,
            max_prompt_tokens=settings.max_prompt_tokens,
            max_engine_tokens=settings.peer_engine_tokens,
        ),
        queue_size=settings.peer_queue,
        timeout_s=settings.peer_timeout_s,
        metrics=metrics.registry,
        on_note=policy.on_peer_routed,
    )


def runtime(request: Request) -> GatewayRuntime:
    """The running gateway serving `request` (set by the app's lifespan)."""
    rt: GatewayRuntime = request.app.state.runtime
    return rt
