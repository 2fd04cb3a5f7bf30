"""The launcher's ports (picking free ones, which every multi-process test relies on; refusing taken ones), whose
answers it trusts, and how `kvdir up` fails: a taken port, a process that dies while starting, a Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from kvdir import local_cluster
from kvdir.launcher import UpSettings, run_up
from kvdir.listeners import listens, taken_ports
from kvdir.local_cluster import NotReady, Workers, free_ports
from tests.support.launcher import Up, descendants
from tests.support.ports import free_base_port, port_free
from tests.support.wait import wait_for

UP_OFFSETS = (0, 1, 2, 3, 101, 102, 103, 11)  # gateway, the replicas' HTTP and Raft, one worker


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    """Ports from the ephemeral range can be taken by any outgoing connection before a server binds them."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = free_ports(64)
    assert len(set(ports)) == 64
    assert all(1024 <= p < low for p in ports), ports
    socks = []
    try:
        for p in ports:
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", p))
    finally:
        for s in socks:
            s.close()


def test_free_ports_never_picks_one_a_mooncake_engine_may_take_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CI run's worker exited at start-up: its HTTP port, picked in 15000-17000, was another worker's
    Mooncake port by the time it bound it."""
    # Ports other tests in this process were handed stay out of reach while remembered; this range holds only
    # 30 that may be picked, so start from none handed out.
    monkeypatch.setattr(local_cluster, "_handed_out", {})
    monkeypatch.setattr(local_cluster, "PORT_RANGE", (14990, 17020))
    ports = free_ports(25)
    assert len(set(ports)) == 25 and all(p < 15000 or p > 17000 for p in ports)
    # Fewer left than asked for: an error naming the range, not a search that never ends.
    with pytest.raises(ValueError, match=r"ports free to pick in 14990\.\.17019"):
        free_ports(10)
    monkeypatch.setattr(local_cluster, "PORT_RANGE", (15100, 16000))
    with pytest.raises(ValueError, match="no ports to pick"):
        free_ports(1)


def test_free_ports_never_hands_out_a_port_twice_while_the_first_taker_may_not_have_bound_it() -> None:
    """Separate calls must not collide either: a test's engine port and its adapter's metrics port, picked
    by two calls, were once the same, and the adapter bound it for metrics and failed to bind it for ZMQ.
    (2,000 random picks from ~22,000 ports would repeat ~90 times.)"""
    picks = [p for _ in range(2000) for p in free_ports(1)]
    assert len(set(picks)) == len(picks)


def test_a_replica_whose_raft_port_is_taken_exits_with_a_clear_error(tmp_path: Path) -> None:
    """pysyncobj retries a failed bind forever and silently: the replica served HTTP but never
    heard its peers, and its cluster never agreed on a leader."""
    http_port, raft_port = free_ports(2)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", raft_port))
        squatter.listen()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvdir",
                "directory",
                "--http",
                f"127.0.0.1:{http_port}",
                "--raft",
                f"127.0.0.1:{raft_port}",
                "--data-dir",
                str(tmp_path / "d"),
                "--log-level",
                "info",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        try:
            out, _ = proc.communicate(timeout=60)
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert f"cannot listen for Raft on 127.0.0.1:{raft_port}" in out, out[-2000:]


def test_taken_ports_names_the_port_and_the_process_that_holds_it() -> None:
    held, free = free_ports(2)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", held))
        squatter.listen()
        assert listens(os.getpid(), held) is True
        taken = taken_ports("127.0.0.1", [(held, "replica 1 Raft"), (free, "gateway")])
        assert [(t.port, t.use) for t in taken] == [(held, "replica 1 Raft")]
        assert str(taken[0]).startswith(f"port {held} (replica 1 Raft): Address already in use, by pid {os.getpid()} (")
    assert taken_ports("127.0.0.1", [(held, "replica 1 Raft")]) == []
    assert listens(os.getpid(), held) is False


SERVE_HEALTH = """
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"ok": True, "node_id": "worker-1", "epoch": 7}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
print("serving", flush=True)
server.serve_forever()
"""


def test_readiness_counts_only_answers_from_the_processes_started_for_them(tmp_path: Path) -> None:
    """Another cluster on the same ports answers the readiness polls as well as this one would (the worker's
    own node id and all): `kvdir up` reported such a cluster's leader as its own, then died 30 s later."""
    (port,) = free_ports(1)
    workers = Workers(tmp_path, [port], ["http://127.0.0.1:9"])
    stranger = subprocess.Popen(
        [sys.executable, "-c", SERVE_HEALTH, str(port)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
    )
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.DEVNULL)
    try:
        assert stranger.stdout is not None and stranger.stdout.readline() == "serving\n"
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()["node_id"] == "worker-1"
        workers.procs[0] = ours  # started "for" the port, but the stranger holds it
        with pytest.raises(NotReady) as caught:
            workers.wait_ready(0.5)
        assert caught.value.logs == [("worker-1", tmp_path / "worker-1.log")]
        workers.procs[0] = stranger  # the process that does listen there: its answer counts
        assert workers.wait_ready(5.0) == [7]
    finally:
        for p in (stranger, ours):
            p.kill()
            p.wait()


def test_kvdir_up_refuses_a_taken_port_before_starting_anything(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    base = free_base_port(UP_OFFSETS)
    children = set(descendants(os.getpid()))
    with socket.socket() as squatter:
        # As a server binds: an earlier test's connections to the port may still be in TIME_WAIT.
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", base + 102))
        squatter.listen()
        status = run_up(UpSettings(base_port=base, data_dir=tmp_path / "up", workers=1))
    assert status == 1
    assert "kvdir up: 1 of the ports it would bind on 127.0.0.1 is taken; nothing was started." in caplog.text
    assert f"port {base + 102} (replica 2 Raft): Address already in use, by pid {os.getpid()} (" in caplog.text
    assert set(descendants(os.getpid())) == children and not (tmp_path / "up").exists()


def test_kvdir_up_shows_and_keeps_the_log_of_a_process_that_failed_to_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The temporary data dir holds the only copy of the log: it is kept, and the log's tail is on stderr."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("KVDIR_DIRECTORY_MAX_BODY_BYTES", "5")  # the replica refuses its settings and exits
    base = free_base_port((1, 101))
    assert run_up(UpSettings(base_port=base, replicas=1, workers=0, gateway=False)) == 1
    (kept,) = tmp_path.glob("kvdir-up-*")
    log = kept / "replica1.log"
    cause = "kvdir directory: invalid setting --max-body-bytes: Input should be greater than or equal to 1024"
    assert cause in log.read_text()
    assert re.search(
        rf"kvdir up: replica 1 \(pid \d+\) exited with code 2 during start-up. Last lines of {log}:\n  \| {cause}", caplog.text
    )
    assert f"kvdir up: kept {kept}: it holds the logs of replica 1" in caplog.text


def test_ctrl_c_during_start_up_stops_everything_and_says_so(tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches the children too: one of them dying of it is no failure to report."""
    base = free_base_port(UP_OFFSETS)
    stderr = tmp_path / "up.stderr"
    launcher = Up(
        ["--base-port", str(base), "--data-dir", str(tmp_path / "up"), "--workers", "0", "--no-gateway"], stderr, own_group=True
    )
    try:
        wait_for(lambda: len(launcher.children()) >= 3, timeout=30, interval=0.02, what="three replicas started")
        launcher.ctrl_c()
        assert launcher.proc.wait(30) == 128 + signal.SIGINT
    finally:
        launcher.stop()
    err = stderr.read_text()
    assert "kvdir up: interrupted; stopped 3 processes" in err, err
    assert "exited" not in err and "killed" not in err and not launcher.lines, err
    assert not any(Path(f"/proc/{pid}").exists() for pid in launcher.started)
    assert all(port_free(base + d) for d in (1, 2, 3, 101, 102, 103))
