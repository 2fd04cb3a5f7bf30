"""The launcher's port picking, which every multi-process test relies on."""

from __future__ import annotations

import socket
from pathlib import Path

from kvdir.launcher import free_ports


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


def test_a_replica_whose_raft_port_is_taken_exits_with_a_clear_error(tmp_path: Path) -> None:
    """pysyncobj retries a failed bind forever and silently: the replica served HTTP but never
    heard its peers, and its cluster never agreed on a leader."""
    import subprocess
    import sys

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
