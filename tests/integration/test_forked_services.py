"""The suite's services forked from a preloaded interpreter (tests/support/forked.py) behave as processes started with
`python -m kvdir` do: the same exit status and message for a bad flag or setting, their own environment and working
directory as of their start, their own log, the same answer to signals."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from kvdir import local_cluster
from kvdir.local_cluster import Child, Cluster, free_ports, write_raft_password
from tests.support import forked
from tests.support.wait import wait_for

Spawn = Callable[[Sequence[str], Path], Child]
SPAWNERS = {"forked": forked.spawn, "exec": local_cluster.popen}
KVDIR = [sys.executable, "-m", "kvdir"]


@pytest.fixture(params=sorted(SPAWNERS))
def spawn(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Spawn:
    """Each test with both ways of starting a service (also as `local_cluster`'s, for the clusters it starts)."""
    chosen = SPAWNERS[request.param]
    monkeypatch.setattr(local_cluster, "spawn", chosen)
    return chosen


def _directory(tmp_path: Path, data_dir: str) -> list[str]:
    http, raft = free_ports(2)
    password = write_raft_password(tmp_path / "secrets")
    return [
        *KVDIR,
        "directory",
        *("--http", f"127.0.0.1:{http}", "--raft", f"127.0.0.1:{raft}", "--peers", ""),
        *("--data-dir", data_dir, "--raft-password-file", str(password)),
    ]


def test_a_forked_service_is_a_forked_process_and_others_are_not(tmp_path: Path) -> None:
    """Only `python -m kvdir ...` is forked: a command with a prefix (a network namespace's) runs as it is."""
    child = forked.spawn([*KVDIR, "directory", "--bogus"], tmp_path / "a.log")
    plain = forked.spawn(["true"], tmp_path / "b.log")
    assert isinstance(child, forked.Forked)
    assert isinstance(plain, subprocess.Popen)
    assert (child.wait(30), plain.wait(30)) == (2, 0)


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        (["--bogus"], {}, "unrecognized arguments: --bogus"),
        ([], {"KVDIR_LEASE_TTL_S": "-7"}, "invalid setting --lease-ttl-s"),
    ],
)
def test_a_bad_flag_or_setting_ends_it_as_it_ends_a_plain_process(
    spawn: Spawn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str], env: dict[str, str], message: str
) -> None:
    """The setting is set after the fork server started (by the first test here, or any earlier one): the child
    reads the environment of its own start, not the server's."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    log = tmp_path / "directory.log"
    child = spawn([*_directory(tmp_path, str(tmp_path / "data")), *flags], log)
    try:
        assert child.wait(30) == 2
    finally:
        child.kill()  # if it started after all
    assert child.returncode == 2 and child.poll() == 2
    assert message in log.read_text()


def test_it_runs_in_the_working_directory_of_its_start(spawn: Spawn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    child = spawn(_directory(tmp_path, "relative-data"), tmp_path / "directory.log")
    try:
        wait_for(lambda: (tmp_path / "relative-data").is_dir(), 30, what="the data dir under the start's cwd")
    finally:
        child.kill()
        child.wait(10)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_signal_ends_a_running_service_as_it_ends_a_plain_one(spawn: Spawn, tmp_path: Path, sig: signal.Signals) -> None:
    cluster = Cluster(
        tmp_path, *([p] for p in free_ports(2)), raft_password_file=write_raft_password(tmp_path / "s"), log_level="info"
    )
    try:
        cluster.start()
        cluster.wait_ready(60)
        child = cluster.procs[0]
        assert child is not None
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(0.1)
        assert child.poll() is None
        child.send_signal(sig)
        assert child.wait(10) == -sig
        assert "Uvicorn running on" in cluster.log_path(0).read_text()
    finally:
        cluster.stop()
