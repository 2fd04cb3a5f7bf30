"""`kvdir bench ranks`: what a pull costs in metadata, and in time, as the TP rank count grows.

Per TP size (1, 2, 8) two worker stubs of that size (mirrored slots, a transfer engine per rank) hold the same
bytes per block in total (`TOTAL_BLOCK_BYTES` split over the ranks); A serves a prompt of `BLOCKS` blocks, B
pulls it by plan, three rounds. Reported: the directory entries the prefix takes, the bytes of the pull plan,
of the lookup answer and of the node's registration as the directory lists it, and the pull's read time
(every rank at once) against the slowest rank's and the ranks' sum (reads one after another). Mirroring
promises the entries, the plan and the lookup constant in the rank count; the registration grows by one
region per rank.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from kvtools.bench.clusters import bench_directory, pull_pair
from kvtools.bench.report import emit, header, say

TP_SIZES = (1, 2, 8)
TOTAL_BLOCK_BYTES = 512 << 10
BLOCKS = 64


def bench_tp(tmp: Path, urls: list[str], tp: int, blocks: int, rounds: int) -> dict[str, Any]:
    with pull_pair(tmp, urls, blocks=blocks, tp=tp, block_bytes=TOTAL_BLOCK_BYTES // tp) as pair:
        node = pair.http.get(f"{urls[0]}/v1/nodes/{pair.holder['node_id']}")
        transfer_s, slowest_rank_s, rank_sum_s = [], [], []
        for round_ in range(rounds):
            k = pair.pull(round_)
            transfer_s.append(k["pull_transfer_s"])
            slowest_rank_s.append(max(k["pull_rank_s"]))
            rank_sum_s.append(sum(k["pull_rank_s"]))
    med = statistics.median
    return {
        f"tp{tp}_directory_entries": pair.holder["matched_blocks"],
        f"tp{tp}_plan_bytes": len(json.dumps(pair.plan, separators=(",", ":"))),
        f"tp{tp}_lookup_bytes": pair.lookup_bytes,
        f"tp{tp}_registration_bytes": len(node.content),
        f"tp{tp}_regions": len(node.json()["regions"]),
        f"tp{tp}_pull_bytes": blocks * TOTAL_BLOCK_BYTES,
        f"tp{tp}_pull_ms": med(transfer_s) * 1e3,
        f"tp{tp}_slowest_rank_ms": med(slowest_rank_s) * 1e3,
        f"tp{tp}_rank_sum_ms": med(rank_sum_s) * 1e3,  # what the reads would take one after another
    }


def main(*, as_json: bool, quick: bool) -> int:
    results: dict[str, Any] = header(quick)
    blocks, rounds = (16, 2) if quick else (BLOCKS, 3)
    results.update(blocks=blocks, block_bytes_all_ranks=TOTAL_BLOCK_BYTES, transfer="mooncake", rounds=rounds)
    with bench_directory() as (c, tmp):
        for tp in TP_SIZES:
            say(f"TP {tp}: {blocks} blocks of {TOTAL_BLOCK_BYTES >> 10} KiB over {tp} ranks, pulled {rounds} times...")
            data = tmp / f"tp{tp}"
            data.mkdir()
            results.update(bench_tp(data, c.replica_urls, tp, blocks, rounds))
    base = results["tp1_pull_ms"]
    for tp in TP_SIZES[1:]:
        results[f"tp{tp}_pull_vs_tp1"] = results[f"tp{tp}_pull_ms"] / base
    emit(results, as_json)
    return 0
