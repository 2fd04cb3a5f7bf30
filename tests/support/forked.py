"""Service processes forked from an interpreter that has already imported them: the tests' `kvdir.local_cluster` spawner.

The suite starts hundreds of directory, worker and gateway processes, and each `python -m kvdir <role>` spends
more CPU importing FastAPI, pydantic, numpy and numba and loading the index's compiled kernels than most tests
spend on what they test; on 2 cores that CPU is the suite's wall time (BENCHMARKS.md has the figures). Here
multiprocessing's fork server, started once per pytest process, does those imports once; each service is a
fork of it that runs `kvdir.cli.main` on its own arguments. It is still a process of its own, with its own
sockets, log file, environment, exit status and signals, as the tests need; only the interpreter's start-up is
shared. Commands that are not `python -m kvdir ...` (a prefix such as a network namespace's `ip netns exec`)
start as plain subprocesses.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path

from kvdir import cli, local_cluster

PRELOAD = ["tests.support.preload"]
"""What the fork server imports before it forks anything (a module, so that its import can warm the kernels)."""

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)
_KVDIR = [sys.executable, "-m", "kvdir"]


def _serve(argv: list[str], env: dict[str, str], log: str) -> None:
    """In the forked child: the process `python -m kvdir argv` would be, writing to `log` (multiprocessing has
    already moved it to the working directory of its start)."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [str(Path(cli.__file__).with_name("__main__.py")), *argv]  # as `python -m kvdir` sets it
    try:
        code = cli.main(argv)
    finally:
        atexit._run_exitfuncs()  # what interpreter shutdown runs; multiprocessing's child ends in os._exit
    sys.exit(code)


class Forked:
    """A forked service with the part of `subprocess.Popen`'s interface `kvdir.local_cluster` and the tests use."""

    def __init__(self, proc: BaseProcess, args: Sequence[str]) -> None:
        self._proc = proc
        self.args = list(args)
        self.pid = int(proc.pid or 0)

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        code = self._proc.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def spawn(cmd: Sequence[str], log: Path) -> local_cluster.Child:
    """`cmd` forked from the fork server if it is `python -m kvdir ...`, else started as `local_cluster.popen` does."""
    if list(cmd[:3]) != _KVDIR:
        return local_cluster.popen(cmd, log)
    proc = _CONTEXT.Process(target=_serve, args=(list(cmd[3:]), dict(os.environ), str(log)), daemon=True)
    proc.start()
    return Forked(proc, cmd)
