"""`DELETE /v1/nodes/{id}` names the epoch it ends, and node ids holding "/" work on every node route
(issue #29 items 6 and 7b), against a real replica over HTTP."""

from __future__ import annotations

import asyncio
import urllib.parse

import httpx
import pytest

from kvdir.local_cluster import Cluster
from kvproto.client import DirectoryClient
from kvproto.errors import StaleEpochError


def _register(url: str, node_id: str, incarnation: str) -> int:
    r = httpx.post(url + "/v1/nodes", json={"node_id": node_id, "api_url": "http://127.0.0.1:9", "incarnation": incarnation})
    assert r.status_code == 200, r.text
    return int(r.json()["epoch"])


def _publish(url: str, node_id: str, epoch: int, hashes: list[int]) -> None:
    body = {"node_id": node_id, "epoch": epoch, "blocks": [{"hash": h, "slot": i} for i, h in enumerate(hashes)]}
    r = httpx.post(url + "/v1/blocks", json=body)
    assert r.status_code == 200, r.text


def _holders(url: str, hashes: list[int]) -> list[tuple[str, int, int]]:
    r = httpx.post(url + "/v1/lookup", json={"hashes": hashes, "consistency": "linearizable"})
    assert r.status_code == 200, r.text
    return [(h["node_id"], h["epoch"], h["matched_blocks"]) for h in r.json()["holders"]]


@pytest.fixture
def url(file_directory: Cluster) -> str:
    return file_directory.replica_urls[0]


def test_a_late_deregister_of_an_old_epoch_is_409_and_spares_the_new_registration(url: str) -> None:
    e1 = _register(url, "w1", "boot-1")
    _publish(url, "w1", e1, [1, 2])
    e2 = _register(url, "w1", "boot-2")  # restarted while its old DELETE was still being retried
    _publish(url, "w1", e2, [1, 2, 3])
    r = httpx.delete(url + f"/v1/nodes/w1?epoch={e1}")
    assert r.status_code == 409 and r.json()["error"] == "stale_epoch", r.text
    assert _holders(url, [1, 2, 3]) == [("w1", e2, 3)]
    assert httpx.get(url + "/v1/nodes/w1").json()["epoch"] == e2
    for bad in ("0", "-1", "x", str(1 << 63)):
        r = httpx.delete(url + f"/v1/nodes/w1?epoch={bad}")
        assert r.status_code == 422, (bad, r.text)
    assert _holders(url, [1, 2, 3]) == [("w1", e2, 3)]
    r = httpx.delete(url + f"/v1/nodes/w1?epoch={e2}")
    assert r.status_code == 200 and r.json() == {"node_id": "w1", "removed": 3}, r.text
    assert httpx.delete(url + f"/v1/nodes/w1?epoch={e2}").status_code == 404  # a retry after success
    # Without an epoch (an operator's): whatever registration is current.
    e3 = _register(url, "w1", "boot-3")
    _publish(url, "w1", e3, [4])
    r = httpx.delete(url + "/v1/nodes/w1")
    assert r.status_code == 200 and r.json()["removed"] == 1, r.text
    assert _holders(url, [1, 2, 3]) == []


def test_the_client_sends_its_epoch_when_deregistering(url: str) -> None:
    async def main() -> None:
        async with DirectoryClient(url, deadline=10) as d:
            old = await d.register("w2", "http://127.0.0.1:9", incarnation="boot-1")
            new = await d.register("w2", "http://127.0.0.1:9", incarnation="boot-2")
            await d.publish("w2", new.epoch, [(7, 0)])
            with pytest.raises(StaleEpochError) as e:
                await d.deregister("w2", old.epoch)
            assert e.value.status == 409
            assert [(n.node_id, n.epoch, n.blocks) for n in await d.nodes()] == [("w2", new.epoch, 1)]
            assert await d.deregister("w2", new.epoch) == 1
            assert await d.nodes() == []

    asyncio.run(main())


@pytest.mark.parametrize("node_id", ["rack-1/gpu-0", "a/heartbeat", "x//y", "/lead", "trail/"])
def test_node_ids_with_a_slash_register_heartbeat_list_and_deregister(url: str, node_id: str) -> None:
    async def main() -> None:
        async with DirectoryClient(url, deadline=10) as d:
            reg = await d.register(node_id, "http://127.0.0.1:9")
            await d.heartbeat(node_id, reg.epoch, {"running": 2.0})
            await d.publish(node_id, reg.epoch, [(11, 0), (12, 1)])
            [listed] = await d.nodes()
            assert (listed.node_id, listed.epoch, listed.load, listed.blocks) == (node_id, reg.epoch, {"running": 2.0}, 2)
            one = httpx.get(url + "/v1/nodes/" + urllib.parse.quote(node_id, safe=""))
            assert one.status_code == 200 and one.json()["node_id"] == node_id, one.text
            assert await d.deregister(node_id, reg.epoch) == 2
            assert await d.nodes() == []

    asyncio.run(main())
