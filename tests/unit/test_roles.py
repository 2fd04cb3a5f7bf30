"""The role table: choices from the registries, and the per-role environment variables."""

from __future__ import annotations

import argparse
from typing import get_args

import pytest

from gateway import config as gateway_config
from gateway.policy import POLICIES
from kvdir import launcher
from kvdir.check_config import check
from kvdir.cli import _parser, main
from kvdir.roles import ENV_PREFIX, ROLES, build_settings, choices
from kvproto.logs import LogLevel
from kvtransfer.backends import ENGINES
from worker_stub import config as worker_config


def test_choices_are_the_registries() -> None:
    assert set(get_args(gateway_config.PolicyName)) == set(POLICIES)
    assert set(get_args(worker_config.TransferName)) == set(ENGINES)
    # Every role (and `kvdir up`) takes the same log levels: kvproto.logs.LogLevel.
    assert {role.settings.model_fields["log_level"].annotation for role in ROLES.values()} == {LogLevel}
    assert choices(launcher.UpSettings.model_fields["policy"].annotation) == get_args(gateway_config.PolicyName)


@pytest.mark.parametrize(
    ("role", "args", "env", "bad"),
    [
        ("gateway", ["--policy", "kvdri"], {}, "'round_robin'"),
        ("gateway", [], {"KVDIR_POLICY": "kvdri"}, "'local_only'"),
        ("worker", ["--transfer", "rdma"], {}, "'mooncake' or 'tcp'"),
        ("up", ["--worker-transfer", "rdma"], {}, "'mooncake' or 'tcp'"),
        ("up", [], {"KVDIR_UP_POLICY": "kvdri"}, "'kvdir'"),
        ("directory", ["--log-level", "verbose"], {}, "'debug'"),
    ],
)
def test_a_choice_outside_the_registry_fails_check_config_naming_the_valid_ones(role, args, env, bad) -> None:
    problems = check(role, args, env)
    assert len(problems) == 1 and bad in problems[0], problems


def test_help_lists_the_choices(capsys) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["gateway", "--help"])
    out = capsys.readouterr().out
    assert "{" + ",".join(POLICIES) + "}" in out and "KVDIR_GATEWAY_POLICY" in out


def test_the_cli_refuses_an_unknown_choice(capsys) -> None:
    assert main(["worker", "--transfer", "rdma"]) == 2
    assert "--transfer" in capsys.readouterr().err


def test_role_prefixed_variables_win_over_plain_ones_and_flags_over_both(monkeypatch) -> None:
    monkeypatch.setenv("KVDIR_HTTP", "127.0.0.1:9000")
    monkeypatch.setenv("KVDIR_GATEWAY_HTTP", "127.0.0.1:9001")
    monkeypatch.setenv("KVDIR_WORKER_POLICY", "round_robin")  # not a worker setting, and no gateway one
    ns = argparse.Namespace()
    assert build_settings(ROLES["gateway"], ns).http == "127.0.0.1:9001"
    assert build_settings(ROLES["gateway"], ns).policy == "kvdir"
    assert build_settings(ROLES["worker"], ns).http == "127.0.0.1:9000"
    assert build_settings(ROLES["gateway"], argparse.Namespace(http="127.0.0.1:9002")).http == "127.0.0.1:9002"


def test_check_config_knows_role_prefixed_variables() -> None:
    assert check("gateway", [], {"KVDIR_GATEWAY_POLICY": "round_robin", "KVDIR_GATEWAY_HTTP": "127.0.0.1:9"}) == []
    assert check("gateway", [], {"KVDIR_WORKER_HTTP": "127.0.0.1:9"}) == ["KVDIR_WORKER_HTTP: not a setting of `kvdir gateway`"]


def test_role_prefixed_names_cannot_collide() -> None:
    """A role's KVDIR_<ROLE>_<NAME> is no other role's plain name, except `kvdir up`'s worker_* settings,
    which are the same settings of the workers it starts."""
    plain = {f"{ENV_PREFIX}{f.upper()}": (r.name, f) for r in ROLES.values() for f in r.settings.model_fields}
    for role in ROLES.values():
        for name in role.settings.model_fields:
            other = plain.get(f"{role.env_prefix}{name.upper()}")
            assert other is None or other == ("up", f"{role.name}_{name}"), (role.name, name, other)
