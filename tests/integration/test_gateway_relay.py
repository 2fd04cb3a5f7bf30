"""A streamed answer through the gateway (gateway.proxy.Relay): relayed as the engine sends it, and given up as soon
as the client goes away: the engine's stream is closed and the request no longer counts on the engine's load."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from kvdir.local_cluster import Gateway, Workers
from tests.support.cluster import one_engine_stack
from tests.support.wait import wait_for

DECODE_TOKENS_PER_S = 20.0  # a 1,000-token answer streams for 50 s


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Workers, Gateway]]:
    """One replica, one worker stub decoding slowly in real time, one gateway."""
    worker = ("--transfer", "tcp", "--decode-tokens-per-s", str(DECODE_TOKENS_PER_S), "--heartbeat-interval-s", "0.3")
    with one_engine_stack(tmp_path_factory.mktemp("relay"), worker) as (_, w, g):
        yield w, g


def _inflight(g: Gateway) -> int:
    return sum(int(e["inflight"]) for e in httpx.get(g.url + "/v1/status", timeout=5).json()["engines"])


def _stream(url: str, max_tokens: int) -> dict[str, object]:
    return {"model": "kvdir-stub", "prompt": "tell me a long story " * 8, "max_tokens": max_tokens, "stream": True}


def test_a_stream_comes_through_as_the_engine_sends_it(stack: tuple[Workers, Gateway]) -> None:
    _, g = stack
    events: list[float] = []
    with httpx.Client(timeout=60) as http, http.stream("POST", g.url + "/v1/completions", json=_stream(g.url, 12)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-kvdir-node"]
        t0 = time.monotonic()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                json.loads(line[6:])
                events.append(time.monotonic() - t0)
    assert len(events) >= 12
    assert events[-1] - events[0] > 0.2  # spread over the decode (12 tokens at 20/s), not delivered at the end
    wait_for(lambda: _inflight(g) == 0, what="the request off the engine's load once its stream ended")


def test_a_client_that_goes_away_mid_stream_stops_the_relay(stack: tuple[Workers, Gateway]) -> None:
    _, g = stack
    with httpx.Client(timeout=60) as http, http.stream("POST", g.url + "/v1/completions", json=_stream(g.url, 1000)) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: a generator over the stream that is collected closes the connection
        assert next(lines).startswith("data: {")  # the answer has begun
        assert _inflight(g) == 1
    # The client closed its connection 50 s before the answer's end: the gateway gives the stream up at once.
    wait_for(lambda: _inflight(g) == 0, timeout=10, what="the gateway to give up the stream of a client gone")
