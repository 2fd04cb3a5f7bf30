"""Queries on a running directory cluster (started by the `make_cluster` fixture)."""

from __future__ import annotations

import httpx

from kvdir.local_cluster import Cluster


def leader_index(cluster: Cluster) -> int:
    """The index in `cluster.replica_urls` of the current leader (waits for one)."""
    leader = cluster.wait_ready(30)
    return cluster.replica_urls.index(leader)


def digests(cluster: Cluster, among: list[int]) -> list[str]:
    """The state digest each of the replicas `among` reports."""
    return [httpx.get(cluster.replica_urls[i] + "/v1/digest", timeout=5).json()["digest"] for i in among]
