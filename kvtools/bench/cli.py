"""`kvdir bench TARGET`: one subcommand per benchmark, each with only the flags it reads.

Every target takes `--json`; the flags beyond it are declared with the target, so `kvdir bench directory --plot`
is refused by argparse instead of being silently ignored. A target runs `main(**flags)` of its module, imported
only when it runs (the benchmarks pull in numpy, zmq, matplotlib, ...).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Flags = Callable[[argparse.ArgumentParser], None]


def _quick(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")


def _plot(what: str) -> Flags:
    def add(p: argparse.ArgumentParser) -> None:
        p.add_argument("--plot", metavar="DIR", help=f"also write PNG figures into DIR ({what})")

    return add


def _minutes(what: str, default: float) -> Flags:
    def add(p: argparse.ArgumentParser) -> None:
        p.add_argument("--minutes", type=float, default=default, help=f"{what} (default {default:g})")

    return add


def _replicas(choices: list[int], default: int, what: str) -> Flags:
    def add(p: argparse.ArgumentParser) -> None:
        p.add_argument("--replicas", type=int, choices=choices, default=default, help=f"{what} (default {default})")

    return add


def _shards(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shards",
        type=int,
        default=1,
        help="directory shards (Raft groups of --replicas each); every shard cycles the faults (default 1)",
    )


def _tp(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, choices=[1, 2], default=1, help="tensor-parallel ranks of both engines (default 1)")


def _model_size(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model-size",
        choices=["tiny", "bench"],
        default="tiny",
        help="both engines' random model: tiny (2 layers, hidden 128) or bench (~32M parameters, 8 layers, hidden "
        "512: a prefill that costs what a pull saves) (default tiny)",
    )


def _calibration(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--case",
        choices=["pulls", "calibration"],
        default="pulls",
        help="pulls: pulled vs recomputed vs local TTFT and the stall case; calibration: prefill rate by running "
        "prefills and decode time by batch and beside a prefill, for `kvdir replay --calibration` (default pulls)",
    )
    p.add_argument("--calibration-out", metavar="FILE", help="--case calibration: write the calibration file here")
    p.add_argument(
        "--replay-live",
        action="store_true",
        help="--case calibration: also replay a multi-turn slice live through kvdir's gateway on both engines and "
        "simulate it with and without the calibration",
    )
    p.add_argument(
        "--calibrate-alike",
        action="store_true",
        help="--case calibration: load the second engine alike while measuring the first (engines sharing a "
        "machine's cores slow each other; default: the first alone)",
    )


def _engines_per_adapter(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engines-per-adapter",
        type=int,
        default=argparse.SUPPRESS,  # absent: the bench's own default
        help="engines each `kvdir events` process follows (1: a process per engine; default 8)",
    )


def _engines(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engines",
        choices=["stubs", "vllm"],
        default="stubs",
        help="route over 4 worker stubs or 2 real vLLM engines with the kvdir connector (default stubs)",
    )


ROUTERS = ("kvdir", "sglang", "smg", "vllm_router", "round_robin", "modeled_sglang", "kvdir_static")
"""`kvdir bench routers`' routers, in the order they run; `modeled_sglang` is kvdir's gateway with `--policy sglang`
(on the stubs only)."""


def _routers(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--routers",
        nargs="+",
        choices=ROUTERS,
        metavar="ROUTER",
        help=f"compare only these on the datasets (the hot path runs kvdir, sglang, smg, vllm_router): {', '.join(ROUTERS)}",
    )
    p.add_argument(
        "--think-s",
        type=float,
        default=1.0,
        help="mean think time between a chat answer and the session's next turn, seconds, exponential (default 1)",
    )


ATTACKS = (
    "raft_flood",
    "header_flood",
    "oversized_publishes",
    "stalled_watchers",
    "peer_notes",
    "origin_hijack",
    "registration_flood",
)
"""`kvdir bench attacks`' attacks, in the order they run (here, not in the bench's module, which loads only when it runs)."""


def _only(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", nargs="+", choices=ATTACKS, metavar="ATTACK", help=f"run only these: {', '.join(ATTACKS)}")


@dataclass(frozen=True)
class Target:
    """A benchmark: its subcommand, what it measures, its flags, and the `module:function` that runs it."""

    name: str
    help: str
    entry: str
    flags: tuple[Flags, ...] = (_quick,)


TARGETS = (
    Target("directory", "hashing, lookups, memory per entry, the state machine's apply and REST", "kvtools.bench.directory:main"),
    Target("worker", "the worker stub's pulls, publishing and its overhead", "kvtools.bench.worker:main"),
    Target(
        "gateway",
        "the gateway's tokenize+hash, policy choice and added latency by path",
        "kvtools.bench.gateway:main",
        (_quick, _plot("latency CDFs by path")),
    ),
    Target(
        "mirror",
        "the gateway's mirror of the directory: its lag under writes and leader kills",
        "kvtools.bench.mirror:main",
        (_quick, _plot("lag over time and its CDF"), _minutes("how long the leader-kill phase runs", 10.0)),
    ),
    Target(
        "events",
        "engine KV events through `kvdir events` adapters into the directory",
        "kvtools.bench.events:main",
        (_quick, _engines_per_adapter),
    ),
    Target("elections", "needless Raft elections after starts, stalls and restarts", "kvtools.bench.elections:main"),
    Target(
        "soak",
        "the fault harness, cycling its schedule under load",
        "kvtools.faults.run:main",
        (
            _minutes("how long to cycle the fault schedule", 10.0),
            _replicas([3, 5], 3, "directory replicas: the schedule kills replicas"),
            _shards,
        ),
    ),
    Target("attacks", "hostile clients' cost", "kvtools.bench.attacks:main", (_quick, _only)),
    Target(
        "vllm",
        "TTFT of pulled vs recomputed vs locally cached prefixes on two vLLM engines with the kvdir connector "
        "(needs `make vllm-install`)",
        "kvtools.bench.vllm:main",
        (_quick, _plot("TTFT by path and prefix size"), _tp, _model_size, _calibration),
    ),
    Target(
        "vllm-tiers",
        "TTFT of a prefix served from the vLLM connector's host tier vs a device hit vs recomputing it "
        "(needs `make vllm-install`)",
        "kvtools.bench.vllm_tiers:main",
    ),
    Target(
        "ranks",
        "a pull's metadata (directory entries, plan, lookup, registration) and read time on worker stubs at TP 1, 2 and 8",
        "kvtools.bench.ranks:main",
    ),
    Target(
        "routers",
        "kvdir's gateway against the real SGLang router, SMG and vllm-router (cache_aware) and round robin, live on "
        "worker stubs or real vLLM engines: prefix repetition by vllm bench serve, closed-loop chat sessions "
        "(needs `make vllm-install` and `make peers-install`)",
        "kvtools.bench.routers:main",
        (_quick, _engines, _routers),
    ),
    Target(
        "shards",
        "publish throughput, replica CPU per write and RSS per entry with 1, 2 and 4 directory shards",
        "kvtools.bench.shards:main",
        (_quick, _replicas([1, 3, 5], 3, "replicas per shard (1 fits a 2-core machine)")),
    ),
)


def register(sub: Any) -> None:
    """Add `bench` and its targets to the `kvdir` command's subparsers (the `kvdir.commands` entry point)."""
    bench = sub.add_parser("bench", help="run a benchmark and print its figures")
    targets = bench.add_subparsers(dest="target", required=True, metavar="TARGET")
    for t in TARGETS:
        p = targets.add_parser(t.name, help=t.help, description=t.help)
        p.add_argument("--json", dest="as_json", action="store_true", help="print one JSON object instead of a table")
        for add in t.flags:
            add(p)
        p.set_defaults(run=_runner(t.entry))


def _runner(entry: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        module, function = entry.split(":")
        flags = {k: v for k, v in vars(args).items() if k not in ("command", "target", "run")}
        return int(getattr(importlib.import_module(module), function)(**flags) or 0)

    return run
