"""Live replay through real gateway, workers and directory agrees with the simulation."""

from __future__ import annotations

import json
import subprocess
import sys

from kvtools.replay.live import live_replay
from kvtools.replay.sim import SimParams, simulate
from kvtools.replay.trace import multi_turn


def test_live_multi_turn_hit_rate_matches_the_simulation(file_directory, make_workers, make_gateway, tmp_path) -> None:
    c = file_directory
    make_workers(c, 4, ("--time-scale", "0.01"))
    g = make_gateway(c, 4)
    requests = multi_turn(sessions=6, rounds=3, seed=3, block_tokens=512)
    # The trace's 28 s in 2.8 s: a chat's next round comes 0.5 s or more after its last, many times what a turn takes
    # to be answered and published (tens of ms). Only the system prompt block (512 of ~90,000 prompt tokens) can
    # come sooner, to the next chats; all five of them missing it would move the hit rate by 0.03.
    live = live_replay(g.url, requests, block_tokens=512, time_scale=0.1, max_output=4, progress=False)
    assert live["failed"] == 0
    # Workers hold 4,096 blocks of 16 tokens: 128 blocks of 512 tokens each.
    sim = simulate(requests, "kvdir", SimParams(nodes=4, capacity_blocks=128, block_tokens=512))
    assert live["hit_rate"] > 0.3  # later rounds reuse the history
    assert abs(live["hit_rate"] - sim["hit_rate"]) < 0.05, (live, sim["hit_rate"])
    assert live["prediction_exact"] >= 0.9
    # The same through the command line, with the simulation beside it, as JSON.
    out = tmp_path / "live.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvdir",
            "replay",
            "--mode",
            "live",
            "--gateway",
            g.url,
            "--synthetic",
            "multi_turn",
            "--limit",
            "6",
            "--time-scale",
            "0.05",
            "--compare-sim",
            "--policies",
            "kvdir",
            "--nodes",
            "4",
            "--capacity-blocks",
            "128",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    doc = json.loads(out.read_text())
    assert doc["live"]["requests"] == 6 and "kvdir" in doc["policies"]
