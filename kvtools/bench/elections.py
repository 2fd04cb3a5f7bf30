"""`kvdir bench elections`: how often a healthy leader is deposed by events that should not depose it.

Raft should elect a new leader only when the old one went quiet. Three everyday events on a
3-replica cluster under write load are each repeated, and every one after which the Raft term moved
counts as a needless election (writes stall ~0.5 s while it runs):

- *start*: a fresh cluster's first second of writes, with numba's cache of compiled index kernels
  warm, and *cold start* with an empty cache (a fresh clone or container): the kernels' first
  compile once ran on the Raft thread there;
- *follower stall*: a follower SIGSTOPped for 1.5 s, as a GC pause, slow disk or starved CPU would;
- *follower restart*: a follower SIGKILLed and started again from its data dir;
- *bulk fill*: a fresh cluster taking in millions of entries in publishes of 16,384 blocks (2M with
  --quick, else 5M): term increments while it lasts, its duration, and the log compactions finished.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import httpx

from kvdir.local_cluster import Cluster, free_ports
from kvtools.bench.attacks import fill, raft_terms, settle
from kvtools.bench.report import emit, header, say

STALL_S = 1.5


def publish_until(urls: list[str], stop: threading.Event, node_id: str) -> None:
    """Publish batches of 64 fresh blocks to random replicas until `stop` (the load under which events happen)."""
    rng = random.Random(node_id)
    slot = 0
    epoch: int | None = None
    with httpx.Client(timeout=3) as http:
        while not stop.is_set():
            url = rng.choice(urls)
            try:
                if epoch is None:
                    epoch = http.post(url + "/v1/nodes", json={"node_id": node_id, "api_url": "http://127.0.0.1:9"}).json()[
                        "epoch"
                    ]
                blocks = [{"hash": rng.getrandbits(63), "slot": slot + i} for i in range(64)]
                slot += 64
                if http.post(url + "/v1/blocks", json={"node_id": node_id, "epoch": epoch, "blocks": blocks}).status_code == 409:
                    epoch = None
            except (httpx.HTTPError, KeyError, ValueError):
                time.sleep(0.01)  # a replica is down or paused; the next request goes elsewhere


class _Loaded:
    """A 3-replica cluster with two publishers running; `stop()` ends both."""

    def __init__(self) -> None:
        ports = free_ports(6)
        self.cluster = Cluster(Path(tempfile.mkdtemp(prefix="kvdir-elections-")), ports[:3], ports[3:], lease_ttl_s=300)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> int:
        """Start replicas and load; returns the term of the first leader."""
        self.cluster.start()
        term = self.term()
        self._threads = [
            threading.Thread(target=publish_until, args=(self.cluster.replica_urls, self._stop, f"w{k}")) for k in range(2)
        ]
        for t in self._threads:
            t.start()
        return term

    def term(self) -> int:
        """The highest term any replica reports, once all of them agree on a leader."""
        self.cluster.wait_ready(60)
        return cast(int, max(httpx.get(u + "/v1/cluster", timeout=5).json()["term"] for u in self.cluster.replica_urls))

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        self.cluster.stop()
        shutil.rmtree(self.cluster.data_dir, ignore_errors=True)


def _starts(n: int, cold: bool) -> int:
    moved = 0
    for k in range(n):
        c = _Loaded()
        cache = os.environ.get("NUMBA_CACHE_DIR")
        empty = tempfile.mkdtemp(prefix="kvdir-numba-")
        if cold:  # the replicas inherit it: nothing compiled yet, as in a fresh clone or container
            os.environ["NUMBA_CACHE_DIR"] = empty
        try:
            first = c.start()
            time.sleep(1.0)  # the window being measured: the first second of writes
            moved += c.term() != first
        finally:
            c.stop()
            if cache is None:
                os.environ.pop("NUMBA_CACHE_DIR", None)
            else:
                os.environ["NUMBA_CACHE_DIR"] = cache
            shutil.rmtree(empty, ignore_errors=True)
        say(f"  {'cold ' if cold else ''}start {k + 1}/{n}: {moved} needless elections so far")
    return moved


def _repeat(n: int, what: str, event: Callable[[Cluster, int], None]) -> int:
    c = _Loaded()
    moved = 0
    try:
        c.start()
        for k in range(n):
            before = c.term()
            lead = c.cluster.replica_urls.index(c.cluster.wait_ready(60))
            f = (lead + 1 + k % 2) % 3  # alternate followers: Raft links are dialled from the higher address
            event(c.cluster, f)
            c.cluster.wait_caught_up(f, 60)
            moved += c.term() != before
            say(f"  {what} {k + 1}/{n}: {moved} needless elections so far")
    finally:
        c.stop()
    return moved


def _stall(cluster: Cluster, i: int) -> None:
    pid = cluster.procs[i].pid  # type: ignore[union-attr]
    os.kill(pid, signal.SIGSTOP)
    time.sleep(STALL_S)
    os.kill(pid, signal.SIGCONT)


def _restart(cluster: Cluster, i: int) -> None:
    cluster.kill(i)
    cluster.start_replica(i)


def _bulk_fill(entries: int) -> dict[str, Any]:
    """Term increments and seconds for `entries` entries into a fresh cluster, and snapshots written."""
    ports = free_ports(6)
    c = Cluster(Path(tempfile.mkdtemp(prefix="kvdir-elections-")), ports[:3], ports[3:], lease_ttl_s=600)
    try:
        c.start()
        leader = c.wait_ready(60)
        before, started = max(raft_terms(c)), time.monotonic()
        asyncio.run(fill(leader, entries))
        took = time.monotonic() - started
        settle(c)
        return {
            "entries": entries,
            "fill_s": round(took, 1),
            "term_increments": max(raft_terms(c)) - before,
            "snapshots_written": sum((c.data_dir / f"replica{i + 1}" / "raft.dump").exists() for i in range(3)),
        }
    finally:
        c.stop()
        shutil.rmtree(c.data_dir, ignore_errors=True)


def main(*, as_json: bool, quick: bool) -> int:
    n = 3 if quick else 10
    results: dict[str, Any] = header(quick)
    say(f"needless elections on a 3-replica cluster under write load, {n} tries each...")
    results["start_tries"] = n
    results["start_needless_elections"] = _starts(n, cold=False)
    results["cold_start_tries"] = n // 2
    results["cold_start_needless_elections"] = _starts(n // 2, cold=True)
    results["stall_s"] = STALL_S
    results["stall_tries"] = n
    results["stall_needless_elections"] = _repeat(n, "follower stall", _stall)
    results["restart_tries"] = n
    results["restart_needless_elections"] = _repeat(n, "follower restart", _restart)
    results["bulk_fill"] = _bulk_fill(2_000_000 if quick else 5_000_000)
    say(f"  bulk fill: {results['bulk_fill']}")
    emit(results, as_json)
    return 0
