"""`kvdir check-config`: validate configurations without starting anything.

One settings class per role serves the command line, the environment,
`kvdir up` and docker-compose.yml, so checking a compose file is checking the
same settings the processes will read.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kvdir.roles import ENV_PREFIX, ROLES, add_settings_flags, build_settings

# Variables read by `kvdir health` (kvdir.health), allowed beside any role's settings.
COMMON_ENV = {"KVDIR_HEALTH_URL"}
# What stands in for a compose secret's file: valid as any secret a setting reads, a password,
# a token, and a tokens file (ROLE:NODE_PATTERN:TOKEN).
STAND_IN_SECRET = "admin:*:stand-in-for-a-secret\n"


@contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """Exactly `env` as the KVDIR_* environment for the duration (other variables kept)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("KVDIR_")}
    for k in saved:
        del os.environ[k]
    os.environ.update(env)
    try:
        yield
    finally:
        for k in env:
            os.environ.pop(k, None)
        os.environ.update(saved)


def check(role: str, args: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """Problems with running `kvdir ROLE ARGS...` under `env`; empty when it would start."""
    spec = ROLES.get(role)
    if spec is None:
        return [f"unknown role {role!r}: expected one of {', '.join(ROLES)}"]
    problems = []
    for key in env:
        if key.startswith(ENV_PREFIX) and key not in COMMON_ENV and spec.env_field(key) is None:
            problems.append(f"{key}: not a setting of `kvdir {role}`")
    parser = argparse.ArgumentParser(prog=f"kvdir {role}", add_help=False, exit_on_error=False)
    add_settings_flags(parser, spec)
    try:
        ns, extra = parser.parse_known_args(list(args))
    except argparse.ArgumentError as exc:
        return [*problems, str(exc)]
    problems += [f"{a}: not a flag of `kvdir {role}`" for a in extra]
    with _environment({k: str(v) for k, v in env.items() if k.startswith(ENV_PREFIX) and k not in COMMON_ENV}):
        try:
            build_settings(spec, ns)
        except ValidationError as exc:
            problems += [f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors()]
    return problems


_VARIABLE = re.compile(r"\$(?:\$|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?-)(?P<default>[^}]*))?\})")


def interpolate(text: str, environ: Mapping[str, str]) -> str:
    """Compose's variable substitution: `${VAR}`, `${VAR:-default}` (also when empty), `${VAR-default}`, `$$`."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        value = environ.get(m["name"])
        if (m["op"] == ":-" and not value) or (m["op"] == "-" and value is None):
            return m["default"]
        return value or ""

    return _VARIABLE.sub(sub, text)


def _substitute(node: Any, environ: Mapping[str, str]) -> Any:
    """`interpolate` over every string value of a parsed compose file (compose substitutes values, not keys or comments)."""
    if isinstance(node, str):
        return interpolate(node, environ)
    if isinstance(node, dict):
        return {k: _substitute(v, environ) for k, v in node.items()}
    if isinstance(node, list):
        return [_substitute(v, environ) for v in node]
    return node


def compose_services(
    path: Path, secrets_stand_in: Path, environ: Mapping[str, str] | None = None
) -> dict[str, tuple[str, list[str], dict[str, str]]]:
    """Each kvdir service of a compose file as (role, args, environment), variables substituted from `environ`
    (default: this process's environment) as compose substitutes them.

    A setting naming /run/secrets/NAME is checked to be a secret the compose
    file declares and the service mounts; the secret's content is not read
    (it may not exist outside the deployment), `secrets_stand_in` takes its place.
    """
    environ = os.environ if environ is None else environ
    doc = _substitute(yaml.safe_load(path.read_text()), environ)
    declared = set((doc.get("secrets") or {}).keys())
    out = {}
    for name, svc in (doc.get("services") or {}).items():
        command = svc.get("command") or []
        if isinstance(command, str):
            command = command.split()
        if not command or command[0] not in ROLES:
            continue  # not a kvdir service (an engine, say)
        env = svc.get("environment") or {}
        if isinstance(env, list):
            env = dict(item.split("=", 1) for item in env)
        mounted = {m if isinstance(m, str) else m.get("source") for m in svc.get("secrets") or []}
        env = {k: str(v) for k, v in env.items()}
        for k, v in env.items():
            if v.startswith("/run/secrets/"):
                secret = v.removeprefix("/run/secrets/")
                if secret in declared and secret in mounted:
                    env[k] = str(secrets_stand_in)
        out[name] = (command[0], [str(a) for a in command[1:]], env)
    return out


CLIENT_ROLES = ("gateway", "worker", "events")  # the roles that talk to the directory


def _sets(role: str, name: str, args: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether a service of `role` gives the setting `name`, as a flag or a KVDIR_[ROLE_]* variable."""
    flag = "--" + name.replace("_", "-")
    return any(ROLES[role].env_field(k) == name for k in env) or any(a == flag or a.startswith(flag + "=") for a in args)


def compose_auth_problems(services: Mapping[str, tuple[str, list[str], dict[str, str]]]) -> list[str]:
    """With auth on any replica of a compose file: it must be on all of them, and every client must send a token.

    Each service on its own is valid without these, and would only meet 401s once deployed.
    """
    replicas = [n for n, (role, _, _) in services.items() if role == "directory"]
    secured = [n for n in replicas if _sets("directory", "auth_tokens_file", *services[n][1:])]
    if not secured:
        return []
    problems = [
        f"{n}: no auth tokens file, while {secured[0]} has one (replicas would disagree on who may write)"
        for n in replicas
        if n not in secured
    ]
    problems += [
        f"{n}: no directory token file, while the directory has auth on (every request would be 401)"
        for n, (role, args, env) in services.items()
        if role in CLIENT_ROLES and not _sets(role, "directory_token_file", args, env)
    ]
    return problems


def run_check_config(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="kvdir check-config", description=__doc__)
    p.add_argument("--compose", type=Path, help="check every kvdir service of this docker-compose file")
    p.add_argument("role", nargs="?", help=f"{', '.join(ROLES)} (with its flags after it)")
    args, rest = p.parse_known_args(list(argv))
    if args.compose is None and args.role is None:
        p.error("give --compose FILE or a role and its flags")
    with tempfile.TemporaryDirectory(prefix="kvdir-check-") as tmp:
        stand_in = Path(tmp) / "secret"
        stand_in.write_text(STAND_IN_SECRET)
        return _run_checks(args.compose, args.role, rest, stand_in)


def _run_checks(compose: Path | None, role: str | None, rest: list[str], stand_in: Path) -> int:
    checks: dict[str, tuple[str, list[str], dict[str, str]]] = {}
    if compose is not None:
        try:
            checks.update(compose_services(compose, stand_in))
        except (OSError, yaml.YAMLError) as exc:
            print(f"kvdir check-config: cannot read {compose}: {exc}", file=sys.stderr)
            return 2
        if not checks:
            print(f"kvdir check-config: no kvdir service in {compose}", file=sys.stderr)
            return 2
    if role is not None:
        checks["(command line)"] = (role, list(rest), {k: v for k, v in os.environ.items() if k.startswith("KVDIR_")})
    failed = 0
    for name, (role, cmd_args, env) in checks.items():
        problems = check(role, cmd_args, env)
        if problems:
            failed += 1
            for pr in problems:
                print(f"{name} (kvdir {role}): {pr}", file=sys.stderr)
        else:
            print(f"ok: {name} (kvdir {role})")
    if compose is not None:
        for pr in compose_auth_problems({k: v for k, v in checks.items() if k != "(command line)"}):
            failed += 1
            print(f"{compose}: {pr}", file=sys.stderr)
    return 2 if failed else 0
