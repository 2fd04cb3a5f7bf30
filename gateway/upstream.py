"""The gateway's client to its engines for the forward: HTTP/1.1 POSTs over pooled keep-alive connections.

Why not httpcore (httpx's transport): the forward needs one request shape (a POST whose body
is in memory), a response read whole or chunk by chunk as it comes, keep-alive, TLS and timeouts, and httpcore
spent most of the gateway's per-request CPU on its layers around that (BENCHMARKS.md, "The gateway's own
cost"). Here a connection is an `asyncio.Protocol` whose bytes are parsed by httptools (llhttp, the parser
uvicorn already uses for the gateway's inbound side): no stream object per request, no task, one write.

What a caller sees:
- `ConnectFailed`: no connection was made (refused, unreachable, connect timeout, TLS handshake): nothing was
  sent, so another engine may take the request;
- `UpstreamFailed`: the connection failed, timed out or answered something that is not HTTP after the request
  went out: the engine may have run it.

A response's body is read as it arrives, up to `HIGH_WATER` bytes ahead of its reader (then the socket is
paused: a slow client's stream holds the engine's, not the gateway's memory). A connection goes back to its
origin's pool only once its response ended cleanly and both sides keep it alive; one idle longer than
`keepalive_s` (shorter than an engine's own idle timeout: uvicorn's, vLLM's, is 5 s) is closed rather than
reused, so a request is never written to a connection the engine is closing.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import cast

import certifi
import httptools

from kvproto.schemas import Origin

__all__ = ["ConnectFailed", "Timeouts", "Upstream", "UpstreamFailed", "UpstreamResponse"]

HIGH_WATER = 1 << 20  # bytes of a response read ahead of its reader before the socket is paused
MAX_IDLE_PER_ORIGIN = 32  # idle keep-alive connections kept per engine


class ConnectFailed(Exception):
    """No connection to the engine: the request was not sent."""


class UpstreamFailed(Exception):
    """The engine's connection failed, timed out or answered malformed HTTP after the request was sent."""


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float  # to open a connection (TLS included)
    read_s: float  # for the response's headers, and between two of its body's chunks


class UpstreamResponse:
    """One engine's answer: `status` and `headers` once they are in, the body still to read (`aread` or
    `aiter_stream`); `aclose` when done with it, read or not (a response not read to its end closes its
    connection). Event loop only."""

    __slots__ = (
        "_chunks",
        "_conn",
        "_done",
        "_eof_ends",
        "_error",
        "_headers_in",
        "_last_at",
        "_loop",
        "_on_first",
        "_queued",
        "_timeouts",
        "_waiter",
        "_whole",
        "headers",
        "status",
    )

    def __init__(self, conn: _Connection, timeouts: Timeouts) -> None:
        self._conn: _Connection | None = conn
        self._timeouts = timeouts
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._chunks: collections.deque[bytes] = collections.deque()
        self._queued = 0
        self._done = False
        self._eof_ends = False  # no content-length and not chunked: the body ends with the connection
        self._error: UpstreamFailed | None = None
        self._loop = asyncio.get_running_loop()
        self._headers_in: asyncio.Future[None] = self._loop.create_future()
        self._waiter: asyncio.Future[None] | None = None
        self._whole = False  # `aread`: wake the reader at the end only
        self._last_at = 0.0  # loop time of the last bytes of the body, while `_whole`
        self._on_first: Callable[[], object] | None = None

    async def aiter_stream(self) -> AsyncIterator[bytes]:
        """The body's chunks (chunked transfer encoding undone) as they arrive."""
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._queued -= len(chunk)
                if self._conn is not None and self._queued < HIGH_WATER // 2:
                    self._conn.resume()
                yield chunk
            elif self._error is not None:
                raise self._error
            elif self._done:
                return
            else:
                await self._wait()

    async def aread(self, on_first: Callable[[], object] | None = None) -> bytes:
        """The whole body; `on_first` is called as its first bytes arrive (a joined stream's first token).

        The reader is woken once, when the body has ended, not at each chunk (a joined answer of N tokens cost N
        wake-ups of the request's task, each with its timer); the read timeout still bounds the wait between two
        chunks (`_until`). Not paused at `HIGH_WATER`: the whole body is wanted in memory."""
        self._whole = True
        self._last_at = self._loop.time()
        if self._chunks and on_first is not None:
            on_first()
        else:
            self._on_first = on_first
        if self._conn is not None:
            self._conn.resume()
        while not self._done and self._error is None:
            await self._wait()
        if self._error is not None:
            raise self._error
        body = b"".join(self._chunks)
        self._chunks.clear()
        self._queued = 0
        return body

    async def aclose(self) -> None:
        """Done with the response: a connection whose response did not end cleanly is closed, not reused."""
        conn, self._conn = self._conn, None
        if conn is not None and not self._done:
            conn.close()

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._until(self._waiter, "no more of the answer from the engine")
        finally:
            self._waiter = None

    async def _until(self, event: asyncio.Future[None], what: str) -> None:
        """`event` (the headers in, more of the body, or with `_whole` its end), or UpstreamFailed after the read
        timeout, the connection closed. With `_whole` the timeout runs from the last bytes that came (`_last_at`,
        which the chunks move on without waking the reader): the wait ends only after `read_s` without any."""
        read_s = self._timeouts.read_s
        since = self._last_at if self._whole else self._loop.time()
        while True:
            try:
                async with asyncio.timeout_at(since + read_s):
                    await (asyncio.shield(event) if self._whole else event)  # `_whole`: waited on again
                return
            except TimeoutError:
                if self._whole and self._last_at > since:
                    since = self._last_at  # bytes came meanwhile: wait on from them
                    continue
                error = UpstreamFailed(f"{what} within {read_s:g} s")
                self._fail(error)
                if event.done() and not event.cancelled():
                    event.exception()  # retrieved: the error is raised here
                if self._conn is not None:
                    self._conn.close()
                raise error from None
            except asyncio.CancelledError:
                event.cancel()  # the caller gave up on it: a failure later is nobody's to retrieve
                raise

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _feed(self, chunk: bytes) -> bool:
        """A chunk of the body arrived; False when the reader is `HIGH_WATER` behind (pause the socket)."""
        self._chunks.append(chunk)
        self._queued += len(chunk)
        if not self._whole:
            self._wake()
            return self._queued < HIGH_WATER
        self._last_at = self._loop.time()
        if self._on_first is not None:
            on_first, self._on_first = self._on_first, None
            on_first()
        return True

    def _end(self) -> None:
        self._done = True
        self._wake()

    def _headers_done(self, status: int) -> None:
        self.status = status
        names = {name.lower() for name, _ in self.headers}
        self._eof_ends = b"content-length" not in names and b"transfer-encoding" not in names and status not in (204, 304)
        if not self._headers_in.done():
            self._headers_in.set_result(None)

    def _fail(self, error: UpstreamFailed) -> None:
        if not self._headers_in.done():
            self._headers_in.set_exception(error)
        if not self._done and self._error is None:
            self._error = error
        self._wake()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an engine; parses what it answers into the current response."""

    def __init__(self, pool: Upstream, key: Origin) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.lost = False
        self.paused = False
        self.idle_since = 0.0

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one in all but its class

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.response is not None:
                self.response._fail(UpstreamFailed(f"the engine answered malformed HTTP: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.forget(self)
        r, self.response = self.response, None
        if r is None:
            return
        if r._eof_ends and r._headers_in.done():
            r._end()
        else:
            r._fail(UpstreamFailed(f"the engine closed the connection{f': {exc}' if exc else ''}"))

    # httptools' callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            self.response.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.response is not None:
            self.response._headers_done(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self.response is not None and not self.response._feed(body):
            self.pause()

    def on_message_complete(self) -> None:
        r = self.response
        if r is None:
            return
        self.response = None
        keep = self.parser.should_keep_alive() and not r._eof_ends
        r._end()
        r._conn = None
        if keep:
            self.resume()
            self.pool.release(self)
        else:
            self.close()

    # the pool's side
    def send(self, head: bytes, body: bytes, timeouts: Timeouts) -> UpstreamResponse:
        assert self.transport is not None
        self.response = UpstreamResponse(self, timeouts)
        self.transport.writelines((head, body))
        return self.response

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.lost:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.lost = True
        self.pool.forget(self)
        if self.transport is not None:
            self.transport.close()


@dataclass(frozen=True, slots=True)
class _Target:
    origin: Origin
    host_header: bytes
    ssl: ssl.SSLContext | None


class Upstream:
    """Keep-alive connections to the engines, by origin, and the POST that uses them. Event loop only."""

    def __init__(self, keepalive_s: float = 4.0) -> None:
        self.keepalive_s = keepalive_s
        self._idle: dict[Origin, list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._targets: dict[Origin, _Target] = {}
        self._tls: ssl.SSLContext | None = None

    async def post(
        self, origin: Origin, path: str, headers: list[tuple[bytes, bytes]], body: bytes, timeouts: Timeouts
    ) -> UpstreamResponse:
        """POST `body` to `path` on `origin` with `headers` (a Host header and content-length are added): the
        response once its status and headers are in."""
        target = self._target(origin)
        conn = self._reuse(origin) or await self._connect(target, timeouts)
        lines = [b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n" % (path.encode(), target.host_header, len(body))]
        lines.extend(b"%s: %s\r\n" % kv for kv in headers)
        lines.append(b"\r\n")
        response = conn.send(b"".join(lines), body, timeouts)
        try:
            await response._until(response._headers_in, "no answer from the engine")
        except BaseException:  # timed out, cancelled (the client went away), or the connection failed
            conn.close()
            raise
        return response

    def release(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= MAX_IDLE_PER_ORIGIN or conn.lost:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle is not None and conn in idle:
            idle.remove(conn)

    async def aclose(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._idle.clear()

    def _reuse(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.lost and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
        return None

    async def _connect(self, target: _Target, timeouts: Timeouts) -> _Connection:
        origin = target.origin
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeouts.connect_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, origin),
                    origin.host,
                    origin.port,
                    ssl=target.ssl,
                    server_hostname=origin.host if target.ssl is not None else None,
                )
        except TimeoutError:
            raise ConnectFailed(f"no connection to {origin} within {timeouts.connect_s:g} s") from None
        except (OSError, ssl.SSLError) as exc:
            raise ConnectFailed(f"no connection to {origin}: {exc}") from exc
        self._open.add(conn)
        return conn

    def _target(self, origin: Origin) -> _Target:
        target = self._targets.get(origin)
        if target is None:
            if origin.scheme == "https" and self._tls is None:
                self._tls = ssl.create_default_context(cafile=certifi.where())  # as httpx verifies
            host = str(origin).split("://")[1]  # HOST:PORT, an IPv6 address in brackets
            target = _Target(origin, host.encode(), self._tls if origin.scheme == "https" else None)
            if len(self._targets) > 4096:
                self._targets.clear()
            self._targets[origin] = target
        return target
