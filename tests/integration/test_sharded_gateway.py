"""A gateway in front of a sharded directory (docs/scale-out.md §6), all in real processes: its mirror follows
every shard (one watch stream each, found through the shard map), a prefix held by a worker homed on either
shard is routed by affinity from the mirror, a newer shard map committed in the shards is followed, and with
one shard down the engine list follows the other shards and keeps the down shard's engines."""

from __future__ import annotations

import asyncio
import signal

import httpx

from gateway.mirror import Mirror
from kvproto.client import DirectoryClient
from kvproto.shardmap import ShardMap
from tests.support.wait import until, wait_for

MODEL = "kvdir-stub"
PROMPT = "A shared system prompt about KV caches, long enough to span several blocks of sixteen tokens. " * 4


def _complete(url: str, prompt: str) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def _metrics(url: str) -> dict[str, float]:
    """Every sample of the gateway's /metrics, by its name and labels as written."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _digest(url: str) -> dict[str, object]:
    d: dict[str, object] = httpx.get(url + "/v1/digest", timeout=10).json()
    return d


def test_the_gateway_mirrors_every_shard_and_routes_by_affinity_on_each(make_sharded, make_workers, make_gateway) -> None:
    c = make_sharded(shards=2, replicas=1)
    shard_url = {name: c.shard(name).replica_urls[0] for name in c.names}
    w = make_workers(c, 2)
    home = {node: c.shard_map.home(node) for node in w.node_ids}
    assert sorted(home.values()) == c.names, home  # one worker homed on each shard
    g = make_gateway(c, 2)

    # Each worker caches a prompt of its own; its blocks are published to its home shard alone.
    for node, url in zip(w.node_ids, w.urls):
        _complete(url, PROMPT + node)
    wait_for(lambda: all(int(_digest(shard_url[s])["entries"]) > 0 for s in c.names), what="both shards holding blocks")
    applied = {s: int(_digest(shard_url[s])["applied"]) for s in c.names}

    # The gateway's mirror follows both shards' logs, each up to what its shard had applied.
    def caught_up() -> bool:
        m = _metrics(g.url)
        return m["kvdir_gateway_mirror_shard_map_version"] == 1 and all(
            m.get(f'kvdir_gateway_mirror_shard_position{{shard="{s}"}}', -1) >= applied[s] for s in c.names
        )

    wait_for(caught_up, what="the gateway's mirror at both shards' positions")
    wait_for(lambda: _metrics(g.url)["kvdir_gateway_mirror_lag_seconds"] <= 0.5, what="a fresh mirror")
    before = _metrics(g.url)
    for node in w.node_ids:
        r = _complete(g.url, PROMPT + node + " and a question")
        assert (r.headers["x-kvdir-decision"], r.headers["x-kvdir-node"]) == ("affinity", node), (home[node], r.headers)
    after = _metrics(g.url)
    source = 'kvdir_gateway_lookups_total{source="%s"}'
    assert after[source % "mirror"] == before.get(source % "mirror", 0) + 2
    assert after.get(source % "rest", 0) == 0 and after.get(source % "none", 0) == 0, after

    async def in_process() -> None:
        # The same mirror in this process, given one replica of one shard: the map leads it to the other.
        directory = DirectoryClient([shard_url["s0"]], timeout=5.0)
        mirror = Mirror([shard_url["s0"]], None, max_lag_s=0.5, directory=directory)
        mirror.start()
        try:
            await until(lambda: mirror.fresh() and sorted(mirror.feeds) == c.names, "a fresh mirror of both shards")
            want = {s: _digest(shard_url[s])["digest"] for s in c.names}  # heartbeats leave digests as they are
            await until(
                lambda: all((f := mirror.feeds[s].state) is not None and f.digest() == want[s] for s in c.names),
                "each shard's state mirrored exactly",
            )
            # A newer map (the same shards) committed in both shards: the mirror is stale until it follows it.
            newer = ShardMap(version=2, shards=c.shard_map.shards).document()
            async with httpx.AsyncClient(timeout=10) as http:
                for s in c.names:
                    r = await http.put(shard_url[s] + "/v1/shards", content=newer)
                    assert r.status_code == 200, r.text
            await until(lambda: mirror.map_version == 2 and mirror.fresh(), "the mirror following map version 2")
            assert sorted(mirror.feeds) == c.names
        finally:
            await mirror.stop()
            await directory.aclose()

    asyncio.run(in_process())
    wait_for(lambda: _metrics(g.url)["kvdir_gateway_mirror_shard_map_version"] == 2, what="the gateway on map version 2")
    wait_for(lambda: _metrics(g.url)["kvdir_gateway_mirror_lag_seconds"] <= 0.5, what="the gateway's mirror fresh again")


def _engines(url: str) -> int:
    return int(httpx.get(url + "/health", timeout=10).json()["engines"])


def test_with_one_shard_down_the_engine_list_follows_the_others_and_keeps_its_engines(
    make_sharded, make_workers, make_gateway
) -> None:
    c = make_sharded(shards=2, replicas=1)
    w = make_workers(c, 2)
    home = {node: c.shard_map.home(node) for node in w.node_ids}
    assert sorted(home.values()) == c.names, home  # one worker homed on each shard
    g = make_gateway(c, 2)
    down = "s1"
    c.shard(down).kill(0)  # its only replica: that shard's node list cannot be read
    leaving = next(i for i, node in enumerate(w.node_ids) if home[node] != down)
    w.kill(leaving, signal.SIGTERM)  # a clean stop deregisters it from its (reachable) home shard
    # The gateway drops the engine that left the reachable shard and keeps the one on the unreachable shard.
    wait_for(lambda: _engines(g.url) == 1, what="the engine list following the reachable shard")
    r = _complete(g.url, PROMPT + "still served")
    assert r.headers["x-kvdir-node"] == next(node for node in w.node_ids if home[node] == down)
