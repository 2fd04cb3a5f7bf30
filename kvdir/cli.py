"""`kvdir` and its subcommands. Flags are generated from the settings classes (kvdir.roles), so every
setting has a `--flag`, a `KVDIR_<ROLE>_*` and a `KVDIR_*` environment variable (in that order of precedence)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

PLOTTED = ("vllm", "gateway", "mirror")  # the bench targets that draw figures (--plot)


def _parser() -> argparse.ArgumentParser:
    from kvdir.roles import ROLES, add_settings_flags

    p = argparse.ArgumentParser(prog="kvdir", description="A Raft-replicated KV-cache directory for LLM inference clusters.")
    sub = p.add_subparsers(dest="command", required=True)

    for role in ROLES.values():
        add_settings_flags(sub.add_parser(role.name, help=role.help), role)
    sub.choices["events"].add_argument(
        "--connect", dest="bind", action="store_false", help="connect the SUB socket (same as --no-bind)"
    )

    sub.add_parser(
        "check-config", help="validate settings (flags, env, a docker-compose file) without starting anything", add_help=False
    )
    sub.add_parser("health", help="probe a running component's health endpoint (for container health checks)", add_help=False)

    from kvdir.replay.report import add_arguments as add_replay_arguments

    r = sub.add_parser(
        "replay", help="replay a trace (Mooncake JSONL or synthetic) through the routing policies: simulated or live"
    )
    add_replay_arguments(r)

    from kvdir.shards_cli import add_arguments as add_shards_arguments

    add_shards_arguments(
        sub.add_parser("shards", help="show a sharded directory's shard map, or change it without downtime (docs/scale-out.md)")
    )

    b = sub.add_parser("bench", help="run a benchmark and print its figures")
    b.add_argument(
        "target",
        choices=["directory", "worker", "gateway", "mirror", "events", "elections", "soak", "attacks", "vllm", "shards"],
        help="what to measure (vllm: TTFT of pulled vs recomputed vs locally cached prefixes on two vLLM engines with "
        "the kvdir connector, needs `make vllm-install`; mirror: the gateway's mirror of the directory, its lag under writes and leader kills; elections: needless Raft elections after starts, stalls and restarts; "
        "soak: the fault harness, cycling its schedule under load; attacks: hostile clients' cost; "
        "shards: publish throughput, replica CPU per write and RSS per entry with 1, 2 and 4 directory shards)",
    )
    b.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    b.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    b.add_argument(
        "--plot",
        metavar="DIR",
        help=f"{', '.join(PLOTTED)}: also write PNG figures into DIR (vllm: TTFT by path and prefix size; gateway: "
        "latency CDFs by path; mirror: lag over time and its CDF)",
    )
    b.add_argument(
        "--minutes",
        type=float,
        default=10.0,
        help="soak: how long to cycle the fault schedule; mirror: how long the leader-kill phase runs",
    )
    b.add_argument(
        "--replicas",
        type=int,
        choices=[1, 3, 5],
        default=3,
        help="soak: directory replicas (3 or 5); shards: replicas per shard (1 fits a 2-core machine)",
    )
    b.add_argument(
        "--shards",
        type=int,
        default=1,
        help="soak: directory shards (Raft groups of --replicas each); every shard cycles the faults",
    )
    b.add_argument(
        "--engines-per-adapter",
        type=int,
        default=None,
        help="events: engines each `kvdir events` process follows (1: a process per engine; default 8)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # These parse their own arguments. `health` runs in every container every few seconds: it imports
    # nothing beyond the standard library (kvdir.health), so nothing above the stdlib is imported at the top.
    if argv[:1] == ["health"]:
        from kvdir.health import run_health

        return run_health(argv[1:])
    if argv[:1] == ["check-config"]:
        from kvdir.check_config import run_check_config

        return run_check_config(argv[1:])
    from pydantic import ValidationError

    from kvdir.roles import ROLES, build_settings

    args = _parser().parse_args(argv)
    try:
        if args.command in ROLES:
            role = ROLES[args.command]
            module, function = role.entry.split(":")
            status = getattr(importlib.import_module(module), function)(build_settings(role, args))
            return int(status or 0)
        if args.command == "replay":
            from kvdir.replay.report import run_replay

            return run_replay(args)
        if args.command == "shards":
            from kvdir.shards_cli import run_shards

            return run_shards(args)
        if args.command == "bench":
            from kvdir.bench import run_bench

            if args.target == "soak":
                from kvdir.faults.run import main as soak_main

                if args.replicas == 1:
                    print("kvdir bench soak: --replicas 3 or 5 (the fault schedule kills replicas)", file=sys.stderr)
                    return 2

                return soak_main(minutes=args.minutes, replicas=args.replicas, as_json=args.json, shards=args.shards)
            if args.plot is not None and args.target not in PLOTTED:
                print(f"kvdir bench {args.target}: --plot is for {', '.join(PLOTTED)}", file=sys.stderr)
                return 2
            if args.target == "mirror":
                from kvdir.bench.mirror import main as mirror_main

                return mirror_main(as_json=args.json, quick=args.quick, minutes=args.minutes, plot=args.plot)
            if args.target == "shards":
                from kvdir.bench.shards import main as shards_main

                return shards_main(as_json=args.json, quick=args.quick, replicas=args.replicas)
            if args.target == "events" and args.engines_per_adapter is not None:
                from kvdir.bench.events import main as events_main

                return events_main(as_json=args.json, quick=args.quick, engines_per_adapter=args.engines_per_adapter)
            return run_bench(args.target, as_json=args.json, quick=args.quick, plot=args.plot)
    except ValidationError as exc:
        for e in exc.errors():
            loc = ".".join(str(x) for x in e["loc"])
            got = f" (got {e['input']!r})" if e["type"] == "literal_error" else ""  # only a choice: inputs may be secrets
            print(f"kvdir {args.command}: invalid setting --{loc.replace('_', '-')}{got}: {e['msg']}", file=sys.stderr)
        return 2
    return 2
