"""Confining listeners that a native library binds to every interface (Mooncake's transfer ports).

A locked classic-BPF socket filter on each wildcard listener drops every packet not addressed to the
transfer host, which is as strong as binding that address (Linux's weak host model: packets for that
address are taken whichever interface they arrive on). Linux only; elsewhere the caller warns.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import struct
import sys
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import NamedTuple, cast


class EarlyConnectionError(Exception):
    """A connection addressed elsewhere reached a listener before it was confined."""


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Linux's values (asm-generic; Python's socket module does not export them).
_SO_ATTACH_FILTER = 26
_SO_LOCK_FILTER = 44
# Classic BPF: loads relative to the network (IP) header, whatever the socket sees as packet start.
_NET = -0x100000 & 0xFFFFFFFF
_LD_W, _LD_B, _RSH, _JEQ, _RET = 0x20, 0x30, 0x74, 0x15, 0x06
_ACCEPT, _DROP = 0xFFFFFFFF, 0
_TCP_STATES_IN_USE = {"01", "03"}  # ESTABLISHED, SYN_RECV (/proc/net/tcp "st")


class TcpListener(NamedTuple):
    """A listening TCP socket of this process, as /proc shows it."""

    inode: int
    fd: int
    family: int
    address: IPAddress
    port: int


def _proc_address(hex_addr: str) -> IPAddress:
    """/proc/net/tcp{,6} print each 32-bit word of an address in host byte order."""
    raw = b"".join(struct.pack("=I", int(hex_addr[i : i + 8], 16)) for i in range(0, len(hex_addr), 8))
    return ipaddress.ip_address(raw)


def _tcp_table(pid: int | str = "self") -> list[tuple[int, int, IPAddress, int, str]]:
    """Every TCP socket of the process's network namespace: (inode, family, local address, local port, state)."""
    rows: list[tuple[int, int, IPAddress, int, str]] = []
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        for line in lines:
            fields = line.split()
            addr, port = fields[1].split(":")
            rows.append((int(fields[9]), family, _proc_address(addr), int(port, 16), fields[3]))
    return rows


def _own_sockets(pid: int | str = "self") -> dict[int, int]:
    """inode -> fd of every socket the process has open."""
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(fd)
    return out


def own_tcp_listeners(pid: int | str = "self") -> list[TcpListener]:
    """The listening TCP sockets of a process (Linux /proc; [] elsewhere), e.g. to see what a native library opened."""
    if not sys.platform.startswith("linux"):
        return []
    fds = _own_sockets(pid)
    return [
        TcpListener(inode, fds[inode], family, addr, port)
        for inode, family, addr, port, state in _tcp_table(pid)
        if state == "0A" and inode in fds
    ]


def _host_addresses(host: str) -> list[IPAddress]:
    """What `host` resolves to, as peers connecting to it would reach it."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise OSError(f"cannot resolve {host!r}: {exc}") from exc
    return sorted(
        {ipaddress.ip_address(cast(str, info[4][0]).split("%")[0]) for info in infos}, key=lambda a: (a.version, a.packed)
    )


def _destination_filter(addresses: Sequence[IPAddress]) -> bytes:
    """A classic BPF program that keeps packets whose IP destination is one of `addresses` and drops the rest."""
    program: list[tuple[int, int | str, int | str, int] | str] = [
        (_LD_B, 0, 0, _NET),
        (_RSH, 0, 0, 4),
        (_JEQ, 0, "not4", 4),
        (_LD_W, 0, 0, _NET + 16),
        *[(_JEQ, "accept", 0, int(a)) for a in addresses if a.version == 4],
        (_RET, 0, 0, _DROP),
        "not4",
        (_JEQ, 0, "drop", 6),
    ]
    for i, a in enumerate(x for x in addresses if x.version == 6):
        words = struct.unpack("!4I", a.packed)
        for w, word in enumerate(words):
            program += [(_LD_W, 0, 0, _NET + 24 + 4 * w), (_JEQ, "accept" if w == 3 else 0, f"next{i}", word)]
        program.append(f"next{i}")
    program += ["drop", (_RET, 0, 0, _DROP), "accept", (_RET, 0, 0, _ACCEPT)]
    labels: dict[str, int] = {}
    code: list[tuple[int, int | str, int | str, int]] = []
    for item in program:
        if isinstance(item, str):
            labels[item] = len(code)
        else:
            code.append(item)

    def rel(target: int | str, i: int) -> int:
        return target if isinstance(target, int) else labels[target] - i - 1

    return b"".join(struct.pack("=HBBI", op, rel(jt, i), rel(jf, i), k) for i, (op, jt, jf, k) in enumerate(code))


def confine_listeners(listeners: Collection[TcpListener], host: str) -> None:
    """Make listeners bound to a wildcard address accept only connections addressed to `host`.

    For libraries that bind 0.0.0.0 / [::] whatever they are told (Mooncake):
    a locked classic-BPF socket filter on each listening socket drops every
    packet whose destination is not an address of `host`, so SYNs to other
    interfaces go unanswered (connections inherit the filter). Raises OSError
    where that cannot be done (not Linux, a wildcard `host`, the kernel
    refused), and TransferError if a connection addressed elsewhere is already
    in, since the filter cannot reach it (EarlyConnectionError).
    """
    if not sys.platform.startswith("linux"):
        raise OSError(f"socket filters need Linux, not {sys.platform}")
    wildcard = [li for li in listeners if li.address.is_unspecified]
    if not wildcard:
        return
    addresses = _host_addresses(host)
    if any(a.is_unspecified for a in addresses):
        raise OSError(f"transfer host {host!r} is a wildcard address")
    code = _destination_filter(addresses)
    instructions = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("HP", len(code) // 8, ctypes.addressof(instructions))  # struct sock_fprog
    for li in wildcard:
        with socket.fromfd(li.fd, li.family, socket.SOCK_STREAM) as s:  # a dup: the filter is on the shared socket
            s.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)
            s.setsockopt(socket.SOL_SOCKET, _SO_LOCK_FILTER, 1)
    ports = {li.port for li in wildcard}
    allowed = set(addresses)
    for _, _, addr, port, state in _tcp_table():
        local = (addr.ipv4_mapped or addr) if isinstance(addr, ipaddress.IPv6Address) else addr
        if port in ports and state in _TCP_STATES_IN_USE and local not in allowed:
            raise EarlyConnectionError(
                f"a connection to {local}:{port} got in before the port was confined to {host}: not serving; restart the worker"
            )
