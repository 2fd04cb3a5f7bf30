"""Queries on a running directory cluster (started by the `make_cluster` fixture or shared by a test file)."""

from __future__ import annotations

import urllib.parse

import httpx

from kvdir.local_cluster import Cluster


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
