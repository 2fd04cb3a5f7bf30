"""Hostile input against real processes: deep and huge JSON, overflowing numbers, unknown nodes,
duplicate hashes, slow clients and registration floods get a fast 4xx (or a correct answer),
never a 5xx, a hang, or unbounded growth."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.cluster import one_engine_stack
from tests.support.wait import wait_for

JSON = {"content-type": "application/json"}
MODEL = "kvdir-stub"


def _post_raw(url: str, body: bytes, timeout: float = 10.0) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = httpx.post(url, content=body, headers=JSON, timeout=timeout)
    return r, time.monotonic() - t0


def _register(url: str, node_id: str, **extra) -> int:
    r = httpx.post(url + "/v1/nodes", json={"node_id": node_id, "api_url": "http://127.0.0.1:9", **extra}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["epoch"]


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """One replica, one worker stub (no simulated waiting) and a gateway, shared by this module's tests."""
    worker = ("--time-scale", "0", "--transfer", "tcp", "--max-model-len", "4096", "--heartbeat-interval-s", "0.3")
    with one_engine_stack(tmp_path_factory.mktemp("hostile"), worker) as stack:
        yield stack


DEEP = 10_000


DEEP_BODIES = [
    b"[" * DEEP + b"]" * DEEP,
    b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    b'{"hashes": ' + b"[" * DEEP + b"]" * DEEP + b"}",
    b'{"model": "kvdir-stub", "prompt": "hi", "x": ' + b"[" * DEEP + b"]" * DEEP + b"}",
]


def test_deeply_nested_json_is_a_fast_400(stack) -> None:
    c, _, g = stack
    for body in DEEP_BODIES:
        for url in (
            c.replica_urls[0] + "/v1/lookup",
            c.replica_urls[0] + "/v1/blocks",
            c.replica_urls[0] + "/v1/nodes",
            g.url + "/v1/completions",
            g.url + "/v1/chat/completions",
        ):
            r, took = _post_raw(url, body)
            assert r.status_code == 400, (url, body[:60], r.status_code, r.text[:300])
            assert took < 2.0, (url, took)
            err = r.json()["error"]
            assert err if isinstance(err, str) else err["message"]


def test_nested_but_parseable_json_is_refused_or_served_not_5xx(stack) -> None:
    c, _, g = stack
    nested = b"[" * 500 + b"1" + b"]" * 500  # within the parser's limit: reaches validation (or is forwarded)
    r, _ = _post_raw(c.replica_urls[0] + "/v1/lookup", b'{"hashes": ' + nested + b"}")
    assert r.status_code == 422 and r.json()["error"] == "invalid_request"
    r, _ = _post_raw(g.url + "/v1/completions", b'{"model": "kvdir-stub", "prompt": ' + nested + b"}")
    assert r.status_code == 400
    r, _ = _post_raw(
        g.url + "/v1/completions", b'{"model": "kvdir-stub", "prompt": "hello", "max_tokens": 1, "x": ' + nested + b"}"
    )
    assert r.status_code == 200, r.text[:300]  # unknown fields are forwarded untouched; the engine ignores them


def test_huge_json_is_refused_fast(stack) -> None:
    c, _, g = stack
    url = c.replica_urls[0]
    # Over the body limit (8 MiB by default): 413 before any parsing, declared or streamed.
    big = b'{"hashes": [' + b"1," * (5 << 20) + b"1]}"
    r, took = _post_raw(url + "/v1/lookup", big)
    assert r.status_code == 413 and r.json()["error"] == "body_too_large" and took < 5.0, (r.status_code, took)

    def chunks():
        for _ in range(10):
            yield b" " * (1 << 20)

    r = httpx.post(url + "/v1/lookup", content=chunks(), headers=JSON, timeout=10)
    assert r.status_code == 413
    # Under the body limit but far over the count limits: 422, in bounded time.
    many = b'{"hashes": [' + b"12345," * 1_000_000 + b"1]}"  # ~7 MB, a million hashes
    r, took = _post_raw(url + "/v1/lookup", many, timeout=30)
    assert r.status_code == 422 and r.json()["error"] == "too_many" and took < 10.0, (r.status_code, r.text[:200], took)
    r, took = _post_raw(url + "/v1/nodes", b'{"node_id": "' + b"n" * (4 << 20) + b'", "api_url": "http://x"}', timeout=30)
    assert r.status_code == 422 and took < 10.0
    # The gateway's limit is 64 MiB.
    r, took = _post_raw(g.url + "/v1/completions", b'{"model": "m", "prompt": "' + b"a" * (65 << 20) + b'"}', timeout=30)
    assert r.status_code == 413 and took < 10.0, (r.status_code, took)
    assert httpx.get(url + "/readyz").status_code == 200


def test_overflowing_and_negative_numbers_are_422(make_cluster) -> None:
    c = make_cluster(1, lease_ttl_s=300)
    url = c.replica_urls[0]
    epoch = _register(url, "n1", capacity_blocks=100)
    cases = [
        ("/v1/blocks", {"node_id": "n1", "epoch": epoch, "blocks": [{"hash": 2**64, "slot": 0}]}, 422),
        ("/v1/blocks", {"node_id": "n1", "epoch": epoch, "blocks": [{"hash": -1, "slot": 0}]}, 422),
        ("/v1/blocks", {"node_id": "n1", "epoch": epoch, "blocks": [{"hash": 1, "slot": -1}]}, 422),
        ("/v1/blocks", {"node_id": "n1", "epoch": epoch, "blocks": [{"hash": 1, "slot": 2**32}]}, 422),
        ("/v1/blocks", {"node_id": "n1", "epoch": epoch, "blocks": [{"hash": 1, "slot": 100}]}, 422),  # past capacity
        ("/v1/blocks", {"node_id": "n1", "epoch": epoch, "blocks": [{"hash": True, "slot": 0}]}, 422),
        ("/v1/blocks", {"node_id": "n1", "epoch": epoch, "blocks": [{"hash": 1e19, "slot": 0}]}, 422),
        ("/v1/blocks", {"node_id": "n1", "epoch": 2**63, "blocks": []}, 422),  # epochs are int64
        ("/v1/blocks", {"node_id": "n1", "epoch": 2**63 - 1, "blocks": []}, 409),  # a valid epoch, just not the node's
        ("/v1/blocks", {"node_id": "n1", "epoch": -5, "blocks": []}, 422),
        ("/v1/blocks/remove", {"node_id": "n1", "epoch": epoch, "hashes": [2**64 + 1]}, 422),
        ("/v1/lookup", {"hashes": [2**64]}, 422),
        ("/v1/lookup", {"hashes": [-(2**63)]}, 422),
        ("/v1/lookup", {"tokens": [2**32]}, 422),
        ("/v1/lookup", {"tokens": [-1]}, 422),
        ("/v1/lookup", {"tokens": [1] * 32, "block_size": -16}, 422),
        ("/v1/lookup", {"tokens": [1] * 32, "block_size": 2**40}, 422),
        ("/v1/nodes", {"node_id": "n2", "api_url": "http://x", "capacity_blocks": 2**40}, 422),
        ("/v1/nodes", {"node_id": "n2", "api_url": "http://x", "capacity_blocks": -1}, 422),
        (
            "/v1/nodes",
            {"node_id": "n2", "api_url": "http://x", "regions": [{"rank": 0, "base_addr": 2**64, "length": 1, "block_bytes": 1}]},
            422,
        ),
        (
            "/v1/nodes",
            {"node_id": "n2", "api_url": "http://x", "regions": [{"rank": 70000, "base_addr": 0, "length": 1, "block_bytes": 1}]},
            422,
        ),
        ("/v1/nodes/n1/heartbeat", {"epoch": epoch, "load": {"running": 1.0, "x" * 65: 1.0}}, 422),
    ]
    for path, body, status in cases:
        r = httpx.post(url + path, json=body, timeout=10)
        assert r.status_code == status, (path, body, r.status_code, r.text[:300])
        assert r.json()["error"], r.text
    # Integers with more digits than fit 64 bits (valid JSON, out of range: 422) and non-finite numbers:
    # NaN and Infinity are not JSON (400), 1e999 overflows (422). A non-finite load used to be stored,
    # and then every answer listing the node (GET /v1/nodes) failed with 500.
    r, _ = _post_raw(url + "/v1/lookup", b'{"hashes": [1' + b"0" * 5000 + b"]}")
    assert r.status_code == 422
    for bad, status in ((b"NaN", 400), (b"Infinity", 400), (b"-Infinity", 400), (b"1e999", 422)):
        r, _ = _post_raw(url + "/v1/nodes/n1/heartbeat", b'{"epoch": %d, "load": {"running": %s}}' % (epoch, bad))
        assert r.status_code == status, (bad, r.text)
    r = httpx.get(url + "/v1/nodes", timeout=5)
    assert r.status_code == 200 and r.json()["nodes"][0]["node_id"] == "n1"


def test_unknown_nodes_are_4xx(make_cluster) -> None:
    c = make_cluster(1, lease_ttl_s=300)
    url = c.replica_urls[0]
    for node_id in ("ghost", "a" * 128):
        r = httpx.post(url + "/v1/blocks", json={"node_id": node_id, "epoch": 1, "blocks": [{"hash": 1, "slot": 0}]})
        assert r.status_code == 409 and r.json()["error"] == "unknown_node"
        r = httpx.post(url + "/v1/blocks/remove", json={"node_id": node_id, "epoch": 1, "hashes": [1]})
        assert r.status_code == 409
        r = httpx.post(url + "/v1/blocks/clear", json={"node_id": node_id, "epoch": 1})
        assert r.status_code == 409
        r = httpx.post(url + f"/v1/nodes/{node_id}/heartbeat", json={"epoch": 1})
        assert r.status_code == 409
    for path in ("ghost", "..%2F..%2Fetc", "%00", "x" * 8000, "%F0%9F%92%A9"):
        assert httpx.get(url + f"/v1/nodes/{path}").status_code == 404
        r = httpx.delete(url + f"/v1/nodes/{path}")
        assert r.status_code == 404 and r.json()["error"] == "not_found", r.text[:200]
    assert httpx.post(url + "/v1/lookup", json={"hashes": [1]}).json() == {"num_blocks": 1, "holders": []}


def test_duplicate_hashes_in_one_publish_are_accepted_and_the_last_slot_wins(make_cluster) -> None:
    c = make_cluster(1, lease_ttl_s=300)
    url = c.replica_urls[0]
    epoch = _register(url, "n1")
    blocks = [{"hash": 7, "slot": 1}, {"hash": 8, "slot": 2}, {"hash": 7, "slot": 3}, {"hash": 7, "slot": 9}]
    r = httpx.post(url + "/v1/blocks", json={"node_id": "n1", "epoch": epoch, "blocks": blocks})
    assert r.status_code == 200 and r.json()["stored"] == 2, r.text
    r = httpx.post(url + "/v1/lookup", json={"hashes": [7, 8], "with_slots": True}).json()
    assert r["holders"] == [{"node_id": "n1", "epoch": epoch, "matched_blocks": 2, "slots": [9, 2]}]
    # Publishing a held hash again only moves its slot.
    r = httpx.post(
        url + "/v1/blocks", json={"node_id": "n1", "epoch": epoch, "blocks": [{"hash": 8, "slot": 4}, {"hash": 8, "slot": 5}]}
    )
    assert r.status_code == 200 and r.json()["stored"] == 0
    r = httpx.post(url + "/v1/lookup", json={"hashes": [7, 8], "with_slots": True}).json()
    assert r["holders"][0]["slots"] == [9, 5]
    assert httpx.get(url + "/v1/nodes/n1").json()["blocks"] == 2


def _slow_request(host: str, port: int, path: str, body: bytes, sent: int) -> socket.socket:
    """Send the headers and the first `sent` bytes of the body, then stall."""
    s = socket.create_connection((host, port), timeout=10)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    s.sendall(head + body[:sent])
    return s


def _read_response(s: socket.socket) -> bytes:
    """One whole HTTP/1.1 response with a Content-Length (as every answer here has)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"connection closed mid-response: {data[:300]!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    while len(rest) < length:
        chunk = s.recv(65536)
        assert chunk, "connection closed mid-body"
        rest += chunk
    return head + b"\r\n\r\n" + rest


def test_slow_clients_do_not_block_other_requests(stack) -> None:
    c, _, g = stack
    url = c.replica_urls[0]
    epoch = _register(url, "slowpoke")
    lookup = b'{"hashes": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]' + b" " * 64 + b"}"
    completion = b'{"model": "kvdir-stub", "prompt": "slow client", "max_tokens": 1}' + b" " * 64
    targets = [(url, "/v1/lookup", lookup)] * 16 + [(g.url, "/v1/completions", completion)] * 4
    slow: list[socket.socket] = []
    sent = 5
    try:
        for base, path, body in targets:
            host, port = base.removeprefix("http://").rsplit(":", 1)
            slow.append(_slow_request(host, int(port), path, body, sent))
        stop = threading.Event()

        def trickle() -> None:
            # One more byte into each stalled body every 0.1 s, never the last ones, until told to stop.
            nonlocal sent
            while not stop.wait(0.1) and sent < 60:
                for s, (_, _, body) in zip(slow, targets):
                    s.sendall(body[sent : sent + 1])
                sent += 1

        t = threading.Thread(target=trickle)
        t.start()
        try:
            with httpx.Client(timeout=5) as http:
                for i in range(10):
                    t0 = time.monotonic()
                    assert http.post(url + "/v1/lookup", json={"hashes": [1, 2]}).status_code == 200
                    r = http.post(
                        url + "/v1/blocks", json={"node_id": "slowpoke", "epoch": epoch, "blocks": [{"hash": i, "slot": i}]}
                    )
                    assert r.status_code == 200
                    r = http.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": "a normal request", "max_tokens": 1})
                    assert r.status_code == 200, r.text
                    assert time.monotonic() - t0 < 1.0, "a normal request waited behind the stalled ones"
        finally:
            stop.set()
            t.join()
        assert sent > 5  # the slow bodies were really trickling meanwhile
        # The stalled requests were waited for, not dropped: finishing their bodies gets each its answer.
        for s, (_, _, body) in zip(slow, targets):
            s.sendall(body[sent:])
            answer = _read_response(s)
            assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    finally:
        for s in slow:
            s.close()


def test_registration_flood_is_bounded(make_cluster) -> None:
    c = make_cluster(1, lease_ttl_s=300, extra_args=("--max-nodes", "20"))
    url = c.replica_urls[0]
    with ThreadPoolExecutor(8) as pool:  # each registration waits for its commit: together, not one after another
        list(pool.map(lambda i: _register(url, f"n{i}"), range(20)))
    regions = [{"rank": r, "base_addr": r << 32, "length": 1 << 30, "rkey": "k" * 200, "block_bytes": 16384} for r in range(128)]
    commit_before = httpx.get(url + "/v1/cluster").json()["commit_index"]
    rss_before = _rss_kib(c.procs[0].pid)

    # Every request on a connection of its own, as from 200 clients; one httpx.Client for them all, as making
    # one costs ~20 ms of this process's CPU (its SSL context), which made most of the flood's time.
    with httpx.Client(timeout=10, limits=httpx.Limits(max_connections=8, max_keepalive_connections=0)) as http:

        def flood(i: int) -> int:
            r = http.post(
                url + "/v1/nodes",
                json={"node_id": f"flood-{i}", "api_url": "http://127.0.0.1:9", "regions": regions, "transfer_url": "t" * 2000},
            )
            assert r.status_code in (429,), r.text[:200]
            assert r.json()["error"] == "node_limit"
            return r.status_code

        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(flood, range(200)))
    assert statuses == [429] * 200
    nodes = httpx.get(url + "/v1/nodes").json()["nodes"]
    assert len(nodes) == 20 and not any(n["node_id"].startswith("flood") for n in nodes)
    # Refused before Raft: the flood did not grow the Raft log (a few commits of the replica's own are fine).
    assert httpx.get(url + "/v1/cluster").json()["commit_index"] - commit_before < 10
    growth_mib = (_rss_kib(c.procs[0].pid) - rss_before) / 1024
    assert growth_mib < 64, f"the replica grew by {growth_mib:.0f} MiB under a flood of refused registrations"
    # The limit is on new nodes: known nodes still re-register (restart), and a freed place can be taken.
    assert _register(url, "n3", incarnation="restart-2") > 20
    assert httpx.delete(url + "/v1/nodes/n0").status_code == 200
    wait_for(lambda: len(httpx.get(url + "/v1/nodes").json()["nodes"]) == 19, what="n0 gone")
    _register(url, "newcomer")
    r = httpx.post(url + "/v1/nodes", json={"node_id": "one-too-many", "api_url": "http://x"})
    assert r.status_code == 429
