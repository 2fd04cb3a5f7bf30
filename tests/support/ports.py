"""Free ports for tests that start servers on 127.0.0.1."""

from __future__ import annotations

import socket
from collections.abc import Sequence

from kvdir import local_cluster
from kvdir.local_cluster import free_ports
from kvtransfer.mooncake import mooncake_rpc_ports


def port_free(port: int) -> bool:
    """Nothing listens on the port (connections in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_base_port(offsets: Sequence[int]) -> int:
    """A base port for `kvdir up` such that base+offset is free now for every offset, all inside this
    process's port range when it has one (a parallel test worker's: tests/conftest.py), and none where the
    workers' Mooncake engines bind."""
    low, high = local_cluster.PORT_RANGE or (1025, 65536)
    mooncake = mooncake_rpc_ports()
    for _ in range(50):
        base = free_ports(1)[0] - 200
        ports = [base + d for d in offsets]
        if base >= low and base + max(offsets) < high and all(p not in mooncake and port_free(p) for p in ports):
            return base
    raise RuntimeError("no free port range found")
