"""`kvdir shards show|apply` against two real shards: a node moved by a pin leaves its old shard at once, registers
at its new one with a new epoch, and its old epoch is fenced on both; an unsafe change is refused untouched."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from kvdir.cli import main
from kvproto.client import DirectoryClient
from kvproto.errors import StaleEpochError
from kvproto.shardmap import SHARD_BITS, ShardMap
from kvproto.state import EPOCH_BASE_BITS

NODES = [f"node-{i}" for i in range(6)]


def blocks(node: str) -> list[tuple[int, int]]:
    """Hashes only this node publishes."""
    base = (NODES.index(node) + 1) << 32
    return [(base + j, j) for j in range(8)]


def kvdir_shards(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = main(["shards", *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_moving_a_node_with_kvdir_shards_apply(make_sharded, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    c = make_sharded(2, 1)
    urls = ",".join(c.replica_urls)
    first = c.shard_map
    homes = {n: first.home(n) for n in NODES}
    assert set(homes.values()) == {"s0", "s1"}  # these ids spread over both shards
    mover = next(n for n in NODES if homes[n] == "s0")
    stayer = next(n for n in NODES if homes[n] == "s0" and n != mover)
    shard = {name: DirectoryClient(c.shard(name).replica_urls, sharded=False, deadline=10) for name in first.names}
    path = tmp_path / "map2.json"

    async def scenario(d: DirectoryClient) -> None:
        epochs = {n: (await d.register(n, "http://127.0.0.1:9")).epoch for n in NODES}
        for n in NODES:
            assert await d.publish(n, epochs[n], blocks(n)) == 8
        status, out, err = await asyncio.to_thread(kvdir_shards, capsys, "show", "--directory", urls)
        assert status == 0, err
        assert f"shard map version 1: 2 shards, {len(NODES)} nodes" in out
        for name in first.names:
            count = sum(h == name for h in homes.values())
            assert f"  {name}: {count} node{'s' * (count != 1)}, map version 1, {first.urls(name)[0]}" in out, out

        moved = ShardMap(version=2, shards=first.shards, nodes={mover: "s1"})
        path.write_text(json.dumps(moved.model_dump()))
        status, out, err = await asyncio.to_thread(kvdir_shards, capsys, "apply", str(path), "--directory", urls)
        assert status == 0, err
        assert "1 registered node move; order s0, s1" in out and f"  {mover}: s0 -> s1" in out
        assert out.index("  s0: version 2 committed, 1 node dropped") < out.index("  s1: version 2 committed, 0 nodes dropped")

        # The old shard neither lists the mover nor serves its entries; the rest of its nodes are untouched.
        listed = {name: {n.node_id for n in await shard[name].nodes()} for name in first.names}
        assert mover not in listed["s0"] and mover not in listed["s1"]
        assert stayer in listed["s0"]
        for name in first.names:
            res = await shard[name].lookup([h for h, _ in blocks(mover)])
            assert res.holders == [], (name, res.holders)
        res = await shard["s0"].lookup([h for h, _ in blocks(stayer)])
        assert [(h.node_id, h.matched_blocks) for h in res.holders] == [(stayer, 8)]
        # The old epoch is refused on both shards: dropped on s0, never registered on s1.
        for name in first.names:
            with pytest.raises(StaleEpochError) as info:
                await shard[name].publish(mover, epochs[mover], [(1, 0)])
            assert info.value.error == "unknown_node", info.value
        # Re-registering through the client that still has map version 1: s0 answers wrong_shard, the client
        # rereads the map and registers at s1, with a new epoch that carries s1's index.
        assert (await d.shard_map()).version == 1
        again = await d.register(mover, "http://127.0.0.1:9")
        assert (await d.shard_map()).version == 2
        assert await d.publish(mover, again.epoch, blocks(mover)) == 8
        assert again.epoch != epochs[mover]
        assert (again.epoch >> EPOCH_BASE_BITS) & ((1 << SHARD_BITS) - 1) == first.index_of("s1")
        assert [(n.node_id, n.epoch) for n in await shard["s1"].nodes() if n.node_id == mover] == [(mover, again.epoch)]
        assert mover not in {n.node_id for n in await shard["s0"].nodes()}
        # Fencing across shards: the old epoch still writes nowhere, now that the node lives on s1.
        for name, error in (("s0", "unknown_node"), ("s1", "stale_epoch")):
            with pytest.raises(StaleEpochError) as info:
                await shard[name].publish(mover, epochs[mover], [(2, 0)])
            assert info.value.error == error, (name, info.value)
        res = await d.lookup([h for h, _ in blocks(mover)])
        assert [(h.node_id, h.epoch, h.matched_blocks) for h in res.holders] == [(mover, again.epoch, 8)]

    async def run() -> None:
        try:
            async with DirectoryClient(c.replica_urls, deadline=10) as d:
                await scenario(d)
        finally:
            for client in shard.values():
                await client.aclose()

    asyncio.run(run())

    # Applying the same file again finishes nothing twice; a swap has no safe order and changes nothing.
    status, out, err = kvdir_shards(capsys, "apply", str(path), "--directory", urls)
    assert status == 0 and "  s0: already at version 2" in out and "  s1: already at version 2" in out, (out, err)
    swap = ShardMap(version=3, shards=first.shards, nodes={mover: "s0", stayer: "s1"})
    path.write_text(json.dumps(swap.model_dump()))
    status, out, err = kvdir_shards(capsys, "apply", str(path), "--directory", urls)
    assert status == 2 and "would both give and take nodes" in err, (out, err)
    assert [httpx.get(u + "/v1/shards").json()["version"] for u in c.replica_urls] == [2, 2]
