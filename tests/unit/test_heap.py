"""A server's startup heap is frozen out of the cyclic collector once its lifespan startup is over (kvproto.heap):
what startup built is skipped by full collections, what requests build later is collected as before."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvproto.heap import frozen_after_startup


@pytest.fixture(autouse=True)
def thawed() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the test process's heap is not a server's: leave it collectable


def tracked(x: object) -> bool:
    """Whether the collector still walks `x` (frozen objects are in no generation)."""
    return any(o is x for o in gc.get_objects())


def test_what_startup_built_is_frozen_and_what_a_request_builds_is_not() -> None:
    built: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        built["startup"] = {"cycle": []}
        built["startup"]["cycle"].append(built["startup"])  # a container that only the cyclic collector could free
        yield

    async def handler(request: Request) -> Response:
        built["request"] = {"cycle": []}
        assert gc.get_freeze_count() > 0, "the request ran before startup was over"
        return Response(b"ok")

    app = frozen_after_startup(Starlette(routes=[Route("/", handler)], lifespan=lifespan))
    sent: list[dict[str, Any]] = []

    async def run() -> None:
        inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        await inbox.put({"type": "lifespan.startup"})

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if message["type"] == "lifespan.startup.complete":
                assert gc.get_freeze_count() > 0, "startup reported complete before the heap was frozen"
                assert not tracked(built["startup"])
                await inbox.put({"type": "lifespan.shutdown"})

        await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, inbox.get, send)

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = {"type": "http", "asgi": {"version": "3.0"}, "method": "GET", "path": "/", "raw_path": b"/",
                 "query_string": b"", "headers": [], "scheme": "http", "server": ("127.0.0.1", 80), "client": None}  # fmt: skip
        await app(scope, receive, send)

    assert gc.get_freeze_count() == 0
    asyncio.run(run())
    assert [m["type"] for m in sent] == [
        "lifespan.startup.complete",
        "lifespan.shutdown.complete",
        "http.response.start",
        "http.response.body",
    ]
    assert sent[-1]["body"] == b"ok"
    assert not tracked(built["startup"])
    assert tracked(built["request"])
