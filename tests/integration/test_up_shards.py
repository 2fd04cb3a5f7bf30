"""`kvdir up --shards 2` end to end: two Raft groups of one replica each, workers registered on their home
shards only, and the gateway routing by prefixes it looks up on every shard (docs/scale-out.md)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvdir.launcher import UpSettings, up_ports
from kvproto.client import DirectoryClient
from kvproto.hashing import KvIdentity, identity_hashes
from kvproto.shardmap import load
from tests.support.launcher import Up
from tests.support.ports import free_base_port, port_free
from tests.support.wait import wait_for

PORTS = (0, 1, 101, 201, 301, 11, 12)  # gateway, shard s0's and s1's replica (HTTP, Raft), two workers
MESSAGES = [{"role": "system", "content": "Sharded clusters still cache. " * 8}, {"role": "user", "content": "Is this cached?"}]


def test_shards_get_ports_of_their_own() -> None:
    """Shard s0 keeps the unsharded ports; no port is bound twice, whatever the counts."""
    ports = dict(up_ports(UpSettings(base_port=9000, shards=2, replicas=2, workers=1)))
    assert ports == {
        9000: "gateway",
        9001: "shard s0 replica 1 HTTP",
        9002: "shard s0 replica 2 HTTP",
        9101: "shard s0 replica 1 Raft",
        9102: "shard s0 replica 2 Raft",
        9201: "shard s1 replica 1 HTTP",
        9202: "shard s1 replica 2 HTTP",
        9301: "shard s1 replica 1 Raft",
        9302: "shard s1 replica 2 Raft",
        9011: "worker-1 HTTP",
    }
    most = up_ports(UpSettings(base_port=9000, shards=16, replicas=7, workers=64))
    assert len({p for p, _ in most}) == len(most) == 1 + 2 * 16 * 7 + 64
    with pytest.raises(ValueError, match="needs port 65603"):
        UpSettings(base_port=62500, shards=16)


@pytest.fixture
def up(tmp_path: Path) -> Iterator[tuple[Up, int]]:
    base = free_base_port(PORTS)
    launcher = Up(
        [
            "--shards",
            "2",
            "--replicas",
            "1",
            "--base-port",
            str(base),
            "--data-dir",
            str(tmp_path / "up"),
            "--workers",
            "2",
            "--worker-time-scale",
            "0.1",
            "--worker-transfer",
            "tcp",
            "--lease-ttl-s",
            "30",
        ],
        tmp_path / "up.stderr",
    )
    try:
        wait_for(
            lambda: launcher.lines or launcher.proc.poll() is not None, timeout=120, interval=0.2, what="kvdir up to be ready"
        )
        assert launcher.lines, (tmp_path / "up.stderr").read_text()
        yield launcher, base
    finally:
        launcher.stop()
        assert not any(Path(f"/proc/{pid}").exists() for pid in launcher.started)
        assert all(port_free(base + d) for d in PORTS)


def test_kvdir_up_with_two_shards(up: tuple[Up, int]) -> None:
    launcher, base = up
    ready = json.loads(launcher.lines[0])
    assert ready["replicas"] == [f"http://127.0.0.1:{base + 1}", f"http://127.0.0.1:{base + 201}"]
    assert ready["leaders"] == ready["replicas"]
    shard_map = load(Path(ready["shard_map_file"]))
    assert {s: shard_map.urls(s) for s in shard_map.names} == {"s0": ready["replicas"][:1], "s1": ready["replicas"][1:]}

    # Every replica serves the map it committed, and lists only the workers it is the home shard of.
    listed: list[tuple[str, str]] = []
    for shard in shard_map.names:
        url = shard_map.urls(shard)[0]
        served = httpx.get(url + "/v1/shards", timeout=5).json()
        assert served["shard"] == shard and served["version"] == shard_map.version
        listed += [(n["node_id"], shard) for n in httpx.get(url + "/v1/nodes", timeout=5).json()["nodes"]]
    assert sorted(listed) == sorted((n, shard_map.home(n)) for n in ("worker-1", "worker-2"))
    assert {shard for _, shard in listed} == {"s0", "s1"}  # these two ids hash to different shards

    # A chat through the gateway, then the same chat again: routed to the worker the first one left its KV on,
    # which the gateway found by asking every shard.
    gateway = ready["gateway"]
    body = {"model": "kvdir-stub", "messages": MESSAGES, "max_tokens": 4}
    first = httpx.post(gateway + "/v1/chat/completions", json=body, timeout=30)
    assert first.status_code == 200, first.text
    node = first.headers["x-kvdir-node"]
    tokens = httpx.post(
        ready["workers"][0] + "/tokenize",
        json={"model": "kvdir-stub", "messages": MESSAGES, "add_generation_prompt": True},
        timeout=5,
    ).json()["tokens"]
    hashes = identity_hashes(list(tokens), KvIdentity(model="kvdir-stub"))

    async def held_by() -> set[str]:
        async with DirectoryClient(ready["replicas"], deadline=5) as d:
            return {h.node_id for h in (await d.lookup(hashes)).holders if h.matched_blocks == len(hashes)}

    wait_for(lambda: node in asyncio.run(held_by()), timeout=30, what=f"{node} to publish the prompt on its shard")
    again = httpx.post(gateway + "/v1/chat/completions", json=body, timeout=30)
    assert again.status_code == 200, again.text
    assert again.headers["x-kvdir-node"] == node, again.headers
    assert int(again.headers["x-kvdir-predicted-cached-tokens"]) > 0
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
