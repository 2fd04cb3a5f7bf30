"""Partitions without network namespaces: Raft links routed through fault proxies on loopback.

pysyncobj opens one TCP connection per pair of replicas, from the one whose
address sorts higher, which then sends its own address as the first message;
the accepting side never checks whom it was dialled as. So each replica gets
its own loopback address (127.0.0.11, .12, ...), and the higher replica of
each pair is given, as its peer's address, a proxy that listens on the lower
one's IP (so the ordering holds) and forwards to its real Raft port. Cutting
a link closes its open connections and holds new ones silent, as a dead link
would; healing lets new ones through. Traffic stays on 127.0.0.0/8.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Collection, Sequence

log = logging.getLogger("kvtools.faults")


class LinkProxy:
    """Forwards connections from `listen_host` to `target` until cut."""

    def __init__(self, listen_host: str, target: tuple[str, int]) -> None:
        self.target = target
        self._server = socket.create_server((listen_host, 0))
        self.address = f"{listen_host}:{self._server.getsockname()[1]}"
        self._cut = False
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            with self._lock:
                self._open.add(client)
                cut = self._cut
            if cut:
                continue  # held open and silent until the heal closes it
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                self._drop(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open.add(upstream)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        self._drop(src)
        self._drop(dst)

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.discard(sock)
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()

    def _drop_all(self) -> None:
        with self._lock:
            socks = list(self._open)
        for s in socks:
            self._drop(s)

    def cut(self) -> None:
        with self._lock:
            self._cut = True
        self._drop_all()

    def heal(self) -> None:
        with self._lock:
            was_cut, self._cut = self._cut, False
        if was_cut:
            self._drop_all()  # the held connections: the dialling replica reconnects through the healed link

    def close(self) -> None:
        self._server.close()
        self._drop_all()


class ProxyNetwork:
    """`n` replicas on their own loopback addresses, every Raft link through a `LinkProxy`.

    `groups` (a sharded directory: one Raft group per shard) lists the replicas of each group;
    links exist only within a group. By default all `n` replicas form one group.
    """

    def __init__(self, n: int, raft_ports: Sequence[int], groups: Sequence[Sequence[int]] | None = None) -> None:
        self.n = n
        self.hosts = [f"127.0.0.{11 + i}" for i in range(n)]
        self._raft = [(self.hosts[i], raft_ports[i]) for i in range(n)]
        self._group = {i: g for g, members in enumerate(groups or [range(n)]) for i in members}
        # Replica hi dials replica lo (lo < hi) through links[(hi, lo)], which listens on lo's IP.
        self.links = {
            (hi, lo): LinkProxy(self.hosts[lo], self._raft[lo])
            for hi in range(n)
            for lo in range(hi)
            if self._group[hi] == self._group[lo]
        }

    def peers(self, i: int) -> list[str]:
        """Replica i's --peers: the proxies of the replicas it dials, the real addresses of those that dial it."""
        return [
            self.links[(i, j)].address if j < i else f"{self.hosts[j]}:{self._raft[j][1]}"
            for j in range(self.n)
            if j != i and self._group[j] == self._group[i]
        ]

    def partition(self, groups: Sequence[Sequence[int]], among: Collection[int] | None = None) -> None:
        """Cut every link between replicas of different groups (replicas in no group are cut from all).

        `among`: only the links between these replicas change, so one Raft group can be cut while
        another is cut or healed at the same time.
        """
        self.heal(among)
        group_of = {h: g for g, members in enumerate(groups) for h in members}
        for (hi, lo), link in self.links.items():
            if (among is None or (hi in among and lo in among)) and group_of.get(hi, -1 - hi) != group_of.get(lo, -1 - lo):
                link.cut()
        log.info("network (proxies): partitioned into %s", [list(g) for g in groups])

    def heal(self, among: Collection[int] | None = None) -> None:
        for (hi, lo), link in self.links.items():
            if among is None or (hi in among and lo in among):
                link.heal()

    def close(self) -> None:
        for link in self.links.values():
            link.close()
