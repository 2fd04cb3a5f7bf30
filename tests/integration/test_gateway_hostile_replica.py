"""A gateway process whose `--directory` is a hostile replica: a small HTTP server on 127.0.0.1 that answers the
directory's REST routes with what no directory can send (a location in no medium, a region of 0 bytes per block)
and is also the one engine it lists. The gateway keeps answering: a malformed lookup answer is a failed lookup (the
request routed by load), a malformed node list an unreachable directory (the engines kept as last seen)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvdir.local_cluster import Gateway, free_ports
from kvproto import media
from tests.support.wait import wait_for

MODEL = "m"


class Hostile:
    """What the server answers; the test changes it as it goes."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.block_bytes = 4096  # of its host region

    def nodes(self) -> dict[str, Any]:
        region = {"rank": 0, "base_addr": 0, "length": 1 << 20, "block_bytes": self.block_bytes, "medium": "host"}
        node = {
            "node_id": "engine-1",
            "epoch": 1,
            "alive": True,
            "api_url": f"http://127.0.0.1:{self.port}",
            "blocks": 2,
            "capacity_blocks": 64,
            "regions": [{**region, "block_bytes": 4096, "medium": None}, region],
            "transfer_url": "tcp://127.0.0.1:1",
            "fingerprint": "fp",
            "models": [MODEL],
            "load": {"running": 0.0, "waiting": 0.0},
        }
        return {"nodes": [node]}

    def lookup(self) -> dict[str, Any]:
        no_medium = len(media.MEDIA) << media.SHIFT | 1  # top bits that name no medium
        holder = {"node_id": "engine-1", "epoch": 1, "matched_blocks": 2, "slots": [0, no_medium]}
        return {"num_blocks": 2, "holders": [holder]}


@pytest.fixture
def hostile() -> Iterator[Hostile]:
    state = Hostile(free_ports(1)[0])

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path.startswith("/v1/nodes"):
                self._answer(200, state.nodes())
            elif self.path == "/v1/models":
                self._answer(200, {"object": "list", "data": [{"id": MODEL, "max_model_len": 4096}]})
            elif self.path == "/v1/cluster":
                self._answer(200, {"term": 1})
            elif self.path == "/v1/shards":  # as every replica answers when not sharded
                self._answer(200, {"version": 0, "shard": None, "shards": {}, "nodes": {}})
            else:
                self._answer(404, {"error": "not_found"})

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            if self.path == "/v1/lookup":
                self._answer(200, state.lookup())
            elif self.path == "/v1/completions":
                self._answer(200, {"object": "text_completion", "choices": [{"index": 0, "text": "ok"}], "usage": {}})
            else:
                self._answer(404, {"error": "not_found"})

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", state.port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_a_hostile_replicas_answers_are_taken_as_no_answer(hostile: Hostile, tmp_path: Path) -> None:
    g = Gateway(
        tmp_path,
        free_ports(1)[0],
        [f"http://127.0.0.1:{hostile.port}"],
        log_level="info",
        extra_args=("--refresh-s", "0.1", "--no-mirror", "--tokenizer", "bytes"),
    )
    try:
        g.wait_ready(60, engines=1)
        with httpx.Client(timeout=30) as client:
            # The lookup answers a location in no medium: routed by load, not a 500.
            r = client.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 40, "max_tokens": 1})
            assert r.status_code == 200, r.text
            assert (r.headers["x-kvdir-node"], r.headers["x-kvdir-decision"]) == ("engine-1", "fallback")
            # The node list turns to regions of 0 bytes per block: the directory counts as unreachable, the engine
            # is kept as last seen and still routed to, and no refresh fails.
            hostile.block_bytes = 0
            wait_for(lambda: client.get(g.url + "/health").json()["directory"] is False, what="the directory taken as down")
            health = client.get(g.url + "/health").json()
            assert health["engines"] == 1
            metrics = client.get(g.url + "/metrics").text
            assert 'kvdir_gateway_task_failures_total{task="engine_refresh"} 0.0' in metrics
            r = client.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": "y" * 40, "max_tokens": 1})
            assert r.status_code == 200 and r.headers["x-kvdir-node"] == "engine-1", r.text
    finally:
        g.stop()
