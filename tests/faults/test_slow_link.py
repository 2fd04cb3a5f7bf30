"""The slow link (kvtools.faults.slow_link) that `make test-vllm` and `kvdir bench vllm` put under a pull's source:
what the shaped ports send crawls at the rate asked for, every other loopback flow keeps its speed, and `lo` is as
it was afterwards, also after a holder that died. It reshapes this machine's loopback, so it runs here, alone."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from kvtools.faults import slow_link

RATE = 200_000  # bytes/s
SIZE = 400_000  # two seconds at RATE


@pytest.fixture(scope="module", autouse=True)
def _can_shape() -> None:
    """Tried when these tests run, not when `make test` collects (and deselects) them: the try shapes `lo`."""
    why_not = slow_link.available()
    assert why_not is None, f"the slow link cannot be made here: {why_not}"


def _server(payload: int) -> tuple[socket.socket, int]:
    """A listener on a free loopback port that sends `payload` bytes to each connection, then closes it."""
    s = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                c, _ = s.accept()
            except OSError:
                return
            with c:
                c.sendall(b"x" * payload)

    threading.Thread(target=serve, daemon=True).start()
    return s, s.getsockname()[1]


def _fetch(port: int) -> tuple[int, float]:
    """(bytes received, seconds) of one connection to `port`."""
    t0 = time.monotonic()
    got = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
        while chunk := c.recv(1 << 20):
            got += len(chunk)
    return got, time.monotonic() - t0


def test_the_shaped_port_crawls_and_the_others_do_not() -> None:
    slow, slow_port = _server(SIZE)
    fast, fast_port = _server(SIZE)
    with slow, fast:
        with slow_link.slow_ports([slow_port], RATE):
            got, shaped_s = _fetch(slow_port)
            other, other_s = _fetch(fast_port)
        assert got == other == SIZE
        # The kernel paces the shaped port: SIZE at RATE takes 2 s (less a burst of 8 KB); the other port is not paced.
        assert shaped_s > 0.8 * SIZE / RATE, shaped_s
        assert other_s < shaped_s / 4, (other_s, shaped_s)
        _, after_s = _fetch(slow_port)
    assert after_s < shaped_s / 4, (after_s, shaped_s)
    assert (
        f"htb {slow_link.HANDLE}:"
        not in subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
    )
    assert not slow_link.OWNER.exists()


def test_one_shaping_at_a_time_and_a_dead_holders_is_cleared() -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from kvtools.faults import slow_link\n"
         "with slow_link.slow_ports([9], 1e6):\n    print('shaped', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "shaped"
        with pytest.raises(RuntimeError, match=f"already shaped by process {holder.pid}"):
            with slow_link.slow_ports([10], 1e6):
                pass
        holder.kill()  # no cleanup runs: its shaping and pid file stay behind
        holder.wait(10)
        assert slow_link.OWNER.read_text() == str(holder.pid)
        with slow_link.slow_ports([10], 1e6):  # the dead holder's shaping is replaced
            assert slow_link.OWNER.read_text() == str(os.getpid())
        assert not slow_link.OWNER.exists()
    finally:
        holder.kill()
        holder.wait(10)
