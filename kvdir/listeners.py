"""Who listens on a TCP port: `kvdir up` checks its ports before it starts anything, and trusts an answer
on a port only from the process it started there.

Without that, a clash passes for success: another cluster on the same ports answers the readiness polls with
*its* leader while the new replicas fail to bind. Linux says who holds a socket: the
listening sockets of a network namespace are in /proc/PID/net/tcp{,6} (state 0A) with their inodes,
and a process's descriptors link to `socket:[INODE]` in /proc/PID/fd. Elsewhere (or for another
user's processes) the answers below are "cannot tell", never a guess.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def listening_inodes(table: str, port: int) -> set[int]:
    """The inodes of the sockets listening on `port` (any address) in one /proc/net/tcp or tcp6 table."""
    inodes = set()
    for line in table.splitlines()[1:]:  # the first line names the columns
        fields = line.split()
        if len(fields) < 10 or fields[3] != _LISTEN:
            continue
        _, _, hex_port = fields[1].rpartition(":")
        if int(hex_port, 16) == port:
            inodes.add(int(fields[9]))
    return inodes


def _listeners(port: int, pid: int | str = "self") -> set[int] | None:
    """Inodes of the sockets listening on `port` in the network namespace of `pid`; None when /proc cannot tell."""
    inodes: set[int] = set()
    read = False
    for name in ("tcp", "tcp6"):
        try:
            inodes |= listening_inodes(Path(f"/proc/{pid}/net/{name}").read_text(), port)
            read = True
        except OSError:
            continue  # no IPv6, or not Linux
    return inodes if read else None


def _socket_inodes(pid: int | str) -> set[int]:
    """The inodes of the sockets process `pid` holds (PermissionError for another user's process)."""
    out = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(fd_dir / fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def listens(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds a socket listening on `port`: True, False, or None when /proc cannot tell."""
    inodes = _listeners(port, pid)
    if inodes is None:
        return None
    try:
        return bool(inodes & _socket_inodes(pid))
    except PermissionError:
        return None
    except OSError:
        return False  # it has exited


def _cmdline(pid: int, limit: int = 120) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    except OSError:
        return "?"
    text = " ".join(a.decode(errors="replace") for a in argv)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def holders(port: int) -> str:
    """Who listens on `port`, in words: 'pid N (its command line)' for each process /proc shows, else why not known."""
    inodes = _listeners(port)
    if not inodes:
        return "(the holder is not known: not listening, or /proc cannot tell)"
    found, hidden = [], False
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if inodes & _socket_inodes(entry.name):
                found.append(f"pid {entry.name} ({_cmdline(int(entry.name))})")
        except PermissionError:
            hidden = True
        except OSError:
            continue  # exited meanwhile
    if found:
        return "by " + ", ".join(found)
    return "by another user's process" if hidden else "(the holder is not known)"


@dataclass(frozen=True)
class Taken:
    """A port `kvdir up` needs that cannot be bound now."""

    port: int
    use: str  # what the launcher would bind it for, e.g. "replica 1 Raft"
    error: str  # the bind's error
    holder: str  # `holders(port)` when it is in use, else ""

    def __str__(self) -> str:
        return f"port {self.port} ({self.use}): {self.error}" + (f", {self.holder}" if self.holder else "")


def taken_ports(host: str, ports: Iterable[tuple[int, str]], who: bool = True) -> list[Taken]:
    """The ports among `ports` (port, what it is for) that `host` cannot bind now; `who`: look up their holders.

    SO_REUSEADDR as the servers set it: a closed connection's TIME_WAIT does not count.
    """
    taken = []
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port, use in ports:
        with socket.socket(family) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                holder = holders(port) if who and exc.errno == errno.EADDRINUSE else ""
                taken.append(Taken(port, use, exc.strerror or str(exc), holder))
    return taken
