"""The README's configuration tables list every setting, so docs cannot drift from the code."""

from __future__ import annotations

from pathlib import Path

import pytest

from directory.config import DirectorySettings
from engines.config import EventsSettings
from gateway.config import GatewaySettings
from kvdir.launcher import UpSettings
from worker_stub.config import WorkerSettings

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


@pytest.mark.parametrize("cls", [DirectorySettings, EventsSettings, GatewaySettings, UpSettings, WorkerSettings])
def test_every_setting_is_documented_with_flag_and_env(cls) -> None:
    for name in cls.model_fields:
        flag = "--" + name.replace("_", "-")
        env = "KVDIR_" + name.upper()
        assert f"| `{flag}` | `{env}` |" in README, f"{cls.__name__}.{name} is missing from README.md"


def test_role_prefixed_variables_are_documented() -> None:
    from kvdir.roles import ROLES

    for role in ROLES.values():
        assert f"`{role.env_prefix}*`" in README, f"README.md does not name {role.env_prefix}* (kvdir {role.name})"


def test_readme_starts_with_the_two_commands() -> None:
    head = README[:600]
    assert "make run" in head and "make test" in head
