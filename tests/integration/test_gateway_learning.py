"""The gateway learns from what the engines do (issue #44): a non-streamed request's prefill ends at its first
token, each engine's TTFT curve is learned from the first bytes observed, and sessions stay with their history."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tests.support.wait import wait_for

MODEL = "kvdir-stub"


def _engines(url: str) -> dict[str, dict[str, Any]]:
    return {e["node_id"]: e for e in httpx.get(url + "/v1/status", timeout=5).json()["engines"]}


def test_a_non_streamed_request_stops_counting_as_prefill_at_its_first_token(file_directory, make_workers, make_gateway) -> None:
    # Real time (no time scale): a 1,000-token prefill takes 10 ms, the 60 tokens of the answer 3 s.
    make_workers(file_directory, 1, extra_args=("--time-scale", "1", "--decode-tokens-per-s", "20"))
    g = make_gateway(file_directory, 1)
    done = threading.Event()
    answer: list[httpx.Response] = []

    def ask() -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 1000}], "max_tokens": 60}
        answer.append(httpx.post(g.url + "/v1/chat/completions", json=body, timeout=60))
        done.set()

    threading.Thread(target=ask, daemon=True).start()
    # While the engine decodes, the gateway counts the request in flight there but its prefill as over.
    wait_for(lambda: any(e["inflight"] == 1 for e in _engines(g.url).values()), timeout=10, what="the request in flight")
    wait_for(
        lambda: done.is_set() or all(e["pending_prefill_tokens"] == 0 for e in _engines(g.url).values()),
        timeout=10,
        what="the prefill to end",
    )
    assert not done.is_set(), "the prefill was counted until the whole answer came"
    (engine,) = _engines(g.url).values()
    assert engine["inflight"] == 1
    assert done.wait(30)
    r = answer[0]
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 60
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and len(choice["message"]["content"]) == 60
    assert choice["finish_reason"] == "length"
    # Its first byte was observed and scored against the estimate.
    wait_for(lambda: _engines(g.url)[engine["node_id"]]["ttft_observed"] == 1, timeout=5, what="the TTFT observed")


def test_the_gateway_learns_an_engine_that_slows_with_load_and_keeps_sessions_home(
    file_directory, make_workers, make_gateway
) -> None:
    # Engines that prefill 20,000 tokens/s alone and half as fast per other request running; the gateway told
    # they prefill 1,000,000 tokens/s.
    make_workers(
        file_directory,
        2,
        extra_args=(
            "--time-scale", "1", "--prefill-tokens-per-s", "20000", "--prefill-contention", "0.5",
            "--decode-tokens-per-s", "2000",
        ),
    )  # fmt: skip
    g = make_gateway(file_directory, 2, extra_args=("--prefill-tokens-per-s", "1000000"))
    rng = random.Random(7)
    moved = stayed = 0
    lock = threading.Lock()

    def session(i: int) -> None:
        nonlocal moved, stayed
        messages = [{"role": "user", "content": f"session {i}: " + " ".join(str(rng.random()) for _ in range(150))}]
        home = None
        for _turn in range(6):
            r = httpx.post(
                g.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": messages, "max_tokens": 8, "stream": True},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            node = r.headers["x-kvdir-node"]
            with lock:
                if home is not None:
                    stayed, moved = (stayed + 1, moved) if node == home else (stayed, moved + 1)
            home = node
            messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"more {_turn} " * 40}]

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(session, range(6)))
    engines = _engines(g.url)
    assert sum(e["ttft_observed"] for e in engines.values()) == 36  # every first byte, wherever the sessions went
    learned = [e for e in engines.values() if e["ttft_observed"] >= 6]  # (a session's turns, at least)
    assert learned, engines
    for e in learned:
        # Learned from the prior of 1,000,000 tokens/s toward the engine's 20,000 (at most, alone).
        assert 2_000 < e["prefill_tokens_per_s"] < 100_000, e
    assert stayed >= 4 * moved, (stayed, moved)
