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


def test_a_restart_that_fails_is_retried_with_backoff_and_the_others_stay_supervised(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue #29 item 7e: a restart that raises (here OSError, as Popen does without memory or descriptors)
    used to propagate out of `tick` and stop the whole cluster."""
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    a_procs: list[subprocess.Popen[bytes]] = []
    b_procs: list[subprocess.Popen[bytes]] = []
    failures = {"left": 2}

    def spawn(into: list[subprocess.Popen[bytes]], log: Path, script: str) -> None:
        with open(log, "ab") as f:
            p = subprocess.Popen([sys.executable, "-c", script, str(len(into))], stdout=f, stderr=subprocess.STDOUT)
        into.append(p)
        procs.append(p)

    def start_a() -> None:
        if a_procs and failures["left"]:
            failures["left"] -= 1
            raise OSError(24, "Too many open files")
        spawn(a_procs, log_a, STAY if a_procs else CRASH)

    def start_b() -> None:
        spawn(b_procs, log_b, CRASH if len(b_procs) < 2 else STAY)

    start_a()
    start_b()
    supervisor = Supervisor(
        [
            Supervised("a", lambda: a_procs[-1], start_a, log_a, since=0.0),
            Supervised("b", lambda: b_procs[-1], start_b, log_b, since=0.0),
        ],
        min_s=0.5,
        max_s=2.0,
        stable_s=10.0,
    )
    caplog.set_level(logging.INFO, logger="kvdir.up")
    a_procs[-1].wait(30)
    b_procs[-1].wait(30)
    supervisor.tick(0.0)  # both died: restarts due at 0.5
    supervisor.tick(0.5)  # a's restart fails (retry in 1.0s); b's goes through, and crashes again
    assert len(a_procs) == 1 and len(b_procs) == 2
    assert "a could not be restarted; trying again in 1.0s" in caplog.text
    failed = next(r for r in caplog.records if "a could not be restarted" in r.getMessage())
    assert failed.exc_info is not None and "Too many open files" in caplog.text  # with its traceback
    b_procs[-1].wait(30)
    supervisor.tick(1.0)  # b's second death: restart due at 2.0; a not yet due (1.5)
    supervisor.tick(1.5)  # a fails again: next try in 2.0s (doubled)
    assert "a could not be restarted; trying again in 2.0s" in caplog.text and len(a_procs) == 1
    supervisor.tick(2.0)  # b restarted, and stays up
    assert len(b_procs) == 3 and b_procs[-1].poll() is None
    supervisor.tick(3.4)
    assert len(a_procs) == 1  # not before 3.5
    supervisor.tick(3.5)  # a starts at last
    assert len(a_procs) == 2 and a_procs[-1].poll() is None
    assert f"a restarted (pid {a_procs[-1].pid})" in caplog.text
    # a crash of the restarted process is supervised as usual, from the doubled delay
    a_procs[-1].kill()
    a_procs[-1].wait(30)
    supervisor.tick(4.0)
    assert f"a (pid {a_procs[-1].pid}) was killed by SIGKILL; restarting it in 2.0s" in caplog.text
