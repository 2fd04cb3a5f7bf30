"""A slow link on loopback: what some local TCP ports send, shaped to a rate by the kernel (tc htb + u32 on `lo`).

A pull's source on a congested or distant link reads slowly but steadily, which neither a frozen source (SIGSTOP)
nor a dead one shows: the reader's deadline never fires and the read lasts as long as the link makes it. Shaping
the source's own listening ports on `lo` makes exactly that link, with real sockets and real TCP flow control,
while every other loopback flow keeps its speed. Needs root (CAP_NET_ADMIN) and iproute2's `tc` with the htb
qdisc and the u32 classifier, which are what this machine's kernel has (no netem, prio or clsact). One shaping at
a time per machine: a pid file names the process that holds it, and one left by a process that died is removed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
from collections.abc import Collection, Iterator
from pathlib import Path

from kvtransfer.mooncake import mooncake_rpc_ports
from kvtransfer.socket_filter import own_tcp_listeners

log = logging.getLogger("kvtools.faults")

DEV = "lo"
HANDLE = "4b1d"  # the root qdisc's major number: ours, whoever else shapes lo uses another
OWNER = Path("/tmp/kvdir-slow-link.pid")
"""The pid of the process holding the shaping, so that one left by a killed run is recognised as stale."""


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["tc", *args], capture_output=True, text=True, check=check, timeout=30)


def _root_qdisc() -> str:
    return _tc("qdisc", "show", "dev", DEV, "root", check=False).stdout.strip()


def available() -> str | None:
    """None when loopback ports can be shaped here, else why not (tried on `lo` and removed at once)."""
    if os.geteuid() != 0:
        return "shaping loopback traffic needs root (CAP_NET_ADMIN)"
    try:
        with slow_ports([], 1e6):
            pass
    except FileNotFoundError:
        return "iproute2's `tc` is not installed"
    except RuntimeError as exc:
        return str(exc)
    return None


def _owner_alive() -> int | None:
    try:
        pid = int(OWNER.read_text())
    except (OSError, ValueError):
        return None
    return pid if pid != os.getpid() and Path(f"/proc/{pid}").exists() else None


def _remove() -> None:
    if f"qdisc htb {HANDLE}:" in _root_qdisc():
        _tc("qdisc", "del", "dev", DEV, "root", check=False)
    OWNER.unlink(missing_ok=True)


@contextlib.contextmanager
def slow_ports(ports: Collection[int], bytes_per_s: float, burst_bytes: int = 8192) -> Iterator[None]:
    """While inside, TCP segments sent from any of `ports` on loopback leave at `bytes_per_s` (IPv4 and IPv6);
    everything else on loopback passes a class with no real limit. Removed on exit, whatever happened inside."""
    if (holder := _owner_alive()) is not None:
        raise RuntimeError(f"loopback is already shaped by process {holder} ({OWNER})")
    _remove()  # a shaping whose process died
    current = _root_qdisc()
    if current and not current.startswith(("qdisc noqueue", "qdisc pfifo_fast", "qdisc pfifo")):
        raise RuntimeError(f"{DEV} has a root qdisc of its own, left as it is: {current}")
    OWNER.write_text(str(os.getpid()))
    rate = f"{max(8, int(bytes_per_s * 8))}bit"
    burst = f"{burst_bytes}b"
    try:
        steps = [
            f"qdisc add dev {DEV} root handle {HANDLE}: htb default 1 r2q 100000",
            f"class add dev {DEV} parent {HANDLE}: classid {HANDLE}:1 htb rate 100gbit",
            f"class add dev {DEV} parent {HANDLE}: classid {HANDLE}:2 htb rate {rate} ceil {rate} burst {burst} cburst {burst}",
        ]
        for port in ports:  # one protocol per filter priority
            steps.append(
                f"filter add dev {DEV} parent {HANDLE}: protocol ip prio 1 u32 match ip sport {port} 0xffff flowid {HANDLE}:2"
            )
            steps.append(
                f"filter add dev {DEV} parent {HANDLE}: protocol ipv6 prio 2 u32 match ip6 sport {port} 0xffff flowid {HANDLE}:2"
            )
        for step in steps:
            r = _tc(*step.split(), check=False)
            if r.returncode != 0:
                raise RuntimeError(f"`tc {step}` failed: {r.stderr.strip()}")
        log.info("slow link: TCP from ports %s on %s shaped to %.0f B/s", sorted(ports), DEV, bytes_per_s)
        yield
    finally:
        _remove()


def listening_ports(pids: Collection[int]) -> list[int]:
    """The TCP ports the processes `pids` listen on in Mooncake's range of random ports (its handshake and data
    ports, not an engine's HTTP port)."""
    span = mooncake_rpc_ports()
    found: set[int] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            found.update(li.port for li in own_tcp_listeners(pid) if li.port in span)
    return sorted(found)
