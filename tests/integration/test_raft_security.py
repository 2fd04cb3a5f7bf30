"""The Raft port against an attacker who reaches it: real replicas in separate processes, raw sockets.

Each attack is one pysyncobj frame (`struct.pack("i", len) + zlib(pickle)`) or a flood of them, as
in issue #12: a pickle that runs a command, a forged vote with a huge term, a frame announcing 2 GiB
followed by an endless stream of zeros, and idle connections that never identify themselves.
"""

from __future__ import annotations

import itertools
import os
import pickle
import socket
import struct
import threading
import time
import zlib
from pathlib import Path

import httpx
import pytest

from kvdir.local_cluster import free_ports
from tests.support.wait import wait_for


class _RunsCommand:
    """Unpickling this runs a shell command, as the attack in the issue did."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (self.command,))


def _frame(obj: object) -> bytes:
    data = zlib.compress(pickle.dumps(obj, protocol=2))
    return struct.pack("i", len(data)) + data


def _raft_hostport(addr: str) -> tuple[str, int]:
    host, port = addr.rsplit(":", 1)
    return host, int(port)


def _send_and_wait_closed(addr: str, payload: bytes, timeout: float = 10.0) -> None:
    """Send `payload` and wait until the replica closes the connection (it has read and judged it)."""
    with socket.create_connection(_raft_hostport(addr), timeout=timeout) as s:
        s.sendall(payload)
        s.settimeout(timeout)
        while True:
            try:
                if not s.recv(65536):
                    return
            except ConnectionResetError:
                return


def _views(urls: list[str]) -> list[dict]:
    return [httpx.get(u + "/v1/cluster", timeout=5).json() for u in urls]


def _leader_and_term(urls: list[str]) -> tuple[str, int] | None:
    views = _views(urls)
    if len({(v["leader_url"], v["term"]) for v in views}) == 1 and views[0]["leader_url"]:
        return views[0]["leader_url"], views[0]["term"]
    return None


def test_raft_listens_only_on_its_own_address(make_cluster) -> None:
    c = make_cluster(3, raft_password=False)
    for addr in c.raft_addrs:
        host, port = _raft_hostport(addr)
        socket.create_connection((host, port), timeout=5).close()
        with pytest.raises(ConnectionRefusedError):  # bound to 0.0.0.0, 127.0.0.2 would answer too
            socket.create_connection(("127.0.0.2", port), timeout=5)


@pytest.mark.parametrize("with_password", [False, True], ids=["no-password", "password"])
def test_a_pickled_command_sent_to_the_raft_port_runs_nothing(make_cluster, tmp_path: Path, with_password: bool) -> None:
    c = make_cluster(3, raft_password=with_password)
    before = wait_for(lambda: _leader_and_term(c.replica_urls), what="an agreed leader")
    marker = tmp_path / "pwned"
    evil = _frame(_RunsCommand(f"touch {marker}"))
    for addr in c.raft_addrs:
        _send_and_wait_closed(addr, evil)  # as the first frame of a connection
        peer = next(a for a in c.raft_addrs if a != addr)
        _send_and_wait_closed(addr, _frame(peer) + evil)  # after naming itself as a peer
        # as an entry of a forged append_entries, which pysyncobj unpickles when it applies it
        entry = (b"\x00" + pickle.dumps(_RunsCommand(f"touch {marker}"), protocol=2), 10**6, 10**6)
        _send_and_wait_closed(
            addr,
            _frame(peer)
            + _frame(
                {"type": "append_entries", "term": 0, "commit_index": 0, "entries": [entry], "prevLogIdx": 0, "prevLogTerm": 0}
            )
            + _frame(_RunsCommand(f"touch {marker}")),
        )
    assert not marker.exists()
    assert _leader_and_term(c.replica_urls) == before
    assert len(c.alive()) == 3


def test_a_forged_vote_does_not_move_a_cluster_with_a_password(make_cluster) -> None:
    c = make_cluster(3)
    before = wait_for(lambda: _leader_and_term(c.replica_urls), what="an agreed leader")
    for addr in c.raft_addrs:
        peer = next(a for a in c.raft_addrs if a != addr)
        vote = {"type": "request_vote", "term": 10**9, "last_log_index": 10**9, "last_log_term": 10**9}
        _send_and_wait_closed(addr, _frame(os.urandom(32)) + _frame(peer) + _frame(vote))
    assert _leader_and_term(c.replica_urls) == before


class _Hostile(threading.Thread):
    """One attacker connection, reopened whenever the replica drops it, until `stop` is set."""

    def __init__(self, addr: str, kind: str, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.addr, self.kind, self.stop = _raft_hostport(addr), kind, stop
        self.connections = 0

    def run(self) -> None:
        zeros = bytes(1 << 16)
        idle: list[socket.socket] = []
        while not self.stop.is_set():
            try:
                s = socket.create_connection(self.addr, timeout=2)
            except OSError:
                continue
            self.connections += 1
            if self.kind == "idle":  # many connections that never say who they are
                idle.append(s)
                if len(idle) > 64:
                    idle.pop(0).close()
                self.stop.wait(0.01)
                continue
            try:
                with s:
                    if self.kind == "huge-frame":
                        s.sendall(struct.pack("i", 2**31 - 1))
                    while not self.stop.is_set():
                        s.sendall(zeros if self.kind == "huge-frame" else struct.pack("i", 60000) + os.urandom(60000))
            except OSError:
                pass  # dropped by the replica: open another
        for s in idle:
            s.close()


# 20 election timeouts at the upper bound (0.5 s): long enough for the attackers' frames to reach every state of
# the replicas' links many times over (`kvdir bench attacks` runs the same for minutes).
ATTACK_S = 10


def test_hostile_connections_neither_stall_writes_nor_force_an_election(make_cluster) -> None:
    c = make_cluster(3)
    leader, term = wait_for(lambda: _leader_and_term(c.replica_urls), what="an agreed leader")
    reg = httpx.post(leader + "/v1/nodes", json={"node_id": "n1", "api_url": "http://127.0.0.1:9"}, timeout=10).json()
    leader_raft = c.raft_addrs[c.replica_urls.index(leader)]
    follower_raft = next(a for a in c.raft_addrs if a != leader_raft)
    stop = threading.Event()
    attackers = [
        _Hostile(leader_raft, "huge-frame", stop),
        _Hostile(leader_raft, "junk-frames", stop),
        _Hostile(leader_raft, "idle", stop),
        _Hostile(follower_raft, "huge-frame", stop),
    ]
    for a in attackers:
        a.start()
    acked: list[float] = []
    slowest = 0.0
    try:
        end = time.monotonic() + ATTACK_S
        with httpx.Client(timeout=10) as http:
            i = 0
            while time.monotonic() < end:
                t0 = time.monotonic()
                r = http.post(
                    leader + "/v1/blocks",
                    json={
                        "node_id": "n1",
                        "epoch": reg["epoch"],
                        "blocks": [{"hash": i * 64 + j + 1, "slot": j} for j in range(64)],
                    },
                )
                assert r.status_code == 200, r.text
                slowest = max(slowest, time.monotonic() - t0)
                acked.append(time.monotonic())
                i += 1
    finally:
        stop.set()
        for a in attackers:
            a.join(10)
    gaps = [b - a for a, b in itertools.pairwise(acked)]
    print(
        f"acknowledged {len(acked)} writes in {ATTACK_S} s, slowest {slowest:.3f} s, largest gap {max(gaps):.3f} s; "
        f"attacker connections: {[a.connections for a in attackers]}"
    )
    assert all(a.connections > 1 for a in attackers if a.kind != "idle")  # the replicas kept dropping them
    assert len(acked) > 100 and max(gaps) < 2.0
    assert all(v["term"] == term for v in _views(c.replica_urls))  # no election
    assert len(c.alive()) == 3


@pytest.mark.parametrize("raft_host", ["0.0.0.0", "[::]"])
def test_a_replica_off_loopback_without_a_raft_password_refuses_to_start(raft_host: str, tmp_path: Path) -> None:
    import subprocess
    import sys

    http, raft = free_ports(2)
    cmd = [sys.executable, "-m", "kvdir", "directory", "--http", f"127.0.0.1:{http}", "--raft", f"{raft_host}:{raft}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode != 0
    assert "no Raft password" in r.stderr and "--insecure-raft-without-password" in r.stderr
