"""The gateway reads real worker stubs' load from their /metrics (gateway.engine_load) and counts its own requests
there once: requests held in a stub (one running, the rest queued behind `--max-running 1`) show on the gateway's
status as the stub's running and waiting, and a least-loaded choice counts the gateway's queued requests once."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvproto.schemas import DP_RANK_HEADER
from tests.support.wait import wait_for

MODEL = "kvdir-stub"
# Slow decode: a request holds its place for minutes; the test ends by closing its connections.
HELD = ("--time-scale", "1", "--max-running", "1", "--decode-tokens-per-s", "20")


@contextmanager
def _held_requests() -> Iterator[list[socket.socket]]:
    """Connections whose requests are left in flight (never read), closed at the end."""
    held: list[socket.socket] = []
    try:
        yield held
    finally:
        for s in held:
            s.close()


def _send(held: list[socket.socket], url: str, prompt: str, extra_headers: str = "") -> None:
    """POST a streamed completion to `url` and leave it in flight: its answer is never read."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2000, "stream": True}).encode()
    u = urlsplit(url)
    s = socket.create_connection((u.hostname, u.port), timeout=10)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra_headers}\r\n"
    s.sendall(head.encode() + body)
    held.append(s)


def _engines(gateway_url: str) -> dict[str, dict[str, Any]]:
    return {e["node_id"]: e for e in httpx.get(gateway_url + "/v1/status", timeout=5).json()["engines"]}


def _engines_once(gateway_url: str, cond: Callable[[dict[str, dict[str, Any]]], bool], what: str) -> dict[str, dict[str, Any]]:
    """The status's engines, once `cond` holds of them."""

    def engines() -> dict[str, dict[str, Any]] | None:
        e = _engines(gateway_url)
        return e if cond(e) else None

    return wait_for(engines, what=what)


def _load(e: dict[str, Any]) -> tuple[Any, ...]:
    return e["load_source"], e["running"], e["waiting"], e["inflight"]


def test_held_requests_show_as_the_stubs_running_and_waiting_and_count_once(file_directory, make_workers, make_gateway) -> None:
    c = file_directory
    w = make_workers(c, 2, HELD)
    a, b = w.node_ids
    g = make_gateway(c, 2, ("--policy", "least_loaded", "--load-scrape-s", "0.1"))
    with _held_requests() as held:
        # Another client's four requests straight to b: one runs, three wait; the gateway has none there.
        for i in range(4):
            _send(held, w.urls[1], f"a direct request {i} " * 4)
        wait_for(lambda: _load(_engines(g.url)[b]) == ("scrape", 1, 3, 0), what="b's direct requests on the status")
        # Three through the gateway: the least loaded is a (0 against 4), every time.
        for i in range(3):
            _send(held, g.url, f"a routed request {i} " * 4)
            wait_for(lambda i=i: _engines(g.url)[a]["inflight"] == i + 1, what=f"routed request {i} in flight at a")
        # a runs one of them and queues two: the stub's figures, read from its /metrics, not the heartbeat's.
        engines = _engines_once(g.url, lambda e: _load(e[a]) == ("scrape", 1, 2, 3), "a's figures scraped")
        assert engines[a]["load_age_s"] < 2 and engines[a]["kv_usage"] > 0 and engines[a]["preemptions"] == 0
        # a's load is its 3 requests (all the gateway's), b's its 4: the next request goes to a. Counting the
        # gateway's queued requests twice (a's 2 waiting + its 3 in flight) would make a 5 and send it to b.
        _send(held, g.url, "the deciding request")
        engines = _engines_once(g.url, lambda e: e[a]["inflight"] + e[b]["inflight"] == 4, "the request sent")
        assert (engines[a]["inflight"], engines[b]["inflight"]) == (4, 0)


def test_each_data_parallel_rank_shows_its_own_load(file_directory, make_workers, make_gateway) -> None:
    c = file_directory
    w = make_workers(c, 1, (*HELD, "--dp", "2"))
    g = make_gateway(c, 2, ("--load-scrape-s", "0.1"))
    with _held_requests() as held:
        for i in range(3):
            _send(held, w.urls[0], f"a request for rank 1, {i} " * 4, f"{DP_RANK_HEADER}: 1\r\n")
        _engines_once(
            g.url,
            lambda e: (_load(e["worker-1-dp0"]), _load(e["worker-1-dp1"])) == (("scrape", 0, 0, 0), ("scrape", 1, 2, 0)),
            "each rank's own figures",
        )
