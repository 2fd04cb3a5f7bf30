"""The roles `kvdir` runs, in one table, and how a role's settings are read from flags and the environment.

`kvdir ROLE`, `kvdir check-config` and `kvdir up` (through the command lines it
starts) all read settings here, so a configuration that checks is the one that runs.

Every setting NAME of a role is read from, first to last:
  `--NAME` (a flag), `KVDIR_<ROLE>_<NAME>` (this role only), `KVDIR_<NAME>` (any role), the default.
The role-prefixed variable lets one environment hold, say, the gateway's and a worker's
`HTTP` apart (`KVDIR_GATEWAY_HTTP`, `KVDIR_WORKER_HTTP`).
"""

from __future__ import annotations

import argparse
import importlib
import typing
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pydantic_settings import BaseSettings, EnvSettingsSource

ENV_PREFIX = "KVDIR_"


@dataclass(frozen=True)
class Role:
    """One `kvdir ROLE` subcommand: its settings and the function that runs it until SIGINT/SIGTERM.

    Both are named, not imported: a process that runs one role (a replica, a worker) imports only that role's
    settings, which is a tenth of a second of CPU less per start."""

    name: str
    help: str
    settings_class: str  # "module:Class", a pydantic-settings class
    entry: str  # "module:function"; the function takes the settings and returns None or an exit status

    @cached_property
    def settings(self) -> type[BaseSettings]:
        module, name = self.settings_class.split(":")
        cls: type[BaseSettings] = getattr(importlib.import_module(module), name)
        return cls

    @property
    def env_prefix(self) -> str:
        """The prefix of the variables only this role reads (they win over plain `KVDIR_*` ones)."""
        return f"{ENV_PREFIX}{self.name.upper()}_"

    def env_field(self, key: str) -> str | None:
        """The setting an environment variable gives this role, or None when it gives none."""
        for prefix in (self.env_prefix, ENV_PREFIX):
            if key.startswith(prefix) and key[len(prefix) :].lower() in self.settings.model_fields:
                return key[len(prefix) :].lower()
        return None


ROLES: dict[str, Role] = {
    r.name: r
    for r in (
        Role("directory", "run one directory replica", "directory.config:DirectorySettings", "directory.server:serve"),
        Role("gateway", "run the OpenAI-compatible affinity gateway", "gateway.config:GatewaySettings", "gateway.server:serve"),
        Role(
            "worker",
            "run one worker stub (a stand-in GPU engine)",
            "worker_stub.config:WorkerSettings",
            "worker_stub.server:serve",
        ),
        Role(
            "events",
            "feed the directory from one vLLM/SGLang engine's KV-cache events (ZMQ)",
            "adapters.config:EventsSettings",
            "adapters.subscriber:serve",
        ),
        Role(
            "up",
            "start a local cluster on loopback: directory replicas, worker stubs, gateway",
            "kvdir.launcher:UpSettings",
            "kvdir.launcher:run_up",
        ),
    )
}


def choices(annotation: Any) -> tuple[str, ...] | None:
    """The valid values of a `Literal[...]` setting (also inside `X | None`), else None."""
    if typing.get_origin(annotation) is typing.Literal:
        return tuple(str(a) for a in typing.get_args(annotation))
    for arg in typing.get_args(annotation):
        found = choices(arg)
        if found is not None:
            return found
    return None


def add_settings_flags(parser: argparse.ArgumentParser, role: Role) -> None:
    """One flag per settings field; defaults stay None so that env vars and defaults apply."""
    for name, field in role.settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        env = f"{role.env_prefix}{name.upper()} or {ENV_PREFIX}{name.upper()}"
        help_text = f"{field.description or ''} [env {env}; default {field.default}]"
        if field.annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            continue
        valid = choices(field.annotation)
        # Choices are shown, not enforced, here: the settings class validates flags and env alike, with one message.
        metavar = "{" + ",".join(valid) + "}" if valid else name.split("_")[-1].upper()
        parser.add_argument(flag, dest=name, default=None, metavar=metavar, help=help_text)


def build_settings(role: Role, args: argparse.Namespace) -> Any:
    """The role's settings: flags given in `args`, then `KVDIR_<ROLE>_*`, then `KVDIR_*`, then defaults."""
    cls = role.settings
    given = {k: v for k, v in vars(args).items() if k in cls.model_fields and v is not None}
    role_env = EnvSettingsSource(cls, env_prefix=role.env_prefix)()
    return cls(**{**role_env, **given})
