"""The gateway's forward client (gateway.upstream) against a real HTTP/1.1 server on 127.0.0.1: bodies read whole
and streamed as they come, keep-alive reuse and its limits, and every way an engine can fail, each as the
ConnectFailed (nothing sent) or UpstreamFailed (sent) the proxy's retry decision rests on."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import uvloop

from gateway.upstream import HIGH_WATER, ConnectFailed, Timeouts, Upstream, UpstreamFailed
from kvproto.schemas import Origin
from tests.support.wait import until

T = Timeouts(connect_s=2.0, read_s=5.0)
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes, bytes], Awaitable[bool]]


class Engine:
    """A server that reads each request (head and content-length body) and lets `handler` answer it; the handler
    returns False to close the connection. Counts connections and keeps what it received."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    @property
    def origin(self) -> Origin:
        assert self.server is not None
        return Origin("http", "127.0.0.1", self.server.sockets[0].getsockname()[1])

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(w)
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                n = next(int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length:"))
                body = await r.readexactly(n)
                self.requests.append((head, body))
                if not await self.handler(r, w, head, body):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[Engine]:
    """An engine listening on a free port of 127.0.0.1 while the block runs."""
    e = Engine(handler)
    e.server = await asyncio.start_server(e._serve, "127.0.0.1", 0)
    try:
        yield e
    finally:
        e.server.close()
        for w in e.writers:
            w.close()


Serve = Callable[[Handler], Awaitable[Engine]]


@pytest.fixture(params=["uvloop", "asyncio"])
def run(request: pytest.FixtureRequest) -> Callable[[Callable[[Serve], Awaitable[None]]], None]:
    """Runs `scenario(serve)` in an event loop of its own, uvloop's (the gateway's) and asyncio's, every engine it
    served stopped at its end."""

    def go(scenario: Callable[[Serve], Awaitable[None]]) -> None:
        async def main() -> None:
            async with contextlib.AsyncExitStack() as stack:
                await asyncio.wait_for(scenario(lambda h: stack.enter_async_context(serving(h))), 30)

        (uvloop.run if request.param == "uvloop" else asyncio.run)(main())

    return go


Run = Callable[[Callable[[Serve], Awaitable[None]]], None]


async def _ok(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
    w.write(OK)
    return True


def test_a_post_sends_its_headers_and_body_and_reads_the_answer_over_one_kept_connection(run: Run) -> None:
    async def scenario(serve: Serve) -> None:
        engine = await serve(_ok)
        up = Upstream()
        try:
            for i in range(3):
                body = b'{"n":%d}' % i
                r = await up.post(engine.origin, "/v1/completions", [(b"content-type", b"application/json")], body, T)
                assert (r.status, await r.aread()) == (200, b"{}")
                assert (b"content-type", b"application/json") in r.headers
                await r.aclose()
            assert engine.connections == 1  # kept alive and reused
            head, body = engine.requests[2]
            lines = head.split(b"\r\n")
            assert lines[0] == b"POST /v1/completions HTTP/1.1"
            assert f"host: 127.0.0.1:{engine.origin.port}".encode() in lines
            assert b"content-length: 7" in lines and b"content-type: application/json" in lines
            assert body == b'{"n":2}'
        finally:
            await up.aclose()

    run(scenario)


def test_a_chunked_stream_is_read_as_it_comes(run: Run) -> None:
    async def scenario(serve: Serve) -> None:
        more = asyncio.Event()

        async def stream(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
            w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            w.write(b"6\r\ndata 1\r\n")
            await more.wait()  # the second chunk goes only once the client has read the first
            w.write(b"6\r\ndata 2\r\n0\r\n\r\n")
            return True

        engine = await serve(stream)
        up = Upstream()
        try:
            r = await up.post(engine.origin, "/s", [], b"{}", T)
            chunks = []
            async for chunk in r.aiter_stream():
                chunks.append(chunk)
                more.set()
            await r.aclose()
            assert b"".join(chunks) == b"data 1data 2" and chunks[0] == b"data 1"
            r = await up.post(engine.origin, "/s", [], b"{}", T)  # a chunked answer ended cleanly: the connection is kept
            assert await r.aread() == b"data 1data 2"
            assert engine.connections == 1
        finally:
            await up.aclose()

    run(scenario)


def test_a_whole_read_tells_the_first_bytes_at_once_and_times_out_only_between_chunks(run: Run) -> None:
    """`aread(on_first=...)` (a joined stream: the first token ends the prefill) is told of the first chunk while the
    rest is still to come, and waits for the end with the read timeout bounding each gap, not the whole body: four
    chunks 0.15 s apart (0.6 s in all) under a 0.5 s timeout are read whole; a gap of 1.2 s times out."""

    async def scenario(serve: Serve) -> None:
        first = asyncio.Event()
        gaps = [0.15, 0.15, 0.15, 0.15]

        async def stream(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
            w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            w.write(b"1\r\n0\r\n")
            await first.wait()  # the rest goes only once the client was told of the first chunk
            for i, gap in enumerate(gaps, 1):
                await asyncio.sleep(gap)
                w.write(b"1\r\n%d\r\n" % i)
            w.write(b"0\r\n\r\n")
            return True

        engine = await serve(stream)
        up = Upstream()
        timeouts = Timeouts(connect_s=2.0, read_s=0.5)
        try:
            r = await up.post(engine.origin, "/s", [], b"{}", timeouts)
            told: list[bool] = []
            assert await r.aread(on_first=lambda: (told.append(r._done), first.set())) == b"01234"
            assert told == [False]  # once, before the body ended
            await r.aclose()
            gaps[2] = 1.2
            first.clear()
            r = await up.post(engine.origin, "/s", [], b"{}", timeouts)
            with pytest.raises(UpstreamFailed, match=r"within 0\.5 s"):
                await r.aread(on_first=first.set)
            await r.aclose()
        finally:
            await up.aclose()

    run(scenario)


def test_no_engine_listening_is_a_connect_failure(run: Run) -> None:
    async def scenario(serve: Serve) -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        up = Upstream()
        with pytest.raises(ConnectFailed, match="no connection"):
            await up.post(Origin("http", "127.0.0.1", port), "/v1/completions", [], b"{}", T)

    run(scenario)


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        (b"", "closed the connection"),  # the engine dies before answering
        (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", "closed the connection"),  # dies mid-body
        (b"SPDY/9 nonsense\r\n\r\n", "malformed HTTP"),
    ],
)
def test_an_engine_that_fails_after_the_request_went_out_is_an_upstream_failure(run: Run, answer: bytes, match: str) -> None:
    async def scenario(serve: Serve) -> None:
        async def fail(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
            w.write(answer)
            await w.drain()
            return False

        engine = await serve(fail)
        up = Upstream()
        try:
            with pytest.raises(UpstreamFailed, match=match):
                r = await up.post(engine.origin, "/x", [], b"{}", T)
                await r.aread()
            assert not up._idle.get(engine.origin)  # a failed connection is never reused
        finally:
            await up.aclose()

    run(scenario)


def test_an_engine_that_does_not_answer_times_out(run: Run) -> None:
    async def scenario(serve: Serve) -> None:
        async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
            await asyncio.Event().wait()
            return False

        engine = await serve(silent)
        up = Upstream()
        with pytest.raises(UpstreamFailed, match=r"within 0\.2 s"):
            await up.post(engine.origin, "/x", [], b"{}", Timeouts(connect_s=2.0, read_s=0.2))
        await up.aclose()

    run(scenario)


def test_a_stream_that_stalls_times_out_between_chunks(run: Run) -> None:
    async def scenario(serve: Serve) -> None:
        async def stall(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
            await asyncio.Event().wait()
            return False

        engine = await serve(stall)
        up = Upstream()
        r = await up.post(engine.origin, "/x", [], b"{}", Timeouts(connect_s=2.0, read_s=0.2))
        got = []
        with pytest.raises(UpstreamFailed, match="no more of the answer"):
            async for chunk in r.aiter_stream():
                got.append(chunk)
        assert got == [b"abc"]
        await up.aclose()

    run(scenario)


def test_a_connection_the_engine_closed_or_left_idle_too_long_is_not_reused(run: Run) -> None:
    async def scenario(serve: Serve) -> None:
        async def once(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
            w.write(OK)  # keep-alive as far as the headers say, then the engine closes it (its idle timeout)
            await w.drain()
            return False

        engine = await serve(once)
        up = Upstream()
        try:
            r = await up.post(engine.origin, "/x", [], b"{}", T)
            assert await r.aread() == b"{}"
            await until(lambda: not up._idle.get(engine.origin), what="the closed connection out of the pool")
            r = await up.post(engine.origin, "/x", [], b"{}", T)
            assert await r.aread() == b"{}"
            assert engine.connections == 2
        finally:
            await up.aclose()
        kept = await serve(_ok)
        up = Upstream(keepalive_s=0.0)  # every idle connection past its keep-alive
        try:
            for _ in range(2):
                r = await up.post(kept.origin, "/x", [], b"{}", T)
                assert await r.aread() == b"{}"
            assert kept.connections == 2
        finally:
            await up.aclose()

    run(scenario)


def test_a_response_closed_before_its_end_closes_its_connection(run: Run) -> None:
    async def scenario(serve: Serve) -> None:
        async def long(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
            await asyncio.sleep(0.05)
            w.write(b"3\r\ndef\r\n0\r\n\r\n")
            return True

        engine = await serve(long)
        up = Upstream()
        try:
            r = await up.post(engine.origin, "/x", [], b"{}", T)
            async for _ in r.aiter_stream():
                break  # the client went away after the first chunk
            await r.aclose()
            r = await up.post(engine.origin, "/x", [], b"{}", T)
            assert await r.aread() == b"abcdef"
            assert engine.connections == 2  # the abandoned one was not handed out again
        finally:
            await up.aclose()

    run(scenario)


def test_a_body_without_a_length_ends_with_the_connection(run: Run) -> None:
    async def scenario(serve: Serve) -> None:
        async def until_close(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
            w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it")
            await w.drain()
            return False

        engine = await serve(until_close)
        up = Upstream()
        r = await up.post(engine.origin, "/x", [], b"{}", T)
        assert await r.aread() == b"all of it"
        await up.aclose()

    run(scenario)


def test_a_reader_that_falls_behind_pauses_the_socket(run: Run) -> None:
    async def scenario(serve: Serve) -> None:
        size = 8 * HIGH_WATER

        async def big(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: bytes, body: bytes) -> bool:
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
            for _ in range(size // 65536):
                w.write(b"x" * 65536)
                await w.drain()
            return True

        engine = await serve(big)
        up = Upstream()
        try:
            r = await up.post(engine.origin, "/x", [], b"{}", T)
            conn = r._conn
            assert conn is not None
            await until(lambda: conn.paused, what="the socket paused while nobody reads")
            assert r._queued < 2 * HIGH_WATER  # read ahead at most about HIGH_WATER, not the whole answer
            assert len(await r.aread()) == size
        finally:
            await up.aclose()

    run(scenario)
