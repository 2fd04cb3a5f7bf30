"""What the benchmarks and test launchers read of a running process (Linux /proc): its state, CPU time and
resident memory."""

from __future__ import annotations

import os
from pathlib import Path


def stat_fields(path: str) -> list[str]:
    """A /proc `stat` file's fields after the command name (which may hold spaces and parentheses): the state
    first, then ppid, pgrp, ... (proc(5), from its third field on)."""
    return Path(path).read_text().rsplit(")", 1)[1].split()


def state(pid: int) -> str:
    """The process's state letter (R, S, D, T, Z, ...)."""
    return stat_fields(f"/proc/{pid}/stat")[0]


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds the process has used so far."""
    fields = stat_fields(f"/proc/{pid}/stat")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0
