"""Queries on a running directory cluster (started by the `make_cluster` fixture or shared by a test file), and the
smallest whole stack a test file shares (`one_engine_stack`)."""

from __future__ import annotations

import contextlib
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import httpx

from kvdir.local_cluster import Cluster, Gateway, Workers, free_ports


def leader_index(cluster: Cluster) -> int:
    """The index in `cluster.replica_urls` of the current leader (waits for one)."""
    leader = cluster.wait_ready(30)
    return cluster.replica_urls.index(leader)


def digests(cluster: Cluster, among: list[int]) -> list[str]:
    """The state digest each of the replicas `among` reports."""
    return [httpx.get(cluster.replica_urls[i] + "/v1/digest", timeout=5).json()["digest"] for i in among]


def deregister_all(url: str, token: str | None = None) -> None:
    """Deregister every node the replica at `url` lists (what a test left behind, in every tenant)."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    with httpx.Client(base_url=url, headers=headers, timeout=5) as http:
        for node in http.get("/v1/nodes").json()["nodes"]:
            r = http.delete("/v1/nodes/" + urllib.parse.quote(node["node_id"], safe="/"))
            assert r.status_code in (200, 404), r.text  # 404: it deregistered itself meanwhile


@contextlib.contextmanager
def one_engine_stack(d: Path, worker_args: tuple[str, ...]) -> Iterator[tuple[Cluster, Workers, Gateway]]:
    """One directory replica, one worker stub (`worker_args` added to its flags) and a gateway that refreshes its
    engine list every 0.1 s, in `d`, each ready; all stopped on exit, however the block ends."""
    ports = free_ports(4)
    c = Cluster(d, ports[:1], ports[1:2], lease_ttl_s=300, log_level="info")
    w = Workers(d, ports[2:3], c.replica_urls, log_level="info", extra_args=worker_args)
    g: Gateway | None = None
    try:
        c.start()
        c.wait_ready(60)
        w.start()
        w.wait_ready(60)
        g = Gateway(d, ports[3], c.replica_urls, log_level="info", extra_args=("--refresh-s", "0.1"))
        g.wait_ready(60, engines=1)
        yield c, w, g
    finally:
        if g is not None:
            g.stop()
        w.stop()
        c.stop()
