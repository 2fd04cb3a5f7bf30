"""A real single-replica Raft node (it binds its ports on 127.0.0.1) writes a snapshot (kvproto.codec's bytes, in
pysyncobj's pickle) and a new one reloads it through kvdir's guarded unpickler. The unpickler's rules without sockets are in tests/unit/test_raft_transport.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from directory.config import DirectorySettings
from directory.replica import Replica
from kvdir.local_cluster import free_ports
from kvproto.codec import encode_entry
from kvproto.schemas import Region
from kvproto.state import NodeProfile, Publish, Register
from tests.support.wait import wait_for

PROFILE = NodeProfile(("m", "m-lora"), "fp-1", "acme", False)  # what a registration says of its engine (§2.1)


def test_a_snapshot_is_written_and_reloaded_through_the_raft_unpickler(tmp_path: Path) -> None:
    """A real single-replica Raft node compacts its log into a snapshot, and a new one loads it (node profiles too)."""
    http, raft = free_ports(2)
    settings = DirectorySettings(http=f"127.0.0.1:{http}", raft=f"127.0.0.1:{raft}", data_dir=tmp_path, fsync=False)
    replica = Replica(settings)
    try:
        wait_for(lambda: replica.is_leader, timeout=30.0, what="a leader")
        assert (
            replica.sm.apply_batch(
                encode_entry(
                    [
                        Register(
                            "n",
                            "inc",
                            "http://127.0.0.1:9",
                            regions=(Region(rank=0, base_addr=4096, length=4096, block_bytes=512, rkey="k"),),
                            epoch_base=1 << 31,
                            profile=PROFILE,
                        ),
                        Register("old", "inc", "http://127.0.0.1:10"),  # a registration that names no profile
                    ]
                ),
                sync=True,
                timeout=10,
            )[0].status
            == "ok"
        )
        epoch = replica.state.nodes["n"].epoch
        hashes = np.arange(1, 1001, dtype=np.uint64)
        replica.sm.apply_batch(
            encode_entry([Publish("n", epoch, hashes, np.arange(1000, dtype=np.uint32))]), sync=True, timeout=10
        )
        digest = replica.state.digest()
        replica.raft.forceLogCompaction()
        wait_for(
            lambda: (tmp_path / "raft.dump").exists() and replica.raft.getStatus()["log_len"] <= 2,
            timeout=30.0,
            what="a snapshot",
        )
    finally:
        replica.raft.destroy()
    with open(tmp_path / "raft.dump", "rb") as f:
        head = f.read(2)
    assert head  # a real file was written (pysyncobj gzips it)
    again = Replica(settings)
    try:
        wait_for(lambda: again.state.digest() == digest, timeout=30.0, what="the state restored from the snapshot")
        assert again.state.nodes["n"].epoch == epoch
        assert again.state.nodes["n"].profile == PROFILE and again.state.nodes["old"].profile is None
    finally:
        again.raft.destroy()
