"""`kvdir bench shards`: how the sharded directory's write path scales (docs/scale-out.md §8).

For 1, 2 and 4 shards of `replicas` replicas each, publishers registered through the shard-aware
`DirectoryClient` (so their ids land on their home shards by the map's rendezvous hash) publish
binary batches of 64 blocks to their home shard for a fixed time, one load process per shard.

Figures per shard count: committed blocks/s in all and per shard; the replicas' CPU-seconds per
1,000 committed blocks, per shard (summed over the shard's replicas from /proc, before and after
the window: steadier than rates on a shared machine, and what should stay flat as shards are added,
since shards share nothing); and each replica's RSS growth over the window per entry it then holds
(the index plus the Raft log pysyncobj keeps in memory until it compacts: an upper bound of the
in-process `bytes_per_entry` of `kvdir bench directory`).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from kvdir.local_cluster import Cluster
from kvdir.progress import clocked, stderr_meter
from kvdir.sharded import ShardedCluster
from kvproto.client import DirectoryClient
from kvtools.bench.directory import rest_load
from kvtools.bench.proc import cpu_s, rss_mib
from kvtools.bench.report import emit, header, say

SHARD_COUNTS = (1, 2, 4)
PUBLISHERS_PER_SHARD = 8
BATCH = 64


async def _register(urls: list[str], nodes: list[str]) -> dict[str, int]:
    """Register `nodes` through the shard-aware client: each lands on its home shard. Returns their epochs."""
    async with DirectoryClient(urls, deadline=30) as d:
        return {n: (await d.register(n, "http://127.0.0.1:1")).epoch for n in nodes}


def _pids(c: Cluster) -> list[int]:
    return [p.pid for p in c.procs if p is not None]


def _entries(c: Cluster) -> list[int]:
    """Entries each replica of the shard holds, once each has applied what its leader had committed."""
    for i in range(len(c.procs)):
        c.wait_caught_up(i, 60)
    with httpx.Client(timeout=10) as http:
        return [int(http.get(u + "/v1/digest").json()["entries"]) for u in c.replica_urls]


def bench_shards(shards: int, replicas: int, duration: float) -> dict[str, Any]:
    """One sharded directory under publishing load for `duration` seconds; its figures, keyed `shardsN_*`."""
    key = f"shards{shards}"
    with tempfile.TemporaryDirectory(prefix="kvdir-bench-shards-") as tmp:
        sc = ShardedCluster(Path(tmp), shards, replicas, log_level="warning")
        try:
            sc.start()
            sc.wait_ready(120)
            nodes = [f"pub{i}" for i in range(PUBLISHERS_PER_SHARD * shards)]
            epochs = asyncio.run(_register(sc.replica_urls, nodes))
            homed = {name: [n for n in nodes if sc.shard_map.home(n) == name] for name in sc.names}
            say(
                f"  {shards} shard{'s' * (shards != 1)} of {replicas}: publishers per shard "
                f"{[len(v) for v in homed.values()]}, batches of {BATCH} for {duration:.0f}s..."
            )
            rss0 = {name: [rss_mib(p) for p in _pids(sc.shard(name))] for name in sc.names}
            cpu0 = {name: sum(map(cpu_s, _pids(sc.shard(name)))) for name in sc.names}
            # One load process per shard, all at once; the first one's time is the bar's.
            with ThreadPoolExecutor(shards) as pool, stderr_meter(f"  {shards} shards", duration, unit="s") as meter:
                runs = {
                    name: pool.submit(
                        rest_load,
                        sc.shard(name).replica_urls,
                        "publish",
                        duration,
                        homed[name],
                        [epochs[n] for n in homed[name]],
                        clocked(meter) if k == 0 else None,
                        blocks_per_request=BATCH,
                        encoding="msgpack",
                    )
                    for k, name in enumerate(name for name in sc.names if homed[name])
                }
                loads = {name: run.result() for name, run in runs.items()}
            cpu = {name: sum(map(cpu_s, _pids(sc.shard(name)))) - cpu0[name] for name in sc.names}
            entries = {name: _entries(sc.shard(name)) for name in sc.names}
            rss = {name: [rss_mib(p) for p in _pids(sc.shard(name))] for name in sc.names}
        finally:
            sc.stop()
    blocks = {name: loads[name][0] if name in loads else 0 for name in sc.names}
    per_entry = [
        (after - before) * 2**20 / n for name in sc.names for before, after, n in zip(rss0[name], rss[name], entries[name]) if n
    ]
    out: dict[str, Any] = {
        f"{key}_blocks_per_s": sum(blocks.values()) / duration,
        f"{key}_per_shard_blocks_per_s": [round(blocks[name] / duration) for name in sc.names],
        f"{key}_replica_cpu_s_per_1k_blocks": [
            round(cpu[name] / blocks[name] * 1e3, 4) if blocks[name] else None for name in sc.names
        ],
        f"{key}_errors": sum(load[2] for load in loads.values()),
        # Every acknowledged block is a new random hash: each replica of a shard must hold exactly that many.
        f"{key}_entries_match_acknowledged": all(set(entries[name]) == {blocks[name]} for name in sc.names),
        f"{key}_rss_bytes_per_entry": [round(b, 1) for b in per_entry],
        f"{key}_rss_bytes_per_entry_median": statistics.median(per_entry) if per_entry else float("nan"),
    }
    say(
        f"    {out[f'{key}_blocks_per_s']:,.0f} blocks/s in all, per shard {out[f'{key}_per_shard_blocks_per_s']}; "
        f"replica CPU-s per 1k blocks {out[f'{key}_replica_cpu_s_per_1k_blocks']}; "
        f"RSS {out[f'{key}_rss_bytes_per_entry_median']:,.0f} B/entry (median of replicas)"
    )
    return out


def main(*, as_json: bool, quick: bool, replicas: int = 3) -> int:
    results: dict[str, Any] = {**header(quick), "replicas_per_shard": replicas, "batch_blocks": BATCH}
    duration = 3.0 if quick else 10.0
    say(f"publishing to 1, 2 and 4 shards of {replicas} replica{'s' * (replicas != 1)} ({duration:.0f}s each)...")
    for shards in SHARD_COUNTS:
        results.update(bench_shards(shards, replicas, duration))
    emit(results, as_json)
    return 0
