"""The worker stub's app in-process, its lifespan included: the runtime it builds and closes, and its routes.

The directory is a port nothing listens on (the publisher keeps retrying in the background, which no
request waits for) and the transfer engine is the TCP one, on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI

from kvdir.local_cluster import free_ports
from worker_stub.api import create_app
from worker_stub.config import WorkerSettings
from worker_stub.runtime import WorkerRuntime

T = TypeVar("T")
MODEL = "kvdir-stub"
METRICS = {
    "kvdir_worker_requests_total",
    "kvdir_worker_prompt_tokens_total",
    "kvdir_worker_cached_tokens_total",
    "kvdir_worker_time_to_first_token_seconds",
    "kvdir_worker_publish_lag_seconds",
    "kvdir_worker_published_blocks_total",
    "kvdir_worker_pulled_blocks_total",
    "kvdir_worker_pull_failed_blocks_total",
    "kvdir_worker_pull_errors_total",
    "kvdir_worker_pull_refused_total",
    "kvdir_worker_pool_full_total",
    "kvdir_worker_running",
    "kvdir_worker_waiting",
    "kvdir_worker_free_slots",
    "kvdir_worker_cached_blocks",
    "kvdir_worker_evictions_total",
    "kvdir_worker_publish_pending",
    "kvdir_worker_epoch",
}


def _settings(**overrides: Any) -> WorkerSettings:
    values: dict[str, Any] = {
        "directory": f"http://127.0.0.1:{free_ports(1)[0]}",
        "transfer": "tcp",
        "capacity_blocks": 64,
        "time_scale": 0,
        **overrides,
    }
    return WorkerSettings(**values)


def _serve(settings: WorkerSettings, scenario: Callable[[FastAPI, httpx.AsyncClient], Awaitable[T]]) -> T:
    async def main() -> T:
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
                return await scenario(app, client)

    return asyncio.run(main())


def _events(text: str) -> list[Any]:
    return [json.loads(line.removeprefix("data: ")) for line in text.split("\n\n") if line and line != "data: [DONE]"]


def test_the_lifespan_builds_one_runtime_that_health_and_metrics_read() -> None:
    async def scenario(app: FastAPI, client: httpx.AsyncClient) -> None:
        [runtime] = app.state.runtimes  # one data-parallel rank (--dp 1)
        assert isinstance(runtime, WorkerRuntime)
        health = (await client.get("/health")).json()
        assert health == {"ok": True, "node_id": "worker-7", "epoch": None, "load": runtime.engine.load()}
        text = (await client.get("/metrics")).text
        types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE "))
        assert METRICS <= types.keys(), METRICS - types.keys()
        counted = [m for m in METRICS if m.endswith("_total")]  # what the engine and its pool count: counters, not gauges
        assert all(types[m] == "counter" for m in counted), {m: types[m] for m in counted}
        assert "kvdir_worker_epoch 0.0" in text  # the publisher's, not yet registered
        assert "kvdir_worker_free_slots 64.0" in text

    _serve(_settings(node_id="worker-7"), scenario)


def test_a_completion_counts_its_prompt_and_a_repeat_is_cached() -> None:
    prompt = "x" * 40  # two full blocks of 16 byte tokens

    async def scenario(app: FastAPI, client: httpx.AsyncClient) -> list[dict[str, Any]]:
        bodies = []
        for _ in range(2):
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3})
            assert r.status_code == 200, r.text
            bodies.append(r.json())
        text = (await client.get("/metrics")).text
        assert 'kvdir_worker_requests_total{endpoint="completions"} 2.0' in text
        assert "kvdir_worker_prompt_tokens_total 80.0" in text
        assert 'kvdir_worker_cached_tokens_total{source="local"} 32.0' in text
        return bodies

    first, second = _serve(_settings(), scenario)
    assert first["object"] == "text_completion" and first["choices"][0]["text"] == "the"
    assert first["usage"] == {
        "prompt_tokens": 40,
        "completion_tokens": 3,
        "total_tokens": 43,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert second["kvdir"]["local_cached_tokens"] == 32 and second["kvdir"]["node_id"] == "worker-1"


def test_a_streamed_chat_ends_with_usage_then_done() -> None:
    async def scenario(app: FastAPI, client: httpx.AsyncClient) -> httpx.Response:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
        return await client.post("/v1/chat/completions", json=body)

    r = _serve(_settings(), scenario)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache"
    assert r.text.endswith("data: [DONE]\n\n")
    events = _events(r.text)
    assert [e["choices"][0]["delta"]["content"] for e in events] == ["t", "h", ""]
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, "length"]
    assert {e["id"] for e in events} == {events[0]["id"]} and events[0]["id"].startswith("chatcmpl-")
    assert events[-1]["usage"]["completion_tokens"] == 2 and events[-1]["kvdir"]["node_id"] == "worker-1"


def test_a_request_past_a_full_queue_is_refused_with_429() -> None:
    async def scenario(app: FastAPI, client: httpx.AsyncClient) -> tuple[httpx.Response, httpx.Response]:
        body = {"model": MODEL, "prompt": "slow", "max_tokens": 20}
        running = asyncio.create_task(client.post("/v1/completions", json=body))
        while app.state.runtimes[0].engine.running == 0:
            await asyncio.sleep(0.005)
        refused = await client.post("/v1/completions", json=body)
        return await running, refused

    served, refused = _serve(_settings(max_running=1, max_queue=0, time_scale=1.0, decode_tokens_per_s=100.0), scenario)
    assert served.status_code == 200
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "rate_limit_error" and refused.json()["error"]["code"] == "queue_full"


def test_a_malformed_pull_plan_is_a_400_naming_it() -> None:
    async def scenario(app: FastAPI, client: httpx.AsyncClient) -> httpx.Response:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "kvdir_pull": {"slots": "nope"}}
        return await client.post("/v1/completions", json=body)

    r = _serve(_settings(), scenario)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "kvdir_pull" and r.json()["error"]["message"].startswith("kvdir_pull: ")
