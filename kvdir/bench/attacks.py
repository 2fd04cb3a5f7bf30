"""`kvdir bench attacks`: what hostile clients cost a 3-replica cluster with a Raft password (issue #12).

Each attack runs against real replicas on loopback while a writer publishes batches of 64 blocks to
the leader, and reports what the writer saw (acknowledged writes, the longest stretch without one),
whether any replica's Raft term moved (an election) and what the attacked process spent:

- *raft flood*: connections to the leader's Raft port that announce a 2 GiB frame and then stream
  zeros, reopened whenever the replica drops them;
- *header flood*: one request to a replica's `/healthz` with a 50 MiB header;
- *oversized publishes*: 8 concurrent 7 MiB publishes of 250,000 blocks (the limit is 16,384);
- *peer notes* (issue #29): a gateway with ``--peers`` and a peer token, in front of 2 worker stubs, is sent
  one POST of 512 notes asking 1e9 tokens for 600 s on one engine, the same again (a replay), then the
  same from 200 invented senders; reported: the pending tokens and notes it holds, the statuses, its
  memory growth and how long until the notes are gone.
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
from kvdir.launcher import Cluster, Gateway, Workers, free_ports


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


def peer_notes(c: Cluster, tmp: Path, ttl_s: float, senders: int = 200) -> dict[str, Any]:
    token = "bench-attacks-peer-token"
    (tmp / "peer_token").write_text(token + "\n")
    ports = free_ports(4)  # 2 workers, the gateway, its peer (never started: nothing else posts notes)
    (tmp / "peer-workers").mkdir()
    workers = Workers(tmp / "peer-workers", ports[:2], c.replica_urls, extra_args=("--heartbeat-interval-s", "0.3"))
    gateway: Gateway | None = None
    try:
        workers.start()
        epochs = workers.wait_ready(60)
        (tmp / "peer-gateway").mkdir()
        args = ("--peers", f"http://127.0.0.1:{ports[3]}", "--peer-token-file", str(tmp / "peer_token"))
        gateway = Gateway(tmp / "peer-gateway", ports[2], c.replica_urls, extra_args=(*args, "--peer-note-ttl-s", f"{ttl_s:g}"))
        gateway.wait_ready(60, engines=2)
        url, pid = gateway.url, gateway.proc.pid
        node, epoch = workers.node_ids[0], epochs[0]
        notes = [{"id": i, "node": node, "epoch": epoch, "tokens": 1e9, "ttl_s": 600.0} for i in range(512)]
        headers = {"authorization": f"Bearer {token}"}
        out: dict[str, Any] = {"notes_per_post": 512, "asked_tokens_per_post": 512 * 1e9, "ttl_s": ttl_s}
        with httpx.Client(timeout=10, headers=headers) as http:
            rss, cpu, started = rss_mib(pid), cpu_s(pid), time.monotonic()
            out["first_post_status"] = http.post(url + "/v1/peers/notes", json={"sender": "evil", "notes": notes}).status_code
            s = http.get(url + "/v1/peers").json()
            out["pending_tokens_after_one_post"], out["notes_after_one_post"] = s["pending_tokens"].get(node, 0.0), s["notes"]
            http.post(url + "/v1/peers/notes", json={"sender": "evil", "notes": notes})
            out["replayed"] = http.get(url + "/v1/peers").json()["replayed"]
            statuses: dict[str, int] = {}
            for k in range(senders):
                code = http.post(url + "/v1/peers/notes", json={"sender": f"evil{k}", "notes": notes}).status_code
                statuses[str(code)] = statuses.get(str(code), 0) + 1
            s = http.get(url + "/v1/peers").json()
            out.update(
                invented_senders=senders,
                invented_sender_statuses=statuses,
                pending_tokens_after_invented_senders=s["pending_tokens"].get(node, 0.0),
                notes_after_invented_senders=s["notes"],
                senders_remembered=s["senders"],
                refused=s["refused"],
                gateway_rss_growth_mib=rss_mib(pid) - rss,
                gateway_cpu_s=cpu_s(pid) - cpu,
            )
            deadline = started + 600.0
            while http.get(url + "/v1/peers").json()["notes"] and time.monotonic() < deadline:
                time.sleep(0.1)
            out["notes_gone_after_s"] = time.monotonic() - started
        return out
    finally:
        if gateway is not None:
            gateway.stop()
        workers.stop()


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
            ttl = 2.0 if quick else 10.0
            say(
                f"peer notes: 512 notes of 1e9 tokens for 600 s at a gateway (--peer-note-ttl-s {ttl:g}), replayed, from 200 senders..."
            )
            results["peer_notes"] = peer_notes(c, Path(tmp), ttl)
        finally:
            c.stop()
    emit(results, as_json)
    return 0
