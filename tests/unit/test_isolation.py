"""tests/unit/conftest.py's guard: a unit test that reaches for the network or a process fails, naming the call."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import pytest


def test_a_network_socket_may_not_be_bound_or_connected() -> None:
    with socket.socket() as s, pytest.raises(AssertionError, match="move it to tests/integration"):
        s.bind(("127.0.0.1", 0))
    with socket.socket(socket.AF_INET6) as s, pytest.raises(AssertionError, match="move it to tests/integration"):
        s.connect_ex(("::1", 9))


def test_no_process_may_be_started() -> None:
    with pytest.raises(AssertionError, match="move it to tests/integration"):
        subprocess.run([sys.executable, "-c", "pass"], check=False)


def test_socket_pairs_and_event_loops_still_work() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"x")
        assert b.recv(1) == b"x"
    assert asyncio.run(asyncio.sleep(0, result=7)) == 7
