"""The clusters the benches start for themselves: a 3-replica directory (`bench_directory`), and two worker
stubs, one holding a prompt and one pulling it by plan (`pull_pair`), which `kvdir bench worker` (pull
throughput) and `kvdir bench ranks` (a pull's metadata and time per TP size) both measure."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvdir.local_cluster import Cluster, Workers, free_ports

MODEL = "kvdir-stub"


@dataclass
class PullPair:
    """Stub A holds a `blocks`-block prompt (`holder`: its directory entry with slots; `lookup_bytes`: the size of
    that lookup's answer); `pull` makes B read it by plan."""

    http: httpx.Client
    workers: Workers
    directory: str
    blocks: int
    holder: dict[str, Any]
    lookup_bytes: int

    @property
    def plan(self) -> dict[str, Any]:
        h = self.holder
        return {"source_node": h["node_id"], "source_epoch": h["epoch"], "slots": h["slots"]}

    def pull(self, round_: int) -> dict[str, Any]:
        """B's `kvdir` answer for the prompt pulled by plan, every block checked pulled. B's pool holds one prompt
        (`--capacity-blocks` = `blocks`): a filler computed first evicts the last round's pull."""
        b = self.workers.urls[1]
        filler = [10_000_000 + round_ * 100_000 + i for i in range(self.blocks * 16)]
        self.http.post(b + "/v1/completions", json=_body(filler)).raise_for_status()
        body = {**_body(list(range(self.blocks * 16))), "kvdir_pull": self.plan}
        k: dict[str, Any] = self.http.post(b + "/v1/completions", json=body).json()["kvdir"]
        if k["pulled_tokens"] != self.blocks * 16 or k["pull_failures"]:
            raise RuntimeError(f"pull failed: {k}")
        return k


def _body(tokens: list[int]) -> dict[str, Any]:
    return {"model": MODEL, "prompt": tokens, "max_tokens": 1}


@contextmanager
def pull_pair(
    tmp: Path, directory_urls: list[str], *, blocks: int, tp: int, block_bytes: int, engine: str = "mooncake"
) -> Iterator[PullPair]:
    """Start A and B (`tp` ranks of `block_bytes` per block, `engine` transfers, no simulated time), have A serve
    the prompt and wait until the directory lists all of it; both are stopped on exit."""
    w = Workers(
        tmp,
        free_ports(2),
        directory_urls,
        extra_args=(
            *("--transfer", engine, "--tp", str(tp), "--block-bytes", str(block_bytes)),
            *("--capacity-blocks", str(blocks), "--time-scale", "0"),
        ),
    )
    try:
        w.start()
        w.wait_ready(120)
        tokens = list(range(blocks * 16))
        with httpx.Client(timeout=300) as http:
            http.post(w.urls[0] + "/v1/completions", json=_body(tokens)).raise_for_status()
            deadline = time.monotonic() + 60
            lookup = {"tokens": tokens, "model": MODEL, "with_slots": True}
            while time.monotonic() < deadline:
                r = http.post(directory_urls[0] + "/v1/lookup", json=lookup)
                holders = r.json()["holders"]
                if holders and holders[0]["matched_blocks"] == blocks:
                    yield PullPair(http, w, directory_urls[0], blocks, holders[0], len(r.content))
                    return
                time.sleep(0.05)
            raise RuntimeError(f"the directory did not list the prompt's {blocks} blocks within 60 s")
    finally:
        w.stop()


@contextmanager
def bench_directory() -> Iterator[tuple[Cluster, Path]]:
    """A fresh 3-replica directory (quiet logs) and the temporary directory it lives in; stopped and removed on
    exit."""
    ports = free_ports(6)
    with tempfile.TemporaryDirectory(prefix="kvdir-bench-") as tmp:
        c = Cluster(Path(tmp), ports[:3], ports[3:], log_level="warning")
        try:
            c.start()
            c.wait_ready(60)
            yield c, Path(tmp)
        finally:
            c.stop()
