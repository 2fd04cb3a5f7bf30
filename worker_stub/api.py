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
`kvdir`, where the time went and what was pulled.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, cast

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvproto.client import DirectoryClient
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
    check_prompt_chars,
    check_prompt_tokens,
    context_length_exceeded,
    error_response,
    http_error,
    message_count,
    openai_error,
    openapi_body,
    parse_request,
)
from kvproto.schemas import PULL_PLAN_FIELD, PullPlan
from kvproto.tokenizer import load_tokenizer, max_chars_per_token
from kvtransfer.backends import create_engine
from worker_stub.config import WorkerSettings
from worker_stub.pool import KVPool
from worker_stub.publisher import Publisher
from worker_stub.stub_engine import Engine, QueueFull, RequestStats

log = logging.getLogger("kvdir.worker")


class WorkerMetrics:
    def __init__(self, engine: Engine, publisher: Publisher) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvdir_worker_requests_total", "Requests served, by endpoint", ["endpoint"], registry=r)
        self.prompt_tokens = Counter("kvdir_worker_prompt_tokens_total", "Prompt tokens", registry=r)
        self.cached_tokens = Counter("kvdir_worker_cached_tokens_total", "Prompt tokens not recomputed", ["source"], registry=r)
        self.ttft = Histogram(
            "kvdir_worker_time_to_first_token_seconds",
            "Queue + pull + prefill time",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.publish_lag = Histogram(
            "kvdir_worker_publish_lag_seconds",
            "From a block's prefill to its publish being committed",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
            registry=r,
        )
        self.published = Counter("kvdir_worker_published_blocks_total", "Blocks published to the directory", registry=r)
        c = engine.counters
        for key, help_text in (
            ("pulled_blocks", "Blocks pulled from peers and verified"),
            ("pull_failed_blocks", "Pulled blocks that failed (transfer error or verification): recomputed"),
            ("pull_errors", "Pulls that failed as a whole"),
            ("pull_refused", "Pull plans refused: the source's KV fingerprint is not this engine's (recomputed)"),
            ("pool_full", "Requests served uncached because every slot was pinned"),
        ):
            Gauge(f"kvdir_worker_{key}_total", help_text, registry=r).set_function(cast(Callable[[], float], lambda k=key: c[k]))
        pool = engine.pool
        Gauge("kvdir_worker_running", "Requests running", registry=r).set_function(lambda: engine.running)
        Gauge("kvdir_worker_waiting", "Requests queued", registry=r).set_function(lambda: engine.waiting)
        Gauge("kvdir_worker_free_slots", "Free KV slots", registry=r).set_function(lambda: pool.free_slots)
        Gauge("kvdir_worker_cached_blocks", "Blocks cached", registry=r).set_function(lambda: pool.cached_blocks)
        Gauge("kvdir_worker_evictions_total", "Blocks evicted (LRU)", registry=r).set_function(lambda: pool.stats["evictions"])
        Gauge("kvdir_worker_publish_pending", "Changes not yet published", registry=r).set_function(lambda: publisher.pending)
        Gauge("kvdir_worker_epoch", "Current directory epoch", registry=r).set_function(lambda: publisher.epoch or 0)

    def on_published(self, n: int, lag: float) -> None:
        self.published.inc(n)
        self.publish_lag.observe(lag)


def create_app(settings: WorkerSettings) -> FastAPI:
    tokenizer = load_tokenizer(settings.tokenizer)
    chars_per_token = max_chars_per_token(tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool = KVPool(settings.capacity_blocks, settings.block_bytes, settings.tp)
        transfer = create_engine(settings.transfer, settings.transfer_host)
        for region in pool.regions:
            transfer.register(region.base_addr, region.length)
        directory = DirectoryClient(settings.directory_urls, deadline=5.0, token=settings.directory_token, tenant=settings.tenant)
        engine = Engine(settings, pool, transfer, directory)
        metrics_box: list[WorkerMetrics] = []
        publisher = Publisher(
            settings.node_id,
            settings.url,
            pool,
            directory,
            transfer_url=transfer.session,
            block_size=settings.block_size,
            models=[settings.model, *settings.adapter_names],
            fingerprint=settings.kv_fingerprint,
            shared=settings.shared,
            load=engine.load,
            interval=settings.publish_interval_s,
            heartbeat_interval=settings.heartbeat_interval_s,
            on_published=lambda n, lag: metrics_box[0].on_published(n, lag),
        )
        metrics_box.append(WorkerMetrics(engine, publisher))
        app.state.engine, app.state.publisher, app.state.metrics = engine, publisher, metrics_box[0]
        publisher.start()
        log.info("worker %s serving %s (transfer %s at %s)", settings.node_id, settings.url, settings.transfer, transfer.session)
        try:
            yield
        finally:
            await publisher.stop()
            await directory.aclose()
            transfer.close()

    app = FastAPI(title="kvdir worker stub", version="1", lifespan=lifespan, docs_url=None, redoc_url=None)
    add_offline_docs(app)
    app.add_middleware(
        BodyLimit,
        limit=settings.max_body_bytes,
        too_large=lambda limit: error_response(413, f"request bodies are limited to {limit} bytes", code="body_too_large"),
    )

    app.exception_handler(OpenAIError)(openai_error)  # the request checks' and the routes' (kvproto.openai_api)
    app.exception_handler(StarletteHTTPException)(http_error)  # an unknown path or method: naming the routes

    adapters = settings.adapter_names

    def identity(body: OpenAIRequest) -> KvIdentity:
        """The request's KV identity (docs/protocol.md §1.1); 404 for a model or adapter this engine does not serve."""
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

    async def run(request: Request, body: OpenAIRequest, kv: KvIdentity, tokens: list[int], chat: bool) -> Response:
        engine: Engine = request.app.state.engine
        metrics: WorkerMetrics = request.app.state.metrics
        max_tokens = body.completion_tokens()
        check_context(len(tokens), max_tokens, settings.max_model_len)
        plan = None
        pull = (body.model_extra or {}).get(PULL_PLAN_FIELD)  # the gateway's pull plan, if any
        if pull is not None:
            try:
                plan = msgspec.convert(pull, PullPlan)
            except msgspec.ValidationError as exc:
                raise OpenAIError(400, f"kvdir_pull: {exc}", param="kvdir_pull") from exc
        stats = RequestStats()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        metrics.requests.labels("chat" if chat else "completions").inc()
        gen = engine.generate(tokens, max_tokens, plan, stats, kv)
        try:
            first = await anext(gen, None)  # queueing, pull and prefill happen here
        except QueueFull as exc:
            raise OpenAIError(429, str(exc), "rate_limit_error", "queue_full") from exc
        ttft = stats.queue_s + stats.pull_s + stats.prefill_s
        metrics.ttft.observe(ttft)
        metrics.prompt_tokens.inc(stats.prompt_tokens)
        metrics.cached_tokens.labels("local").inc(stats.local_cached_tokens)
        metrics.cached_tokens.labels("pulled").inc(stats.pulled_tokens)

        def usage() -> dict[str, Any]:
            return {
                "prompt_tokens": stats.prompt_tokens,
                "completion_tokens": stats.completion_tokens,
                "total_tokens": stats.prompt_tokens + stats.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
            }

        def extension() -> dict[str, Any]:
            return {
                "node_id": settings.node_id,
                "local_cached_tokens": stats.local_cached_tokens,
                "pulled_tokens": stats.pulled_tokens,
                "queue_s": stats.queue_s,
                "pull_s": stats.pull_s,
                "pull_transfer_s": stats.pull_transfer_s,
                "pull_bytes": stats.pull_bytes,
                "prefill_s": stats.prefill_s,
                "decode_s": stats.decode_s,
                "ttft_s": ttft,
                "pull_failures": stats.pull_failures,
            }

        def choice(text: str, final: bool) -> dict[str, Any]:
            reason = "length" if final else None
            if chat:
                key = "message" if not body.stream else "delta"
                return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": reason}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

        obj = "chat.completion" if chat else "text_completion"
        if not body.stream:
            parts = [first] if first is not None else []
            async for piece in gen:
                parts.append(piece)
            text = b"".join(parts).decode("utf-8", errors="replace")
            return JSONResponse(
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": settings.model,
                    "choices": [choice(text, True)],
                    "usage": usage(),
                    "kvdir": extension(),
                }
            )

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        async def sse() -> AsyncIterator[bytes]:
            def event(payload: dict[str, Any]) -> bytes:
                return b"data: " + json.dumps(payload).encode() + b"\n\n"

            base = {"id": rid, "object": chunk_obj, "created": created, "model": settings.model}
            try:
                if first is not None:
                    yield event({**base, "choices": [choice(first.decode("utf-8", errors="replace"), False)]})
                async for piece in gen:
                    yield event({**base, "choices": [choice(piece.decode("utf-8", errors="replace"), False)]})
                yield event({**base, "choices": [choice("", True)], "usage": usage(), "kvdir": extension()})
                yield b"data: [DONE]\n\n"
            finally:
                await gen.aclose()

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"cache-control": "no-cache"})

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        _, body = parse_request(await request.body(), CompletionRequest)
        kv = identity(body)
        tokens = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        return await run(request, body, kv, tokens, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatRequest))
    async def chat_completions(request: Request) -> Response:
        _, body = parse_request(await request.body(), ChatRequest)
        kv = identity(body)
        return await run(request, body, kv, tokenizer.encode(chat_prompt(body.messages)), chat=True)

    @app.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        raw = await request.body()
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
        check_prompt_chars(text, limit, chars_per_token, param)
        tokens = tokenizer.encode(text)
        check_prompt_tokens(len(tokens), limit, param)
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": settings.max_model_len})

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "kvdir",
                        "parent": None if name == settings.model else settings.model,  # as vLLM lists a LoRA adapter
                        "max_model_len": settings.max_model_len,
                    }
                    for name in [settings.model, *adapters]
                ],
            }
        )

    @app.get("/health")
    async def health(request: Request) -> Response:
        pub: Publisher = request.app.state.publisher
        return JSONResponse(
            {"ok": True, "node_id": settings.node_id, "epoch": pub.epoch, "load": request.app.state.engine.load()}
        )

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
