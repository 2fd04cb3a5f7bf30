"""A sharded directory (docs/scale-out.md): 2 Raft groups of real replica processes and one shard map.

Node writes land on the node's home shard only, lookups through the client merge every shard, a
replica refuses a node homed elsewhere, fencing holds across shards, and a map change under
publishing load loses nothing acknowledged for a live epoch and never serves a node from two shards.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvproto.client import DirectoryClient
from kvproto.errors import StaleEpochError
from kvproto.session import NodeSession
from kvproto.shardmap import ShardMap, apply_order
from tests.support.wait import until

pytestmark = pytest.mark.timeout(120)


def _nodes_on(urls: list[str]) -> set[str]:
    return {n["node_id"] for n in httpx.get(urls[0] + "/v1/nodes", timeout=5).json()["nodes"]}


def test_nodes_live_on_their_home_shard_and_lookups_merge_both(make_sharded) -> None:
    sc = make_sharded(shards=2, replicas=1)
    m = sc.shard_map
    ids = [f"w{i}" for i in range(8)]
    assert {m.home(n) for n in ids} == {"s0", "s1"}, "the test needs nodes on both shards"

    async def go() -> None:
        # Given one shard's URL only: the client finds the other through the map.
        async with DirectoryClient(m.urls("s0"), deadline=20) as d:
            epochs = {n: (await d.register(n, "http://127.0.0.1:1")).epoch for n in ids}
            for i, n in enumerate(ids):
                await d.publish(n, epochs[n], [(100, 0), (200 + i, 1)])
            found = await d.lookup([100, 200])
            assert sorted(h.node_id for h in found.holders) == ids
            assert found.holders[0].matched_blocks == 2  # w0 holds both blocks: longest first
            assert {n.node_id for n in await d.nodes()} == set(ids)

    asyncio.run(go())
    for shard in sc.names:
        assert _nodes_on(m.urls(shard)) == {n for n in ids if m.home(n) == shard}
        served = httpx.get(m.urls(shard)[0] + "/v1/shards", timeout=5).json()
        assert served["shard"] == shard and ShardMap.model_validate({k: v for k, v in served.items() if k != "shard"}) == m
    # A replica refuses, with the node's home, a node the map homes elsewhere.
    other = next(n for n in ids if m.home(n) == "s1")
    r = httpx.post(m.urls("s0")[0] + "/v1/nodes", json={"node_id": other, "api_url": "http://127.0.0.1:1"}, timeout=5)
    assert r.status_code == 409 and r.json()["error"] == "wrong_shard" and "'s1'" in r.json()["detail"]


def test_a_move_under_publishing_load_loses_nothing_acknowledged_and_fences_the_old_epoch(make_sharded) -> None:
    sc = make_sharded(shards=2, replicas=1)
    m1 = sc.shard_map
    ids = [f"p{i}" for i in range(6)]
    mover = next(n for n in ids if m1.home(n) == "s0")
    m2 = ShardMap(version=2, shards=m1.shards, nodes={mover: "s1"})
    homes = {n: m1.home(n) for n in ids}
    assert apply_order(m2, homes) == ["s0", "s1"]  # s0 gives, so it drops the node first

    async def go() -> None:
        acked: dict[tuple[str, int], set[int]] = {}
        seen_twice: list[list[str]] = []
        stop = asyncio.Event()
        old_epoch: dict[str, int] = {}

        async def publisher(d: DirectoryClient, node: str) -> None:
            epoch = (await d.register(node, "http://127.0.0.1:1", incarnation=f"{node}-a")).epoch
            old_epoch[node] = epoch
            h, incarnation = 1_000_000 * (ids.index(node) + 1), 0
            while not stop.is_set():
                h += 1
                try:
                    await d.publish(node, epoch, [(h, h % 64)])
                except StaleEpochError:
                    # The directory dropped this node (its shard gave it away): register again, at its new home
                    # (wrong_shard, also a 409, while the new home has not committed the map yet).
                    incarnation += 1
                    while True:
                        try:
                            epoch = (await d.register(node, "http://127.0.0.1:1", incarnation=f"{node}-{incarnation}")).epoch
                            break
                        except StaleEpochError:
                            await asyncio.sleep(0.02)
                    continue
                acked.setdefault((node, epoch), set()).add(h)

        async def watcher(d: DirectoryClient) -> None:
            while not stop.is_set():
                nodes = [n.node_id for n in await d.nodes()]  # from every shard
                if len(nodes) != len(set(nodes)):  # a node registered on two shards at once: one serves stale holders
                    seen_twice.append(nodes)
                await asyncio.sleep(0.01)

        async with DirectoryClient(sc.replica_urls, deadline=20) as d, DirectoryClient(m1.urls("s1"), deadline=20) as w:
            tasks = [asyncio.create_task(publisher(d, n)) for n in ids]
            tasks.append(asyncio.create_task(watcher(w)))
            await until(lambda: len(acked) == len(ids) and all(len(v) >= 20 for v in acked.values()), timeout=30.0)
            async with httpx.AsyncClient(timeout=10) as http:
                for shard in apply_order(m2, homes):
                    r = await http.put(m1.urls(shard)[0] + "/v1/shards", content=m2.document())
                    assert r.status_code == 200, r.text
            await until(
                lambda: any(node == mover and e != old_epoch[mover] and len(v) >= 20 for (node, e), v in acked.items()),
                timeout=30.0,
            )
            stop.set()
            await asyncio.gather(*tasks)

            assert seen_twice == []
            assert _nodes_on(m1.urls("s1")) >= {mover} and mover not in _nodes_on(m1.urls("s0"))
            # Every block acknowledged under each node's current epoch is held by that node.
            current = {n.node_id: n.epoch for n in await d.nodes()}
            for node, epoch in current.items():
                held = acked[node, epoch]
                found = {h for h in held if any(x.node_id == node for x in (await d.lookup([h])).holders)}
                assert found == held, f"{node}: {len(held - found)} acknowledged blocks missing"
            # The mover's old epoch is fenced on both shards, and no shard serves its old blocks.
            old = old_epoch[mover]
            assert current[mover] != old
            for shard in sc.names:
                async with DirectoryClient(m1.urls(shard), sharded=False, deadline=5) as one:
                    with pytest.raises(StaleEpochError):
                        await one.publish(mover, old, [(5, 5)])
            stale = acked[mover, old]
            assert not any(x.node_id == mover for x in (await d.lookup([next(iter(stale))])).holders)

    asyncio.run(go())


def test_a_node_between_shards_backs_off_until_its_new_home_has_the_map(make_sharded) -> None:
    # An apply interrupted after the first shard: the old home drops the node, the new home still
    # sends it back. Its session must wait between tries (not spin), and land once the map is complete.
    sc = make_sharded(shards=2, replicas=1)
    m1 = sc.shard_map
    node = next(f"b{i}" for i in range(100) if m1.home(f"b{i}") == "s0")
    m2 = ShardMap(version=2, shards=m1.shards, nodes={node: "s1"})

    async def go() -> None:
        async with DirectoryClient(m1.urls("s1"), deadline=5) as d:
            held: list[tuple[int, int, str | None]] = []
            session = NodeSession(d, node, "http://127.0.0.1:1", holdings=lambda: held, retry_first_s=0.05, retry_max_s=0.4)
            assert await session.sync() is None and session.stats.registrations == 1
            async with httpx.AsyncClient(timeout=10) as http:
                assert (await http.put(m1.urls("s0")[0] + "/v1/shards", content=m2.document())).status_code == 200
                held.append((7, 0, None))
                session.stored([(7, 0)])
                waits = []
                loop = asyncio.get_running_loop()
                end = loop.time() + 1.5
                while loop.time() < end:
                    wait = await session.sync()
                    assert wait is not None, "the node cannot land while s1 has map version 1"
                    waits.append(wait)
                    await asyncio.sleep(wait)
                assert len(waits) < 15 and max(waits) >= 0.2, waits  # backed off, not retried at once
                assert (await http.put(m1.urls("s1")[0] + "/v1/shards", content=m2.document())).status_code == 200
            while (wait := await session.sync()) is not None:
                await asyncio.sleep(wait)
            assert {n.node_id for n in await d.nodes() if n.node_id == node} == {node}
            assert node in _nodes_on(m1.urls("s1")) and node not in _nodes_on(m1.urls("s0"))
            assert any(h.node_id == node for h in (await d.lookup([7])).holders)

    asyncio.run(go())
