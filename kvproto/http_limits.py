"""Caps on the size of an HTTP request's head and body, for every uvicorn server of kvdir.

uvicorn's httptools protocol has no such cap (`h11_max_incomplete_event_size` only applies to
h11), and httptools joins the pieces of a header that arrives over many reads with `+=`: a
50 MB header to `/healthz` cost a replica 3.3 s of CPU on its event loop. This module imports
only uvicorn and starlette, so the gateway and the worker can use it without the directory's
server side. `serve_app` runs every kvdir HTTP server the same way, with these caps and with
what its startup built frozen out of the cyclic garbage collector (`kvproto.heap`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import uvicorn
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvproto.addresses import parse_hostport
from kvproto.heap import frozen_after_startup
from kvproto.logs import configure_logging

log = logging.getLogger(__name__)

ENDLESS_PATHS = frozenset({"/v1/watch"})  # the directory's watch stream (directory.watch)
MAX_HEAD_BYTES = 64 * 1024  # request line and headers; real clients send a few KiB at most (a bearer token is < 100 B)

_MESSAGE = b"request line and headers too big\n"
_REFUSAL = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_MESSAGE), _MESSAGE)
)


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol that answers 431 and closes once a request's head passes MAX_HEAD_BYTES.

    Every read that arrives while a request's headers are incomplete is counted (a body is not),
    and the connection is refused as soon as the count passes the cap: the parser never holds
    more than the cap plus one read of the transport, however big the head. Passed to uvicorn as
    its `http` class.
    """

    _head_bytes = 0  # bytes received since the current request's head began
    _in_body = False  # its headers are complete; counting resumes with the next request

    def data_received(self, data: bytes) -> None:
        if not self._in_body:
            self._head_bytes += len(data)
        super().data_received(data)
        if not self._in_body and self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
            log.warning("%s sent a request head over %d bytes: refused with 431", self.client, MAX_HEAD_BYTES)
            self.transport.write(_REFUSAL)
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._in_body, self._head_bytes = True, 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        super().on_message_complete()

    def shutdown(self) -> None:
        """At shutdown, close a connection streaming a response that never ends on its own (ENDLESS_PATHS)
        at once: uvicorn would otherwise wait `timeout_graceful_shutdown` for it. Its consumer resumes
        elsewhere; other in-flight responses still get their grace period."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and cycle.scope.get("path") in ENDLESS_PATHS:
            self.transport.close()
            return
        super().shutdown()


class TooLarge(Exception):
    """A request body over its limit (`read_body`)."""


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes | None:
    """The request's body, read whole: TooLarge once it is declared or found to be over `limit` bytes (the rest is
    left unread), None if the client went away first."""
    declared = dict(scope["headers"]).get(b"content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise TooLarge
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return None
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise TooLarge
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(chunks) if len(chunks) != 1 else chunks[0]


class BodyLimit:
    """ASGI middleware: 413 for bodies over `limit` bytes, whether declared or streamed.

    The body is read (at most `limit` bytes) before the app sees it, so an
    oversized chunked upload is refused before any parsing starts.
    """

    def __init__(self, app: ASGIApp, limit: int, too_large: Callable[[int], Response]) -> None:
        """`too_large(limit)` is the 413 response, in the shape of the app's other errors."""
        self.app, self.limit, self.too_large = app, limit, too_large

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            body = await read_body(scope, receive, self.limit)
        except TooLarge:
            return await self.too_large(self.limit)(scope, receive, send)
        if body is None:
            return  # client went away
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def serve_app(make_app: Callable[[], ASGIApp], http: str, log_level: str) -> None:
    """Serve the app `make_app` builds on HOST:PORT until SIGINT/SIGTERM: the head cap, uvloop, no access log
    (one line per request is noise), 5 s for open requests to finish at shutdown, and what startup built
    frozen out of the cyclic garbage collector once the lifespan startup is over (`kvproto.heap`).

    Logging is set up before the app is built, so what building it logs (auth on, tenant keys) is not lost.
    """
    configure_logging(log_level)
    app = make_app()
    host, port = parse_hostport(http)
    uvicorn.run(
        frozen_after_startup(app),
        host=host,
        port=port,
        log_level=log_level.lower(),
        access_log=False,
        loop="uvloop",
        http=LimitedHttpToolsProtocol,
        timeout_graceful_shutdown=5,
    )
