"""Run NVIDIA Dynamo's own trace simulator (`dynamo.replay`) with its real router, and print its figures as JSON.

Run by the peers venv's Python (`make peers-install`), not kvdir's: it imports only Dynamo and the standard
library, so it is a script by path, never imported by kvdir. Arguments: one JSON object (trace, workers,
capacity_blocks, block_tokens, speedup_ratio, decode_speedup_ratio, modes); output: one JSON object per mode name.
"""

from __future__ import annotations

import json
import sys
import time

# The figures kvdir reports next to its own (Dynamo's summary has many more).
KEPT = (
    "prefix_cache_reused_ratio",
    "num_requests",
    "completed_requests",
    "median_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "request_throughput_rps",
)


def main(argv: list[str]) -> int:
    from dynamo.replay import run_trace_replay

    spec = json.loads(argv[0])
    out = {}
    for mode in spec["modes"]:
        t0 = time.perf_counter()
        report = run_trace_replay(
            [spec["trace"]],
            num_workers=spec["workers"],
            router_mode=mode,
            trace_block_size=spec["block_tokens"],
            extra_engine_args={
                "engine": {
                    "block_size": spec["block_tokens"],
                    "num_gpu_blocks": spec["capacity_blocks"],
                    "speedup_ratio": spec["speedup_ratio"],
                    "decode_speedup_ratio": spec["decode_speedup_ratio"],
                }
            },
        )
        summary = report.summary
        out[mode] = {k: summary.get(k) for k in KEPT} | {"wall_s": time.perf_counter() - t0}
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
