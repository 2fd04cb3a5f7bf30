"""Nodes between tenants on real replicas: a tenant's node cannot take another tenant's engine endpoint, a
confined token sees and writes only its tenant's nodes (and shared ones, without their memory), registrations
are bounded in size, and an unchanged node list is a 304."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvdir.local_cluster import Cluster, free_ports, write_raft_password
from kvproto.client import DirectoryClient
from tests.support.wait import wait_for

ENGINE, ENGINE_ACME, ENGINE_BRAVO = "engine-any-5e6f7a8b", "engine-acme-1a2b3c4d", "engine-bravo-9c8d7e6f"
GATEWAY, GATEWAY_ACME, ADMIN = "gateway-any-2b3c4d5e", "gateway-acme-6f7a8b9c", "admin-tok-3d4e5f6a"
TOKENS = f"""\
engine:*:{ENGINE}
engine@acme:acme-*:{ENGINE_ACME}
engine@bravo:bravo-*:{ENGINE_BRAVO}
gateway:*:{GATEWAY}
gateway@acme:*:{GATEWAY_ACME}
admin:*:{ADMIN}
"""


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Three replicas with confined tokens and a tenant secret; each test uses node ids of its own."""
    data: Path = tmp_path_factory.mktemp("tenant-nodes")
    (data / "tokens").write_text(TOKENS)
    (data / "tenant-secret").write_text("tenant-nodes-secret\n")
    ports = free_ports(6)
    c = Cluster(
        data,
        ports[:3],
        ports[3:],
        lease_ttl_s=300,
        log_level="info",
        extra_args=("--auth-tokens-file", str(data / "tokens"), "--tenant-secret-file", str(data / "tenant-secret")),
        token=ADMIN,
        raft_password_file=write_raft_password(data / "secrets"),
    )
    try:
        c.start()
        c.wait_ready(60)
        yield c
    finally:
        c.stop()


def register(url: str, token: str, node_id: str, api_url: str, **fields: object) -> httpx.Response:
    return httpx.post(
        url + "/v1/nodes", json={"node_id": node_id, "api_url": api_url, **fields}, headers=bearer(token), timeout=10
    )


def ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, (r.request.url, r.status_code, r.text[:300])
    body: dict[str, Any] = r.json()
    return body


def nodes(url: str, token: str) -> dict[str, dict[str, Any]]:
    return {n["node_id"]: n for n in ok(httpx.get(url + "/v1/nodes", headers=bearer(token), timeout=10))["nodes"]}


def agreed(c: Cluster) -> bool:
    digests = {ok(httpx.get(u + "/v1/digest", headers=bearer(ADMIN), timeout=5))["digest"] for u in c.replica_urls}
    return len(digests) == 1


def test_a_tenants_node_cannot_take_another_tenants_engine(cluster: Cluster) -> None:
    """Bravo reads acme's engine origin from the node list and registers a node of its own there, idle: refused
    (409, without naming acme) on every spelling of it, as are acme's transfer sessions; acme's own data-parallel
    ranks share the origin."""
    c = cluster
    url = c.replica_urls[0]
    ok(register(url, ENGINE_ACME, "acme-e1", "http://127.0.0.1:47101", transfer_url="127.0.0.1:47102", fingerprint="fp"))
    seen = nodes(url, ADMIN)["acme-e1"]
    for api_url, transfer_url in (
        (seen["api_url"], None),
        ("http://127.0.0.1.:47101", None),
        ("https://127.1:47101/", None),
        ("http://[::ffff:127.0.0.1]:47101", None),
        ("http://127.0.0.1:47199", "127.0.0.1:47102"),
        ("http://127.0.0.1:47199", "tcp://127.1:47102"),
    ):
        for u in c.replica_urls:  # followers forward: every replica's state machine refuses it
            r = register(u, ENGINE_BRAVO, "bravo-e1", api_url, transfer_url=transfer_url, load={"running": 0})
            assert r.status_code == 409, (api_url, transfer_url, r.status_code, r.text)
            body = r.json()
            assert body["error"] == "endpoint_taken" and "another tenant" in body["detail"], body
            assert "acme" not in r.text, r.text
    regions = [{"rank": 0, "base_addr": 0, "length": 4096, "block_bytes": 4096, "transfer_url": "127.0.0.1:47102"}]
    assert register(url, ENGINE_BRAVO, "bravo-e1", "http://127.0.0.1:47199", regions=regions).status_code == 409
    # Nor through an unconfined token naming bravo, nor as a shared node of the shared tenant.
    assert register(url, ENGINE, "any-e1", "http://127.0.0.1:47101", tenant="bravo").status_code == 409
    assert register(url, ENGINE, "any-e1", "http://127.0.0.1:47101", shared=True).status_code == 409
    # Acme's data-parallel ranks share the origin; bravo's engine of its own is welcome.
    ok(register(url, ENGINE_ACME, "acme-e1-dp1", "http://127.0.0.1:47101", dp_rank=1))
    ok(register(url, ENGINE_BRAVO, "bravo-e1", "http://127.0.0.1:47199"))
    listed = nodes(url, ADMIN)
    assert "any-e1" not in listed and listed["bravo-e1"]["api_url"] == "http://127.0.0.1:47199"
    wait_for(lambda: agreed(c), what="every replica in the same state")
    # Once acme's engines are gone, the origin is free for another tenant.
    for node_id in ("acme-e1", "acme-e1-dp1"):
        ok(httpx.delete(f"{url}/v1/nodes/{node_id}", headers=bearer(ENGINE_ACME), timeout=10))
    ok(register(url, ENGINE_BRAVO, "bravo-e2", "http://127.0.0.1:47101"))


def test_a_confined_token_sees_its_tenants_nodes_and_shared_ones_without_memory(cluster: Cluster) -> None:
    c = cluster
    url = c.replica_urls[1]
    region = {"rank": 0, "base_addr": 1 << 40, "length": 1 << 20, "block_bytes": 4096, "rkey": "secret-rkey"}
    ok(register(url, ENGINE_ACME, "acme-v1", "http://127.0.0.1:47201", transfer_url="127.0.0.1:47202", regions=[region]))
    ok(register(url, ENGINE_BRAVO, "bravo-v1", "http://127.0.0.1:47211", transfer_url="127.0.0.1:47212", regions=[region]))
    ok(
        register(
            url, ENGINE, "shared-v1", "http://127.0.0.1:47221", transfer_url="127.0.0.1:47222", regions=[region], shared=True
        )
    )
    wait_for(lambda: {"acme-v1", "bravo-v1", "shared-v1"} <= set(nodes(url, GATEWAY)), what="the nodes listed")
    for token in (GATEWAY_ACME, ENGINE_ACME):
        seen = nodes(url, token)
        assert not any(n.startswith("bravo-") for n in seen), sorted(seen)
        assert seen["acme-v1"]["regions"][0]["rkey"] == "secret-rkey" and seen["acme-v1"]["transfer_url"] == "127.0.0.1:47202"
        shared = seen["shared-v1"]
        assert shared["shared"] and shared["regions"] == [] and shared["transfer_url"] is None, shared
        assert shared["api_url"] == "http://127.0.0.1:47221"  # routable, not readable
        r = httpx.get(url + "/v1/nodes/bravo-v1", headers=bearer(token), timeout=10)
        assert r.status_code == 404 and r.json()["error"] == "not_found", r.text
        assert ok(httpx.get(url + "/v1/nodes/shared-v1", headers=bearer(token), timeout=10))["regions"] == []
    for token in (GATEWAY, ADMIN, ENGINE):  # unconfined tokens see every node in full
        seen = nodes(url, token)
        assert seen["bravo-v1"]["regions"][0]["rkey"] == "secret-rkey"
        assert seen["shared-v1"]["transfer_url"] == "127.0.0.1:47222"

    async def client() -> None:
        async with DirectoryClient(c.replica_urls, token=GATEWAY_ACME, deadline=10) as d:
            listed = {n.node_id: n for n in await d.nodes()}
            assert "bravo-v1" not in listed and listed["shared-v1"].regions == [] and listed["acme-v1"].regions

    asyncio.run(client())


def test_a_confined_token_cannot_write_another_tenants_node(cluster: Cluster) -> None:
    """Acme's token pattern matches acme-x9, but an unconfined token registered it for bravo: acme's token can
    neither heartbeat, publish to, remove from, clear, re-register nor deregister it."""
    url = cluster.replica_urls[0]
    epoch = ok(register(url, ENGINE, "acme-x9", "http://127.0.0.1:47301", tenant="bravo"))["epoch"]
    h = bearer(ENGINE_ACME)
    attempts = [
        httpx.post(f"{url}/v1/nodes/acme-x9/heartbeat", json={"epoch": epoch, "load": {"running": 0}}, headers=h),
        httpx.post(
            url + "/v1/blocks", json={"node_id": "acme-x9", "epoch": epoch, "blocks": [{"hash": 1, "slot": 0}]}, headers=h
        ),
        httpx.post(url + "/v1/blocks/remove", json={"node_id": "acme-x9", "epoch": epoch, "hashes": [1]}, headers=h),
        httpx.post(url + "/v1/blocks/clear", json={"node_id": "acme-x9", "epoch": epoch}, headers=h),
        register(url, ENGINE_ACME, "acme-x9", "http://127.0.0.1:47302"),
        httpx.delete(f"{url}/v1/nodes/acme-x9?epoch={epoch}", headers=h),
        httpx.delete(f"{url}/v1/nodes/acme-x9", headers=h),
    ]
    for r in attempts:
        assert r.status_code == 403, (r.request.method, r.request.url, r.status_code, r.text)
        assert r.json()["error"] == "forbidden" and "another tenant" in r.json()["detail"], r.text
    listed = nodes(url, ADMIN)["acme-x9"]
    assert (listed["epoch"], listed["tenant"], listed["api_url"]) == (epoch, "bravo", "http://127.0.0.1:47301")
    # An unconfined token still writes it; once it is gone, acme may register the id for itself.
    ok(httpx.post(f"{url}/v1/nodes/acme-x9/heartbeat", json={"epoch": epoch}, headers=bearer(ENGINE)))
    ok(httpx.delete(f"{url}/v1/nodes/acme-x9?epoch={epoch}", headers=bearer(ENGINE)))
    ok(register(url, ENGINE_ACME, "acme-x9", "http://127.0.0.1:47302"))


def test_registrations_are_bounded(cluster: Cluster) -> None:
    url = cluster.replica_urls[0]
    # 2,048 regions, each with a 256-character rkey: about 700 KB stored and listed, over the 512 KiB default.
    regions = [
        {"rank": 0, "base_addr": i << 20, "length": 1 << 20, "block_bytes": 4096, "rkey": f"{i:05d}" + "k" * 251}
        for i in range(2048)
    ]
    r = register(url, ENGINE, "big-1", "http://127.0.0.1:47401", regions=regions)
    assert r.status_code == 422 and r.json()["error"] == "too_large", r.text[:300]
    assert "KVDIR_MAX_REGISTRATION_BYTES" in r.json()["detail"]
    # Every rank behind a transfer session of its own, over the limit of distinct sessions.
    ranked = [
        {"rank": i, "base_addr": 0, "length": 4096, "block_bytes": 4096, "transfer_url": f"127.0.0.1:{20000 + i}"}
        for i in range(65)
    ]
    r = register(url, ENGINE, "big-2", "http://127.0.0.1:47402", regions=ranked)
    assert r.status_code == 422 and r.json()["error"] == "too_many", r.text[:300]
    assert "KVDIR_MAX_TRANSFER_URLS_PER_NODE" in r.json()["detail"]
    ok(register(url, ENGINE, "big-2", "http://127.0.0.1:47402", regions=ranked[:64]))
    # Regions beyond the address space, or smaller than a block.
    for bad, why in (
        ({"base_addr": (1 << 64) - 4096, "length": 8192, "block_bytes": 4096}, "below 2**64"),
        ({"base_addr": 0, "length": 4096, "block_bytes": 8192}, "at most length"),
    ):
        r = register(url, ENGINE, "big-3", "http://127.0.0.1:47403", regions=[{"rank": 0, **bad}])
        assert r.status_code == 422 and r.json()["error"] == "invalid_request" and why in r.text, r.text[:300]
    assert not {"big-1", "big-3"} & set(nodes(url, ADMIN))


def test_an_unchanged_node_list_is_a_304(cluster: Cluster) -> None:
    c = cluster
    url = c.replica_urls[2]
    regions = [
        {
            "rank": r,
            "base_addr": r << 32,
            "length": 1 << 30,
            "block_bytes": 16384,
            "rkey": 0,
            "transfer_url": f"127.0.0.1:{47510 + r}",
        }
        for r in range(8)
        for _ in range(100)
    ]
    ok(register(url, ENGINE, "etag-1", "http://127.0.0.1:47501", regions=regions))
    wait_for(lambda: "etag-1" in nodes(url, GATEWAY), what="etag-1 listed")
    with httpx.Client(timeout=10) as http:
        first = http.get(url + "/v1/nodes", headers=bearer(GATEWAY))
        etag = first.headers["etag"]
        t0 = time.perf_counter()
        again = http.get(url + "/v1/nodes", headers={**bearer(GATEWAY), "If-None-Match": etag})
        t_304 = time.perf_counter() - t0
        assert again.status_code == 304 and again.content == b"" and again.headers["etag"] == etag
        # Another view of the same state has another tag: a confined token's answer is not the full one.
        acme = http.get(url + "/v1/nodes", headers={**bearer(GATEWAY_ACME), "If-None-Match": etag})
        assert acme.status_code == 200 and acme.headers["etag"] != etag and "etag-1" not in acme.text
        # Every replica gives the same state the same tag (a client may fail over with it).
        wait_for(lambda: agreed(c), what="every replica in the same state")
        for u in c.replica_urls:
            r = http.get(u + "/v1/nodes", headers={**bearer(GATEWAY), "If-None-Match": etag})
            assert r.status_code == 304, (u, r.status_code)
        t0 = time.perf_counter()
        full = http.get(url + "/v1/nodes", headers=bearer(GATEWAY))
        t_200 = time.perf_counter() - t0
        assert full.content == first.content
        # A heartbeat changes the answer (the node's load): a new tag and body.
        epoch = nodes(url, ADMIN)["etag-1"]["epoch"]
        ok(http.post(f"{url}/v1/nodes/etag-1/heartbeat", json={"epoch": epoch, "load": {"running": 3}}, headers=bearer(ENGINE)))

        def changed() -> httpx.Response | None:
            r = http.get(url + "/v1/nodes", headers={**bearer(GATEWAY), "If-None-Match": etag})
            return r if r.status_code == 200 else None

        after = wait_for(changed, what="a new node list after the heartbeat")
        assert after.headers["etag"] != etag and '"running":3' in after.text
    print(f"\nGET /v1/nodes: {len(first.content)} bytes in {t_200 * 1e3:.1f} ms; 304 in {t_304 * 1e3:.1f} ms")

    async def client() -> None:
        statuses: list[int] = []

        async def record(response: httpx.Response) -> None:
            statuses.append(response.status_code)

        async with DirectoryClient([url], token=GATEWAY, deadline=10) as d:
            d._http.event_hooks["response"].append(record)
            a = await d.nodes()
            b = await d.nodes()
            assert [n.model_dump() for n in a] == [n.model_dump() for n in b] and any(n.node_id == "etag-1" for n in b)
        assert statuses[-2:] == [200, 304], statuses

    asyncio.run(client())
