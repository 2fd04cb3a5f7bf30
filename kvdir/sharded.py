"""A sharded directory on one host: N Raft groups (`Cluster`s) and the shard map that joins them.

`kvdir up --shards N`, the tests and the benches start sharded directories through `ShardedCluster`
(docs/scale-out.md). Each shard is an ordinary `Cluster` whose replicas run with
`--shard-map-file MAP --shard NAME`; the map names every shard's replica URLs, so a client given any
replica's URL finds the rest (`GET /v1/shards`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from kvdir.local_cluster import Cluster, free_ports
from kvproto.shardmap import ShardMap


def shard_names(n: int) -> list[str]:
    return [f"s{i}" for i in range(n)]


class ShardedCluster:
    """`shards` groups of `replicas` directory replicas each, with one shard map file; `stop()` ends them all."""

    def __init__(
        self,
        data_dir: Path,
        shards: int,
        replicas: int = 3,
        *,
        ports: Sequence[int] | None = None,
        host: str = "127.0.0.1",
        lease_ttl_s: float = 10.0,
        log_level: str = "warning",
        extra_args: Sequence[str] = (),
        token: str | None = None,
        raft_password_file: Path | None = None,
    ) -> None:
        """`ports`: 2 x shards x replicas ports (HTTP ports first, then Raft), free ones by default."""
        if shards < 1 or replicas < 1:
            raise ValueError("a sharded cluster needs at least one shard of at least one replica")
        per = shards * replicas
        ports = list(ports) if ports is not None else free_ports(2 * per, host)
        if len(ports) != 2 * per:
            raise ValueError(f"{shards} shards of {replicas} replicas need {2 * per} ports, not {len(ports)}")
        self.data_dir = data_dir
        self.names = shard_names(shards)
        http = [ports[i * replicas : (i + 1) * replicas] for i in range(shards)]
        raft = [ports[per + i * replicas : per + (i + 1) * replicas] for i in range(shards)]
        self.shard_map = ShardMap(
            version=1, shards={name: [f"http://{host}:{p}" for p in http[i]] for i, name in enumerate(self.names)}
        )
        self.map_file = data_dir / "shards.json"
        data_dir.mkdir(parents=True, exist_ok=True)
        self.map_file.write_text(json.dumps(self.shard_map.model_dump(), indent=2) + "\n")
        self.clusters = []
        for i, name in enumerate(self.names):
            shard_dir = data_dir / name
            shard_dir.mkdir(exist_ok=True)
            self.clusters.append(
                Cluster(
                    shard_dir,
                    http[i],
                    raft[i],
                    host=host,
                    lease_ttl_s=lease_ttl_s,
                    log_level=log_level,
                    extra_args=[*extra_args, "--shard-map-file", str(self.map_file), "--shard", name],
                    token=token,
                    raft_password_file=raft_password_file,
                )
            )

    @property
    def replica_urls(self) -> list[str]:
        """Every replica of every shard: what clients may be given (they read the map from any one)."""
        return [u for c in self.clusters for u in c.replica_urls]

    def shard(self, name: str) -> Cluster:
        return self.clusters[self.names.index(name)]

    def start(self) -> None:
        for c in self.clusters:
            c.start()

    def wait_ready(self, timeout: float) -> list[str]:
        """Wait until every shard has a leader; returns their URLs, shard by shard."""
        return [c.wait_ready(timeout) for c in self.clusters]

    def stop(self, grace: float = 5.0) -> None:
        for c in self.clusters:
            c.stop(grace)
