"""Only the gateway writes pull plans: a client's `kvdir_pull`, top level or inside `kv_transfer_params`, never
reaches an engine, and the rest of the client's `kv_transfer_params` does, unchanged.

The gateway app runs in-process (its lifespan included) in front of a real HTTP server on 127.0.0.1 that
records what it is sent; the directory is a port nothing listens on, so the request is routed by load to
the one static engine (no plan of the gateway's own to tell apart from the client's).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.config import GatewaySettings
from kvdir.local_cluster import free_ports

ANSWER = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}


@pytest.fixture
def engine() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A stand-in engine: answers every POST with one completion and keeps the bodies it got."""
    bodies: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def answer(self, body: dict[str, Any]) -> None:
            out = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def do_GET(self) -> None:  # the gateway's /v1/models probe
            self.answer({"object": "list", "data": []})

        def do_POST(self) -> None:
            bodies.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            self.answer(ANSWER)

        def log_message(self, format: str, *args: Any) -> None:
            return

    class Server(ThreadingHTTPServer):
        def handle_error(self, request: Any, client_address: Any) -> None:
            if not isinstance(sys.exc_info()[1], ConnectionError):  # the gateway leaving mid-probe at shutdown
                super().handle_error(request, client_address)

    server = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", bodies
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_a_client_pull_plan_is_dropped_and_its_other_transfer_params_forwarded(
    engine: tuple[str, list[dict[str, Any]]],
) -> None:
    url, bodies = engine
    settings = GatewaySettings(
        http="127.0.0.1:8100", engine=url, directory=f"http://127.0.0.1:{free_ports(1)[0]}", mirror=False, tokenizer="bytes"
    )
    app = create_app(settings)
    plan = {"source_node": "victim", "source_epoch": 1, "slots": [1, 2, 3]}
    params = {"do_remote_decode": False, "remote_host": "10.0.0.9", "nested": {"kvdir_pull": "kept: not the plan's field"}}
    sent = {
        "model": "m",
        "prompt": "hello",
        "max_tokens": 2,
        "kvdir_pull": plan,
        "kv_transfer_params": {**params, "kvdir_pull": plan},
    }

    async def run() -> httpx.Response:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
                return await client.post("/v1/completions", json=sent)

    r = asyncio.run(run())
    assert r.status_code == 200, r.text
    assert r.headers["x-kvdir-decision"] != "pull"  # no directory: no plan of the gateway's own either
    # Sent as a stream, with the usage chunk, to be joined into the answer (gateway.stream_join); this engine
    # answers it unstreamed, which is relayed as it came.
    streamed = {"stream": True, "stream_options": {"include_usage": True}}
    assert bodies == [{"model": "m", "prompt": "hello", "max_tokens": 2, "kv_transfer_params": params, **streamed}]
