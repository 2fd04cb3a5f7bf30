"""Network namespaces joined by a bridge: one host per replica, links that can be cut.

Each replica runs in its own namespace with one address on a private /24;
the harness's own process (in the root namespace) holds `.254` on the bridge
and reaches every replica whatever the partition, as a Jepsen client does.
A partition installs blackhole routes in both namespaces of every pair that
it separates: packets vanish silently, as on a real cut link, so Raft sees
timeouts rather than fast connection errors. Needs root (CAP_SYS_ADMIN and
CAP_NET_ADMIN) and iproute2; traffic never leaves the machine.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import threading
from collections.abc import Collection, Sequence

log = logging.getLogger("kvtools.faults")

_NAME = re.compile(r"^kvf(\d+)n\d+$")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN)"
    probe = f"kvf{os.getpid()}probe"
    try:
        r = _ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "iproute2 (`ip`) is not installed"
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def sweep() -> None:
    """Delete namespaces left by harness runs whose process is gone (a crash skips cleanup)."""
    r = _ip("netns", "list", check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME.match(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _ip("netns", "del", name, check=False)
            _ip("link", "del", f"kvf{m.group(1)}b", check=False)


class Network:
    """`n` hosts in namespaces on one bridge; `partition()` and `heal()` cut and restore links."""

    def __init__(self, n: int) -> None:
        pid = os.getpid()
        self.n = n
        self.names = [f"kvf{pid}n{i}" for i in range(n)]
        self.bridge = f"kvf{pid}b"
        self.subnet = f"10.{200 + pid % 50}.{(pid // 50) % 256}"
        self.hosts = [f"{self.subnet}.{i + 1}" for i in range(n)]
        self._cut: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self._up = False

    def __enter__(self) -> Network:
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def setup(self) -> None:
        sweep()
        self._up = True
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(self.names):
                _ip("netns", "add", name)
                veth = f"{self.bridge}{i}"
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", name, "addr", "add", f"{self.hosts[i]}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as exc:
            self.close()
            raise RuntimeError(f"setting up network namespaces failed: {' '.join(exc.cmd)}: {exc.stderr.strip()}") from exc
        log.info("network: %d namespaces on bridge %s (%s.0/24)", self.n, self.bridge, self.subnet)

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program on host i."""
        return ["ip", "netns", "exec", self.names[i]]

    def partition(self, groups: Sequence[Sequence[int]], among: Collection[int] | None = None) -> None:
        """Cut every link between hosts of different groups (hosts in no group are cut from all).

        `among`: only the links between these hosts change, so one Raft group can be cut while
        another is cut or healed at the same time (from another thread).
        """
        self.heal(among)
        hosts = range(self.n) if among is None else sorted(among)
        group_of = {h: g for g, members in enumerate(groups) for h in members}
        for a in hosts:
            for b in hosts:
                if a != b and group_of.get(a, -1 - a) != group_of.get(b, -1 - b):
                    _ip("-n", self.names[a], "route", "add", "blackhole", f"{self.hosts[b]}/32")
                    with self._lock:
                        self._cut.add((a, b))
        log.info("network: partitioned into %s", [list(g) for g in groups])

    def heal(self, among: Collection[int] | None = None) -> None:
        with self._lock:
            cut = sorted(p for p in self._cut if among is None or (p[0] in among and p[1] in among))
            self._cut.difference_update(cut)
        for a, b in cut:
            _ip("-n", self.names[a], "route", "del", "blackhole", f"{self.hosts[b]}/32", check=False)
        if cut:
            log.info("network: healed")

    def close(self) -> None:
        if not self._up:
            return
        self._up = False
        for name in self.names:
            _ip("netns", "del", name, check=False)
        _ip("link", "del", self.bridge, check=False)
