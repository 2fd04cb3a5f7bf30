"""A real worker's listening sockets answer only on its configured hosts (issue #12, item 3).

The worker runs with the Mooncake transfer engine and transfer host 127.0.0.1.
Its listeners are read from /proc/<pid>/net/tcp{,6} (parsed here, independently
of kvtransfer.backends). Mooncake binds two of them to the wildcard address,
which the worker must confine: 127.0.0.2, also loopback but not the transfer
host, must not get a connection through to any of them.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from pathlib import Path

import pytest

from tests.support.wait import wait_for

HOST = "127.0.0.1"
ELSEWHERE = "127.0.0.2"

pytestmark = pytest.mark.timeout(180)


def listeners(pid: int) -> list[tuple[str, int]]:
    """(local address, port) of every listening TCP socket the process holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = b"".join(struct.pack("=I", int(hex_addr[i : i + 8], 16)) for i in range(0, len(hex_addr), 8))
            out.append((str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return out


def reaches(host: str, port: int) -> bool:
    with socket.socket() as c:
        c.settimeout(1.0)  # a confined port drops the SYN: the connect times out
        try:
            c.connect((host, port))
        except OSError:
            return False
        return True


def test_worker_transfer_ports_answer_only_on_the_transfer_host(make_cluster, make_workers) -> None:
    cluster = make_cluster(n=1)
    workers = make_workers(cluster, n=1, extra_args=("--transfer", "mooncake", "--transfer-host", HOST))
    proc = workers.procs[0]
    assert proc is not None
    log = workers.data_dir / f"{workers.node_ids[0]}.log"
    session = wait_for(
        lambda: next(
            (line.rsplit(" at ", 1)[1].rstrip(")") for line in log.read_text().splitlines() if "(transfer mooncake at " in line),
            None,
        ),
        what="the worker's transfer session",
    )
    found = listeners(proc.pid)
    ports = {port for _, port in found}
    assert int(session.rpartition(":")[2]) in ports, (session, found)
    assert len(found) >= 3, found  # the OpenAI API, Mooncake's handshake port and its TCP data port
    for address, port in found:
        assert address in (HOST, "0.0.0.0", "::"), (address, port)  # bound to the configured host or (Mooncake) the wildcard
        assert not reaches(ELSEWHERE, port), f"{ELSEWHERE}:{port} ({address}) accepted a connection"
        assert reaches(HOST, port), f"{HOST}:{port} refused"
    text = log.read_text()
    assert f"accept only connections addressed to {HOST}" in text
    assert "listen on all interfaces" not in text
    assert proc.poll() is None
