"""Bearer tokens with roles on real replicas: 401 without a known token, 403 for what a role may
not do, open health endpoints, and workers, the gateway and the client sending their tokens."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvdir.local_cluster import Cluster, free_ports, write_raft_password
from kvproto.client import DirectoryClient
from kvproto.errors import AuthError
from kvproto.hashing import block_hashes
from tests.support.cluster import deregister_all
from tests.support.wait import wait_for

ENGINE, GATEWAY, ADMIN = "engine-tok-3f9a1c0d2b", "gateway-tok-77aa01bc", "admin-tok-5e5e1234abcd"
TOKENS = f"""\
# role:node pattern:token
engine:worker-*:{ENGINE}

gateway:*:{GATEWAY}
admin:*:{ADMIN}
"""
MODEL = "kvdir-stub"
PROMPT = "Tokens guard the directory; the cache still works behind them. " * 4


Secured = tuple[Cluster, dict[str, Path]]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def _secured_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    """A 3-replica cluster with an auth tokens file, and one file per client token, started once per file."""
    d = tmp_path_factory.mktemp("secured")
    tokens = d / "tokens"
    tokens.write_text(TOKENS)
    tokens.chmod(0o600)
    files = {}
    for name, token in (("engine", ENGINE), ("gateway", GATEWAY), ("admin", ADMIN)):
        files[name] = d / f"{name}.token"
        files[name].write_text(token + "\n")
    ports = free_ports(6)
    (d / "cluster").mkdir()
    c = Cluster(
        d / "cluster",
        ports[:3],
        ports[3:],
        lease_ttl_s=300,
        log_level="info",
        extra_args=("--auth-tokens-file", str(tokens)),
        token=ADMIN,
        raft_password_file=write_raft_password(d / "secrets"),
    )
    try:
        c.start()
        c.wait_ready(60)
        yield c, files
    finally:
        c.stop()


@pytest.fixture
def secured(_secured_cluster: Secured) -> Iterator[Secured]:
    """The file's secured cluster, with every node a test registered deregistered after it."""
    c, files = _secured_cluster
    leader = c.wait_ready(30)
    yield c, files
    deregister_all(leader, ADMIN)


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    """One client for a test's requests: each `httpx.get` makes a client of its own, and with it an SSL context
    (~20 ms of CPU); the role checks here make dozens."""
    with httpx.Client(timeout=5) as client:
        yield client


def _err(r: httpx.Response, status: int, error: str) -> None:
    assert r.status_code == status, (r.request.method, r.request.url, r.status_code, r.text)
    body = r.json()
    assert body["error"] == error and body["detail"], body


def test_requests_without_a_known_token_are_401_and_health_is_open(secured, http) -> None:
    c, _ = secured
    for url in c.replica_urls:
        for method, path, body in [
            ("GET", "/v1/nodes", None),
            ("GET", "/v1/nodes/x", None),
            ("GET", "/v1/cluster", None),
            ("GET", "/v1/digest", None),
            ("POST", "/v1/lookup", {"hashes": [1]}),
            ("POST", "/v1/nodes", {"node_id": "worker-1", "api_url": "http://127.0.0.1:9"}),
            ("DELETE", "/v1/nodes/worker-1", None),
            ("GET", "/openapi.json", None),
            ("GET", "/v1/no-such-route", None),
        ]:
            for headers in (
                {},
                bearer("not-a-token"),
                bearer(ADMIN + "x"),
                bearer(ADMIN[:-1]),
                {"Authorization": ADMIN},
                {"Authorization": f"Basic {ADMIN}"},
                {"Authorization": "Bearer"},
            ):
                r = http.request(method, url + path, json=body, headers=headers)
                _err(r, 401, "unauthorized")
                assert r.headers["www-authenticate"].startswith("Bearer")
        for path in ("/healthz", "/readyz", "/metrics"):
            assert http.get(url + path).status_code == 200, path
        assert 'kvdir_directory_requests_rejected_total{error="unauthorized"}' in http.get(url + "/metrics").text
    # With a token, unknown routes are the usual 404, and the schema is readable by every role.
    _err(http.get(c.replica_urls[0] + "/v1/no-such-route", headers=bearer(GATEWAY)), 404, "not_found")
    assert http.get(c.replica_urls[0] + "/openapi.json", headers=bearer(ENGINE)).status_code == 200


def test_roles_and_node_patterns(secured, http) -> None:
    c, _ = secured
    leader = c.wait_ready(30)
    follower = next(u for u in c.replica_urls if u != leader)
    hashes = block_hashes(list(range(64)))
    blocks = [{"hash": h, "slot": i} for i, h in enumerate(hashes)]
    admin, engine, gateway = bearer(ADMIN), bearer(ENGINE), bearer(GATEWAY)
    # The admin registers a node the engine token does not cover.
    r = http.post(leader + "/v1/nodes", json={"node_id": "other-1", "api_url": "http://127.0.0.1:9"}, headers=admin)
    assert r.status_code == 200, r.text
    other_epoch = r.json()["epoch"]
    for url in (leader, follower):  # every replica enforces the same rules
        # engine:worker-* registers, publishes, heartbeats, removes and clears for worker-1 ...
        r = http.post(url + "/v1/nodes", json={"node_id": "worker-1", "api_url": "http://127.0.0.1:9"}, headers=engine)
        assert r.status_code == 200, r.text
        epoch = r.json()["epoch"]
        assert (
            http.post(
                url + "/v1/blocks", json={"node_id": "worker-1", "epoch": epoch, "blocks": blocks}, headers=engine
            ).status_code
            == 200
        )
        assert (
            http.post(
                url + "/v1/nodes/worker-1/heartbeat", json={"epoch": epoch, "load": {"running": 1}}, headers=engine
            ).status_code
            == 200
        )
        assert (
            http.post(
                url + "/v1/blocks/remove", json={"node_id": "worker-1", "epoch": epoch, "hashes": hashes[-1:]}, headers=engine
            ).status_code
            == 200
        )
        assert http.post(url + "/v1/lookup", json={"hashes": hashes}, headers=engine).status_code == 200  # engines may read
        # ... but nothing for other-1, nor for ids that only look alike.
        for node_id in ("other-1", "worker", "xworker-1", "Worker-1"):
            _err(
                http.post(url + "/v1/nodes", json={"node_id": node_id, "api_url": "http://127.0.0.1:9"}, headers=engine),
                403,
                "forbidden",
            )
        _err(
            http.post(url + "/v1/blocks", json={"node_id": "other-1", "epoch": other_epoch, "blocks": blocks}, headers=engine),
            403,
            "forbidden",
        )
        _err(
            http.post(
                url + "/v1/blocks/remove", json={"node_id": "other-1", "epoch": other_epoch, "hashes": hashes}, headers=engine
            ),
            403,
            "forbidden",
        )
        _err(
            http.post(url + "/v1/blocks/clear", json={"node_id": "other-1", "epoch": other_epoch}, headers=engine),
            403,
            "forbidden",
        )
        _err(http.post(url + "/v1/nodes/other-1/heartbeat", json={"epoch": other_epoch}, headers=engine), 403, "forbidden")
        _err(http.delete(url + "/v1/nodes/other-1", headers=engine), 403, "forbidden")
        # The gateway token reads (lookups, nodes, cluster) and writes nothing.
        r = http.post(url + "/v1/lookup?consistency=linearizable", json={"hashes": hashes}, headers=gateway)
        assert r.status_code == 200 and r.json()["holders"][0]["node_id"] == "worker-1", r.text
        assert {n["node_id"] for n in http.get(url + "/v1/nodes", headers=gateway).json()["nodes"]} == {"worker-1", "other-1"}
        assert http.get(url + "/v1/nodes/worker-1", headers=gateway).status_code == 200
        assert http.get(url + "/v1/cluster", headers=gateway).json()["leader_url"] in c.replica_urls
        _err(
            http.post(url + "/v1/blocks", json={"node_id": "worker-1", "epoch": epoch, "blocks": blocks}, headers=gateway),
            403,
            "forbidden",
        )
        _err(
            http.post(url + "/v1/nodes", json={"node_id": "worker-9", "api_url": "http://127.0.0.1:9"}, headers=gateway),
            403,
            "forbidden",
        )
        _err(http.post(url + "/v1/nodes/worker-1/heartbeat", json={"epoch": epoch}, headers=gateway), 403, "forbidden")
        _err(http.delete(url + "/v1/nodes/worker-1", headers=gateway), 403, "forbidden")
        # The engine deregisters its own node.
        assert http.delete(url + "/v1/nodes/worker-1", headers=engine).status_code == 200
    # The admin deletes any node.
    r = http.post(leader + "/v1/nodes", json={"node_id": "worker-2", "api_url": "http://127.0.0.1:9"}, headers=engine)
    assert r.status_code == 200
    for node_id in ("other-1", "worker-2"):
        r = http.delete(follower + f"/v1/nodes/{node_id}", headers=admin)
        assert r.status_code == 200 and r.json()["node_id"] == node_id, r.text
    assert http.get(leader + "/v1/nodes", headers=admin).json()["nodes"] == []
    metrics = http.get(leader + "/metrics").text
    assert 'kvdir_directory_requests_rejected_total{error="forbidden"}' in metrics


def test_client_sends_its_token(secured) -> None:
    c, _ = secured

    async def main() -> None:
        async with DirectoryClient(c.replica_urls, token=ENGINE, deadline=10) as d:
            reg = await d.register("worker-7", "http://127.0.0.1:9")
            assert await d.publish("worker-7", reg.epoch, [(1, 0), (2, 1)]) == 2
            assert [n.node_id for n in await d.nodes()] == ["worker-7"]
            with pytest.raises(AuthError) as e:
                await d.register("other-7", "http://127.0.0.1:9")
            assert e.value.status == 403 and e.value.error == "forbidden"
            assert await d.deregister("worker-7", reg.epoch) == 2
        async with DirectoryClient(c.replica_urls, deadline=10) as anonymous:
            with pytest.raises(AuthError) as e:
                await anonymous.lookup([1])
            assert e.value.status == 401 and e.value.error == "unauthorized"

    asyncio.run(main())


def test_worker_and_gateway_send_tokens_from_files(secured, make_workers, make_gateway, http) -> None:
    c, files = secured
    w = make_workers(c, 1, ("--directory-token-file", str(files["engine"]), "--transfer", "tcp"))  # registers as worker-1
    g = make_gateway(c, 1, ("--directory-token-file", str(files["gateway"])))  # reads the engine list with its token
    r = http.post(w.urls[0] + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    n_blocks = len(PROMPT.encode()) // 16

    def holders(url: str) -> dict[str, int]:
        res = http.post(
            url + "/v1/lookup", json={"tokens": list(PROMPT.encode()), "model": "kvdir-stub"}, headers=bearer(GATEWAY), timeout=5
        ).json()
        return {h["node_id"]: h["matched_blocks"] for h in res["holders"]}

    for url in c.replica_urls:  # the worker published with its engine token
        wait_for(lambda: holders(url) == {"worker-1": n_blocks}, what=f"worker-1's blocks on {url}")
    node = http.get(c.replica_urls[0] + "/v1/nodes/worker-1", headers=bearer(GATEWAY)).json()
    wait_for(
        lambda: http.get(c.replica_urls[0] + "/v1/nodes/worker-1", headers=bearer(GATEWAY)).json()["load"], what="a heartbeat"
    )
    assert node["api_url"] == w.urls[0]
    # The gateway looked the prompt up with its token: an affinity decision, not a fallback.
    r = http.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT + "more", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.headers["x-kvdir-decision"] == "affinity", (r.headers, r.text)
    assert int(r.headers["x-kvdir-predicted-cached-tokens"]) == n_blocks * 16
    assert http.get(g.url + "/health").json()["directory"] is True


def test_a_replica_logs_that_auth_is_on(tmp_path: Path) -> None:
    """What building the app logs reaches the log: once lost, because logging was set up only after the app was built
    (the docker-compose test caught it), leaving operators no sign that auth was on."""
    import subprocess
    import sys

    from kvdir.local_cluster import free_ports

    tokens = tmp_path / "tokens"
    tokens.write_text("admin:*:s3cr3t\n")
    http, raft = free_ports(2)
    log = tmp_path / "replica.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvdir", "directory", "--http", f"127.0.0.1:{http}", "--raft", f"127.0.0.1:{raft}",
             "--auth-tokens-file", str(tokens), "--log-level", "info"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_for(lambda: "index kernels ready" in log.read_text(), what="the replica to start", timeout=60)
        text = log.read_text()
        assert "bearer-token auth on: 1 tokens" in text and "auth is off" not in text, text
    finally:
        proc.kill()
        proc.wait(10)
