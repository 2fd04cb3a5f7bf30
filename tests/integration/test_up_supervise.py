"""`kvdir up` without `--auth`, end to end: Raft still gets a fresh per-cluster password (only its path on
command lines), and a process that dies is restarted with its log's tail on stderr instead of the
whole cluster being stopped."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.launcher import Up
from tests.support.ports import free_base_port, port_free
from tests.support.wait import wait_for

PORTS = (0, 1, 2, 3, 101, 102, 103, 11, 12)  # gateway, replicas' HTTP and Raft, two workers


def started_by(launcher: Up) -> dict[str, tuple[int, list[str]]]:
    """The launcher's own children by the address they serve on: pid and argv (forked helpers are grandchildren)."""
    out = {}
    for pid in launcher.children():
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue  # exited meanwhile
        if ppid == launcher.proc.pid and "--http" in argv:
            out[argv[argv.index("--http") + 1]] = (pid, argv)
    return out


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Up, Path, Path, dict]]:
    tmp = tmp_path_factory.mktemp("up-supervise")
    base = free_base_port(PORTS)
    data_dir, stderr = tmp / "up", tmp / "up.stderr"
    launcher = Up(
        [
            "--base-port",
            str(base),
            "--data-dir",
            str(data_dir),
            "--workers",
            "2",
            "--worker-time-scale",
            "0.1",
            "--worker-transfer",
            "tcp",
            "--lease-ttl-s",
            "30",
            "--log-level",
            "info",
        ],
        stderr,
    )
    try:
        wait_for(
            lambda: launcher.lines or launcher.proc.poll() is not None, timeout=120, interval=0.2, what="kvdir up to be ready"
        )
        assert launcher.lines, stderr.read_text()
        yield launcher, data_dir, stderr, json.loads(launcher.lines[0])
    finally:
        launcher.stop()
        assert not any(Path(f"/proc/{pid}").exists() for pid in launcher.started)
        assert all(port_free(base + d) for d in PORTS)


def test_kvdir_up_without_auth_still_gives_raft_a_password(up: tuple[Up, Path, Path, dict]) -> None:
    launcher, data_dir, _, ready = up
    secrets_dir = data_dir / "secrets"
    password = secrets_dir / "raft_password"
    assert stat.S_IMODE(secrets_dir.stat().st_mode) == 0o700 and stat.S_IMODE(password.stat().st_mode) == 0o600
    assert sorted(p.name for p in secrets_dir.iterdir()) == ["raft_password"]  # no tokens: auth is off
    secret = password.read_text().strip()
    assert len(secret) >= 40
    replicas = [argv for _, argv in started_by(launcher).values() if "directory" in argv]
    assert len(replicas) == 3
    for argv in replicas:
        assert argv[argv.index("--raft-password-file") + 1] == str(password)
    for pid in [launcher.proc.pid, *launcher.children()]:
        blob = Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/environ").read_bytes()
        assert secret.encode() not in blob

    # The replicas share it: they elected a leader that every one of them follows. Not necessarily the one `kvdir up`
    # reported: on a loaded machine (the parallel pass) a later election may have moved it, which is no fault here.
    def one_leader() -> bool:
        leaders = {httpx.get(url + "/v1/cluster", timeout=5).json()["leader_url"] for url in ready["replicas"]}
        return len(leaders) == 1 and leaders <= set(ready["replicas"])

    wait_for(one_leader, what="every replica following one leader")


def test_kvdir_up_says_its_progress_while_it_starts(up: tuple[Up, Path, Path, dict]) -> None:
    """Off a terminal, one line per step with the seconds since the launch, in start-up order."""
    _, data_dir, stderr, ready = up
    leader = ready["replicas"].index(ready["leader"]) + 1
    steps = [
        f"starting 3 directory replicas; logs in {data_dir}",
        "replicas 3/3 up",
        f"leader elected: replica {leader} ({ready['leader']})",
        "starting 2 worker stubs",
        "workers 2/2 registered",
        "starting the gateway",
        "gateway ready",
        "cluster ready in ",
    ]
    said = [m.groups() for m in re.finditer(r"^\[ *(\d+\.\d)s\] (.*)$", stderr.read_text(), re.MULTILINE)]
    at = [next(i for i, (_, text) in enumerate(said) if text.startswith(step)) for step in steps]
    assert at == sorted(at), said
    seconds = [float(t) for t, _ in said]
    assert seconds == sorted(seconds) and seconds[-1] > 0, said


def test_kvdir_up_restarts_a_killed_replica_worker_and_gateway(up: tuple[Up, Path, Path, dict]) -> None:
    launcher, data_dir, stderr, ready = up
    leader = ready["leader"]
    n = ready["replicas"].index(leader) + 1
    victims = {
        f"replica {n}": (leader, data_dir / f"replica{n}.log"),  # the leader: the others must elect a new one
        "worker-1": (ready["workers"][0], data_dir / "worker-1.log"),
        "gateway": (ready["gateway"], data_dir / "gateway.log"),
    }
    before = started_by(launcher)
    old_pid = {name: before[url.removeprefix("http://")][0] for name, (url, _) in victims.items()}
    last_line = {}
    for name, (_, log) in victims.items():
        last_line[name] = log.read_text().strip().splitlines()[-1]  # read just before the kill, so among the last 20
        os.kill(old_pid[name], signal.SIGKILL)
    t0 = time.monotonic()

    def restarted() -> dict[str, int]:
        now = started_by(launcher)
        pids = {name: now.get(url.removeprefix("http://"), (0, []))[0] for name, (url, _) in victims.items()}
        return pids if all(pid not in (0, old_pid[name]) for name, pid in pids.items()) else {}

    new_pid = wait_for(restarted, timeout=30, what="new processes in place of the killed ones")
    t_restart = time.monotonic() - t0

    def agreed_leader() -> str | None:
        leaders = {httpx.get(url + "/v1/cluster", timeout=2).json()["leader_url"] for url in ready["replicas"]}
        return leaders.pop() if len(leaders) == 1 and None not in leaders else None

    wait_for(agreed_leader, timeout=60, what="every replica, the restarted one too, to follow one leader")
    t_leader = time.monotonic() - t0
    wait_for(
        lambda: httpx.get(ready["workers"][0] + "/health", timeout=2).json().get("epoch"),
        timeout=60,
        what="the restarted worker to register again",
    )
    wait_for(
        lambda: httpx.get(ready["gateway"] + "/health", timeout=2).json().get("engines") == 2,
        timeout=60,
        what="the restarted gateway to know both engines",
    )
    t_all = time.monotonic() - t0
    print(
        f"after SIGKILL: new pids in {t_restart:.2f}s, one leader in {t_leader:.2f}s, worker and gateway serving in {t_all:.2f}s"
    )

    assert launcher.proc.poll() is None
    log = stderr.read_text()
    for name, (_, path) in victims.items():
        assert f"{name} (pid {old_pid[name]}) was killed by SIGKILL; restarting it in 0.5s. Last lines of {path}:" in log, log
        assert last_line[name] in log, (name, last_line[name])  # its log's tail
        assert f"{name} restarted (pid {new_pid[name]})" in log, log
    assert "a process exited" not in log
