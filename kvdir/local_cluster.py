"""The processes of a local cluster on this machine: directory replicas (`Cluster`), worker stubs
(`Workers`) and a gateway (`Gateway`), each started, awaited with a deadline and stopped, on ports
`free_ports` picks. `kvdir up` (kvdir.launcher) and the test suite share them.

Readiness counts only answers from the processes started here (kvdir.listeners): another cluster on the
same ports must not pass for this one. Every replica gets a Raft password file (mode 0600): without one
pysyncobj unpickles whatever reaches a Raft port; `AuthFiles` writes fresh tokens, and only paths go on
command lines, which `ps` shows to every user of the machine.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast
from urllib.parse import urlsplit

import httpx

from kvdir.listeners import listens
from kvtransfer.mooncake import mooncake_rpc_ports

log = logging.getLogger("kvdir.up")


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
    outside the range a Mooncake transfer engine binds in at random (`kvtransfer.mooncake.mooncake_rpc_ports`).

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
    tried: set[int] = set()  # so that a range with fewer than n free ports ends in an error, not a loop
    with _HANDED_OUT_LOCK:
        while len(ports) < n:
            if len(tried) == high - low:
                raise ValueError(f"only {len(ports)} of {n} ports free to pick in {low}..{high - 1}")
            port = rng.randrange(low, high)
            if port in tried:
                continue
            tried.add(port)
            if port in _handed_out or port in mooncake:
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


class Child(Protocol):
    """A started process, as this module uses it: `subprocess.Popen`'s interface, which `spawn` may stand in for."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


def popen(cmd: Sequence[str], log: Path) -> Child:
    """Start `cmd` with its output appended to `log`."""
    with open(log, "ab") as logf:
        return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


spawn: Callable[[Sequence[str], Path], Child] = popen
"""How every process here starts; the test suite forks its many short-lived services from a preloaded
interpreter instead (tests/support/forked.py)."""


class ChildExited(RuntimeError):
    """A started process exited while the launcher waited for it to become ready."""

    def __init__(self, name: str, proc: Child, log: Path) -> None:
        self.name, self.pid, self.code, self.log = name, proc.pid, cast(int, proc.returncode), log
        super().__init__(f"{name} (pid {proc.pid}) {exit_reason(self.code)} during start-up; see {log}")


class NotReady(TimeoutError):
    """Start-up timed out; `logs` are those of the processes that were not ready, (name, path) each."""

    def __init__(self, reason: str, logs: Sequence[tuple[str, Path]], see: str) -> None:
        super().__init__(f"{reason}; see {see}")
        self.reason = reason  # without the pointer to the logs, which `kvdir up` may not keep
        self.logs = list(logs)


def _answered_by(proc: Child | None, url: str, verified: set[int]) -> bool:
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


_ENDS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT})
"""The signals `kill` waits on: they end a process (SIGSTOP and SIGCONT do not)."""


class _Children:
    """Processes of one kind started here, one per slot, each writing its log file: started, signalled, checked
    and stopped alike for the replicas, the workers and the gateway."""

    def __init__(self, data_dir: Path, n: int) -> None:
        self.data_dir = data_dir
        self.procs: list[Child | None] = [None] * n
        self._verified: set[int] = set()  # pids seen listening on their HTTP port

    def _log(self, i: int) -> Path:
        raise NotImplementedError

    def name(self, i: int) -> str:
        raise NotImplementedError

    def _spawn(self, i: int, cmd: Sequence[str]) -> None:
        self.procs[i] = spawn(cmd, self._log(i))

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to process i (if it runs), and wait for it to end if `sig` ends it."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            if sig in _ENDS:
                proc.wait()

    def alive(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p is not None and p.poll() is None]

    def _check_running(self) -> None:
        """ChildExited for the first process that ended other than by a SIGKILL sent to it (`kill`)."""
        for i, p in enumerate(self.procs):
            if p is not None and p.poll() not in (None, -signal.SIGKILL):
                raise ChildExited(self.name(i), p, self._log(i))

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM to every process, then SIGKILL to those still running after `grace` seconds."""
        stop_all([p for p in self.procs if p is not None], grace)


class Cluster(_Children):
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
        super().__init__(data_dir, len(http_ports))
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

    def log_path(self, i: int) -> Path:
        return self.data_dir / f"replica{i + 1}.log"

    _log = log_path

    def name(self, i: int) -> str:
        return f"replica {i + 1}"

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
        self._spawn(i, cmd)

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
                self._check_running()
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


class Workers(_Children):
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
        super().__init__(data_dir, len(http_ports))
        self.urls = [f"http://{host}:{p}" for p in http_ports]
        self.node_ids = worker_node_ids(len(http_ports))
        self.directory_urls = list(directory_urls)
        self.log_level = log_level
        self.extra_args = list(extra_args)
        self.token_files = dict(token_files or {})  # node id -> file of its directory token

    def start(self) -> None:
        for i in range(len(self.procs)):
            self.start_worker(i)

    def log_path(self, i: int) -> Path:
        return self.data_dir / f"{self.node_ids[i]}.log"

    _log = log_path

    def name(self, i: int) -> str:
        return self.node_ids[i]

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
        self._spawn(i, cmd)

    def wait_ready(self, timeout: float, progress: Callable[[int], None] | None = None) -> list[int]:
        """Poll until every worker answers /health with its node id and a directory epoch; returns the epochs.

        Only answers from the processes started here count; `progress(registered)` is called on every poll.
        """
        end = time.monotonic() + timeout
        epochs: list[int | None] = []
        with httpx.Client(timeout=1.0) as http:
            while time.monotonic() < end:
                self._check_running()
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


class Gateway(_Children):
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
        tokenizer: str | None = "bytes",
    ) -> None:
        """`tokenizer`: the engines' tokenizer (`--tokenizer`) where `extra_args` name none: the worker stubs' own
        (UTF-8 bytes) by default; None: the gateway's default (`auto`: each model's files, else its engines)."""
        self.url = f"http://{host}:{port}"
        if tokenizer is not None and "--tokenizer" not in extra_args:
            extra_args = ("--tokenizer", tokenizer, *extra_args)
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
        super().__init__(data_dir, 1)
        self.log_path = data_dir / "gateway.log"
        self.start()

    def _log(self, i: int) -> Path:
        return self.log_path

    def name(self, i: int) -> str:
        return "gateway"

    @property
    def proc(self) -> Child:
        proc = self.procs[0]
        assert proc is not None
        return proc

    def start(self) -> None:
        """Start the process (again)."""
        self._spawn(0, self._cmd)

    def wait_ready(self, timeout: float, engines: int, progress: Callable[[], None] | None = None) -> None:
        """Poll until the gateway started here answers and knows `engines` engines; `progress()` on every poll."""
        end = time.monotonic() + timeout
        with httpx.Client(timeout=1.0) as http:
            while time.monotonic() < end:
                self._check_running()
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


def stop_all(procs: Sequence[Child], grace: float) -> None:
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


def exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
