"""`kvdir` and its subcommands. Flags are generated from the settings classes, so every
setting has a `--flag` and a `KVDIR_*` environment variable (flags win)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from kvdir.check_config import ROLES


def add_settings_flags(parser: argparse.ArgumentParser, cls: type[BaseSettings]) -> None:
    """One flag per settings field; defaults stay None so that env vars and defaults apply."""
    prefix = cls.model_config.get("env_prefix", "")
    for name, field in cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        env = f"{prefix}{name}".upper()
        help_text = f"{field.description or ''} [env {env}; default {field.default}]"
        if field.annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=name, default=None, metavar=name.split("_")[-1].upper(), help=help_text)


def build_settings(cls: type[BaseSettings], args: argparse.Namespace) -> Any:
    given = {k: v for k, v in vars(args).items() if k in cls.model_fields and v is not None}
    return cls(**given)


# The long-running roles: each is a settings class (kvdir.check_config.ROLES) and a module whose
# serve(settings) runs it until SIGINT/SIGTERM.
_SERVERS = {
    "directory": ("run one directory replica", "directory.server"),
    "gateway": ("run the OpenAI-compatible affinity gateway", "gateway.server"),
    "worker": ("run one worker stub (a stand-in GPU engine)", "worker_stub.server"),
    "events": ("feed the directory from one vLLM/SGLang engine's KV-cache events (ZMQ)", "engines.subscriber"),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvdir", description="A Raft-replicated KV-cache directory for LLM inference clusters.")
    sub = p.add_subparsers(dest="command", required=True)

    for role, (help_text, _) in _SERVERS.items():
        add_settings_flags(sub.add_parser(role, help=help_text), ROLES[role])
    sub.choices["events"].add_argument(
        "--connect", dest="bind", action="store_false", help="connect the SUB socket (same as --no-bind)"
    )

    from kvdir.launcher import UpSettings

    u = sub.add_parser("up", help="start a local cluster on loopback: directory replicas, worker stubs, gateway")
    add_settings_flags(u, UpSettings)

    sub.add_parser(
        "check-config", help="validate settings (flags, env, a docker-compose file) without starting anything", add_help=False
    )
    sub.add_parser("health", help="probe a running component's health endpoint (for container health checks)", add_help=False)

    from kvdir.replay.report import add_arguments as add_replay_arguments

    r = sub.add_parser(
        "replay", help="replay a trace (Mooncake JSONL or synthetic) through the routing policies: simulated or live"
    )
    add_replay_arguments(r)

    b = sub.add_parser("bench", help="run a benchmark and print its figures")
    b.add_argument(
        "target",
        choices=["directory", "worker", "gateway", "events", "elections", "soak", "attacks"],
        help="what to measure (elections: needless Raft elections after starts, stalls and restarts; "
        "soak: the fault harness, cycling its schedule under load; attacks: hostile clients' cost)",
    )
    b.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    b.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    b.add_argument("--minutes", type=float, default=10.0, help="soak: how long to cycle the fault schedule")
    b.add_argument("--replicas", type=int, choices=[3, 5], default=3, help="soak: directory replicas")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["check-config"], ["health"]):  # they parse their own arguments
        from kvdir.check_config import run_check_config, run_health

        return (run_check_config if argv[0] == "check-config" else run_health)(argv[1:])
    args = _parser().parse_args(argv)
    try:
        if args.command in _SERVERS:
            importlib.import_module(_SERVERS[args.command][1]).serve(build_settings(ROLES[args.command], args))
            return 0
        if args.command == "up":
            from kvdir.launcher import UpSettings, run_up

            return run_up(build_settings(UpSettings, args))
        if args.command == "replay":
            from kvdir.replay.report import run_replay

            return run_replay(args)
        if args.command == "bench":
            from kvdir.bench import run_bench

            if args.target == "soak":
                from kvdir.faults.run import main as soak_main

                return soak_main(minutes=args.minutes, replicas=args.replicas, as_json=args.json)
            return run_bench(args.target, as_json=args.json, quick=args.quick)
    except ValidationError as exc:
        for e in exc.errors():
            loc = ".".join(str(x) for x in e["loc"])
            print(f"kvdir {args.command}: invalid setting --{loc.replace('_', '-')}: {e['msg']}", file=sys.stderr)
        return 2
    return 2
