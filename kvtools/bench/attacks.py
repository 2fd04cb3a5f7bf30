"""`kvdir bench attacks`: what hostile clients cost a 3-replica cluster with a Raft password.

Each attack runs against real replicas on loopback while a writer publishes batches of 64 blocks to
the leader, and reports what the writer saw (acknowledged writes, the longest stretch without one),
whether any replica's Raft term moved (an election) and what the attacked process spent:

- *raft flood*: connections to the leader's Raft port that announce a 2 GiB frame and then stream
  zeros, reopened whenever the replica drops them;
- *header flood*: one request to a replica's `/healthz` with a 50 MiB header;
- *oversized publishes*: 8 concurrent 7 MiB publishes of 250,000 blocks (the limit is 16,384);
- *stalled watchers*: the leader holds 5M entries (1M with ``--quick``) and 20 watch streams
  that read their headers and then nothing; reported: the writer's view as above, the leader's memory
  growth, and how many streams it cut off as slow consumers;
- *peer notes*: a gateway with ``--peers`` and a peer token, in front of 2 worker stubs, is sent
  one POST of 512 notes asking 1e9 tokens for 600 s on one engine, the same again (a replay), then the
  same from 200 invented senders; reported: the pending tokens and notes it holds, the statuses, its
  memory growth and how long until the notes are gone;
- *origin hijack* and *registration flood*: on one replica with tokens confined to tenants
  (kvtools.bench.tenant_attacks says what each reports).

`--only NAME ...` runs some of them (their names in ATTACKS).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvdir.local_cluster import Cluster, Gateway, Workers, free_ports
from kvproto.client import DirectoryClient
from kvtools.bench.cli import ATTACKS
from kvtools.bench.proc import cpu_s, rss_mib
from kvtools.bench.report import emit, header, say
from kvtools.bench.tenant_attacks import origin_hijack, registration_flood, tenanted


def raft_terms(c: Cluster) -> list[int]:
    """Every replica's Raft term (their sum's growth counts elections)."""
    return [httpx.get(u + "/v1/cluster", timeout=5).json()["term"] for u in c.replica_urls]


def _under_writes(c: Cluster, seconds: float, attack: Callable[[threading.Event], None]) -> dict[str, Any]:
    """Publish to the leader for `seconds` while `attack(stop)` runs on another thread; what the writer saw."""
    leader = c.wait_ready(60)
    reg = httpx.post(
        leader + "/v1/nodes", json={"node_id": f"w{time.monotonic_ns()}", "api_url": "http://127.0.0.1:9"}, timeout=10
    ).json()
    terms = raft_terms(c)
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
        "elections": sum(b - a for a, b in zip(terms, raft_terms(c))),
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
    terms, cpu = raft_terms(c), cpu_s(pid)

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
        "elections": sum(b - a for a, b in zip(terms, raft_terms(c))),
    }


async def fill(url: str, entries: int, nodes: int = 8, batch: int = 16_384) -> None:
    """`entries` random entries over `nodes` nodes (`fill0`...), in binary publishes of `batch` blocks, two at a time."""
    rng = np.random.default_rng(29)
    async with DirectoryClient(url, timeout=60, deadline=120, sharded=False) as client:
        epochs = [(await client.register(f"fill{i}", "http://127.0.0.1:9", capacity_blocks=1 << 20)).epoch for i in range(nodes)]
        per = entries // nodes
        sem = asyncio.Semaphore(2)

        async def one(i: int, a: int) -> None:
            hashes = rng.integers(1, 2**63, min(batch, per - a), dtype=np.uint64).tolist()
            async with sem:
                await client.publish(f"fill{i}", epochs[i], zip(hashes, range(len(hashes))))

        await asyncio.gather(*(one(i, a) for i in range(nodes) for a in range(0, per, batch)))


@contextmanager
def stalled_watchers(url: str, n: int) -> Iterator[list[bytes]]:
    """`n` watch streams that read their answer's first bytes (yielded) and then nothing (4 KiB receive buffers,
    so the replica's socket buffer fills at once); all closed at exit."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.settimeout(30)
            s.connect((host, int(port)))
            s.sendall(f"GET /v1/watch HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        yield [s.recv(256) for s in socks]
    finally:
        for s in socks:
            s.close()


def settle(c: Cluster, timeout: float = 180.0) -> None:
    """Return once every replica has stood at the same position and term for a second: a fill's backlog applied
    everywhere (on two cores, three replicas taking it in set off elections of their own while it lasts)."""
    last: list[list[int]] = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            seen = [raft_terms(c), [httpx.get(u + "/v1/digest", timeout=30).json()["applied"] for u in c.replica_urls]]
        except (httpx.HTTPError, KeyError, ValueError):
            seen = []  # a replica busy or between leaders: not settled
        if seen and seen == last and len(set(seen[0])) == 1 and len(set(seen[1])) == 1:
            return
        last = seen
        time.sleep(1.0)
    raise TimeoutError(f"the cluster did not settle within {timeout:g} s")


def sample(url: str, name: str) -> float:
    """One unlabelled (or fully labelled) sample's value from `url`'s /metrics, 0 if it has none yet."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def watchers(c: Cluster, entries: int, seconds: float, n: int = 20) -> dict[str, Any]:
    leader = c.wait_ready(60)
    started, terms = time.monotonic(), raft_terms(c)
    asyncio.run(fill(leader, entries))
    filled_s = time.monotonic() - started
    settle(c)
    filling = sum(b - a for a, b in zip(terms, raft_terms(c)))
    leader = c.wait_ready(60)  # the fill's backlog may have moved the leader on two cores
    pid = c.procs[c.replica_urls.index(leader)].pid  # type: ignore[union-attr]
    rss = rss_mib(pid)
    cut = 'kvdir_directory_watch_cut_total{reason="slow_consumer"}'
    cut_before = sample(leader, cut)
    heads: list[bytes] = []

    def attack(stop: threading.Event) -> None:
        with stalled_watchers(leader, n) as answers:
            heads.extend(answers)
            stop.wait()

    out = _under_writes(c, seconds, attack)
    out.update(
        entries=entries,
        fill_s=filled_s,
        elections_while_filling=filling,
        watchers=n,
        admitted=sum(h.startswith(b"HTTP/1.1 200") for h in heads),
        leader_rss_growth_mib=rss_mib(pid) - rss,
        cut_off_as_slow=sample(leader, cut) - cut_before,
    )
    return out


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


def main(*, as_json: bool, quick: bool, only: list[str] | None = None) -> int:
    results: dict[str, Any] = header(quick)
    chosen = set(only or ATTACKS)
    seconds = 5.0 if quick else 20.0
    with tempfile.TemporaryDirectory(prefix="kvdir-bench-attacks-") as tmp:
        if chosen & set(ATTACKS[:5]):
            _untenanted(results, Path(tmp), chosen, seconds, quick)
        if chosen & set(ATTACKS[5:]):
            (Path(tmp) / "tenanted").mkdir()
            with tenanted(Path(tmp) / "tenanted") as t:
                if "origin_hijack" in chosen:
                    say(
                        "origin hijack: bravo's engine token registers a node at acme's engine origin, bravo's gateway is sent 10 requests..."
                    )
                    results["origin_hijack"] = origin_hijack(t)
                if "registration_flood" in chosen:
                    say(
                        "registration flood: 4 registrations of 2,048 ranks with 2,000-character transfer URLs, then node list polls..."
                    )
                    results["registration_flood"] = registration_flood(t)
    emit(results, as_json)
    return 0


def _untenanted(results: dict[str, Any], tmp: Path, chosen: set[str], seconds: float, quick: bool) -> None:
    """The attacks on a 3-replica cluster with a Raft password and no tokens."""
    password = tmp / "raft_password"
    password.write_text("bench-attacks-password\n")
    ports = free_ports(6)
    c = Cluster(
        tmp,
        ports[:3],
        ports[3:],
        log_level="warning",
        lease_ttl_s=300,
        # 20 watchers from one address (auth off: the address is the key): past the default 8, to load the snapshot path.
        extra_args=("--raft-password-file", str(password), "--watch-max-streams-per-token", "32", "--watch-stall-s", "4"),
    )
    try:
        c.start()
        c.wait_ready(60)
        say("writes alone (the baseline)...")
        results["baseline"] = _under_writes(c, seconds, lambda stop: None)
        if "raft_flood" in chosen:
            say(f"raft flood: 3 connections announcing 2 GiB frames at the leader for {seconds:.0f}s under writes...")
            results["raft_flood"] = raft_flood(c, seconds)
        if "header_flood" in chosen:
            say("header flood: a 50 MiB header to /healthz...")
            results["header_flood"] = header_flood(c)
        if "oversized_publishes" in chosen:
            say("oversized publishes: 8 concurrent 250,000-block bodies...")
            results["oversized_publishes"] = oversized_publishes(c)
        if "stalled_watchers" in chosen:
            entries = 1_000_000 if quick else 5_000_000
            say(f"stalled watchers: {entries:,} entries at the leader, then 20 watch streams that stop reading, under writes...")
            results["stalled_watchers"] = watchers(c, entries, max(seconds, 8.0))
        if "peer_notes" in chosen:
            ttl = 2.0 if quick else 10.0
            say(
                f"peer notes: 512 notes of 1e9 tokens for 600 s at a gateway (--peer-note-ttl-s {ttl:g}), replayed, from 200 senders..."
            )
            results["peer_notes"] = peer_notes(c, tmp, ttl)
    finally:
        c.stop()
