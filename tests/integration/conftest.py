"""Real directory replicas in separate processes on 127.0.0.1, on free ports, always stopped."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvdir.local_cluster import Cluster, Gateway, Workers, free_ports, write_raft_password
from kvdir.sharded import ShardedCluster
from tests.support.cluster import deregister_all


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """Start clusters of n replicas; every one is stopped at teardown, pass or fail."""
    started: list[Cluster] = []

    def make(
        n: int = 3,
        lease_ttl_s: float = 10.0,
        extra_args: tuple[str, ...] = (),
        token: str | None = None,
        raft_password: bool = True,
    ) -> Cluster:
        """A Raft password as `kvdir up` gives (a fresh file), unless `raft_password` is False."""
        ports = free_ports(2 * n)
        data_dir = tmp_path / f"cluster{len(started)}"
        data_dir.mkdir()
        cluster = Cluster(
            data_dir,
            ports[:n],
            ports[n:],
            lease_ttl_s=lease_ttl_s,
            log_level="info",
            extra_args=extra_args,
            token=token,
            raft_password_file=write_raft_password(data_dir / "secrets") if raft_password else None,
        )
        started.append(cluster)
        cluster.start()
        cluster.wait_ready(60)
        return cluster

    yield make
    for c in started:
        c.stop()


@pytest.fixture(scope="module")
def _file_directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One single-replica directory shared by a test file's tests (see `file_directory`)."""
    data_dir = tmp_path_factory.mktemp("file-directory")
    ports = free_ports(2)
    cluster = Cluster(
        data_dir,
        ports[:1],
        ports[1:],
        lease_ttl_s=10.0,
        log_level="info",
        raft_password_file=write_raft_password(data_dir / "secrets"),
    )
    try:
        cluster.start()
        cluster.wait_ready(60)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def file_directory(_file_directory: Cluster) -> Iterator[Cluster]:
    """A real single-replica directory (its own process, Raft and REST), started once per test file.

    For the tests of the gateway, the workers and the adapters, which need a directory but do not test
    Raft: a replica process costs more to start than most of these tests take to run. Each test starts
    with no node registered: what a test leaves (the node of a worker it killed) is deregistered after it,
    so no test sees another's engines, whatever the order. Tests that kill, restart or configure the
    directory start their own with `make_cluster`.
    """
    leader = _file_directory.wait_ready(30)
    assert httpx.get(leader + "/v1/nodes", timeout=5).json()["nodes"] == [], "a node left by an earlier test"
    yield _file_directory
    deregister_all(leader)


@pytest.fixture
def make_sharded(tmp_path: Path) -> Iterator[Callable[..., ShardedCluster]]:
    """Start sharded directories (docs/scale-out.md) with a Raft password; all stopped at teardown."""
    started: list[ShardedCluster] = []

    def make(shards: int = 2, replicas: int = 1, lease_ttl_s: float = 10.0, extra_args: tuple[str, ...] = ()) -> ShardedCluster:
        data_dir = tmp_path / f"sharded{len(started)}"
        data_dir.mkdir()
        cluster = ShardedCluster(
            data_dir,
            shards,
            replicas,
            lease_ttl_s=lease_ttl_s,
            log_level="info",
            extra_args=extra_args,
            raft_password_file=write_raft_password(data_dir / "secrets"),
        )
        started.append(cluster)
        cluster.start()
        cluster.wait_ready(60)
        return cluster

    yield make
    for c in started:
        c.stop()


@pytest.fixture
def make_workers(tmp_path: Path) -> Iterator[Callable[..., Workers]]:
    """Start worker stubs registered with a cluster; every one is stopped at teardown."""
    started: list[Workers] = []

    def make(cluster: Cluster, n: int = 2, extra_args: tuple[str, ...] = ()) -> Workers:
        data_dir = tmp_path / f"workers{len(started)}"
        data_dir.mkdir()
        workers = Workers(
            data_dir,
            free_ports(n),
            cluster.replica_urls,
            log_level="info",
            # TCP transfers unless a test asks for Mooncake (the tests of the transfer engines do): a Mooncake
            # engine takes ~0.5 s to tear down, on every worker's stop.
            extra_args=("--time-scale", "0.05", "--heartbeat-interval-s", "0.3", "--transfer", "tcp", *extra_args),
        )
        started.append(workers)
        workers.start()
        workers.wait_ready(60)
        return workers

    yield make
    for w in started:
        w.stop()


@pytest.fixture
def make_gateway(tmp_path: Path) -> Iterator[Callable[..., Gateway]]:
    """Start gateways in front of a cluster; every one is stopped at teardown."""
    started: list[Gateway] = []

    def make(cluster: Cluster, engines: int, extra_args: tuple[str, ...] = ()) -> Gateway:
        data_dir = tmp_path / f"gateway{len(started)}"
        data_dir.mkdir()
        g = Gateway(
            data_dir, free_ports(1)[0], cluster.replica_urls, log_level="info", extra_args=("--refresh-s", "0.1", *extra_args)
        )
        started.append(g)
        g.wait_ready(60, engines=engines)
        return g

    yield make
    for g in started:
        g.stop()
