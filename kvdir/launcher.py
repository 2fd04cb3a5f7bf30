"""`kvdir up`: a local cluster on loopback, each component in its own process.

Over 400 lines: `kvdir up`'s settings, the three kinds of child processes, their supervisor and the
start-up sequence, which one command drives together.

Replica i (1-based) serves HTTP on base_port+i and Raft on base_port+100+i; with `--shards N`
(docs/scale-out.md) replica i of shard k (0-based, named sk) serves on base_port+200k+i and
base_port+200k+100+i, so shard s0 keeps the unsharded ports.
Once every shard has a leader it prints one JSON line `{"ready": true, ...}` on
stdout, optionally drives a demo, and keeps the cluster up until SIGINT or
SIGTERM, restarting any process that dies (with backoff, its log's tail on
stderr); then it stops every process it started, whatever happened.

Before it starts anything it checks every port it will bind, and refuses with the holder of a taken
one; while it starts it says its progress on stderr (kvdir.progress), and counts only answers from
the processes it started (kvdir.listeners): another cluster on the same ports once passed for this
one. A process that dies while starting ends the launch with its log's tail on stderr; a temporary
DATA_DIR that holds the log of a process that died is kept, and its path said. Ctrl-C while
starting stops what was started and exits 130.

It always writes a fresh Raft password into DATA_DIR/secrets (mode 0600): without
one pysyncobj unpickles whatever reaches a Raft port. With `auth` it also writes
fresh random tokens there and hands every process the path of its own: the
replicas' tokens file, one engine token per worker confined to its node id, a
read-only token for the gateway. Only paths go on command lines, which `ps`
shows to every user of the machine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import cast
from urllib.parse import urlsplit

import httpx
from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gateway.config import PolicyName
from kvdir.listeners import listens, taken_ports
from kvdir.progress import Progress, StartState, on_terminal
from kvproto.addresses import is_wildcard
from kvproto.logs import LogLevel
from kvtransfer.backends import mooncake_rpc_ports
from worker_stub.config import TransferName

log = logging.getLogger("kvdir.up")

MAX_UP_SHARDS = 16
SHARD_PORT_STRIDE = 200


class UpSettings(BaseSettings):
    """The local cluster (`kvdir up`)."""

    model_config = SettingsConfigDict(env_prefix="KVDIR_", extra="forbid")

    host: str = Field("127.0.0.1", description="address every component binds to (keep it on loopback)")
    base_port: int = Field(
        8100, ge=1, le=65000, description="the gateway serves on BASE_PORT, replica i on BASE_PORT+i (Raft BASE_PORT+100+i)"
    )
    replicas: int = Field(3, ge=1, le=7, description="directory replicas to start (of each shard)")
    shards: int = Field(
        1,
        ge=1,
        le=MAX_UP_SHARDS,
        description="directory shards, Raft groups of --replicas replicas each (docs/scale-out.md); shard k's "
        "replica i serves on BASE_PORT+200k+i (Raft +100); 1: one unsharded group",
    )
    data_dir: Path | None = Field(
        None, description="where replicas keep state and logs (default: a temporary directory removed on exit)"
    )
    lease_ttl_s: float = Field(10.0, gt=0.2, description="node lease TTL of the directory")
    log_level: LogLevel = Field("warning", description="log level of the started processes (their logs go to DATA_DIR/*.log)")
    ready_timeout_s: float = Field(60.0, gt=0, description="give up if no leader is elected within this time")
    workers: int = Field(4, ge=0, le=64, description="worker stubs to start; worker i serves HTTP on BASE_PORT+10+i")
    worker_capacity_blocks: int = Field(4096, ge=1, description="KV slots of each worker stub")
    worker_time_scale: float = Field(1.0, ge=0, description="time scale of the workers' simulated prefill and decode")
    worker_transfer: TransferName = Field("mooncake", description="transfer engine of the workers: mooncake or tcp")
    gateway: bool = Field(True, description="start the gateway on BASE_PORT")
    policy: PolicyName = Field("kvdir", description="routing policy of the gateway")
    demo: bool = Field(False, description="after start-up, drive a short demo workload and print what it did")
    demo_and_exit: bool = Field(False, description="run the demo, then stop everything and exit 0")
    auth: bool = Field(
        False,
        description="directory auth: fresh random tokens in DATA_DIR/secrets (mode 0600); "
        "the Raft password there is written with or without it",
    )

    @field_validator("host")
    @classmethod
    def _not_a_wildcard(cls, v: str) -> str:
        # Every component also advertises this address to the others (and workers their transfer ports).
        if is_wildcard(v):
            raise ValueError(f"give one address to bind and advertise, not the wildcard {v!r} (e.g. 127.0.0.1)")
        return v

    @model_validator(mode="after")
    def _ports_exist(self) -> UpSettings:
        top = max(port for port, _ in up_ports(self))
        if top > 65535:
            raise ValueError(f"--base-port {self.base_port} with {self.shards} shards needs port {top}: choose a lower one")
        if clash := mooncake_clashes(self):
            port, what = clash[0]
            raise ValueError(
                f"--base-port {self.base_port} puts the {what} on port {port}, in the range the workers' Mooncake "
                f"engines bind in at random ({_range_text(mooncake_rpc_ports())}): choose another base port"
            )
        return self


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


PORT_RANGE: tuple[int, int] | None = None
"""Where `free_ports` picks: None for 10000 up to the kernel's ephemeral range. Processes that start servers
side by side (the test suite's parallel workers, tests/conftest.py) each set a range of their own: a port one
of them picked but has not bound yet is then never the other's pick."""


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports that were free a moment ago, below the kernel's ephemeral range (or in `PORT_RANGE`),
    outside the range a Mooncake transfer engine binds in at random (`kvtransfer.backends.mooncake_rpc_ports`).

    Not port 0's pick: that comes from the ephemeral range, where any outgoing connection on the
    machine can be given the port as its source port before the server binds it, and a Raft link
    that does so holds it for good. That was the suspected cause of a CI run in which one replica
    never bound its Raft port; below the range no connect() can take it.
    """
    low, high = PORT_RANGE or (10000, _ephemeral_low())
    high = max(high, low + 4 * n)
    mooncake = mooncake_rpc_ports()
    if mooncake.start <= low and high <= mooncake.stop:
        raise ValueError(f"no ports to pick: {low}..{high - 1} lies in Mooncake's ({mooncake.start}..{mooncake.stop - 1})")
    rng = random.SystemRandom()
    ports: list[int] = []
    with _HANDED_OUT_LOCK:
        while len(ports) < n:
            port = rng.randrange(low, high)
            if port in ports or port in _handed_out or port in mooncake:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
            ports.append(port)
        for port in ports:
            _handed_out[port] = None
        while len(_handed_out) > min(_HANDED_OUT_MAX, (high - low) // 2):  # half a range stays to pick from
            del _handed_out[next(iter(_handed_out))]
    return ports


# Ports free_ports gave out lately, never given again while remembered: a port handed to a process
# that has not bound it yet still looks free, and a second caller given it (a test's metrics port
# equal to its engine's ZMQ port) made one of the two fail to bind.
_HANDED_OUT_MAX = 4096
_handed_out: dict[int, None] = {}
_HANDED_OUT_LOCK = threading.Lock()


def worker_node_ids(n: int) -> list[str]:
    """The node ids of n worker stubs started by `Workers`."""
    return [f"worker-{i}" for i in range(1, n + 1)]


def _write_secret(path: Path, text: str) -> None:
    """Write `text` to a fresh file that only its owner can read (never briefly readable by others)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _secrets_dir(directory: Path) -> None:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)


def write_raft_password(directory: Path) -> Path:
    """Write a fresh random Raft password to `directory`/raft_password (dir 0700, file 0600); returns the path.

    Pass the path as `Cluster(raft_password_file=...)`: a cluster without a password accepts
    pickled commands from anyone who reaches a Raft port.
    """
    _secrets_dir(directory)
    path = directory / "raft_password"
    _write_secret(path, secrets.token_urlsafe(32) + "\n")
    return path


@dataclass(frozen=True)
class AuthFiles:
    """The secret files of `kvdir up --auth`: paths only, which may appear on command lines."""

    dir: Path
    tokens: Path  # the replicas' --auth-tokens-file
    raft_password: Path
    admin: Path
    gateway: Path
    engines: dict[str, Path]  # node id -> that worker's engine token

    @classmethod
    def generate(cls, directory: Path, node_ids: Sequence[str]) -> AuthFiles:
        """Fresh secrets in `directory` (mode 0700): one admin, one gateway, one engine token per node id, a Raft password.

        Each engine token may write only its own node (the pattern is the exact
        id), so one compromised worker cannot publish entries for another.
        """
        _secrets_dir(directory)
        files = cls(
            directory,
            directory / "tokens",
            write_raft_password(directory),
            directory / "admin.token",
            directory / "gateway.token",
            {n: directory / f"{n}.token" for n in node_ids},
        )
        lines = ["# role:node pattern:token, written by `kvdir up --auth` (fresh on every start)"]
        for role, pattern, path in [
            ("admin", "*", files.admin),
            ("gateway", "*", files.gateway),
            *(("engine", n, p) for n, p in files.engines.items()),
        ]:
            token = secrets.token_urlsafe(32)
            _write_secret(path, token + "\n")
            lines.append(f"{role}:{pattern}:{token}")
        _write_secret(files.tokens, "\n".join(lines) + "\n")
        return files

    @property
    def replica_args(self) -> list[str]:
        """The replicas' auth flags; the Raft password goes to `Cluster(raft_password_file=...)`."""
        return ["--auth-tokens-file", str(self.tokens)]

    def admin_token(self) -> str:
        return self.admin.read_text().strip()


class ChildExited(RuntimeError):
    """A started process exited while the launcher waited for it to become ready."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.name, self.pid, self.code, self.log = name, proc.pid, cast(int, proc.returncode), log
        super().__init__(f"{name} (pid {proc.pid}) {_exit_reason(self.code)} during start-up; see {log}")


class NotReady(TimeoutError):
    """Start-up timed out; `logs` are those of the processes that were not ready, (name, path) each."""

    def __init__(self, reason: str, logs: Sequence[tuple[str, Path]], see: str) -> None:
        super().__init__(f"{reason}; see {see}")
        self.reason = reason  # without the pointer to the logs, which `kvdir up` may not keep
        self.logs = list(logs)


def _answered_by(proc: subprocess.Popen[bytes] | None, url: str, verified: set[int]) -> bool:
    """Whether what answered at `url` was `proc`, the process started to serve it (as far as /proc can tell).

    Another cluster on the same ports answers as well as this one would: its answers must not count.
    A pid found listening (or one /proc cannot tell about) goes into `verified`, so each is looked up once.
    """
    if proc is None or proc.poll() is not None:
        return False
    if proc.pid in verified:
        return True
    if listens(proc.pid, cast(int, urlsplit(url).port)) is False:
        return False
    verified.add(proc.pid)
    return True


class Cluster:
    """Directory replica processes on one host; `stop()` ends them all (SIGTERM, then SIGKILL)."""

    def __init__(
        self,
        data_dir: Path,
        http_ports: Sequence[int],
        raft_ports: Sequence[int],
        *,
        host: str = "127.0.0.1",
        lease_ttl_s: float = 10.0,
        log_level: str = "warning",
        extra_args: Sequence[str] = (),
        token: str | None = None,
        hosts: Sequence[str] | None = None,
        prefix: Callable[[int], list[str]] | None = None,
        peers: Callable[[int], list[str]] | None = None,
        raft_password_file: Path | None = None,
    ) -> None:
        """`hosts` gives each replica its own address, `prefix(i)` a command prefix and `peers(i)` its
        Raft peers (the fault harness runs replicas in network namespaces or behind link proxies);
        by default all share `host` and each peers with the others' Raft addresses.
        `raft_password_file` (see `write_raft_password`) is passed to every replica."""
        self.data_dir = data_dir
        self.raft_password_file = raft_password_file
        self.token = token  # bearer token for wait_ready when the replicas run with an auth tokens file
        self.lease_ttl_s = lease_ttl_s
        self.log_level = log_level
        self.extra_args = list(extra_args)
        hosts = list(hosts) if hosts is not None else [host] * len(http_ports)
        self.replica_urls = [f"http://{h}:{p}" for h, p in zip(hosts, http_ports)]
        self.raft_addrs = [f"{h}:{p}" for h, p in zip(hosts, raft_ports)]
        self._prefix = prefix
        self._peers = peers
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * len(http_ports)
        self._verified: set[int] = set()  # pids seen listening on their replica's HTTP port

    @classmethod
    def from_settings(cls, s: UpSettings, data_dir: Path, raft_password_file: Path, auth: AuthFiles | None = None) -> Cluster:
        n = range(1, s.replicas + 1)
        return cls(
            data_dir,
            [s.base_port + i for i in n],
            [s.base_port + 100 + i for i in n],
            host=s.host,
            lease_ttl_s=s.lease_ttl_s,
            log_level=s.log_level,
            raft_password_file=raft_password_file,
            extra_args=auth.replica_args if auth else (),
            token=auth.admin_token() if auth else None,
        )

    def log_path(self, i: int) -> Path:
        return self.data_dir / f"replica{i + 1}.log"

    def start(self) -> None:
        for i in range(len(self.procs)):
            self.start_replica(i)

    def start_replica(self, i: int) -> None:
        """Start replica i (0-based) from its data dir; it catches up from the others."""
        raft = self.raft_addrs[i]
        peers = ",".join(self._peers(i) if self._peers else [a for a in self.raft_addrs if a != raft])
        cmd = [
            *(self._prefix(i) if self._prefix else []),
            sys.executable,
            "-m",
            "kvdir",
            "directory",
            "--http",
            self.replica_urls[i].removeprefix("http://"),
            "--raft",
            raft,
            "--peers",
            peers,
            "--data-dir",
            str(self.data_dir / f"replica{i + 1}"),
            "--lease-ttl-s",
            str(self.lease_ttl_s),
            "--log-level",
            self.log_level,
            *(["--raft-password-file", str(self.raft_password_file)] if self.raft_password_file else []),
            *self.extra_args,
        ]
        with open(self.log_path(i), "ab") as logf:
            self.procs[i] = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            if sig == signal.SIGKILL:
                proc.wait()

    def alive(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p is not None and p.poll() is None]

    def wait_ready(
        self, timeout: float, among: Sequence[int] | None = None, progress: Callable[[int, str | None], None] | None = None
    ) -> str:
        """Poll until the running replicas (or `among`) agree on a leader whose URL they know; returns it.

        Only answers from the processes started here count. `progress(up, leader)` is called on every
        poll with how many replicas answered and the leader they agree on, if any.
        """
        end = time.monotonic() + timeout
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        with httpx.Client(timeout=1.0, headers=headers) as http:
            while time.monotonic() < end:
                for i, p in enumerate(self.procs):
                    if p is not None and p.poll() not in (None, -signal.SIGKILL):
                        raise ChildExited(f"replica {i + 1}", p, self.log_path(i))
                leaders: set[str | None] = set()
                up = 0  # replicas that answered, as the processes started here
                for i in self.alive() if among is None else among:
                    try:
                        view = http.get(self.replica_urls[i] + "/v1/cluster").json()
                    except (httpx.HTTPError, ValueError):
                        view = None
                    if view is None or not _answered_by(self.procs[i], self.replica_urls[i], self._verified):
                        leaders.add(None)
                    else:
                        leaders.add(view.get("leader_url"))
                        up += 1
                agreed = next(iter(leaders)) if len(leaders) == 1 else None
                if progress is not None:
                    progress(up, agreed)
                if agreed is not None:
                    return agreed
                time.sleep(0.05)
        logs = [(f"replica {i + 1}", self.log_path(i)) for i in range(len(self.procs))]
        raise NotReady(f"no leader elected within {timeout}s", logs, f"{self.data_dir}/replica*.log")

    def wait_caught_up(self, i: int, timeout: float) -> None:
        """Poll until replica i follows a leader and has applied what that leader had committed when asked."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        with httpx.Client(timeout=1.0, headers=headers) as http:
            target = http.get(self.wait_ready(timeout) + "/v1/cluster").json()["commit_index"]
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                try:
                    view = http.get(self.replica_urls[i] + "/v1/cluster").json()
                    if view["leader_url"] and view["last_applied"] >= target:
                        return
                except (httpx.HTTPError, ValueError):
                    pass  # not listening yet
                time.sleep(0.05)
        raise TimeoutError(f"replica {i} did not catch up within {timeout}s; see {self.data_dir}/replica{i + 1}.log")

    def stop(self, grace: float = 5.0) -> None:
        _stop_all([p for p in self.procs if p is not None], grace)


class Workers:
    """Worker stub processes registered with a directory; `stop()` ends them all."""

    def __init__(
        self,
        data_dir: Path,
        http_ports: Sequence[int],
        directory_urls: Sequence[str],
        *,
        host: str = "127.0.0.1",
        log_level: str = "warning",
        extra_args: Sequence[str] = (),
        token_files: Mapping[str, Path] | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.urls = [f"http://{host}:{p}" for p in http_ports]
        self.node_ids = worker_node_ids(len(http_ports))
        self.directory_urls = list(directory_urls)
        self.log_level = log_level
        self.extra_args = list(extra_args)
        self.token_files = dict(token_files or {})  # node id -> file of its directory token
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * len(http_ports)
        self._verified: set[int] = set()  # pids seen listening on their worker's HTTP port

    def start(self) -> None:
        for i in range(len(self.procs)):
            self.start_worker(i)

    def log_path(self, i: int) -> Path:
        return self.data_dir / f"{self.node_ids[i]}.log"

    def start_worker(self, i: int, *extra: str) -> None:
        token_file = self.token_files.get(self.node_ids[i])
        cmd = [
            sys.executable,
            "-m",
            "kvdir",
            "worker",
            "--node-id",
            self.node_ids[i],
            "--http",
            self.urls[i].removeprefix("http://"),
            "--directory",
            ",".join(self.directory_urls),
            "--log-level",
            self.log_level,
            *(["--directory-token-file", str(token_file)] if token_file else []),
            *self.extra_args,
            *extra,
        ]
        with open(self.log_path(i), "ab") as logf:
            self.procs[i] = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            proc.wait()

    def wait_ready(self, timeout: float, progress: Callable[[int], None] | None = None) -> list[int]:
        """Poll until every worker answers /health with its node id and a directory epoch; returns the epochs.

        Only answers from the processes started here count; `progress(registered)` is called on every poll.
        """
        end = time.monotonic() + timeout
        epochs: list[int | None] = []
        with httpx.Client(timeout=1.0) as http:
            while time.monotonic() < end:
                for i, p in enumerate(self.procs):
                    if p is not None and p.poll() not in (None, -signal.SIGKILL):
                        raise ChildExited(self.node_ids[i], p, self.log_path(i))
                epochs = [self._epoch(http, i) for i in range(len(self.urls))]
                if progress is not None:
                    progress(sum(e is not None for e in epochs))
                if None not in epochs:
                    return cast(list[int], epochs)
                time.sleep(0.05)
        logs = [(node, self.log_path(i)) for i, node in enumerate(self.node_ids) if epochs and epochs[i] is None]
        raise NotReady(f"workers not registered within {timeout}s", logs, f"{self.data_dir}/worker-*.log")

    def _epoch(self, http: httpx.Client, i: int) -> int | None:
        """Worker i's directory epoch if it registered, and answered as the process started here; else None."""
        try:
            health = http.get(self.urls[i] + "/health").json()
        except (httpx.HTTPError, ValueError):
            return None
        if health.get("node_id") != self.node_ids[i] or not _answered_by(self.procs[i], self.urls[i], self._verified):
            return None
        return cast(int | None, health.get("epoch"))

    def stop(self, grace: float = 5.0) -> None:
        _stop_all([p for p in self.procs if p is not None], grace)


class Gateway:
    """One gateway process in front of the workers."""

    def __init__(
        self,
        data_dir: Path,
        port: int,
        directory_urls: Sequence[str],
        *,
        host: str = "127.0.0.1",
        log_level: str = "warning",
        extra_args: Sequence[str] = (),
        token_file: Path | None = None,
    ) -> None:
        self.url = f"http://{host}:{port}"
        self._cmd = [
            sys.executable,
            "-m",
            "kvdir",
            "gateway",
            "--http",
            f"{host}:{port}",
            "--directory",
            ",".join(directory_urls),
            "--log-level",
            log_level,
            *(["--directory-token-file", str(token_file)] if token_file else []),
            *extra_args,
        ]
        self.data_dir = data_dir
        self.log_path = data_dir / "gateway.log"
        self.proc: subprocess.Popen[bytes]
        self._verified: set[int] = set()  # pids seen listening on the gateway's port
        self.start()

    def start(self) -> None:
        """Start the process (again)."""
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(self._cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_ready(self, timeout: float, engines: int, progress: Callable[[], None] | None = None) -> None:
        """Poll until the gateway started here answers and knows `engines` engines; `progress()` on every poll."""
        end = time.monotonic() + timeout
        with httpx.Client(timeout=1.0) as http:
            while time.monotonic() < end:
                if self.proc.poll() is not None:
                    raise ChildExited("gateway", self.proc, self.log_path)
                try:
                    known = http.get(self.url + "/health").json().get("engines", -1)
                except (httpx.HTTPError, ValueError):
                    known = -1
                if known >= engines and _answered_by(self.proc, self.url, self._verified):
                    return
                if progress is not None:
                    progress()
                time.sleep(0.05)
        raise NotReady(f"the gateway was not ready within {timeout}s", [("gateway", self.log_path)], str(self.log_path))

    def stop(self, grace: float = 5.0) -> None:
        _stop_all([self.proc], grace)


def _stop_all(procs: Sequence[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM every process, then SIGKILL those still running after `grace` seconds."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def log_tail(path: Path, lines: int = 20) -> str:
    """The last `lines` lines of a log file, indented (read from its end: logs of long runs grow large)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            tail = f.read().splitlines()[-lines:]
    except OSError as exc:
        return f"  (cannot read {path}: {exc})"
    return "\n".join("  | " + line.decode(errors="replace") for line in tail) if tail else "  (the log is empty)"


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class Supervised:
    """One process `kvdir up` keeps running: how to find it, start it again, and read its log."""

    name: str
    proc: Callable[[], subprocess.Popen[bytes] | None]
    start: Callable[[], None]
    log: Path
    delay_s: float = field(init=False, default=0.0)  # backoff before the next restart, set by the supervisor
    due: float | None = None  # when the pending restart runs
    since: float = field(default_factory=time.monotonic)  # when the running process was started


class Supervisor:
    """Restarts dead processes with exponential backoff, so one crash does not take the cluster down.

    The first restart waits `min_s`, each next one twice as long up to `max_s`; a process that
    stays up for `stable_s` starts again from `min_s`. Every death is logged with the tail of
    the process's log, every restart with the new pid. A restart that fails (the process cannot be
    started: no memory, no file descriptors, its log unwritable) is logged with its traceback and
    tried again after the next backoff: the rest of the cluster keeps running and being supervised.
    """

    def __init__(self, children: Sequence[Supervised], min_s: float = 0.5, max_s: float = 30.0, stable_s: float = 60.0) -> None:
        self.children = list(children)
        self.min_s, self.max_s, self.stable_s = min_s, max_s, stable_s
        self.died: set[str] = set()  # names of the processes that died: their logs are worth keeping
        for c in self.children:
            c.delay_s = min_s

    def tick(self, now: float) -> None:
        """Look at every process once; call it a few times a second."""
        for c in self.children:
            proc = c.proc()
            if proc is None:
                continue
            code = proc.poll()
            if code is None:
                if c.due is not None:  # a restart that raised started it after all
                    c.due, c.since = None, now
                if now - c.since >= self.stable_s:
                    c.delay_s = self.min_s
            elif c.due is None:
                c.due = now + c.delay_s
                self.died.add(c.name)
                log.error(
                    "%s (pid %d) %s; restarting it in %.1fs. Last lines of %s:\n%s",
                    c.name,
                    proc.pid,
                    _exit_reason(code),
                    c.delay_s,
                    c.log,
                    log_tail(c.log),
                )
                c.delay_s = min(2 * c.delay_s, self.max_s)
            elif now >= c.due:
                try:
                    c.start()
                except Exception:  # anything: one process that cannot start must not stop the others' supervision
                    c.due = now + c.delay_s
                    log.exception("%s could not be restarted; trying again in %.1fs", c.name, c.delay_s)
                    c.delay_s = min(2 * c.delay_s, self.max_s)
                    continue
                c.due, c.since = None, now
                restarted = c.proc()
                log.warning("%s restarted (pid %s)", c.name, restarted.pid if restarted else "?")


def _supervisor(clusters: Sequence[Cluster], workers: Workers, gateway: Gateway | None) -> Supervisor:
    # mypy cannot infer the type of a lambda with a default argument (i, bound per child) against a zero-argument
    # Callable, hence the ignores
    children = [
        Supervised(
            replica_name(len(clusters), k, i),
            lambda c=cluster, i=i: c.procs[i],  # type: ignore[misc]
            lambda c=cluster, i=i: c.start_replica(i),  # type: ignore[misc]
            cluster.log_path(i),
        )
        for k, cluster in enumerate(clusters)
        for i in range(len(cluster.procs))
    ]
    children += [
        Supervised(
            node,
            lambda i=i: workers.procs[i],  # type: ignore[misc]
            lambda i=i: workers.start_worker(i),  # type: ignore[misc]
            workers.log_path(i),
        )
        for i, node in enumerate(workers.node_ids)
    ]
    if gateway is not None:
        children.append(Supervised("gateway", lambda: gateway.proc, gateway.start, gateway.log_path))
    return Supervisor(children)


def replica_name(shards: int, shard: int, i: int) -> str:
    """How `kvdir up` names replica i (0-based) of shard `shard` in its messages."""
    return f"replica {i + 1}" if shards == 1 else f"shard s{shard} replica {i + 1}"


def replica_ports(s: UpSettings) -> tuple[list[int], list[int]]:
    """The replicas' HTTP and Raft ports, shard by shard (the order `kvdir.sharded.ShardedCluster` takes them in)."""
    firsts = [s.base_port + SHARD_PORT_STRIDE * k for k in range(s.shards)]
    http = [first + i for first in firsts for i in range(1, s.replicas + 1)]
    return http, [port + 100 for port in http]


def up_ports(s: UpSettings) -> list[tuple[int, str]]:
    """Every port `kvdir up` binds, with what for (the workers' transfer engines pick theirs when they start)."""
    ports = [(s.base_port, "gateway")] if s.gateway else []
    http, raft = replica_ports(s)
    names = [replica_name(s.shards, k, i) for k in range(s.shards) for i in range(s.replicas)]
    ports += [(p, f"{name} HTTP") for p, name in zip(http, names)]
    ports += [(p, f"{name} Raft") for p, name in zip(raft, names)]
    ports += [(s.base_port + 10 + i, f"worker-{i} HTTP") for i in range(1, s.workers + 1)]
    return ports


def mooncake_clashes(s: UpSettings) -> list[tuple[int, str]]:
    """The ports of `up_ports` a worker's Mooncake engine could take first (none with the tcp transfer)."""
    if s.workers == 0 or s.worker_transfer != "mooncake":
        return []
    mooncake = mooncake_rpc_ports()
    return [(port, what) for port, what in up_ports(s) if port in mooncake]


def _range_text(r: range) -> str:
    return f"{r.start}-{r.stop - 1}"


def _free_base_port(s: UpSettings) -> int | None:
    """A base port whose every port `kvdir up` would bind is free now (a suggestion for the clash message)."""
    offsets = [port - s.base_port for port, _ in up_ports(s)]
    for base in free_ports(20, s.host):
        base -= 110  # free_ports' picks lie in 10000..the ephemeral range; the offsets go up to +107 (more with shards)
        ports = [(base + d, "") for d in offsets]
        if (
            base >= 1024
            and not mooncake_clashes(s.model_copy(update={"base_port": base}))
            and not taken_ports(s.host, ports, who=False)
        ):
            return base
    return None


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived while `kvdir up` was starting."""


@dataclass
class _Launch:
    """The processes of one `kvdir up`, as far as it got."""

    clusters: list[Cluster]  # one per shard
    workers: Workers
    gateway: Gateway | None = None

    @property
    def replica_urls(self) -> list[str]:
        """Every replica of every shard (a directory client given them reads the shard map from any one)."""
        return [u for c in self.clusters for u in c.replica_urls]

    def procs(self) -> list[subprocess.Popen[bytes]]:
        procs = [p for c in self.clusters for p in c.procs if p is not None]
        procs += [p for p in self.workers.procs if p is not None]
        return procs + ([self.gateway.proc] if self.gateway else [])

    def stop(self) -> None:
        """Stop everything started, the gateway first: it would only log errors while its engines went."""
        if self.gateway is not None:
            self.gateway.stop()
        self.workers.stop()
        for c in self.clusters:
            c.stop()


def _directory(s: UpSettings, data_dir: Path, raft_password: Path, auth: AuthFiles | None) -> tuple[list[Cluster], Path | None]:
    """The directory's groups, one per shard, and the shard map file (None unsharded: today's single group)."""
    if s.shards == 1:
        return [Cluster.from_settings(s, data_dir, raft_password, auth)], None
    from kvdir.sharded import ShardedCluster  # it builds on this module's Cluster

    http, raft = replica_ports(s)
    sharded = ShardedCluster(
        data_dir,
        s.shards,
        s.replicas,
        ports=http + raft,
        host=s.host,
        lease_ttl_s=s.lease_ttl_s,
        log_level=s.log_level,
        extra_args=auth.replica_args if auth else (),
        token=auth.admin_token() if auth else None,
        raft_password_file=raft_password,
    )
    return sharded.clusters, sharded.map_file


def _start(settings: UpSettings, up: _Launch, auth: AuthFiles | None, progress: Progress, stop: threading.Event) -> list[str]:
    """Start replicas, workers and gateway in turn, each waited for with progress; returns each shard's leader URL."""

    def poll(**changes: object) -> None:
        if stop.is_set():
            raise Interrupted
        progress.update(**changes)

    def on_replicas(n: int, url: str | None) -> None:
        urls = up.clusters[0].replica_urls
        poll(replicas_up=n, leader=url and (f"replica {urls.index(url) + 1}" if url in urls else url), leader_url=url)

    timeout = settings.ready_timeout_s
    n = settings.replicas * settings.shards
    shards = f" in {settings.shards} shards" if settings.shards > 1 else ""
    progress.note(f"starting {n} directory replica{'s' * (n != 1)}{shards}; logs in {up.workers.data_dir}")
    for c in up.clusters:
        c.start()
    if settings.shards == 1:
        leaders = [up.clusters[0].wait_ready(timeout, progress=on_replicas)]
    else:

        def on_shard(done: int) -> Callable[[int, str | None], None]:
            """Progress while a shard elects: its replicas up, after the `done` of the shards before it."""
            return lambda n, _: poll(replicas_up=done + n)

        leaders = []
        for k, c in enumerate(up.clusters):  # every shard must have a leader: each homes some of the nodes
            leaders.append(c.wait_ready(timeout, progress=on_shard(k * settings.replicas)))
            progress.note(f"shard s{k}: leader {leaders[-1]}")
        poll(leader=f"in each of the {settings.shards} shards")
    if settings.workers:
        progress.note(f"starting {settings.workers} worker stub{'s' * (settings.workers != 1)}")
    up.workers.start()
    up.workers.wait_ready(timeout, progress=lambda n: poll(workers_up=n))
    if settings.gateway:
        progress.note("starting the gateway")
        up.gateway = Gateway(
            up.clusters[0].data_dir,
            settings.base_port,
            up.replica_urls,
            host=settings.host,
            log_level=settings.log_level,
            extra_args=["--policy", settings.policy, "--refresh-s", "0.2"],
            token_file=auth.gateway if auth else None,
        )
        up.gateway.wait_ready(timeout, engines=settings.workers, progress=poll)
        progress.update(gateway_ready=True)
    return leaders


def _has_text(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def run_up(settings: UpSettings) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("kvdir.client").setLevel(logging.WARNING)  # the demo's clients would each say the shard map
    taken = taken_ports(settings.host, up_ports(settings))
    if taken:
        free = _free_base_port(settings)
        log.error(
            "kvdir up: %d of the ports it would bind on %s %s taken; nothing was started.\n%s\n"
            "Stop what holds %s, or choose another --base-port%s.",
            len(taken),
            settings.host,
            "is" if len(taken) == 1 else "are",
            "\n".join(f"  {t}" for t in taken),
            "it" if len(taken) == 1 else "them",
            f" (--base-port {free} is free now)" if free else "",
        )
        return 1
    temp = settings.data_dir is None
    data_dir = Path(tempfile.mkdtemp(prefix="kvdir-up-")) if temp else settings.data_dir
    assert data_dir is not None
    data_dir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    caught: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        caught.append(signum)
        stop.set()

    auth = AuthFiles.generate(data_dir / "secrets", worker_node_ids(settings.workers)) if settings.auth else None
    raft_password = auth.raft_password if auth else write_raft_password(data_dir / "secrets")
    clusters, shard_map = _directory(settings, data_dir, raft_password, auth)
    replica_urls = [u for c in clusters for u in c.replica_urls]
    workers = Workers(
        data_dir,
        [settings.base_port + 10 + i for i in range(1, settings.workers + 1)],
        replica_urls,
        host=settings.host,
        log_level=settings.log_level,
        extra_args=[
            "--capacity-blocks",
            str(settings.worker_capacity_blocks),
            "--time-scale",
            str(settings.worker_time_scale),
            "--transfer",
            settings.worker_transfer,
            "--transfer-host",
            settings.host,
        ],
        token_files=auth.engines if auth else None,
    )
    up = _Launch(clusters, workers)
    progress = Progress(
        StartState(len(replica_urls), settings.workers, settings.gateway), sys.stderr, live=on_terminal(sys.stderr)
    )
    evidence: list[str] = []  # what died: then a temporary data dir holds the only copy of its log, and is kept
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        leaders = _start(settings, up, auth, progress, stop)
        leader = leaders[0]
        progress.close(f"cluster ready in {progress.elapsed:.1f}s")
        gateway = up.gateway
        ready = {
            "ready": True,
            "gateway": gateway.url if gateway else None,
            "replicas": replica_urls,
            "leader": leader,
            **({"shard_map_file": str(shard_map), "leaders": leaders} if shard_map else {}),
            "workers": workers.urls,
            "data_dir": str(data_dir),
            "admin_token_file": str(auth.admin) if auth else None,
            "gateway_token_file": str(auth.gateway) if auth else None,
        }
        print(json.dumps(ready), flush=True)
        if auth is not None:
            log.info(
                "directory auth on: tokens file %s, Raft password %s; admin token in %s, e.g.\n"
                '  curl -H "Authorization: Bearer $(cat %s)" %s/v1/nodes',
                auth.tokens,
                raft_password,
                auth.admin,
                auth.admin,
                leader,
            )
        else:
            log.info("Raft password in %s (directory auth off: --auth turns it on)", raft_password)
        if settings.demo or settings.demo_and_exit:
            from kvdir.demo import run_demo

            asyncio.run(run_demo(replica_urls, workers.urls, gateway.url if gateway else None, print, token=clusters[0].token))
        if settings.demo_and_exit:
            return 0
        log.info("kvdir cluster up; Ctrl-C to stop")
        supervisor = _supervisor(clusters, workers, gateway)
        try:
            while not stop.wait(0.2):
                supervisor.tick(time.monotonic())
        finally:
            evidence = sorted(supervisor.died)
        return 0
    except (Interrupted, ChildExited) as exc:
        progress.close()
        if stop.is_set():  # a Ctrl-C reaches the children too: one of them dying of it is no failure
            n = len(up.procs())
            up.stop()
            log.error("kvdir up: interrupted; stopped %d process%s", n, "" if n == 1 else "es")
            return 128 + caught[0]
        assert isinstance(exc, ChildExited)
        said = f"kvdir up: {exc.name} (pid {exc.pid}) {_exit_reason(exc.code)} during start-up"
        if _has_text(exc.log):
            evidence = [exc.name]
            log.error("%s. Last lines of %s:\n%s", said, exc.log, log_tail(exc.log))
        else:
            log.error("%s; its log is empty", said)
        return 1
    except NotReady as exc:
        progress.close()
        log.error("kvdir up: %s", exc.reason if temp else exc)
        for name, path in exc.logs:
            if _has_text(path):
                evidence.append(name)
                log.error("Last lines of %s (%s):\n%s", path, name, log_tail(path, 10))
        if not evidence:
            log.error("(their logs are empty: --log-level info says more)")
        return 1
    finally:
        up.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if temp and evidence:
            log.error("kvdir up: kept %s: it holds the logs of %s (remove it when done)", data_dir, ", ".join(evidence))
        elif temp:
            shutil.rmtree(data_dir, ignore_errors=True)
