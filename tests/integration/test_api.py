"""The REST contract: fencing, leases, limits and errors, against real replicas over HTTP."""

from __future__ import annotations

import threading

import httpx
import pytest

from kvproto.hashing import block_hashes
from tests.support.cluster import leader_index
from tests.support.wait import wait_for


def _register(url: str, node_id: str, incarnation: str | None = None, **extra) -> int:
    body = {"node_id": node_id, "api_url": "http://127.0.0.1:9", **extra}
    if incarnation:
        body["incarnation"] = incarnation
    r = httpx.post(url + "/v1/nodes", json=body)
    assert r.status_code == 200, r.text
    return r.json()["epoch"]


def _publish(url: str, node_id: str, epoch: int, hashes: list[int]) -> httpx.Response:
    return httpx.post(
        url + "/v1/blocks",
        json={"node_id": node_id, "epoch": epoch, "blocks": [{"hash": h, "slot": i} for i, h in enumerate(hashes)]},
    )


def test_epochs_fence_restarted_nodes(make_cluster) -> None:
    c = make_cluster(3, lease_ttl_s=300)
    url = c.replica_urls[0]
    hashes = block_hashes(list(range(64)))
    e1 = _register(url, "n1", "boot-1")
    assert _register(url, "n1", "boot-1") == e1  # a retried registration is idempotent
    assert _publish(url, "n1", e1, hashes).status_code == 200
    e2 = _register(url, "n1", "boot-2")  # the node restarted
    assert e2 > e1
    r = _publish(url, "n1", e1, hashes)
    assert r.status_code == 409 and r.json()["error"] == "stale_epoch", r.text
    r = httpx.post(url + "/v1/nodes/n1/heartbeat", json={"epoch": e1})
    assert r.status_code == 409
    r = httpx.post(url + "/v1/blocks/remove", json={"node_id": "n1", "epoch": e1, "hashes": hashes})
    assert r.status_code == 409
    # The old epoch's entries are gone everywhere, even on a follower answering a linearizable read.
    for u in c.replica_urls:
        r = httpx.post(u + "/v1/lookup?consistency=linearizable", json={"hashes": hashes}).json()
        assert r["holders"] == []
    assert _publish(url, "n1", e2, hashes[:2]).status_code == 200
    r = httpx.post(c.replica_urls[1] + "/v1/lookup", json={"tokens": list(range(64)), "consistency": "linearizable"}).json()
    assert r == {"num_blocks": 4, "holders": [{"node_id": "n1", "epoch": e2, "matched_blocks": 2}]}
    r = httpx.post(url + "/v1/blocks/clear", json={"node_id": "n1", "epoch": e2})
    assert r.json()["removed"] == 2
    r = httpx.delete(url + "/v1/nodes/n1")
    assert r.status_code == 200
    assert httpx.delete(url + "/v1/nodes/n1").status_code == 404
    r = httpx.post(url + "/v1/nodes/n1/heartbeat", json={"epoch": e2})
    assert r.status_code == 409 and r.json()["error"] == "unknown_node"


def test_lease_expiry_drops_silent_nodes_only(make_cluster) -> None:
    c = make_cluster(3, lease_ttl_s=1.0)
    url = c.replica_urls[leader_index(c)]
    hashes = block_hashes(list(range(32)))
    quiet = _register(url, "quiet")
    chatty = _register(url, "chatty")
    assert _publish(url, "quiet", quiet, hashes).status_code == 200
    assert _publish(url, "chatty", chatty, hashes).status_code == 200
    stop = threading.Event()

    def beat() -> None:
        with httpx.Client() as http:
            while not stop.wait(0.2):
                http.post(url + "/v1/nodes/chatty/heartbeat", json={"epoch": chatty, "load": {"running": 1}})

    t = threading.Thread(target=beat)
    t.start()
    try:

        def nodes() -> set[str]:
            return {n["node_id"] for n in httpx.get(c.replica_urls[2] + "/v1/nodes").json()["nodes"]}

        wait_for(lambda: nodes() == {"chatty"}, timeout=15, what="the silent node to expire")
        r = httpx.post(c.replica_urls[2] + "/v1/lookup?consistency=linearizable", json={"hashes": hashes}).json()
        assert [h["node_id"] for h in r["holders"]] == ["chatty"]
        r = httpx.post(url + "/v1/nodes/quiet/heartbeat", json={"epoch": quiet})
        assert r.status_code == 409
        node = httpx.get(url + "/v1/nodes/chatty").json()
        assert node["blocks"] == 2 and node["load"] == {"running": 1.0}
    finally:
        stop.set()
        t.join()


BAD_REQUESTS = [
    # (method, path, body or raw bytes, expected status)
    ("POST", "/v1/blocks", b"{not json", 400),
    ("POST", "/v1/blocks", {"node_id": "n1", "epoch": "1", "blocks": []}, 422),
    ("POST", "/v1/blocks", {"node_id": "n1", "epoch": 1, "blocks": [{"hash": 2**64, "slot": 0}]}, 422),
    ("POST", "/v1/blocks", {"node_id": "n1", "epoch": 1, "blocks": [{"hash": -1, "slot": 0}]}, 422),
    ("POST", "/v1/blocks", {"node_id": "n1", "epoch": 1, "blocks": [{"hash": "12", "slot": 0}]}, 422),
    ("POST", "/v1/blocks", {"node_id": "n1", "epoch": 1, "blocks": [{"hash": 1.5, "slot": 0}]}, 422),
    ("POST", "/v1/blocks", {"node_id": "n1", "epoch": 1, "blocks": [{"hash": 1, "slot": -3}]}, 422),
    ("POST", "/v1/blocks", {"node_id": "n1", "epoch": 1, "blocks": [{"hash": 1, "slot": 2**32}]}, 422),
    ("POST", "/v1/blocks", {"node_id": "n1", "epoch": 1, "blocks": [{"hash": 1, "slot": 0}] * 101}, 422),
    ("POST", "/v1/blocks", {"node_id": "ghost", "epoch": 1, "blocks": [{"hash": 1, "slot": 0}]}, 409),
    ("POST", "/v1/blocks", {"node_id": "", "epoch": 1, "blocks": []}, 422),
    ("POST", "/v1/blocks", [1, 2, 3], 422),
    ("POST", "/v1/nodes", {"node_id": "bad id with spaces", "api_url": "x"}, 422),
    ("POST", "/v1/nodes", {"node_id": "n2"}, 422),
    (
        "POST",
        "/v1/nodes",
        {"node_id": "n2", "api_url": "x", "regions": [{"rank": 0, "base_addr": -1, "length": 1, "block_bytes": 1}]},
        422,
    ),
    ("POST", "/v1/nodes/ghost/heartbeat", {"epoch": 1}, 409),
    ("POST", "/v1/nodes/ghost/heartbeat", {"epoch": 0}, 422),
    ("DELETE", "/v1/nodes/ghost", None, 404),
    ("GET", "/v1/nodes/ghost", None, 404),
    ("POST", "/v1/lookup", {}, 422),
    ("POST", "/v1/lookup", {"hashes": [1], "tokens": [1]}, 422),
    ("POST", "/v1/lookup", {"hashes": list(range(201))}, 422),
    ("POST", "/v1/lookup", {"tokens": [2**32]}, 422),
    ("POST", "/v1/lookup", {"tokens": [1, 2], "block_size": 0}, 422),
    ("POST", "/v1/lookup?consistency=strong", {"hashes": [1]}, 422),
    ("POST", "/v1/lookup", {"hashes": [[[[[[[[[[1]]]]]]]]]]}, 422),
    ("GET", "/v1/no-such-route", None, 404),
    ("PUT", "/v1/lookup", {"hashes": [1]}, 405),
]


@pytest.fixture(scope="module")
def small_limits_cluster(tmp_path_factory):
    from kvdir.local_cluster import Cluster, free_ports

    ports = free_ports(2)
    c = Cluster(
        tmp_path_factory.mktemp("limits"),
        ports[:1],
        ports[1:],
        log_level="info",
        extra_args=[
            "--max-blocks-per-publish",
            "100",
            "--max-hashes-per-lookup",
            "200",
            "--max-body-bytes",
            "65536",
            "--max-nodes",
            "3",
        ],
    )
    try:
        c.start()
        c.wait_ready(60)
        _register(c.replica_urls[0], "n1")
        yield c
    finally:
        c.stop()


@pytest.mark.parametrize("method,path,body,status", BAD_REQUESTS)
def test_bad_input_gets_a_4xx_with_a_message(small_limits_cluster, method, path, body, status) -> None:
    url = small_limits_cluster.replica_urls[0] + path
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.request(method, url, **({} if body is None else kwargs))
    assert r.status_code == status, r.text
    err = r.json()
    assert isinstance(err["error"], str) and err["error"] and err.get("detail")


def test_oversized_bodies_and_limits(small_limits_cluster) -> None:
    url = small_limits_cluster.replica_urls[0]
    r = httpx.post(url + "/v1/lookup", content=b"[" + b"1," * 40000 + b"1]", headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "body_too_large"

    def chunks():
        for _ in range(100):
            yield b" " * 1024

    r = httpx.post(url + "/v1/lookup", content=chunks(), headers={"content-type": "application/json"})  # no content-length
    assert r.status_code == 413
    for i in range(2, 4):
        _register(url, f"n{i}")
    r = httpx.post(url + "/v1/nodes", json={"node_id": "n4", "api_url": "http://x"})
    assert r.status_code == 429 and r.json()["error"] == "node_limit"
    r = httpx.post(url + "/v1/lookup", json={"hashes": []})
    assert r.status_code == 200 and r.json() == {"num_blocks": 0, "holders": []}


def test_observability_endpoints(small_limits_cluster) -> None:
    url = small_limits_cluster.replica_urls[0]
    assert httpx.get(url + "/healthz").status_code == 200
    assert httpx.get(url + "/readyz").status_code == 200
    httpx.post(url + "/v1/lookup", json={"hashes": [1, 2]})
    text = httpx.get(url + "/metrics").text
    for name in (
        "kvdir_directory_entries",
        "kvdir_directory_nodes",
        "kvdir_directory_commits_total",
        "kvdir_directory_lookups_total",
        "kvdir_directory_lookup_seconds_bucket",
        "kvdir_directory_raft_term",
        "kvdir_directory_raft_role 2.0",
        "kvdir_directory_commit_seconds_bucket",
    ):
        assert name in text, name
    info = httpx.get(url + "/v1/cluster").json()
    assert info["role"] == "leader" and info["leader_url"] == url and info["term"] >= 1 and info["commit_index"] >= 1
    schema = httpx.get(url + "/openapi.json").json()
    assert "/v1/lookup" in schema["paths"]
