"""A real server process freezes its startup heap once its lifespan startup is over (kvproto.heap, wired in by
`serve_app` for every kvdir server): a replica's log says so after its Raft node and index kernels are up."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from kvdir.local_cluster import free_ports
from tests.support.wait import wait_for


def test_a_replica_freezes_what_its_startup_built(tmp_path: Path) -> None:
    http, raft = free_ports(2)
    log = tmp_path / "replica.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvdir", "directory", "--http", f"127.0.0.1:{http}", "--raft", f"127.0.0.1:{raft}",
             "--log-level", "debug"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        frozen = wait_for(
            lambda: re.search(r"(\d+) objects alive after startup frozen", log.read_text()),
            what="the replica to freeze its startup heap",
            timeout=60,
        )
        text = log.read_text()
        assert text.index("index kernels ready") < frozen.start(), text  # after the lifespan startup, not before it
        assert int(frozen.group(1)) > 10_000, text  # the modules and the app, not a handful
    finally:
        proc.kill()
        proc.wait(10)
