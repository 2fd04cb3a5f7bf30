"""`kvdir bench directory`: hashing, in-process lookups (vs Dynamo's RadixTree when installed),
memory per entry, the state machine's own publish rate, and publish (JSON and binary batches) /
lookup / failover over REST on three local replicas."""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvdir.local_cluster import Cluster, free_ports
from kvdir.progress import clocked, stderr_meter
from kvproto.client import DirectoryClient
from kvproto.errors import DirectoryUnavailable
from kvproto.hashing import block_hashes, chain_hashes, seed_for
from kvproto.index import BlockIndex
from kvproto.state import DirectoryState, Publish, Register
from kvtools.bench.loadgen import LoadSpec, load_in_process
from kvtools.bench.proc import cpu_s
from kvtools.bench.report import emit, header, pct, say

SEED = seed_for("")


def _best_rate(fn: Callable[[], int], rounds: int = 3) -> float:
    """Items per second of the fastest of `rounds` runs (the least disturbed by this shared machine)."""
    best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        n = fn()
        best = max(best, n / (time.perf_counter() - t0))
    return best


# -- hashing ----------------------------------------------------------------------


def bench_hashing(quick: bool) -> float:
    tokens = np.random.default_rng(0).integers(0, 2**31, 100_000)
    reps = 5 if quick else 20

    def run() -> int:
        for _ in range(reps):
            block_hashes(tokens)
        return reps * len(tokens)

    return _best_rate(run)


# -- in-process lookups -----------------------------------------------------------------


class LookupWorkload:
    """16 nodes x S sequences of 64 blocks: 100 shared 32-block system prompts + random suffixes.

    Queries are 256 blocks: half continue a stored sequence (64 known blocks), a
    quarter start with a system prompt only, a quarter are new.
    """

    def __init__(self, sequences: int, nodes: int = 16, queries: int = 2000, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.nodes = nodes
        prompts = [rng.integers(0, 2**63, 32, dtype=np.uint64) for _ in range(100)]
        self.local: list[np.ndarray] = []
        self.owner: list[int] = []
        for s in range(sequences):
            self.local.append(np.concatenate([prompts[s % 100], rng.integers(0, 2**63, 32, dtype=np.uint64)]))
            self.owner.append(int(rng.integers(0, nodes)))
        self.seq = [np.asarray(chain_hashes(loc.tolist(), SEED), dtype=np.uint64) for loc in self.local]
        self.query_local: list[list[int]] = []
        self.query_seq: list[list[int]] = []
        for q in range(queries):
            kind = q % 4
            tail = rng.integers(0, 2**63, 256, dtype=np.uint64)
            if kind < 2:
                head = self.local[int(rng.integers(0, sequences))]
            elif kind == 2:
                head = prompts[int(rng.integers(0, 100))]
            else:
                head = tail[:0]
            loc = np.concatenate([head, tail])[:256].tolist()
            self.query_local.append(loc)
            self.query_seq.append(chain_hashes(loc, SEED))

    def build_state(self) -> DirectoryState:
        st = DirectoryState()
        for n in range(self.nodes):
            st.apply(Register(f"node{n}", "bench", "http://127.0.0.1:1"))
        slots = np.arange(64, dtype=np.uint32)
        for seq, owner in zip(self.seq, self.owner):
            st.apply(Publish(f"node{owner}", owner + 1, seq, slots))
        st.index.merge()
        return st

    def build_dynamo(self) -> Any:
        from dynamo.llm import RadixTree

        tree = RadixTree()
        for i, (loc, seq, owner) in enumerate(zip(self.local, self.seq, self.owner)):
            blocks = [{"block_hash": int(s), "tokens_hash": int(h)} for s, h in zip(seq.tolist(), loc.tolist())]
            event = {"event_id": i, "data": {"stored": {"parent_hash": None, "blocks": blocks}}}
            tree.apply_event(owner, json.dumps(event).encode())
        return tree


def bench_lookups(quick: bool) -> dict[str, Any]:
    w = LookupWorkload(sequences=2_000 if quick else 20_000)
    st = w.build_state()
    entries = len(st.index)
    queries = w.query_seq

    def ours() -> int:
        for q in queries:
            st.lookup(np.asarray(q, dtype=np.uint64))  # from a list, as the REST layer has it
        return len(queries)

    out: dict[str, Any] = {
        "lookup_index_entries": entries,
        "lookup_per_s": None,
        "dynamo_lookup_per_s": None,
        "dynamo_ratio": None,
    }
    try:
        tree = w.build_dynamo()
    except ImportError:
        tree = None
        say("  (ai-dynamo-runtime not installed: `pip install -e '.[peers]'` to compare with Dynamo's RadixTree)")
    if tree is None:
        out["lookup_per_s"] = _best_rate(ours, 5)
        return out
    # Same answers first: the longest match per node must agree.
    for q_seq, q_loc in zip(queries[:200], w.query_local[:200]):
        mine = {h.node_id: h.matched_blocks for h in st.lookup(np.asarray(q_seq, dtype=np.uint64))}
        theirs = {f"node{wid}": n for (wid, _), n in tree.find_matches(q_loc).scores.items() if n}
        if mine != theirs:
            raise AssertionError(f"kvdir and Dynamo disagree: {mine} vs {theirs}")
    local_queries = w.query_local

    def dynamo() -> int:
        for q in local_queries:
            _ = tree.find_matches(q).scores  # the per-worker overlaps as Python objects, as ours returns them
        return len(local_queries)

    ours_rates, theirs_rates = [], []
    for _ in range(7):  # interleaved pairs, so both see the same (shared, noisy) machine
        ours_rates.append(_best_rate(ours, 1))
        theirs_rates.append(_best_rate(dynamo, 1))
    out["lookup_per_s"] = statistics.median(ours_rates)
    out["dynamo_lookup_per_s"] = statistics.median(theirs_rates)
    out["dynamo_ratio"] = statistics.median(o / t for o, t in zip(ours_rates, theirs_rates))
    return out


# -- memory ------------------------------------------------------------------------------


def bench_memory(entries: int = 1_000_000) -> float:
    """Bytes of Python heap per (block, holder) entry with `entries` entries, 16 nodes."""
    rng = np.random.default_rng(1)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    st = DirectoryState()
    for n in range(16):
        st.apply(Register(f"node{n}", "bench", "http://127.0.0.1:1"))
    per_node = entries // 16
    batch = 4096
    for n in range(16):
        for start in range(0, per_node, batch):
            k = min(batch, per_node - start)
            st.apply(
                Publish(
                    f"node{n}",
                    n + 1,
                    rng.integers(0, 2**64 - 1, k, dtype=np.uint64, endpoint=True),
                    np.arange(start, start + k, dtype=np.uint32),
                )
            )
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(st.index) == per_node * 16
    return used / len(st.index)


# -- the state machine alone ---------------------------------------------------------------


def bench_apply(batch: int, blocks: int) -> float:
    """Blocks/s `DirectoryState.apply` stores in-process, publishing `blocks` random hashes in batches of
    `batch` into one node (merges included): the ceiling under the REST and Raft layers."""
    rng = np.random.default_rng(2)
    hashes = rng.integers(0, 2**64 - 1, blocks, dtype=np.uint64, endpoint=True)
    slots = np.arange(blocks, dtype=np.uint32)

    def run() -> int:
        st = DirectoryState()
        epoch = st.apply(Register("node0", "bench", "http://127.0.0.1:1")).value
        for i in range(0, blocks, batch):
            st.apply(Publish("node0", epoch, hashes[i : i + batch], slots[i : i + batch]))
        return blocks

    return _best_rate(run)


# -- the index's worst stall ------------------------------------------------------------------


def bench_mutation_stall(entries: int) -> dict[str, Any]:
    """CPU of the slowest index mutation while 16 nodes grow a `BlockIndex` to `entries` entries in puts of
    64 random hashes (as publishes arrive), then of dropping one node: the stall every replica's Raft
    thread and every gateway's mirror takes at once. Also the CPU per 1,000 entries over the whole growth,
    merges included, and the lookup rate (256-hash queries, as `bench_lookups`) at the final size."""
    rng = np.random.default_rng(3)
    ix = BlockIndex()
    slots = np.arange(64, dtype=np.uint32)
    worst = total = 0.0
    published: list[np.ndarray] = []
    with stderr_meter("  index growth", entries // 64 * 64, unit="entries") as meter:
        for i in range(entries // 64):
            hashes = rng.integers(0, 2**64 - 1, 64, dtype=np.uint64, endpoint=True)
            if i % 64 == 0:
                published.append(hashes)
                meter.update(i * 64, time.monotonic())
            t0 = time.process_time()
            ix.put(i % 16, hashes, slots)
            took = time.process_time() - t0
            total += took
            worst = max(worst, took)
        meter.update(entries // 64 * 64, time.monotonic())
    t0 = time.process_time()
    ix.drop_node(0)
    drop = time.process_time() - t0
    queries = [np.concatenate([h, rng.integers(0, 2**64 - 1, 192, dtype=np.uint64, endpoint=True)]) for h in published[:2000]]

    def lookups() -> int:
        for q in queries:
            ix.lookup(q)
        return len(queries)

    return {
        "stall_entries": len(ix),
        "stall_worst_put_ms": worst * 1e3,
        "stall_put_cpu_ms_per_1k_entries": total / (entries // 64 * 64) * 1e6,
        "stall_drop_node_ms": drop * 1e3,
        "stall_lookup_per_s": _best_rate(lookups),
    }


# -- REST ----------------------------------------------------------------------------


def rest_load(
    urls: list[str],
    mode: str,
    duration: float,
    nodes: list[str],
    epochs: list[int],
    progress: Callable[[float], None] | None = None,
    **kw: Any,
) -> tuple[int, list[float], int]:
    """One load process with 16 keep-alive connections spread over `urls`: (items, latencies, errors);
    `progress(seconds elapsed)` while it runs."""
    r = load_in_process(LoadSpec(urls, mode, duration, 16, 0, nodes, epochs, **kw), progress)
    return r["items"], r["latencies"], r["errors"]


@contextmanager
def _publishing_cluster(extra_args: tuple[str, ...] = ()) -> Iterator[tuple[Cluster, list[str], list[int]]]:
    """Three fresh local replicas with 8 registered publisher nodes: (cluster, node ids, epochs); stopped on exit."""
    ports = free_ports(6)
    with tempfile.TemporaryDirectory(prefix="kvdir-bench-") as tmp:
        c = Cluster(Path(tmp), ports[:3], ports[3:], log_level="warning", extra_args=extra_args)
        try:
            c.start()
            c.wait_ready(60)
            nodes = [f"pub{n}" for n in range(8)]
            with httpx.Client() as http:
                epochs = [
                    http.post(c.replica_urls[0] + "/v1/nodes", json={"node_id": n, "api_url": "http://127.0.0.1:1"}).json()[
                        "epoch"
                    ]
                    for n in nodes
                ]
            yield c, nodes, epochs
        finally:
            c.stop()


def bench_rest(quick: bool, queries_tail: list[list[int]]) -> dict[str, Any]:
    duration = 3.0 if quick else 10.0
    out: dict[str, Any] = {}
    with _publishing_cluster() as (c, nodes, epochs):
        urls = c.replica_urls
        for batch, key in ((64, "publish"), (1024, "publish_batch1024")):
            out.update(_publish_json_vs_msgpack(c, nodes, epochs, batch, key, duration))
        with httpx.Client() as http:
            seqs = [chain_hashes([i * 1000 + j for j in range(64)], SEED) for i in range(len(queries_tail))]
            for i, seq in enumerate(seqs):
                http.post(
                    urls[0] + "/v1/blocks",
                    json={
                        "node_id": nodes[i % 8],
                        "epoch": epochs[i % 8],
                        "blocks": [{"hash": h, "slot": j} for j, h in enumerate(seq)],
                    },
                )
        queries = [s + q[:192] for s, q in zip(seqs, queries_tail)]
        say(
            f"  looking up 256-hash queries for {duration:.0f}s (index of {httpx.get(urls[0] + '/v1/digest').json()['entries']:,} entries)..."
        )
        with stderr_meter("  lookups", duration, unit="s") as meter:
            items, lat, errors = rest_load(urls, "lookup", duration, nodes, epochs, clocked(meter), lookup_queries=queries)
        out.update(
            rest_lookup_per_s=items / duration,
            rest_lookup_p50_ms=pct(lat, 50) * 1e3,
            rest_lookup_p99_ms=pct(lat, 99) * 1e3,
            rest_lookup_errors=errors,
        )
        rounds = 2 if quick else 5
        say(f"  failover: SIGKILL the leader under a steady writer, {rounds} times...")
        with stderr_meter("  failover", rounds, unit="kills") as meter:
            out["failover_runs_s"] = []
            for k in range(rounds):
                out["failover_runs_s"].append(asyncio.run(_failover_once(c)))
                meter.update(k + 1, time.monotonic())
        out["failover_s"] = statistics.median(out["failover_runs_s"])
        return out


@dataclass
class _Tally:
    """What the runs of one encoding added up to."""

    items: int = 0
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    replica_cpu_s: float = 0.0


def _publish_json_vs_msgpack(
    c: Cluster, nodes: list[str], epochs: list[int], batch: int, key: str, duration: float
) -> dict[str, Any]:
    """Publish rate with JSON bodies (`KEY_*`) and binary batches (`KEY_msgpack_*`), `duration` seconds each,
    and the CPU the three replicas spent per 1,000 blocks (steadier than the rate on a shared machine).

    Halves in the order JSON, msgpack, msgpack, JSON: the index grows as the run goes on, and this
    order gives both encodings the same share of early and late."""
    pids = [p.pid for p in c.procs if p is not None]
    tallies = {"json": _Tally(), "msgpack": _Tally()}
    say(
        f"  publishing batches of {batch} blocks, JSON and msgpack bodies, {duration:.0f}s each (16 connections over 3 replicas)..."
    )
    with stderr_meter(f"  batches of {batch}", 2 * duration, unit="s") as meter:
        for k, encoding in enumerate(("json", "msgpack", "msgpack", "json"), 1):
            cpu = sum(map(cpu_s, pids))
            meter.stage(f"{encoding} {k}/4", duration / 2, time.monotonic())
            items, lat, errors = rest_load(
                c.replica_urls,
                "publish",
                duration / 2,
                nodes,
                epochs,
                clocked(meter),
                blocks_per_request=batch,
                encoding=encoding,
            )
            t = tallies[encoding]
            t.replica_cpu_s += sum(map(cpu_s, pids)) - cpu
            t.items += items
            t.errors += errors
            t.latencies += lat
    out: dict[str, Any] = {}
    for encoding, t in tallies.items():
        name = key if encoding == "json" else f"{key}_msgpack"
        out[f"{name}_blocks_per_s"] = t.items / duration
        out[f"{name}_p50_ms"] = pct(t.latencies, 50) * 1e3
        out[f"{name}_p99_ms"] = pct(t.latencies, 99) * 1e3
        out[f"{name}_errors"] = t.errors
        out[f"{name}_replica_cpu_ms_per_1k_blocks"] = t.replica_cpu_s / t.items * 1e6 if t.items else float("nan")
    rate, binary_rate = out[f"{key}_blocks_per_s"], out[f"{key}_msgpack_blocks_per_s"]
    out[f"{key}_msgpack_speedup"] = binary_rate / rate if rate else float("nan")
    say(
        f"    batches of {batch}: JSON {rate:,.0f} blocks/s, {out[f'{key}_replica_cpu_ms_per_1k_blocks']:.1f} ms of replica CPU"
        f" per 1k blocks; msgpack {binary_rate:,.0f} blocks/s, {out[f'{key}_msgpack_replica_cpu_ms_per_1k_blocks']:.1f} ms"
    )
    return out


def bench_fsync(quick: bool) -> dict[str, Any]:
    """Publish rate (batches of 64) on 3 fresh replicas with and without `--fsync` (the default), and
    with a Raft password (encrypted, authenticated links, as `kvdir up` and compose run)."""
    duration = 3.0 if quick else 10.0
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvdir-bench-secret-") as secrets:
        password = Path(secrets) / "raft_password"
        password.write_text("bench-password\n")
        for mode, args in (
            ("fsync", ()),
            ("no_fsync", ("--no-fsync",)),
            ("raft_password", ("--raft-password-file", str(password))),
        ):
            with _publishing_cluster(args) as (c, nodes, epochs), stderr_meter("  publish", duration, unit="s") as meter:
                say(f"  publishing batches of 64 blocks for {duration:.0f}s, {mode.replace('_', ' ')}...")
                items, lat, _ = rest_load(
                    c.replica_urls, "publish", duration, nodes, epochs, clocked(meter), blocks_per_request=64
                )
                out[f"publish_{mode}_blocks_per_s"] = items / duration
                out[f"publish_{mode}_p50_ms"] = pct(lat, 50) * 1e3
    return out


async def _failover_once(c: Cluster) -> float:
    """Seconds from SIGKILL of the leader to the first acknowledgement of a write sent after it."""
    lead = c.replica_urls.index(c.wait_ready(60))
    async with DirectoryClient(c.replica_urls, timeout=1.0, deadline=30) as d:
        reg = await d.register(f"fo{time.monotonic_ns()}", "http://127.0.0.1:1")
        for _ in range(20):
            await d.publish(reg.node_id, reg.epoch, [(time.monotonic_ns() & (2**64 - 1), 0)])
        c.kill(lead)
        killed = time.monotonic()
        while True:
            try:
                await d.publish(reg.node_id, reg.epoch, [(time.monotonic_ns() & (2**64 - 1), 1)])
                took = time.monotonic() - killed
                break
            except DirectoryUnavailable:
                continue
    c.start_replica(lead)
    c.wait_ready(60, among=list(range(len(c.procs))))
    return took


def main(*, as_json: bool, quick: bool) -> int:
    results: dict[str, Any] = header(quick)
    say("hashing a 100k-token prompt...")
    results["hash_tokens_per_s"] = bench_hashing(quick)
    say("in-process lookups (256-block queries, 16 nodes x 20,000 sequences x 64 blocks)...")
    lk = bench_lookups(quick)
    results.update(lk)
    say("memory per entry at 1M entries...")
    results["bytes_per_entry"] = bench_memory(200_000 if quick else 1_000_000)
    say("the state machine alone: in-process publishes of batches of 64 and 1,024 blocks...")
    blocks = 100_000 if quick else 500_000
    results["apply_blocks_per_s"] = bench_apply(64, blocks)
    results["apply_batch1024_blocks_per_s"] = bench_apply(1024, blocks)
    stall_entries = 1_000_000 if quick else 8_000_000
    say(f"the slowest index mutation while growing to {stall_entries:,} entries in puts of 64 (CPU)...")
    results.update(bench_mutation_stall(stall_entries))
    say("REST on 3 local replicas...")
    results.update(bench_rest(quick, LookupWorkload(sequences=10, queries=200, seed=5).query_seq))
    # The write path's figure: committed publishes on 3 replicas against the state machine's own rate.
    for key, apply_key in (("publish", "apply_blocks_per_s"), ("publish_batch1024", "apply_batch1024_blocks_per_s")):
        for name in (key, f"{key}_msgpack"):
            results[f"{name}_vs_apply"] = results[f"{name}_blocks_per_s"] / results[apply_key]
    say("the cost of syncing the Raft journal...")
    results.update(bench_fsync(quick))
    emit(results, as_json)
    return 0
