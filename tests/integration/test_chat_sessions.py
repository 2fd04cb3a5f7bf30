"""`kvdir bench routers`' closed-loop chat client (kvtools/bench/chat_sessions.py) against a real HTTP server on
127.0.0.1 that streams chat answers and records what it was sent and when: a session's turn k+1 arrives only
after turn k's answer was streamed whole, carries that very answer (unique per request) in its history, no
session ever has two requests in flight, `concurrency` sessions do run at once, and a failed turn ends its session
(the later turns are counted as failed and never sent)."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvdir.local_cluster import free_ports
from kvtools.bench.chat_sessions import ChatShape, make_sessions, run_sessions
from tests.support.wait import wait_for

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]


@dataclass
class Seen:
    """One request the server got: its session (the first user message), its messages, when it arrived and when
    the server had streamed its whole answer."""

    session: str
    messages: list[dict[str, str]]
    arrived: float
    answered: float = 0.0
    answer: str = ""


@dataclass
class ChatServer:
    """A chat server that records every request; `fail_turn` answers that turn (0-based) with a 500, and `hold`
    holds the answers until two sessions have a request in flight at once (for 5 s at the most)."""

    fail_turn: int | None = None
    hold: bool = False
    seen: list[Seen] = field(default_factory=list)
    in_flight: dict[str, int] = field(default_factory=dict)
    most_in_flight: int = 0  # sessions with a request in flight at once, at the most
    overlapped: asyncio.Event | None = None

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        messages = body["messages"]
        seen = Seen(messages[0]["content"], messages, time.monotonic())
        self.seen.append(seen)
        turn = sum(m["role"] == "user" for m in messages) - 1
        if turn == self.fail_turn:
            return JSONResponse({"error": "no"}, status_code=500)
        self.in_flight[seen.session] = self.in_flight.get(seen.session, 0) + 1
        sessions_in_flight = sum(n > 0 for n in self.in_flight.values())
        self.most_in_flight = max(self.most_in_flight, sessions_in_flight)
        if self.overlapped is None:
            self.overlapped = asyncio.Event()
        if sessions_in_flight >= 2:
            self.overlapped.set()
        return StreamingResponse(self._stream(seen, len(self.seen)), media_type="text/event-stream")

    async def _stream(self, seen: Seen, n: int) -> AsyncIterator[str]:
        try:
            if self.hold:
                assert self.overlapped is not None
                try:
                    await asyncio.wait_for(self.overlapped.wait(), timeout=5.0)
                except TimeoutError:
                    pass
            yield _chunk({"role": "assistant"})  # no content: not yet the first token
            for piece in (f"answer {n}", " to", f" {seen.session[:12]!r}"):
                await asyncio.sleep(0.01)  # a token's decode: the answer spans several chunks
                seen.answer += piece
                yield _chunk({"content": piece})
            seen.answered = time.monotonic()  # every piece is out; the client can only finish the turn after this
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight[seen.session] -= 1


def _chunk(delta: dict[str, str]) -> str:
    return f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta}]})}\n\n"


@pytest.fixture
def serve() -> Iterator[tuple[str, ChatServer]]:
    """A fresh `ChatServer` under uvicorn on a free port; stopped after the test."""
    chat = ChatServer()
    port = free_ports(1)[0]
    app = Starlette(routes=[Route("/v1/chat/completions", chat.chat, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 10, interval=0.02, what="the chat server to start")
    try:
        yield f"http://127.0.0.1:{port}", chat
    finally:
        server.should_exit = True
        thread.join(10)


SHAPE = ChatShape(sessions=4, turns=3, document=20, question=4, answer=8, own=1, bare=1)


def test_each_turn_is_sent_after_the_last_answer_arrived_and_carries_it(serve: tuple[str, ChatServer]) -> None:
    url, server = serve
    server.hold = True
    sessions = make_sessions(SHAPE, WORDS)
    turns = asyncio.run(run_sessions(url, "m", sessions, concurrency=2, think_s=0.02))
    assert [(t.session, t.turn) for t in turns] == [(s, k) for s in range(4) for k in range(3)]
    assert all(t.ttft_s is not None and t.ttft_s > 0 and t.error is None for t in turns)
    assert len(server.seen) == 12
    assert server.most_in_flight == 2  # two sessions at once, never more
    for session in sessions:
        seen = [r for r in server.seen if r.session == session.questions[0]]
        assert len(seen) == 3
        for k, (last, this) in enumerate(itertools.pairwise(seen), start=1):
            assert this.arrived > last.answered > 0  # sent only once the whole answer had been streamed
            assert this.messages[:-1] == last.messages + [{"role": "assistant", "content": last.answer}]
            assert this.messages[-1] == {"role": "user", "content": session.questions[k]}


def test_a_failed_turn_ends_its_session(serve: tuple[str, ChatServer]) -> None:
    url, server = serve
    server.fail_turn = 1
    sessions = make_sessions(SHAPE, WORDS)[:1]
    turns = asyncio.run(run_sessions(url, "m", sessions, concurrency=1, think_s=0.0))
    assert turns[0].ttft_s is not None
    assert turns[1].ttft_s is None and turns[1].error is not None and "HTTP 500" in turns[1].error
    assert turns[2].ttft_s is None and turns[2].error == "not sent: an earlier turn failed"
    assert len(server.seen) == 2  # the third turn had no answer to build on: never sent
