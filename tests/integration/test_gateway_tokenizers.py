"""The gateway's engine-side pieces against real worker stubs (their HTTP app under uvicorn on 127.0.0.1):
`EngineTokenizer` (the engine's /tokenize, its refusals and an unreachable engine) and `ModelsList` (the
/v1/models union, kept for its time to live)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

import httpx
import pytest
import uvicorn

from gateway.engine_registry import EngineRegistry, EngineState, parse_origin
from gateway.errors import GatewayError
from gateway.models_list import ModelsList
from gateway.tokenizers import ChatPrompt, EngineTokenizer, LocalTokenizer
from kvdir.local_cluster import free_ports
from kvproto.client import DirectoryClient
from kvproto.openai_api import ChatMessage
from kvproto.tokenizer import ByteTokenizer
from tests.support.wait import wait_for
from worker_stub.api import create_app
from worker_stub.config import WorkerSettings

MAX_MODEL_LEN = 64
_T = TypeVar("_T")


@pytest.fixture
def stubs() -> Iterator[list[str]]:
    """Two worker stubs' HTTP apps (lifespan off: /tokenize and /v1/models need no directory), the second with an
    adapter; their URLs."""
    servers: list[uvicorn.Server] = []
    threads: list[threading.Thread] = []
    ports = free_ports(2)
    for port, adapters in zip(ports, ("", "lora")):
        settings = WorkerSettings(http=f"127.0.0.1:{port}", model="m", adapters=adapters, max_model_len=MAX_MODEL_LEN)
        server = uvicorn.Server(
            uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, lifespan="off", log_level="warning")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append(server)
        threads.append(thread)
    wait_for(lambda: all(s.started for s in servers), 10, interval=0.02, what="the worker stubs to start")
    try:
        yield [f"http://127.0.0.1:{p}" for p in ports]
    finally:
        for s in servers:
            s.should_exit = True
        for t in threads:
            t.join(10)


def _with_registry(urls: list[str], body: Callable[[EngineRegistry, httpx.AsyncClient], Awaitable[_T]]) -> _T:
    """`body` run on a registry of engines at `urls` (static-1, ... in that order; nothing refreshes it)."""

    async def main() -> _T:
        async with httpx.AsyncClient() as http:
            directory = DirectoryClient("http://127.0.0.1:1")
            registry = EngineRegistry(directory, http, [], refresh_s=1.0, unhealthy_s=30.0)
            for i, url in enumerate(urls):
                registry.engines[f"static-{i + 1}"] = EngineState(f"static-{i + 1}", parse_origin(url), url, registered=False)
            try:
                return await body(registry, http)
            finally:
                await directory.aclose()

    return asyncio.run(main())


def test_the_engine_tokenizer_gives_the_engines_tokens_for_prompts_and_messages(stubs: list[str]) -> None:
    messages = [{"role": "user", "content": "hi", "name": "sent as given"}]
    chat = ChatPrompt([ChatMessage.model_validate(m) for m in messages], messages)

    async def body(registry: EngineRegistry, http: httpx.AsyncClient) -> tuple[list[int], list[int]]:
        engine = EngineTokenizer(registry, http)
        return await engine.encode("m", "hello", MAX_MODEL_LEN), await engine.encode("m", chat, MAX_MODEL_LEN)

    prompt, chat_tokens = _with_registry(stubs[:1], body)
    local = LocalTokenizer(ByteTokenizer())  # the stub's own tokenizer and template
    assert prompt == asyncio.run(local.encode("m", "hello", MAX_MODEL_LEN))
    assert chat_tokens == asyncio.run(local.encode("m", chat, MAX_MODEL_LEN))


def test_the_engines_refusal_is_the_requests_with_its_code_and_param(stubs: list[str]) -> None:
    async def body(registry: EngineRegistry, http: httpx.AsyncClient) -> GatewayError:
        with pytest.raises(GatewayError) as exc:
            await EngineTokenizer(registry, http).encode("m", "x" * (MAX_MODEL_LEN + 1), 10**6)
        return exc.value

    err = _with_registry(stubs[:1], body)
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "prompt")
    assert err.message.startswith("the engine could not tokenize: This model's maximum context length is 64 tokens")


def test_an_unreachable_engine_is_marked_unhealthy_and_the_next_one_asked(stubs: list[str]) -> None:
    dead = f"http://127.0.0.1:{free_ports(1)[0]}"  # nothing listens there

    async def body(registry: EngineRegistry, http: httpx.AsyncClient) -> tuple[list[int], bool, bool]:
        registry.engines["static-2"].inflight = 1  # the dead engine (static-1) is the least busy: asked first
        tokens = await EngineTokenizer(registry, http).encode("m", "ok", MAX_MODEL_LEN)
        return tokens, registry.engines["static-1"].healthy, registry.engines["static-2"].healthy

    assert _with_registry([dead, stubs[0]], body) == (list(b"ok"), False, True)


def test_no_engine_left_to_ask_is_a_503(stubs: list[str]) -> None:
    dead = f"http://127.0.0.1:{free_ports(1)[0]}"

    async def body(registry: EngineRegistry, http: httpx.AsyncClient) -> list[GatewayError]:
        errors = []
        for _ in range(2):  # the first marks the engine unhealthy; the second finds none to ask
            with pytest.raises(GatewayError) as exc:
                await EngineTokenizer(registry, http).encode("m", "ok", MAX_MODEL_LEN)
            errors.append(exc.value)
        return errors

    for err in _with_registry([dead], body):
        assert (err.status, err.type, err.code) == (503, "service_unavailable", "no_engine")


def test_the_models_list_is_the_union_of_the_healthy_engines_kept_for_its_ttl(stubs: list[str]) -> None:
    dead = f"http://127.0.0.1:{free_ports(1)[0]}"

    async def body(registry: EngineRegistry, http: httpx.AsyncClient) -> tuple[list[str | None], ...]:
        models = ModelsList(registry, http, ttl_s=30.0)
        first = [m.get("id") for m in await models.data()]  # the dead engine lists nothing
        # The adapter's engine goes unhealthy: not asked any more, but only once the cached list is old.
        registry.mark_unhealthy("static-3")
        cached = [m.get("id") for m in await models.data()]
        models.ttl_s = 0.0
        fresh = [m.get("id") for m in await models.data()]
        return first, cached, fresh

    first, cached, fresh = _with_registry([dead, stubs[0], stubs[1]], body)
    assert first == cached == ["m", "lora"]  # "m" once, from the first engine that lists it
    assert fresh == ["m"]


@contextmanager
def _listing_server(listing: bytes, hold: threading.Event | None = None) -> Iterator[tuple[str, list[str]]]:
    """An engine on 127.0.0.1 answering every GET with `listing` (after `hold` is set, if given): its URL, and the
    paths it was asked for."""
    asked: list[str] = []

    class Listing(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            if hold is not None:
                hold.wait(10)
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(listing)))
            self.end_headers()
            self.wfile.write(listing)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_ports(1)[0]), Listing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", asked
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.mark.parametrize(
    ("listing", "ids"),
    [
        (b"[1, 2]", []),
        (b'{"data": "x"}', []),
        (b'{"data": [1, {"id": "ok"}, "y"]}', ["ok"]),
        (b"not json", []),
        (b'{"data": [{"id": "nan", "created": NaN}]}', []),
        (b'{"data": [{"id": "inf", "created": -Infinity}]}', []),
        (b'{"data": [{"id": "big", "created": 1e999}]}', []),
        (b'{"data": [{"id": "deep", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]}", []),
    ],
    ids=["list", "data not a list", "some entries", "not json", "NaN", "Infinity", "1e999", "deep"],
)
def test_a_malformed_model_listing_lists_nothing_of_it(listing: bytes, ids: list[str]) -> None:
    """An engine's listing is outside input: whatever it sends, /v1/models answers what JSON can say (never a 500)."""

    async def body(registry: EngineRegistry, http: httpx.AsyncClient) -> list[Any]:
        return await ModelsList(registry, http).data()

    with _listing_server(listing) as (url, _):
        data = _with_registry([url], body)
    assert [m.get("id") for m in data] == ids
    json.dumps(data, allow_nan=False)  # what the route answers: it must encode


def test_callers_that_find_the_models_list_old_share_one_fan_out() -> None:
    """Concurrent /v1/models past the list's time to live ask each engine once between them, and all get its list."""
    hold = threading.Event()

    async def body(registry: EngineRegistry, http: httpx.AsyncClient) -> list[list[Any]]:
        models = ModelsList(registry, http, ttl_s=0.0)
        calls = [asyncio.ensure_future(models.data()) for _ in range(20)]
        await asyncio.to_thread(wait_for, lambda: asked, what="the engine asked")  # every caller is waiting by now
        hold.set()
        return await asyncio.gather(*calls)

    with _listing_server(b'{"data": [{"id": "m"}]}', hold) as (url, asked):
        answers = _with_registry([url], body)
    assert answers == [[{"id": "m"}]] * 20
    assert asked == ["/v1/models"]
