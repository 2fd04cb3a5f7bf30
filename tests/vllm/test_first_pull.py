"""A fresh engine whose very first request carries a pull plan (issue #35): it serves it, and keeps serving.

The session engines of test_connector.py have served other requests by the time most of its tests run, so
these engines are this module's own: a holder A and, for each test, a B started for it whose first completion
is the pull (once with the plan in the body, once planned by a gateway of this module's own), after one whose
first completions are plain, which measures its pull bandwidth with a probe of A before any pull. The conftest
runs this file first, and its engines stop before the session's start: at most two vLLM engines at a time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from kvdir.local_cluster import Cluster, Gateway
from tests.support.wait import wait_for
from tests.vllm.conftest import BLOCK, MODEL, PROMPT, Engine, running_directory, start_gateway, vllm_venv
from tests.vllm.test_connector import (
    FAILED,
    PULL,
    REFUSED,
    _decisions,
    _gateway_running,
    _node,
    _plan,
    _served,
    keep_busy,
    wait_gateway_sees_running,
)


class Pair:
    """The holder A and the current fresh engine B (`fresh` replaces B: two engines at most)."""

    def __init__(self, model: Path, directory: Cluster, logs: Path) -> None:
        self.model, self.directory, self.logs = model, directory, logs
        self.a = Engine("first-a", vllm_venv(), model, directory.replica_urls, logs)
        self.b: Engine | None = None

    def fresh(self, name: str) -> Engine:
        if self.b is not None:
            self.b.stop()
        # A longer transfer timeout than the default 5 s: these tests are about a first pull landing, and in the
        # gateway's test, with A decoding two streams on the same two cores, B's reader thread was seen to start
        # the read only after 5 s (the pull then failed at its deadline, as it should on a hung source).
        self.b = Engine(
            name, vllm_venv(), self.model, self.directory.replica_urls, self.logs, connector={"transfer_timeout_s": 30}
        )
        self.b.start()
        return self.b

    def stop(self) -> None:
        for e in (self.a, self.b):
            if e is not None:
                e.stop()


@pytest.fixture(scope="module")
def own_directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_directory(tmp_path_factory.mktemp("first-pull-directory")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def pair(model: Path, own_directory: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    p = Pair(model, own_directory, tmp_path_factory.mktemp("first-pull-engines"))
    try:
        p.a.start()
        yield p
    finally:
        p.stop()


def _alive(engine: Engine) -> None:
    """The engine still serves: its process runs, /health answers 200, and no worker died (vLLM's log line)."""
    assert engine.proc is not None and engine.proc.poll() is None, engine.log_lines("died unexpectedly")
    assert httpx.get(engine.url + "/health", timeout=10).status_code == 200, engine.log_lines("died unexpectedly")
    assert not engine.log_lines("died unexpectedly")


def _first_request_is_a_pull(b: Engine) -> None:
    """B has served no completion (nothing published, nothing pulled) and its log shows none."""
    assert b.metric(PULL) == 0 and b.metric(FAILED) == 0 and b.metric("kvdir_connector_published_blocks_total") == 0
    assert not b.log_lines("POST /v1/completions")


def test_a_fresh_engine_measures_its_pull_bandwidth_before_its_first_pull(pair: Pair) -> None:
    """Issue #43, the first pull priced right: once the directory lists B, B's worker half reads a probe of A's KV
    as a pull would (into buffers of its own), and the scheduler half reports its bandwidth (`pull_gbps`) from B's
    next step on: vLLM runs no step while an engine is idle, so B is sent plain requests until it does."""
    b = pair.fresh("first-b0")
    pair.a.wait_ready()
    b.wait_ready()
    wait_for(lambda: (n := _node(pair.directory, b.name)) is not None and n["alive"], what="B registered", timeout=60)

    def measured() -> float:
        b.complete("a plain prompt, one step", max_tokens=1)
        n = _node(pair.directory, b.name)
        return n["load"].get("pull_gbps", 0.0) if n is not None else 0.0

    assert wait_for(measured, what="B's pull_gbps", timeout=60, interval=0.5) > 0
    # Measured by the probe's read alone: nothing pulled, nothing failed, the read's page bytes counted.
    assert b.metric(PULL) == 0 and b.metric(FAILED) == 0, b.log_lines("pull of")
    assert b.metric("kvdir_connector_pull_page_bytes_total") > 0


def test_a_fresh_engines_first_request_can_be_a_pull(pair: Pair) -> None:
    b = pair.fresh("first-b1")
    pair.a.wait_ready()
    b.wait_ready()
    hashes, holder = _served(pair.a, pair.directory)
    _first_request_is_a_pull(b)
    out = b.complete(PROMPT, kv_transfer_params=_plan(holder))
    pullable = min(len(hashes), (out["usage"]["prompt_tokens"] - 1) // BLOCK)
    assert (b.metric(PULL), b.metric(FAILED)) == (pullable, 0), b.log_lines("pull of")
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= pullable * BLOCK
    _alive(b)
    # And it goes on serving: the same prompt recomputed gives the pulled prefix's output.
    b.reset_cache()
    again = b.complete(PROMPT)
    assert again["choices"][0]["text"] == out["choices"][0]["text"]
    _alive(b)


def test_a_fresh_engines_first_request_can_be_a_gateway_pull(pair: Pair, tmp_path_factory: pytest.TempPathFactory) -> None:
    """As test_connector's busy-holder test: A runs two long streams, so the gateway's TTFT model sends the
    prompt to the fresh B with a plan to pull it from A."""
    b = pair.fresh("first-b2")
    pair.a.wait_ready()
    b.wait_ready()
    hashes, _ = _served(pair.a, pair.directory)
    wait_for(lambda: (n := _node(pair.directory, b.name)) is not None and n["alive"], what="B registered", timeout=60)
    _first_request_is_a_pull(b)
    gateway: Gateway = start_gateway(tmp_path_factory.mktemp("first-pull-gateway"), pair.directory)
    try:
        wait_for(lambda: _gateway_running(gateway, b.name) is not None, what="the gateway to list B", timeout=60)
        a = pair.a
        with ExitStack() as streams, httpx.Client(timeout=180) as http:
            keep_busy(streams, http, a)
            wait_gateway_sees_running(gateway, a.name, 2)
            r = http.post(
                gateway.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
            )
        assert r.status_code == 200, (r.text, b.log_lines("died unexpectedly"))
        assert (r.headers["x-kvdir-node"], r.headers["x-kvdir-decision"]) == (b.name, "pull"), _decisions(gateway)
    finally:
        gateway.stop()
    out = r.json()
    pullable = min(len(hashes), (out["usage"]["prompt_tokens"] - 1) // BLOCK)
    assert (b.metric(PULL), b.metric(FAILED)) == (pullable, 0), b.log_lines("pull of")
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= pullable * BLOCK
    _alive(b)


def test_with_the_directory_down_a_pull_waits_on_nothing(pair: Pair) -> None:
    """Issue #29 (item 5): the worker reads pull sources from a list it keeps fresh in the background, never on the
    engine step. With every replica stopped, a plan naming a source of the last list is still pulled, and one
    naming an epoch no list had is recomputed at once (before: a blocking node-list call, 3-5 s, on the step)."""
    a, b = pair.a, pair.b
    assert b is not None
    _, holder = _served(a, pair.directory)
    other = "an unrelated prompt of about the same length, computed from scratch " * 12
    t0 = time.monotonic()
    b.complete(other)
    plain_s = time.monotonic() - t0
    pair.directory.stop()
    b.reset_cache()
    pulled, refused = b.metric(PULL), b.metric(REFUSED)
    out = b.complete(PROMPT, kv_transfer_params=_plan(holder))
    assert b.metric(PULL) > pulled and out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    b.reset_cache()
    t0 = time.monotonic()
    b.complete(PROMPT, kv_transfer_params=_plan(holder, epoch=holder["epoch"] + 1))
    unknown_s = time.monotonic() - t0
    assert b.metric(REFUSED) > refused and b.log_lines("is not registered (as last seen)")
    # An order of magnitude, not a speed target: the old blocking call alone waited out a 3 s deadline.
    assert unknown_s < plain_s + 1.5, (unknown_s, plain_s)
    _alive(b)
