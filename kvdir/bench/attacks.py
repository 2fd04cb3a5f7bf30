"""`kvdir bench attacks`: what hostile clients cost a 3-replica cluster with a Raft password (issue #12).

Each attack runs against real replicas on loopback while a writer publishes batches of 64 blocks to
the leader, and reports what the writer saw (acknowledged writes, the longest stretch without one),
whether any replica's Raft term moved (an election) and what the attacked process spent:

- *raft flood*: connections to the leader's Raft port that announce a 2 GiB frame and then stream
  zeros, reopened whenever the replica drops them;
- *header flood*: one request to a replica's `/healthz` with a 50 MiB header;
- *oversized publishes*: 8 concurrent 7 MiB publishes of 250,000 blocks (the limit is 16,384).
"""

from __future__ import annotations

import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from kvdir.bench.proc import cpu_s, rss_mib
from kvdir.bench.report import emit, header, say
from kvdir.launcher import Cluster, free_ports


def _terms(c: Cluster) -> list[int]:
    return [httpx.get(u + "/v1/cluster", timeout=5).json()["term"] for u in c.replica_urls]


def _under_writes(c: Cluster, seconds: float, attack: Callable[[threading.Event], None]) -> dict[str, Any]:
    """Publish to the leader for `seconds` while `attack(stop)` runs on another thread; what the writer saw."""
    leader = c.wait_ready(60)
    reg = httpx.post(
        leader + "/v1/nodes", json={"node_id": f"w{time.monotonic_ns()}", "api_url": "http://127.0.0.1:9"}, timeout=10
    ).json()
    terms = _terms(c)
    stop = threading.Event()
    attacker = threading.Thread(target=attack, args=(stop,), daemon=True)
    attacker.start()
    acked = failed = 0
    longest = 0.0
    last = time.monotonic()
    end = last + seconds
    with httpx.Client(timeout=10) as http:
        i = 0
        while time.monotonic() < end:
            blocks = [{"hash": (time.monotonic_ns() + j) & (2**64 - 1), "slot": j} for j in range(64)]
            try:
                ok = (
                    http.post(
                        leader + "/v1/blocks", json={"node_id": reg["node_id"], "epoch": reg["epoch"], "blocks": blocks}
                    ).status_code
                    == 200
                )
            except httpx.HTTPError:
                ok = False
            now = time.monotonic()
            if ok:
                acked, longest, last = acked + 1, max(longest, now - last), now
            else:
                failed += 1
            i += 1
    longest = max(longest, time.monotonic() - last)
    stop.set()
    attacker.join(15)
    return {
        "writes_acked": acked,
        "writes_failed": failed,
        "longest_gap_s": longest,
        "elections": sum(b - a for a, b in zip(terms, _terms(c))),
    }


def raft_flood(c: Cluster, seconds: float, connections: int = 3) -> dict[str, Any]:
    leader = c.replica_urls.index(c.wait_ready(60))
    host, port = c.raft_addrs[leader].rsplit(":", 1)
    pid = c.procs[leader].pid  # type: ignore[union-attr]
    opened = [0]

    def one(stop: threading.Event) -> None:
        zeros = bytes(1 << 16)
        while not stop.is_set():
            try:
                with socket.create_connection((host, int(port)), timeout=2) as s:
                    opened[0] += 1
                    s.sendall(struct.pack("i", 2**31 - 1))
                    while not stop.is_set():
                        s.sendall(zeros)
            except OSError:
                continue  # dropped: open another

    def attack(stop: threading.Event) -> None:
        threads = [threading.Thread(target=one, args=(stop,), daemon=True) for _ in range(connections)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    rss, cpu = rss_mib(pid), cpu_s(pid)
    out = _under_writes(c, seconds, attack)
    out.update(leader_rss_growth_mib=rss_mib(pid) - rss, leader_cpu_s=cpu_s(pid) - cpu, attacker_connections=opened[0])
    return out


def header_flood(c: Cluster, mib: int = 50) -> dict[str, Any]:
    pid = c.procs[0].pid  # type: ignore[union-attr]
    host, port = c.replica_urls[0].removeprefix("http://").rsplit(":", 1)
    payload = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (mib << 20) + b"\r\n\r\n"
    cpu, started = cpu_s(pid), time.monotonic()
    with socket.create_connection((host, int(port)), timeout=60) as s:
        try:
            s.sendall(payload)
        except OSError:
            pass  # refused mid-way: the answer is already waiting
        try:
            answer = s.recv(64).split(b"\r\n", 1)[0].decode()
        except OSError as exc:
            answer = repr(exc)
    took = time.monotonic() - started
    return {"header_mib": mib, "answer": answer, "seconds": took, "replica_cpu_s": cpu_s(pid) - cpu}


def oversized_publishes(c: Cluster, n: int = 8, blocks: int = 250_000) -> dict[str, Any]:
    leader = c.wait_ready(60)
    pid = c.procs[c.replica_urls.index(leader)].pid  # type: ignore[union-attr]
    body = (
        '{"node_id":"big","epoch":1,"blocks":['  # under the 8 MiB body limit: refused by the count
        + ",".join(f'{{"hash":{i + 1},"slot":{i % 4096}}}' for i in range(blocks))
        + "]}"
    ).encode()
    terms, cpu = _terms(c), cpu_s(pid)

    def post(_: int) -> tuple[int, float]:
        started = time.monotonic()
        r = httpx.post(leader + "/v1/blocks", content=body, headers={"content-type": "application/json"}, timeout=120)
        return r.status_code, time.monotonic() - started

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(post, range(n)))
    return {
        "bodies": n,
        "body_mib": len(body) / 2**20,
        "statuses": sorted({s for s, _ in results}),
        "slowest_s": max(t for _, t in results),
        "leader_cpu_s": cpu_s(pid) - cpu,
        "elections": sum(b - a for a, b in zip(terms, _terms(c))),
    }


def main(*, as_json: bool, quick: bool) -> int:
    results: dict[str, Any] = header(quick)
    seconds = 5.0 if quick else 20.0
    with tempfile.TemporaryDirectory(prefix="kvdir-bench-attacks-") as tmp:
        password = Path(tmp) / "raft_password"
        password.write_text("bench-attacks-password\n")
        ports = free_ports(6)
        c = Cluster(
            Path(tmp),
            ports[:3],
            ports[3:],
            log_level="warning",
            lease_ttl_s=300,
            extra_args=("--raft-password-file", str(password)),
        )
        try:
            c.start()
            c.wait_ready(60)
            say("writes alone (the baseline)...")
            results["baseline"] = _under_writes(c, seconds, lambda stop: None)
            say(f"raft flood: 3 connections announcing 2 GiB frames at the leader for {seconds:.0f}s under writes...")
            results["raft_flood"] = raft_flood(c, seconds)
            say("header flood: a 50 MiB header to /healthz...")
            results["header_flood"] = header_flood(c)
            say("oversized publishes: 8 concurrent 250,000-block bodies...")
            results["oversized_publishes"] = oversized_publishes(c)
        finally:
            c.stop()
    emit(results, as_json)
    return 0
