"""`kvdir bench`: benchmarks that print figures (targets are judged from these, never in tests)."""

from __future__ import annotations


def run_bench(target: str, *, as_json: bool, quick: bool, plot: str | None = None) -> int:
    """Run the `target` bench; `plot`: the folder for the figures of those that draw some (gateway, vllm)."""
    if target == "attacks":
        from kvdir.bench.attacks import main as attacks_main

        return attacks_main(as_json=as_json, quick=quick)
    if target == "directory":
        from kvdir.bench.directory import main

        return main(as_json=as_json, quick=quick)
    if target == "elections":
        from kvdir.bench.elections import main as elections_main

        return elections_main(as_json=as_json, quick=quick)
    if target == "events":
        from kvdir.bench.events import main as events_main

        return events_main(as_json=as_json, quick=quick)
    if target == "gateway":
        from kvdir.bench.gateway import main as gateway_main

        return gateway_main(as_json=as_json, quick=quick, plot=plot)
    if target == "vllm":
        from kvdir.bench.vllm import main as vllm_main

        return vllm_main(as_json=as_json, quick=quick, plot=plot)
    if target == "worker":
        from kvdir.bench.worker import main as worker_main

        return worker_main(as_json=as_json, quick=quick)
    raise ValueError(f"unknown benchmark {target!r}")
