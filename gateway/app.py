"""The gateway: an OpenAI-compatible reverse proxy that routes by cached prefix and estimated TTFT.

For each completion it tokenizes and hashes the prompt (as the engines do),
asks the directory which engines hold how much of it (with slots), lets the
routing policy pick an engine (and, for an engine that can pull, a pull plan
from the holder's memory), and forwards the request body unchanged apart from
that plan. Responses stream through as they come. A connection failure before
any byte was received is retried on the next-best engine. When the directory
is unreachable, requests are routed by load alone (decision `fallback`): a
request never fails because the directory is down.

Response headers say what happened: `x-kvdir-node`, `x-kvdir-decision`,
`x-kvdir-predicted-cached-tokens`.

This module is the FastAPI wiring: routes, middleware, metrics and lifespan;
the request shapes, their parsing and size checks are kvproto.openai_api's
(shared with the worker stub, so both answer a bad request alike). Choosing the engine is gateway.router (pure:
request -> candidates -> decision); sending, retrying, streaming and counting
the gateway's own load on each engine is gateway.proxy.

Sizes are checked before the work they would cost: the body's length from its
header (413), the length of a token-array prompt and the number of chat
messages from one allocation-light scan of the raw JSON (400), a string
prompt's length in characters against what the tokenizer could make of it,
and the token count itself, against the largest `max_model_len` the engines
report (400), before anything is hashed, looked up or forwarded.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import httpcore
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from gateway.config import GatewaySettings
from gateway.engine_registry import EngineRegistry, EngineState
from gateway.errors import GatewayError
from gateway.metrics import GatewayMetrics
from gateway.mirror import Mirror
from gateway.peers import PeerNotes
from gateway.peers import routes as peer_routes
from gateway.policy import KvdirPolicy, make_policy
from gateway.prefix_hasher import PrefixHasher
from gateway.proxy import KvRequest, Proxy
from gateway.router import Router, cost_model
from gateway.status import StatusBoard, render_page, status_json
from kvproto.client import DirectoryClient
from kvproto.hashing import KvIdentity
from kvproto.http_limits import BodyLimit
from kvproto.index import warm_up
from kvproto.offline_docs import add_offline_docs
from kvproto.openai_api import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    OpenAIRequest,
    chat_prompt,
    check_prompt_chars,
    check_prompt_tokens,
    check_sizes,
    error_response,
    http_error,
    openai_error,
    openapi_body,
    parse_request,
)
from kvproto.schemas import KV_TRANSFER_PARAMS_FIELD, PULL_PLAN_FIELD
from kvproto.tokenizer import load_tokenizer, max_chars_per_token

log = logging.getLogger("kvdir.gateway")

_Request = TypeVar("_Request", bound=OpenAIRequest)


def _unhashable(raw: dict[str, Any], messages: list[ChatMessage] | None = None) -> str | None:
    """Why the gateway cannot hash this prompt as the engine will (None: it can).

    An engine's block hashes cover the multimodal inputs a block holds (docs/protocol.md §1.1), which the
    gateway does not expand: such a prompt is routed by load, never looked up nor given a pull plan.
    """
    if raw.get("prompt_embeds") is not None:
        return "the prompt is given as embeddings"
    for m in messages or ():
        if isinstance(m.content, list) and any(isinstance(p, dict) and p.get("type", "text") != "text" for p in m.content):
            return "a message has non-text content parts (images, audio, ...)"
    return None


def create_app(settings: GatewaySettings) -> FastAPI:
    use_engine_tokenizer = settings.tokenizer == "engine"
    tokenizer = None if use_engine_tokenizer else load_tokenizer(settings.tokenizer)
    chars_per_token = max_chars_per_token(tokenizer)
    policy = make_policy(settings.policy, cost=cost_model(settings))
    router = Router(policy, random.Random(settings.seed), PrefixHasher(settings.block_size, settings.namespace))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
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
            directory, http, settings.static_engines, settings.refresh_s, settings.unhealthy_s, settings.networks, settings.tenant
        )
        await registry.refresh()
        registry.start()
        app.state.directory, app.state.registry, app.state.http = directory, registry, http
        app.state.metrics = metrics = GatewayMetrics(registry)
        mirror = None
        if settings.mirror and not settings.tenant:
            # The index kernels the mirror runs, loaded now: startup's end freezes what they built (kvproto.heap).
            await asyncio.to_thread(warm_up)
            # One feed per shard of a sharded directory (the map is read with `directory`), else one on these URLs.
            mirror = Mirror(settings.directory_urls, settings.directory_token, settings.mirror_max_lag_s, directory=directory)
            mirror.start()
        elif settings.mirror:
            log.info("directory mirror off: keys of tenant %r are known to the replicas only (REST lookups)", settings.tenant)
        metrics.watch_mirror(mirror)
        app.state.peers = peers = PeerNotes(
            registry,
            settings.peer_urls,
            token=settings.peer_token,
            ttl_s=settings.peer_note_ttl_s,
            queue_size=settings.peer_queue,
            timeout_s=settings.peer_timeout_s,
            max_notes=settings.peer_max_notes,
            max_sender_notes=settings.peer_max_sender_notes,
            max_senders=settings.peer_max_senders,
            note_rate=settings.peer_note_rate,
            max_prompt_tokens=settings.max_prompt_tokens,
            max_engine_tokens=settings.peer_engine_tokens,
            metrics=metrics.registry,
            # The kvdir policy counts peers' sends as recent work per engine (its near-tie balance).
            on_note=policy.on_peer_routed if isinstance(policy, KvdirPolicy) else None,
        )
        peers.start()
        app.state.status = status = StatusBoard(metrics, registry, directory, settings.policy, mirror, peers)
        status.start()
        # An idle connection is dropped after 4 s, before an engine's server drops it (uvicorn, and vLLM on it:
        # 5 s): one closed by the engine as a request goes out would fail a request the engine never saw.
        upstream = httpcore.AsyncConnectionPool(max_connections=512, max_keepalive_connections=32, keepalive_expiry=4.0)
        app.state.proxy = Proxy(
            router,
            registry,
            directory,
            upstream,
            settings.request_timeout_s,
            metrics,
            settings.lookup_timeout_s,
            mirror,
            peers,
            settings.mirror_stale_lag_s,
        )
        app.state.models_cache = (0.0, [])
        log.info("gateway on %s, policy %s, %d engines known", settings.http, settings.policy, len(registry.engines))
        try:
            yield
        finally:
            await status.stop()
            await peers.stop()
            if mirror is not None:
                await mirror.stop()
            await registry.stop()
            await upstream.aclose()
            await http.aclose()
            await directory.aclose()

    app = FastAPI(title="kvdir gateway", version="1", lifespan=lifespan, docs_url=None, redoc_url=None)
    add_offline_docs(app)
    if settings.peer_urls:  # the notes route exists only on a gateway with peers (gateway.peers, issue #29)
        app.include_router(peer_routes())

    def too_large(limit: int) -> JSONResponse:
        response = error_response(413, f"request bodies are limited to {limit} bytes", code="body_too_large")
        response.headers["connection"] = "close"  # the rest of the body is not read: the connection cannot be reused
        return response

    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, too_large=too_large)

    app.exception_handler(OpenAIError)(openai_error)  # GatewayError's and the request checks' (kvproto.openai_api)
    app.exception_handler(HTTPException)(http_error)  # an unknown path or method: OpenAI-shaped, naming the routes

    def max_prompt_tokens(request: Request) -> int:
        registry: EngineRegistry = request.app.state.registry
        return registry.max_model_len or settings.max_prompt_tokens

    async def parse(request: Request, model: type[_Request]) -> tuple[dict[str, Any], _Request]:
        body = await request.body()  # at most max_body_bytes: BodyLimit refused more (413) before reading it
        check_sizes(body, model is ChatRequest, settings.max_messages, max_prompt_tokens(request))
        raw, parsed = parse_request(body, model)
        raw.pop(PULL_PLAN_FIELD, None)  # only the gateway writes pull plans
        if isinstance(raw.get(KV_TRANSFER_PARAMS_FIELD), dict):
            raw[KV_TRANSFER_PARAMS_FIELD].pop(PULL_PLAN_FIELD, None)
        return raw, parsed

    def kv_request(
        request: Request, raw: dict[str, Any], body: OpenAIRequest, messages: list[ChatMessage] | None = None
    ) -> KvRequest:
        """The request's model and KV identity (docs/protocol.md §1.1); 404 `model_not_found` when engines are
        known and none serves its model (checked before the prompt is tokenized)."""
        registry: EngineRegistry = request.app.state.registry
        if registry.engines and not registry.serving(body.model):
            raise GatewayError(
                404,
                f"The model `{body.model}` does not exist: no engine serves it (GET /v1/models lists what is served)",
                code="model_not_found",
                param="model",
            )
        base = registry.base_of(body.model)
        identity = KvIdentity(
            settings.namespace,
            model=base if base is not None else body.model,
            adapter=body.model if base is not None else "",
            cache_salt=body.cache_salt or "",
        )
        return KvRequest(body.model, identity, _unhashable(raw, messages))

    async def engine_tokens(request: Request, model: str, payload: dict[str, Any]) -> list[int]:
        """Tokens from an engine's own /tokenize (vLLM's API): its tokenizer and chat template, exactly."""
        registry: EngineRegistry = request.app.state.registry
        http: httpx.AsyncClient = request.app.state.http
        for e in sorted(registry.serving(model), key=lambda e: e.inflight):
            if not e.healthy:
                continue
            try:
                r = await http.post(e.origin.url("/tokenize"), json={"model": payload.get("model"), **payload}, timeout=5.0)
            except httpx.TransportError:
                registry.mark_unhealthy(e.node_id)
                continue
            if r.status_code == 200:
                return [int(t) for t in r.json()["tokens"]]
            try:  # an OpenAI-shaped error (a prompt over the engine's limit, ...): keep its code and param
                err = r.json()["error"]
                message, code, param = str(err["message"]), err.get("code"), err.get("param")
            except (ValueError, KeyError, TypeError):
                message, code, param = r.text, None, None
            raise GatewayError(
                r.status_code if r.status_code < 500 else 502,
                f"the engine could not tokenize: {message[:300]}",
                code=code if isinstance(code, str) else None,
                param=param if isinstance(param, str) else None,
            )
        raise GatewayError(503, "no engine is available to tokenize", "service_unavailable", "no_engine")

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        t = time.perf_counter()
        raw, body = await parse(request, CompletionRequest)
        kv = kv_request(request, raw, body)
        t_tok = time.perf_counter()
        if not isinstance(body.prompt, str):
            tokens = list(body.prompt)
        elif tokenizer is None:
            tokens = await engine_tokens(request, body.model, {"model": body.model, "prompt": body.prompt})
        else:
            check_prompt_chars(body.prompt, max_prompt_tokens(request), chars_per_token, "prompt")
            tokens = tokenizer.encode(body.prompt)
        check_prompt_tokens(len(tokens), max_prompt_tokens(request), "prompt")
        proxy: Proxy = request.app.state.proxy
        return await proxy.complete("/v1/completions", raw, tokens, body.stream, t, time.perf_counter() - t_tok, kv)

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatRequest))
    async def chat(request: Request) -> Response:
        t = time.perf_counter()
        raw, body = await parse(request, ChatRequest)
        kv = kv_request(request, raw, body, body.messages)
        t_tok = time.perf_counter()
        if tokenizer is None:
            tokens = await engine_tokens(request, body.model, {"model": body.model, "messages": raw["messages"]})
        else:
            text = chat_prompt(body.messages)
            check_prompt_chars(text, max_prompt_tokens(request), chars_per_token, "messages")
            tokens = tokenizer.encode(text)
        check_prompt_tokens(len(tokens), max_prompt_tokens(request), "messages")
        proxy: Proxy = request.app.state.proxy
        return await proxy.complete("/v1/chat/completions", raw, tokens, body.stream, t, time.perf_counter() - t_tok, kv)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        stamp, cached = request.app.state.models_cache
        if time.monotonic() - stamp > 5.0:
            registry: EngineRegistry = request.app.state.registry
            http: httpx.AsyncClient = request.app.state.http

            async def one(e: EngineState) -> list[dict[str, Any]]:
                try:
                    data: list[dict[str, Any]] = (await http.get(e.origin.url("/v1/models"), timeout=2.0)).json().get("data", [])
                    return data
                except (httpx.HTTPError, ValueError):
                    return []

            merged: dict[str | None, dict[str, Any]] = {}  # a model without an "id" is kept under None
            for data in await asyncio.gather(*(one(e) for e in registry.engines.values() if e.healthy)):
                for m in data:
                    merged.setdefault(m.get("id"), m)
            cached = list(merged.values())
            request.app.state.models_cache = (time.monotonic(), cached)
        return JSONResponse({"object": "list", "data": cached})

    @app.get("/health")
    async def health(request: Request) -> Response:
        registry: EngineRegistry = request.app.state.registry
        return JSONResponse(
            {
                "ok": True,
                "engines": len(registry.engines),
                "directory": registry.directory_ok,
                "policy": settings.policy,
                "max_prompt_tokens": max_prompt_tokens(request),
            }
        )

    @app.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def status_page(request: Request) -> HTMLResponse:
        return HTMLResponse(render_page(await request.app.state.status.figures()))

    @app.get("/v1/status")
    async def status_figures(request: Request) -> JSONResponse:
        return JSONResponse(status_json(await request.app.state.status.figures()))

    return app
