"""docker-compose.yml through the real `kvdir check-config` process, and deploy/secrets/generate.sh run by sh.

The static checks (no processes) are in tests/unit/test_deployment.py.
"""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys

import pytest
import yaml

from directory.auth import load_tokens
from kvdir.check_config import check, compose_auth_problems, compose_services
from tests.support.deployment import COMPOSE, SECRETS, stand_in_services


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    return stand_in_services(tmp_path_factory.mktemp("secrets"))


def test_every_service_passes_check_config(services) -> None:
    assert services, "no kvdir service found"
    for name, (role, args, env) in services.items():
        assert check(role, args, env) == [], name
    out = subprocess.run(
        [sys.executable, "-m", "kvdir", "check-config", "--compose", str(COMPOSE)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("ok: ") == len(services)


def test_check_config_catches_a_client_without_a_token(tmp_path) -> None:
    broken = yaml.safe_load(COMPOSE.read_text())
    del broken["services"]["worker3"]["environment"]["KVDIR_DIRECTORY_TOKEN_FILE"]
    del broken["services"]["dir2"]["environment"]["KVDIR_AUTH_TOKENS_FILE"]
    path = tmp_path / "compose.yml"
    path.write_text(yaml.safe_dump(broken))
    stand_in = tmp_path / "s"
    stand_in.write_text("x")
    problems = compose_auth_problems(compose_services(path, stand_in))
    assert len(problems) == 2 and problems[0].startswith("dir2:") and problems[1].startswith("worker3:"), problems
    out = subprocess.run(
        [sys.executable, "-m", "kvdir", "check-config", "--compose", str(path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "worker3: no directory token file" in out.stderr, out.stderr


def test_generate_secrets_script(tmp_path, services) -> None:
    """deploy/secrets/generate.sh writes every file the compose secrets name, consistent with each other."""
    script = tmp_path / "secrets" / "generate.sh"
    script.parent.mkdir()
    shutil.copy(SECRETS / "generate.sh", script)
    node_ids = [env["KVDIR_NODE_ID"] for role, _, env in services.values() if role == "worker"]
    subprocess.run(["sh", str(script), *node_ids], check=True, capture_output=True, timeout=60)
    d = script.parent
    assert stat.S_IMODE(d.stat().st_mode) == 0o700  # the files are 0644 for the containers' user; the directory guards them
    table = load_tokens(d / "auth_tokens")
    assert len(table) == 2 + len(node_ids)

    def principal(name: str):
        return table.find((d / name).read_text().strip().encode())

    assert principal("admin.token").role == "admin" and principal("gateway.token").role == "gateway"
    for node_id in node_ids:
        engine = principal(f"{node_id}.token")
        assert engine.role == "engine" and engine.may_write(node_id)
        assert not any(engine.may_write(other) for other in node_ids if other != node_id)
    assert len((d / "raft_password").read_text().strip()) >= 40
    tokens = {(d / f"{n}.token").read_text() for n in [*node_ids, "admin", "gateway"]}
    assert len(tokens) == len(node_ids) + 2
