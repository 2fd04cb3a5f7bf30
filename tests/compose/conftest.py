"""The shipped docker-compose clusters, each brought up once for its test module: docker-compose.yml as docs/deployment.md
runs it (test_cluster.py), and with deploy/docker-compose.vllm.yml on vLLM's CPU build (test_vllm.py); both
plus tests/compose/expose.yml (each replica's REST port on an ephemeral loopback port, for inspection).

Run by `make test-compose` (tests/compose/run.sh), which provides Docker, the image and deploy/secrets/;
`make test` does not collect this directory. Containers run under a project name of their own, so a
cluster the user runs beside it is left alone, and the gateway is published on a free loopback port.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvdir.local_cluster import free_ports
from tests.support.wait import wait_for

ROOT = Path(__file__).resolve().parents[2]
SECRETS = ROOT / "deploy" / "secrets"
STUBS = ("docker-compose.yml", "tests/compose/expose.yml")
REPLICAS = ("dir1", "dir2", "dir3")
WORKERS = ("worker1", "worker2", "worker3", "worker4")
SERVICES = (*REPLICAS, *WORKERS, "gateway")
MODEL = "kvdir-stub"
UP_DEADLINE_S = 240.0
WAIT_S = 60.0  # what the compose tests wait for at most, unless a step says otherwise


@dataclass
class ComposeCluster:
    """One compose project: commands, container names, the published URLs and the tokens."""

    command: list[str]
    files: tuple[str, ...]
    project: str
    gateway_url: str
    env: dict[str, str] = field(default_factory=dict)

    def compose(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        files = [a for f in self.files for a in ("-f", str(ROOT / f))]
        return subprocess.run(
            [*self.command, "-p", self.project, *files, *args],
            cwd=ROOT,
            env=self.env,
            check=check,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def container(self, service: str) -> str:
        out = self.compose("ps", "-q", service).stdout.split()
        assert out, f"no container for {service}"
        return out[0]

    def inspect(self, service: str) -> dict[str, Any]:
        out = subprocess.run(["docker", "inspect", self.container(service)], check=True, capture_output=True, text=True)
        return json.loads(out.stdout)[0]

    def health(self, service: str) -> str:
        state = self.inspect(service)["State"]
        return state.get("Health", {}).get("Status", state["Status"])

    def health_report(self, service: str) -> str:
        """The service's state, restarts and its last health probes' exit codes and output: what a
        timed-out wait shows, so a CI log says which service failed and why."""
        info = self.inspect(service)
        state = info["State"]
        probes = [
            f"exit {p.get('ExitCode')}: {str(p.get('Output', '')).strip()[:200]}"
            for p in state.get("Health", {}).get("Log", [])[-3:]
        ]
        return (
            f"{service}: {state.get('Health', {}).get('Status', state['Status'])}, "
            f"restarts {info.get('RestartCount', 0)}, last probes {probes}"
        )

    def wait_healthy(self, services: tuple[str, ...] = SERVICES, timeout: float = UP_DEADLINE_S) -> None:
        try:
            wait_for(
                lambda: all(self.health(s) == "healthy" for s in services),
                what=f"{', '.join(services)} healthy",
                timeout=timeout,
                interval=1.0,
            )
        except AssertionError as exc:
            report = []
            for s in services:
                try:
                    report.append(self.health_report(s))
                except (subprocess.CalledProcessError, AssertionError, KeyError) as why:
                    report.append(f"{s}: no report ({why})")
            raise AssertionError(f"{exc}\n" + "\n".join(report)) from None

    def replica_url(self, service: str) -> str:
        host, port = self.compose("port", service, "8101").stdout.strip().rsplit(":", 1)
        return f"http://{host}:{port}"

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", service).stdout

    def down_leaves_nothing(self) -> None:
        """`compose down -v`, then no container, volume or network of this project is left."""
        self.compose("down", "-v", "--remove-orphans", "--timeout", "5")
        label = f"label=com.docker.compose.project={self.project}"
        for kind in (["ps", "-a"], ["volume", "ls"], ["network", "ls"]):
            left = subprocess.run(["docker", *kind, "-q", "--filter", label], check=True, capture_output=True, text=True)
            assert left.stdout.strip() == "", f"docker {' '.join(kind)}: {left.stdout}"

    def exec_python(self, service: str, code: str) -> str:
        """Run `code` with the container's Python (inside its network namespace); its stdout."""
        return self.compose("exec", "-T", service, "python", "-c", code).stdout


def token(name: str) -> str:
    return (SECRETS / f"{name}.token").read_text().strip()


def _compose_command() -> list[str]:
    if os.environ.get("KVDIR_COMPOSE"):
        return shlex.split(os.environ["KVDIR_COMPOSE"])
    if subprocess.run(["docker", "compose", "version"], check=False, capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"]


@contextmanager
def compose_up(files: tuple[str, ...], services: tuple[str, ...], **variables: str) -> Iterator[ComposeCluster]:
    """`compose up -d` of `files` under a fresh project name, every one of `services` healthy; `down -v` at exit."""
    if subprocess.run(["docker", "info"], check=False, capture_output=True).returncode != 0:
        pytest.fail("no Docker daemon answers: run these tests with `make test-compose`, which starts one")
    if not (SECRETS / "auth_tokens").exists():
        pytest.fail("deploy/secrets/ has no secrets: run deploy/secrets/generate.sh (make test-compose does)")
    port = free_ports(1)[0]
    env = {**os.environ, **variables, "KVDIR_GATEWAY_PUBLISH": f"127.0.0.1:{port}"}
    c = ComposeCluster(_compose_command(), files, f"kvdirtest{uuid.uuid4().hex[:8]}", f"http://127.0.0.1:{port}", env)
    try:
        c.compose("up", "-d", "--no-build", timeout=UP_DEADLINE_S)
        c.wait_healthy(services)
        yield c
    finally:
        if c.compose("ps", "-q", check=False).stdout.strip():
            print(c.compose("logs", "--no-color", "--tail", "30", check=False).stdout[-20000:])
        c.compose("down", "-v", "--remove-orphans", "--timeout", "5", check=False)


@pytest.fixture(scope="module")
def cluster() -> Iterator[ComposeCluster]:
    with compose_up(STUBS, SERVICES) as c:
        yield c
