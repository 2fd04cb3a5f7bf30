"""`kvdir up`'s supervisor on real short-lived processes, with the clock passed in: restarts double their
delay up to the cap, a process that stays up resets it, and every death is logged with its log's tail."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdir.launcher import Supervised, Supervisor

CRASH = "import sys\nfor i in range(25): print(f'attempt {sys.argv[1]} line {i}')\nsys.exit(3)"
STAY = "import time; time.sleep(60)"


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        p.kill()
        p.wait()


def test_restarts_back_off_exponentially_and_reset_once_stable(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    log = tmp_path / "crasher.log"

    def start() -> None:
        """The first four attempts crash at once after 25 log lines, later ones stay up."""
        n = len(procs)
        with open(log, "ab") as f:
            script = CRASH if n < 4 else STAY
            procs.append(subprocess.Popen([sys.executable, "-c", script, str(n)], stdout=f, stderr=subprocess.STDOUT))

    start()
    child = Supervised("crasher", lambda: procs[-1], start, log, since=0.0)
    supervisor = Supervisor([child], min_s=0.5, max_s=2.0, stable_s=10.0)
    caplog.set_level(logging.INFO, logger="kvdir.up")

    now = 0.0
    for expected_delay in (0.5, 1.0, 2.0, 2.0):  # doubling, capped at max_s
        dead = procs[-1]
        dead.wait(30)
        supervisor.tick(now)
        assert f"crasher (pid {dead.pid}) exited with code 3; restarting it in {expected_delay}s" in caplog.text
        attempt = len(procs) - 1
        tail = [line for line in caplog.records[-1].getMessage().splitlines() if line.startswith("  | ")]
        assert tail == [f"  | attempt {attempt} line {i}" for i in range(5, 25)]  # the last 20 lines of its log
        supervisor.tick(now + expected_delay - 0.01)
        assert procs[-1] is dead  # not yet
        now += expected_delay
        supervisor.tick(now)
        assert procs[-1] is not dead and f"crasher restarted (pid {procs[-1].pid})" in caplog.text

    # The fifth process stays up past stable_s: its next death is restarted after min_s again.
    supervisor.tick(now + 10.0)
    procs[-1].kill()
    procs[-1].wait(30)
    supervisor.tick(now + 10.1)
    assert f"crasher (pid {procs[-1].pid}) was killed by SIGKILL; restarting it in 0.5s" in caplog.text
