"""`kvdir replay`'s flags, and its entry into the `kvdir` command (the `kvdir.commands` entry point).

The simulation's numeric knobs are one table (`_MODEL`): flag, SimParams field, the flag's unit and the help;
each default is the field's own, so the CLI and SimParams cannot disagree.
Standalone: ``python -m kvtools.replay.cli --synthetic multi_turn``. Plots need matplotlib (imported only
when ``--plot`` is given).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtools.replay.calibration import EngineCalibration
from kvtools.replay.peers_real import DEFAULT_PYTHON
from kvtools.replay.report import ORDER, SYNTHETIC, run_replay
from kvtools.replay.sim import SimParams

_D = SimParams()

# The flag's unit against its field's: "ms" for seconds as milliseconds, "G" for bytes/s as GB/s, "" for the same.
_TO_FLAG = {"": lambda v: v, "ms": lambda v: v * 1e3, "G": lambda v: v / 1e9}
_TO_FIELD = {"": lambda v: v, "ms": lambda v: v / 1e3, "G": lambda v: v * 1e9}

# (flag, SimParams field, unit, type, help; the default is appended)
_MODEL: tuple[tuple[str, str, str, type, str], ...] = (
    ("--nodes", "nodes", "", int, "engines"),
    (
        "--dp-ranks",
        "dp_ranks",
        "",
        int,
        "data-parallel ranks per node, each an engine with its own cache (--capacity-blocks), prefill and queue: a holder "
        "and routing candidate of its own, as the gateway treats DP ranks",
    ),
    ("--capacity-blocks", "capacity_blocks", "", int, "KV cache per engine (per node, or per DP rank), in blocks"),
    (
        "--host-blocks",
        "host_blocks",
        "",
        int,
        "a host tier per engine, in blocks: what the device evicts lives on there, loaded back on a hit and readable "
        "by peers (0: none)",
    ),
    (
        "--host-copy-gbps",
        "host_copy_bytes_per_s",
        "G",
        float,
        "host-to-device copy rate of a block loaded from the host tier, GB/s (as the gateway's --host-copy-gbps)",
    ),
    ("--trace-block-tokens", "block_tokens", "", int, "tokens per block of the trace's hash_ids, also used by --synthetic"),
    ("--prefill-tokens-per-s", "prefill_tokens_per_s", "", float, "prefill rate per node, one prefill at a time"),
    ("--decode-tokens-per-s", "decode_tokens_per_s", "", float, "decode rate per request"),
    (
        "--link-gbps",
        "link_bytes_per_s",
        "G",
        float,
        "pull bandwidth between nodes in GB/s, gigabytes as the gateway's --link-gbps (100 Gb/s by default)",
    ),
    (
        "--block-bytes",
        "block_bytes",
        "",
        int,
        "KV bytes of one block on a node, all TP ranks (the default: 512 tokens x 128 KiB, a Llama-3-8B-like model in bf16)",
    ),
    ("--pull-setup-ms", "pull_setup_s", "ms", float, "fixed cost of one pull"),
    ("--publish-lag-ms", "publish_lag_s", "ms", float, "delay before the router sees a node's stores and evictions"),
    ("--max-running", "max_running", "", int, "requests an engine runs at once; the rest wait"),
    (
        "--evict-scan",
        "evict_scan",
        "",
        int,
        "eviction looks this many blocks from the cold end for one another node also holds, and evicts it first (0: plain LRU)",
    ),
    (
        "--displace-weight",
        "displace_weight",
        "",
        float,
        "kvdir's price of what storing a request evicts on a full node, as a fraction of its recompute time "
        "(gateway.cost; 0: ignored)",
    ),
    (
        "--gateways",
        "gateways",
        "",
        int,
        "gateway replicas behind a round-robin balancer: kvdir's share the directory, the modeled peers each keep their "
        "own index (Dynamo's replicas share their decisions)",
    ),
    (
        "--heartbeat-s",
        "heartbeat_s",
        "",
        float,
        "engines report their prefill backlog this often; gateways add the others' share of it to their own count "
        "(0: each knows only its own)",
    ),
    (
        "--replica-sync-ms",
        "replica_sync_s",
        "ms",
        float,
        "with --gateways > 1: delay before a modeled Dynamo router replica learns another's routing decision or request "
        "end (its --router-replica-sync over NATS core messaging), and before a kvdir gateway learns another's note "
        "(gateway.peers)",
    ),
    (
        "--ttft-learn-window",
        "ttft_learn_window",
        "",
        int,
        "each gateway learns its engines' TTFT curves from the TTFTs it observes, as the live gateway's flag of the "
        "same name (gateway.ttft_learner; 0: off)",
    ),
)


def register(sub: Any) -> None:
    """Add `replay` to the `kvdir` command's subparsers."""
    p = sub.add_parser(
        "replay", help="replay a trace (Mooncake JSONL or synthetic) through the routing policies: simulated or live"
    )
    add_arguments(p)
    p.set_defaults(run=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The replay's flags (kvtools.replay.sim's module docstring describes the model they set)."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--trace", metavar="PATH", help="Mooncake JSONL trace, plain or .gz (timestamp ms, input_length, output_length, hash_ids)"
    )
    src.add_argument("--synthetic", choices=sorted(SYNTHETIC), help="a synthetic workload with its default parameters")
    parser.add_argument("--policies", default=",".join(ORDER), help=f"comma-separated policies (default all: {','.join(ORDER)})")
    parser.add_argument("--limit", type=int, metavar="K", help="replay only the first K requests")
    parser.add_argument("--strict", action="store_true", help="stop at the first malformed trace line")
    for flag, field, unit, kind, text in _MODEL:
        default = kind(_TO_FLAG[unit](getattr(_D, field)))
        parser.add_argument(flag, type=kind, default=default, help=f"{text} (default {default:g})")
    parser.add_argument(
        "--no-share-decisions",
        dest="share_decisions",
        action="store_false",
        help="with --gateways > 1: kvdir's gateways do not send each other notes of their routing decisions "
        "(each counts only its own pending prefill: the ablation)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the policies' rng and of --synthetic (default 0)")
    parser.add_argument(
        "--calibration",
        metavar="FILE",
        help="the simulated engines follow this measured engine (`kvdir bench vllm --calibration-out`): prefill rate "
        "by running prefills, decode time by batch and beside prefills, fixed overhead (default: none, the cost "
        "model's FIFO prefill at --prefill-tokens-per-s and parallel decode at --decode-tokens-per-s)",
    )
    parser.add_argument(
        "--stay-margin-ms",
        type=float,
        default=0.0,
        help="kvdir policy: a request leaves the engine holding most of its prefix only for an option faster by more "
        "than this and by --stay-margin-ratio, as the gateway's flag (default 0; the gateway's is 100)",
    )
    parser.add_argument(
        "--stay-margin-ratio",
        type=float,
        default=0.0,
        help="kvdir policy: with --stay-margin-ms, the fraction of the home engine's TTFT to save (default 0; the "
        "gateway's is 0.25)",
    )
    _live_arguments(parser)
    parser.add_argument(
        "--peers-real",
        action="store_true",
        help="also run Dynamo's real router in Dynamo's own simulator on the same requests and cluster, and compare "
        "hit rates (needs `make peers-install`)",
    )
    parser.add_argument(
        "--peers-python",
        type=Path,
        default=DEFAULT_PYTHON,
        help=f"--peers-real: the peers venv's Python (default {DEFAULT_PYTHON.relative_to(DEFAULT_PYTHON.parents[2])})",
    )
    parser.add_argument("--json", metavar="FILE", help="write the figures as one JSON object")
    parser.add_argument("--plot", metavar="DIR", help="write PNG charts (hit rate, TTFT, per-node load) into DIR")


def _live_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mode",
        choices=["sim", "live"],
        default="sim",
        help="sim: the discrete-event simulation; live: send the requests through a running gateway",
    )
    parser.add_argument("--gateway", default="http://127.0.0.1:8100", help="--mode live: the gateway's URL (kvdir up's default)")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="--mode live: multiply the trace's inter-arrival times (0.1: ten times faster)",
    )
    parser.add_argument(
        "--max-output",
        type=int,
        default=16,
        help="--mode live: cap on each request's output tokens (--compare-sim simulates the capped requests)",
    )
    parser.add_argument(
        "--stream",
        action="store_true",
        help="--mode live: stream the answers and time each TTFT to its first token here (real engines report none)",
    )
    parser.add_argument("--model", default="kvdir-stub", help="--mode live: the model named in the requests")
    parser.add_argument(
        "--vocab",
        type=int,
        default=50_000,
        help="--mode live: the prompts' token ids are drawn below this (the model's vocabulary size; default 50,000)",
    )
    parser.add_argument(
        "--compare-sim", action="store_true", help="--mode live: also simulate the same requests (with --policies) and show both"
    )


def sim_params(args: argparse.Namespace) -> SimParams:
    """The SimParams the parsed flags describe (each `_MODEL` flag back in its field's unit)."""
    fields: dict[str, Any] = {
        field: _TO_FIELD[unit](getattr(args, flag[2:].replace("-", "_"))) for flag, field, unit, _, _ in _MODEL
    }
    margins = {"stay_margin_s": args.stay_margin_ms / 1e3, "stay_margin_ratio": args.stay_margin_ratio}
    return SimParams(
        **fields,
        share_decisions=args.share_decisions,
        seed=args.seed,
        calibration=EngineCalibration.load(args.calibration) if args.calibration else None,
        policy_options={"kvdir": margins} if any(margins.values()) else {},
    )


def run(args: argparse.Namespace) -> int:
    """Run the replay the parsed flags describe; 2 (with the reason on stderr) when they describe no valid model."""
    try:
        params = sim_params(args)
    except (OSError, ValueError) as exc:
        print(f"kvdir replay: {exc}", file=sys.stderr)
        return 2
    return run_replay(args, params)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvdir replay", description="Replay a trace through the routing policies.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
