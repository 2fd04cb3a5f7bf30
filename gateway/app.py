"""The gateway: an OpenAI-compatible reverse proxy that routes by cached prefix and estimated TTFT.

For each completion it tokenizes and hashes the prompt (as the engines do),
asks the directory which engines hold how much of it (with slots), lets the
routing policy pick an engine (and, for an engine that can pull, a pull plan
from the holder's memory), and forwards the request. What goes upstream is the
client's JSON object re-serialized (compact UTF-8), with every field the client
sent except a pull plan (`kvdir_pull`, at the top level or inside
`kv_transfer_params`: only the gateway writes those), plus the router's plan
when it chose one. Responses stream through as they come. A connection failure
before any byte was received is retried on the next-best engine. When the
directory is unreachable, requests are routed by load alone (decision
`fallback`): a request never fails because the directory is down.

Response headers say what happened: `x-kvdir-node`, `x-kvdir-decision`,
`x-kvdir-predicted-cached-tokens`.

This module is the FastAPI wiring: routes, middleware and lifespan, each route
translating HTTP to calls on the running gateway (gateway.runtime). The two
completion routes, which every request of a cluster pays for, are served before
FastAPI's routing and middleware stack (`GatewayApp`): the body read within its
limit, then the same `complete` the declared routes call; everything else (the
docs, status, metrics, admin and peer routes, a wrong method's 405) is FastAPI's. The request
shapes, their parsing and size checks are kvproto.openai_api's (shared with the
worker stub, so both answer a bad request alike); the body to forward and the
request's KV identity are gateway.client_request's, its tokens
gateway.tokenizers'; the /v1/models union is gateway.models_list. Choosing the
engine is gateway.router (pure: request -> candidates -> decision); sending,
retrying, streaming and counting the gateway's own load on each engine is
gateway.proxy.

Sizes are checked before the work they would cost: the body's length from its
header (413), the length of a token-array prompt and the number of chat
messages from one allocation-light scan of the raw JSON (400), a string
prompt's length in characters against what the tokenizer could make of it,
and the token count itself, against the largest `max_model_len` the engines
report (400), before anything is hashed, looked up or forwarded.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from gateway.client_request import kv_request, parse
from gateway.config import GatewaySettings
from gateway.peers import routes as peer_routes
from gateway.policy import make_policy
from gateway.prefix_hasher import PrefixHasher
from gateway.router import Router, cost_model
from gateway.runtime import GatewayRuntime, runtime
from gateway.status import status_json
from gateway.status_page import render_page
from gateway.tokenizers import fixed_tokenizer, prompt_tokens
from gateway.ttft_learner import TtftLearner
from kvproto.http_limits import BodyLimit, TooLarge, read_body
from kvproto.offline_docs import add_offline_docs
from kvproto.openai_api import (
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    error_response,
    http_error,
    openai_error,
    openapi_body,
)


def create_app(settings: GatewaySettings) -> FastAPI:
    """The gateway's app; its lifespan starts and stops the `GatewayRuntime` the routes use.

    The tokenizer and the policy are made here, so a bad `--tokenizer` or
    `--policy` fails before the server starts.
    """
    local = fixed_tokenizer(settings.tokenizer, settings.tokenize_cache_entries)
    options = (
        {"stay_margin_s": settings.stay_margin_ms / 1000, "stay_margin_ratio": settings.stay_margin_ratio}
        if settings.policy == "kvdir"
        else {}
    )
    policy = make_policy(settings.policy, cost=cost_model(settings), **options)
    learner = TtftLearner(settings.prefill_tokens_per_s, settings.ttft_learn_window, settings.output_tokens_prior)
    router = Router(policy, random.Random(settings.seed), PrefixHasher(settings.block_size, settings.namespace), learner=learner)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        rt = await GatewayRuntime.start(settings, router, policy, local)
        app.state.runtime = rt
        try:
            yield
        finally:
            await rt.stop()

    app = GatewayApp(
        settings.max_body_bytes, title="kvdir gateway", version="1", lifespan=lifespan, docs_url=None, redoc_url=None
    )
    add_offline_docs(app)
    if settings.peer_urls:  # the notes route exists only on a gateway with peers (gateway.peers)
        app.include_router(peer_routes(lambda request: runtime(request).peers))
    _add_error_handling(app, settings.max_body_bytes)
    _add_routes(app)
    return app


def _too_large(limit: int) -> JSONResponse:
    response = error_response(413, f"request bodies are limited to {limit} bytes", code="body_too_large")
    response.headers["connection"] = "close"  # the rest of the body is not read: the connection cannot be reused
    return response


COMPLETIONS: dict[str, type[CompletionRequest] | type[ChatRequest]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatRequest,
}


class GatewayApp(FastAPI):
    """FastAPI, with the completion routes served before its routing and middleware: a request there pays for
    reading its body within the limit and for the gateway's own work, not for a router's table walk, the
    middleware stack and a Request object (BENCHMARKS.md, "The gateway's own cost")."""

    def __init__(self, max_body_bytes: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        model = COMPLETIONS.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if model is None:
            return await super().__call__(scope, receive, send)
        try:
            body = await read_body(scope, receive, self.max_body_bytes)
        except TooLarge:
            return await _too_large(self.max_body_bytes)(scope, receive, send)
        if body is None:
            return  # the client went away
        try:
            response = await complete(self.state.runtime, scope["path"], model, body)
        except OpenAIError as exc:
            response = exc.response()
        await response(scope, receive, send)


def _add_error_handling(app: FastAPI, max_body_bytes: int) -> None:
    """Bodies over `max_body_bytes` refused unread (413), and every error answered in OpenAI's shape."""
    app.add_middleware(BodyLimit, limit=max_body_bytes, too_large=_too_large)
    app.exception_handler(OpenAIError)(openai_error)  # GatewayError's and the request checks' (kvproto.openai_api)
    app.exception_handler(HTTPException)(http_error)  # an unknown path or method: OpenAI-shaped, naming the routes


async def complete(rt: GatewayRuntime, path: str, model: type[CompletionRequest] | type[ChatRequest], data: bytes) -> Response:
    """A completion request to `path` (its body `data`, within the body limit): checked and parsed, its model and
    prompt resolved, then proxied."""
    t = time.perf_counter()
    raw, body = parse(data, model, rt.settings.max_messages, rt.max_prompt_tokens())
    kv = kv_request(rt.registry, rt.settings.namespace, raw, body)
    t_tok = time.perf_counter()
    tokens = await prompt_tokens(rt.tokenizer, raw, body, rt.max_prompt_tokens)
    return await rt.proxy.complete(path, raw, tokens, body.stream, t, time.perf_counter() - t_tok, kv)


def _add_routes(app: FastAPI) -> None:
    """The OpenAI API, the health and metrics probes and the status page."""

    # Declared for the OpenAPI schema and the route lists of 404s and 405s: GatewayApp serves them before routing.
    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await complete(runtime(request), "/v1/completions", CompletionRequest, await request.body())

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatRequest))
    async def chat(request: Request) -> Response:
        return await complete(runtime(request), "/v1/chat/completions", ChatRequest, await request.body())

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": await runtime(request).models.data()})

    @app.get("/health")
    async def health(request: Request) -> Response:
        rt = runtime(request)
        return JSONResponse(
            {
                "ok": True,
                "engines": len(rt.registry.engines),
                "directory": rt.registry.directory_ok,
                "policy": rt.settings.policy,
                "max_prompt_tokens": rt.max_prompt_tokens(),
                "block_size_mismatch": rt.registry.mismatched_block_size,
                "tokenizer": rt.settings.tokenizer,
                # Engines whose /tokenize differs from the gateway's tokens, or could not be asked (gateway.tokenizer_parity)
                "tokenizer_mismatch": [
                    {"node_id": p.node_id, "epoch": p.epoch, "model": p.model, "status": p.status, "detail": p.detail}
                    for p in rt.parity.problems
                ],
            }
        )

    @app.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        return Response(generate_latest(runtime(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def status_page(request: Request) -> HTMLResponse:
        return HTMLResponse(render_page(await runtime(request).status.figures()))

    @app.get("/v1/status")
    async def status_figures(request: Request) -> JSONResponse:
        return JSONResponse(status_json(await runtime(request).status.figures()))
