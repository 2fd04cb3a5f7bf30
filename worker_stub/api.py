"""The worker stub's OpenAI-compatible API: completions, chat completions, models, streaming.

The request shapes, their parsing and limit checks are kvproto.openai_api's, shared
with the gateway, so both answer a bad request alike. Errors follow OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`: 400 for invalid requests (bad JSON,
wrong types, prompt too long), 404 for an unknown model or path, 405 for a method a
path does not take (both messages list the routes), 413 for an oversized body, 429
when the queue is full. `/docs` is served with its assets from this host (kvproto.offline_docs).
`/tokenize` refuses a prompt over `max_model_len` (as vLLM does) before the
work it would cost: more messages than that, or (with the bytes tokenizer) more
characters than that, is refused unparsed and untokenized.
Answers report `usage.prompt_tokens_details.cached_tokens` (prompt tokens not
recomputed: local hits plus pulled blocks) and, in the extension field
`kvdir`, where the time went and what was pulled (their shapes are worker_stub.responses').
With `--dp N` the API serves N data-parallel ranks, each an engine, pool and directory node of its own
(`NODE_ID-dpR`); a request names its rank in `X-data-parallel-rank`, as with vLLM, else goes to the least busy;
`/health` and `/metrics` answer for the rank the header names; without it, `/health` for the whole engine (its
ranks listed) and `/metrics` for rank 0.
The routes only translate HTTP: what a worker holds is a WorkerRuntime (worker_stub.runtime).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Annotated, Any

import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvproto.hashing import KvIdentity
from kvproto.http_limits import BodyLimit
from kvproto.offline_docs import add_offline_docs
from kvproto.openai_api import (
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    OpenAIRequest,
    TokenizeRequest,
    chat_prompt,
    check_context,
    context_length_exceeded,
    encode_checked,
    error_response,
    http_error,
    message_count,
    openai_error,
    openapi_body,
    parse_request,
)
from kvproto.schemas import DP_RANK_HEADER, PULL_PLAN_FIELD, PullPlan
from kvproto.tokenizer import Tokenizer, load_tokenizer
from worker_stub.config import WorkerSettings
from worker_stub.responses import SSE_DONE, Completion, decode, kvdir_extension, sse_event, usage
from worker_stub.runtime import Generation, WorkerRuntime
from worker_stub.stub_engine import QueueFull


def _named(request: Request) -> WorkerRuntime | None:
    """The runtime of the data-parallel rank the request names in `DP_RANK_HEADER` (as vLLM's API server takes
    it), None if it names none; 400 for a rank this engine does not have."""
    runtimes: list[WorkerRuntime] = request.app.state.runtimes
    named = request.headers.get(DP_RANK_HEADER)
    if named is None:
        return None
    if not named.isdigit() or int(named) >= len(runtimes):
        raise OpenAIError(
            400, f"{DP_RANK_HEADER}: {named[:32]!r} is not one of this engine's data-parallel ranks 0..{len(runtimes) - 1}"
        )
    return runtimes[int(named)]


async def _runtime(request: Request) -> WorkerRuntime:
    """The runtime to serve a request: the rank it names, else the least busy. (Async: a sync dependency would
    take a threadpool hop.)"""
    named = _named(request)
    if named is not None:
        return named
    runtimes: list[WorkerRuntime] = request.app.state.runtimes
    return runtimes[0] if len(runtimes) == 1 else min(runtimes, key=lambda r: r.engine.running + r.engine.waiting)


async def _ops_runtime(request: Request) -> WorkerRuntime:
    """The runtime `/health` and `/metrics` answer for: the rank the request names, else rank 0."""
    named = _named(request)
    if named is not None:
        return named
    runtime: WorkerRuntime = request.app.state.runtimes[0]
    return runtime


RuntimeDep = Annotated[WorkerRuntime, Depends(_runtime)]
OpsRuntimeDep = Annotated[WorkerRuntime, Depends(_ops_runtime)]


def _lifespan(settings: WorkerSettings) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtimes: list[WorkerRuntime] = []
        try:
            for rank in range(settings.dp):
                runtimes.append(WorkerRuntime.build(settings, dp_rank=rank if settings.dp > 1 else None))
            app.state.runtimes = runtimes
            for runtime in runtimes:
                runtime.start()
            yield
        finally:
            for runtime in runtimes:
                await runtime.aclose()

    return lifespan


def _identity(settings: WorkerSettings, body: OpenAIRequest) -> KvIdentity:
    """The request's KV identity (docs/protocol.md §1.1); 404 for a model or adapter this engine does not serve."""
    adapters = settings.adapter_names
    if body.model != settings.model and body.model not in adapters:
        served = ", ".join(f"`{m}`" for m in [settings.model, *adapters])
        raise OpenAIError(
            404,
            f"The model `{body.model}` does not exist; this engine serves {served}",
            code="model_not_found",
            param="model",
        )
    adapter = body.model if body.model != settings.model else ""
    return KvIdentity(settings.namespace, settings.model, adapter, body.cache_salt or "")


def _pull_plan(body: OpenAIRequest) -> PullPlan | None:
    """The gateway's pull plan, if the request carries one; 400 for one that does not parse."""
    pull = (body.model_extra or {}).get(PULL_PLAN_FIELD)
    if pull is None:
        return None
    try:
        return msgspec.convert(pull, PullPlan)
    except msgspec.ValidationError as exc:
        raise OpenAIError(400, f"kvdir_pull: {exc}", param="kvdir_pull") from exc


async def _answer(
    settings: WorkerSettings, runtime: WorkerRuntime, body: OpenAIRequest, kv: KvIdentity, tokens: list[int], chat: bool
) -> Response:
    """Serve a parsed completion request: the whole body, or an SSE stream when it asks to stream."""
    max_tokens = body.completion_tokens()
    check_context(len(tokens), max_tokens, settings.max_model_len)
    plan = _pull_plan(body)
    completion = Completion.new(settings.model, chat=chat, stream=body.stream)
    try:
        gen = await runtime.generate("chat" if chat else "completions", tokens, max_tokens, plan, kv)
    except QueueFull as exc:
        raise OpenAIError(429, str(exc), "rate_limit_error", "queue_full") from exc
    if not body.stream:
        return JSONResponse(await _body(settings, completion, gen))
    return StreamingResponse(
        _sse(settings, completion, gen), media_type="text/event-stream", headers={"cache-control": "no-cache"}
    )


async def _body(settings: WorkerSettings, completion: Completion, gen: Generation) -> dict[str, Any]:
    """The non-streaming answer, once every token is decoded (`usage` and `kvdir` are final only then)."""
    parts = [gen.first] if gen.first is not None else []
    async for piece in gen.rest:
        parts.append(piece)
    text = decode(b"".join(parts))
    return completion.body(text, usage(gen.stats), kvdir_extension(gen.node_id, gen.stats, gen.ttft))


async def _sse(settings: WorkerSettings, completion: Completion, gen: Generation) -> AsyncIterator[bytes]:
    """The answer as SSE events; the engine's generator is closed however the stream ends (a client may leave)."""
    try:
        if gen.first is not None:
            yield sse_event(completion.chunk(decode(gen.first)))
        async for piece in gen.rest:
            yield sse_event(completion.chunk(decode(piece)))
        yield sse_event(completion.last_chunk(usage(gen.stats), kvdir_extension(gen.node_id, gen.stats, gen.ttft)))
        yield SSE_DONE
    finally:
        await gen.rest.aclose()


def _tokenize(settings: WorkerSettings, tokenizer: Tokenizer, raw: bytes) -> dict[str, Any]:
    # Counted before validation: each message renders to at least one token, and a body of a million
    # messages would otherwise be validated (and tokenized) in full first.
    limit = settings.max_model_len
    if (n_messages := message_count(raw)) > limit:
        raise context_length_exceeded(limit, f"the request has {n_messages} messages", "messages")
    _, body = parse_request(raw, TokenizeRequest)
    if (body.prompt is None) == (body.messages is None):
        raise OpenAIError(400, "give exactly one of `prompt` or `messages`")
    param = "prompt" if body.prompt is not None else "messages"
    text = body.prompt if body.prompt is not None else chat_prompt(body.messages or [])
    tokens = encode_checked(tokenizer, text, limit, param)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": settings.max_model_len}


def _models(settings: WorkerSettings) -> dict[str, Any]:
    """The base model and its adapters, each adapter naming the model as its parent (as vLLM lists a LoRA adapter)."""
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "kvdir",
                "parent": None if name == settings.model else settings.model,
                "max_model_len": settings.max_model_len,
            }
            for name in [settings.model, *settings.adapter_names]
        ],
    }


def _add_openai_routes(app: FastAPI, settings: WorkerSettings, tokenizer: Tokenizer) -> None:
    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request, runtime: RuntimeDep) -> Response:
        _, body = parse_request(await request.body(), CompletionRequest)
        kv = _identity(settings, body)
        tokens = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        return await _answer(settings, runtime, body, kv, tokens, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatRequest))
    async def chat_completions(request: Request, runtime: RuntimeDep) -> Response:
        _, body = parse_request(await request.body(), ChatRequest)
        kv = _identity(settings, body)
        return await _answer(settings, runtime, body, kv, tokenizer.encode(chat_prompt(body.messages)), chat=True)

    @app.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        return JSONResponse(_tokenize(settings, tokenizer, await request.body()))

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(_models(settings))


def _rank_health(runtime: WorkerRuntime) -> dict[str, Any]:
    return {"ok": True, "node_id": runtime.node_id, "epoch": runtime.publisher.epoch, "load": runtime.engine.load()}


def _add_ops_routes(app: FastAPI, settings: WorkerSettings) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        named = _named(request)
        runtimes: list[WorkerRuntime] = request.app.state.runtimes
        ranks = [_rank_health(r) for r in ([named] if named is not None else runtimes)]
        if named is not None or len(runtimes) == 1:
            return JSONResponse(ranks[0])
        # The whole engine: its node id, and an epoch (rank 0's) once every rank has registered.
        epoch = ranks[0]["epoch"] if all(r["epoch"] is not None for r in ranks) else None
        return JSONResponse({"ok": True, "node_id": settings.node_id, "epoch": epoch, "ranks": ranks})

    @app.get("/metrics")
    async def metrics(runtime: OpsRuntimeDep) -> Response:
        return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def create_app(settings: WorkerSettings) -> FastAPI:
    tokenizer = load_tokenizer(settings.tokenizer)
    app = FastAPI(title="kvdir worker stub", version="1", lifespan=_lifespan(settings), docs_url=None, redoc_url=None)
    add_offline_docs(app)
    app.add_middleware(
        BodyLimit,
        limit=settings.max_body_bytes,
        too_large=lambda limit: error_response(413, f"request bodies are limited to {limit} bytes", code="body_too_large"),
    )
    app.exception_handler(OpenAIError)(openai_error)  # the request checks' and the routes' (kvproto.openai_api)
    app.exception_handler(StarletteHTTPException)(http_error)  # an unknown path or method: naming the routes
    _add_openai_routes(app, settings, tokenizer)
    _add_ops_routes(app, settings)
    return app
