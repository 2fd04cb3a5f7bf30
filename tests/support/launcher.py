"""A `kvdir up` process under test: its stdout lines collected, and every process it started killed at the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every living process below `pid`, from the parent ids in /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat_line = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        ppid = int(stat_line.rsplit(")", 1)[1].split()[1])  # the command name in parentheses may contain spaces
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class Up:
    """A `kvdir up` process whose stdout lines are collected by a thread."""

    def __init__(self, args: list[str], log: Path, *, own_group: bool = False) -> None:
        """`own_group`: in a process group of its own, so that `ctrl_c()` can signal it as a terminal would."""
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvdir", "up", *args],
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
                text=True,
                start_new_session=own_group,
            )
        self.lines: list[str] = []
        self.started: set[int] = set()  # every descendant seen, to make sure none outlives the test
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def children(self) -> list[int]:
        pids = descendants(self.proc.pid)
        self.started.update(pids)
        return pids

    def ctrl_c(self) -> None:
        """SIGINT to the launcher and every process of its group at once, as a terminal's Ctrl-C sends it."""
        assert os.getpgid(self.proc.pid) == self.proc.pid, "start it with own_group=True"
        self.children()
        os.killpg(self.proc.pid, signal.SIGINT)

    def stop(self) -> int:
        """SIGTERM (the launcher stops what it started), then SIGKILL whatever is left."""
        self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.started:  # only if the launcher failed to stop one (and its id was not reused)
            try:
                if b"kvdir" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                pass
        return self.proc.returncode
