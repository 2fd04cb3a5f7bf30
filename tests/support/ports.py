"""Free ports for tests that start servers on 127.0.0.1."""

from __future__ import annotations

import socket
from collections.abc import Sequence

from kvdir.launcher import free_ports


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
    """A base port for `kvdir up` such that base+offset is free now for every offset."""
    for _ in range(50):
        base = free_ports(1)[0] - 200
        if base > 1024 and all(port_free(base + d) for d in offsets):
            return base
    raise RuntimeError("no free port range found")
