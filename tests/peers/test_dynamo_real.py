"""`kvdir replay --peers-real`: Dynamo's real router in Dynamo's own simulator (the peers venv, `make test-peers`),
on the same requests and cluster as kvdir's simulation, through the `kvdir` command as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

KVDIR = Path(sys.executable).with_name("kvdir")


def replay(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "replay.json"
    proc = subprocess.run(
        [str(KVDIR), "replay", *flags, "--policies", "kvdir,round_robin,dynamo", "--peers-real", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "real peers, in Dynamo's own simulator" in proc.stdout
    doc: dict = json.loads(out.read_text())
    return doc


def test_the_two_simulators_agree_where_routing_is_blind_and_kvdir_is_not_below_the_real_router(tmp_path: Path) -> None:
    doc = replay(tmp_path, "--synthetic", "multi_turn", "--nodes", "4", "--capacity-blocks", "400")
    real = doc["peers_real"]["dynamo"]
    assert real["kv_router"]["completed_requests"] == real["kv_router"]["num_requests"] == doc["workload"]["requests"]
    # Round robin ignores the caches: the same requests on the same engines reuse the same share in both models.
    rr = doc["policies"]["round_robin"]["hit_rate"]
    assert real["round_robin"]["prefix_cache_reused_ratio"] == pytest.approx(rr, abs=0.01)
    assert doc["policies"]["kvdir"]["hit_rate"] >= real["kv_router"]["prefix_cache_reused_ratio"]
