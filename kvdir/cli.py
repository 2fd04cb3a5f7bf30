"""`kvdir` and its subcommands. Flags are generated from the settings classes (kvdir.roles), so every
setting has a `--flag`, a `KVDIR_<ROLE>_*` and a `KVDIR_*` environment variable (in that order of precedence)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

log = logging.getLogger("kvdir")

# The entry-point group of subcommands that live outside this package (pyproject.toml: `bench` and `replay`, in
# kvtools): each names a `register(subparsers)` that adds its parser and sets `run(args) -> int` as its default.
COMMANDS = "kvdir.commands"


def _parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or only role `only`'s: a process that runs one role (every replica, gateway and
    worker `kvdir up` starts) imports neither the other roles' settings nor the tools' subcommands."""
    from kvdir.roles import ROLES, add_settings_flags

    p = argparse.ArgumentParser(prog="kvdir", description="A Raft-replicated KV-cache directory for LLM inference clusters.")
    sub = p.add_subparsers(dest="command", required=True)

    for role in ROLES.values():
        if only in ROLES and role.name != only:
            continue
        parser = sub.add_parser(role.name, help=role.help)
        add_settings_flags(parser, role)
        if role.name == "events":
            parser.add_argument("--connect", dest="bind", action="store_false", help="connect the SUB socket (same as --no-bind)")
    if only in ROLES:
        return p

    sub.add_parser(
        "check-config", help="validate settings (flags, env, a docker-compose file) without starting anything", add_help=False
    )
    sub.add_parser("health", help="probe a running component's health endpoint (for container health checks)", add_help=False)

    from kvdir.shards_cli import add_arguments as add_shards_arguments

    add_shards_arguments(
        sub.add_parser("shards", help="show a sharded directory's shard map, or change it without downtime (docs/scale-out.md)")
    )

    for command in entry_points(group=COMMANDS):
        try:
            register = command.load()
        except ModuleNotFoundError as exc:
            if exc.name != command.module.partition(".")[0]:
                raise
            log.debug("kvdir %s: not installed (%s)", command.name, exc)  # an install without the tools: the image
            continue
        register(sub)
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

    args = _parser(argv[0] if argv else None).parse_args(argv)
    try:
        if args.command in ROLES:
            role = ROLES[args.command]
            module, function = role.entry.split(":")
            status = getattr(importlib.import_module(module), function)(build_settings(role, args))
            return int(status or 0)
        if args.command == "shards":
            from kvdir.shards_cli import run_shards

            return run_shards(args)
        if hasattr(args, "run"):  # a plugged-in subcommand (COMMANDS)
            return int(args.run(args))
    except ValidationError as exc:
        for e in exc.errors():
            loc = ".".join(str(x) for x in e["loc"])
            got = f" (got {e['input']!r})" if e["type"] == "literal_error" else ""  # only a choice: inputs may be secrets
            print(f"kvdir {args.command}: invalid setting --{loc.replace('_', '-')}{got}: {e['msg']}", file=sys.stderr)
        return 2
    return 2
