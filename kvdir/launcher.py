"""`kvdir up`: a local cluster on loopback, each component in its own process (kvdir.local_cluster).

This module holds what is `kvdir up`'s own: its settings and ports, the supervisor that restarts a
process that dies, and the start-up sequence.

Replica i (1-based) serves HTTP on base_port+i and Raft on base_port+100+i; with `--shards N`
(docs/scale-out.md) replica i of shard k (0-based, named sk) serves on base_port+200k+i and
base_port+200k+100+i, so shard s0 keeps the unsharded ports.
Once every shard has a leader it prints one JSON line `{"ready": true, ...}` on
stdout, optionally drives a demo, and keeps the cluster up until SIGINT or
SIGTERM, restarting any process that dies (with backoff, its log's tail on
stderr); then it stops every process it started, whatever happened.

Before it starts anything it checks every port it will bind, and refuses with the holder of a taken
one; while it starts it says its progress on stderr (kvdir.progress). A process that dies while
starting ends the launch with its log's tail on stderr; a temporary DATA_DIR that holds the log of a
process that died is kept, and its path said. Ctrl-C while starting stops what was started and exits 130.

It always writes a fresh Raft password into DATA_DIR/secrets; with `auth` also fresh random tokens, one
engine token per worker confined to its node id and a read-only token for the gateway.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gateway.config import PolicyName
from kvdir.listeners import taken_ports
from kvdir.local_cluster import (
    AuthFiles,
    Child,
    ChildExited,
    Cluster,
    Gateway,
    NotReady,
    Workers,
    exit_reason,
    free_ports,
    log_tail,
    worker_node_ids,
    write_raft_password,
)
from kvdir.progress import Progress, StartState, on_terminal
from kvproto.addresses import is_wildcard
from kvproto.logs import LogLevel
from kvtransfer.mooncake import mooncake_rpc_ports
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
    worker_tp: int = Field(
        1, ge=1, le=64, description="tensor-parallel ranks of each worker stub (mirrored slots, a transfer engine each)"
    )
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


@dataclass
class Supervised:
    """One process `kvdir up` keeps running: how to find it, start it again, and read its log."""

    name: str
    proc: Callable[[], Child | None]
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
                    exit_reason(code),
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

    def procs(self) -> list[Child]:
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


def _unsharded(s: UpSettings, data_dir: Path, raft_password_file: Path, auth: AuthFiles | None) -> Cluster:
    """The one Raft group of `kvdir up` without shards: replica i on BASE_PORT+i, Raft on BASE_PORT+100+i."""
    n = range(1, s.replicas + 1)
    return Cluster(
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


def _directory(s: UpSettings, data_dir: Path, raft_password: Path, auth: AuthFiles | None) -> tuple[list[Cluster], Path | None]:
    """The directory's groups, one per shard, and the shard map file (None unsharded: today's single group)."""
    if s.shards == 1:
        return [_unsharded(s, data_dir, raft_password, auth)], None
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


def _ports_free(settings: UpSettings) -> bool:
    """Whether every port `kvdir up` would bind is free (else it says which are not, and a base port that is)."""
    taken = taken_ports(settings.host, up_ports(settings))
    if not taken:
        return True
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
    return False


def _workers(settings: UpSettings, data_dir: Path, replica_urls: list[str], auth: AuthFiles | None) -> Workers:
    """The worker stubs, on BASE_PORT+10+i, not started."""
    return Workers(
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
            "--tp",
            str(settings.worker_tp),
        ],
        token_files=auth.engines if auth else None,
    )


def _announce(
    up: _Launch, leaders: list[str], shard_map: Path | None, data_dir: Path, auth: AuthFiles | None, raft_password: Path
) -> None:
    """The ready line (one JSON object on stdout, what scripts wait for) and where the secrets are."""
    gateway = up.gateway
    ready = {
        "ready": True,
        "gateway": gateway.url if gateway else None,
        "replicas": up.replica_urls,
        "leader": leaders[0],
        **({"shard_map_file": str(shard_map), "leaders": leaders} if shard_map else {}),
        "workers": up.workers.urls,
        "data_dir": str(data_dir),
        "admin_token_file": str(auth.admin) if auth else None,
        "gateway_token_file": str(auth.gateway) if auth else None,
    }
    print(json.dumps(ready), flush=True)
    if auth is None:
        log.info("Raft password in %s (directory auth off: --auth turns it on)", raft_password)
        return
    log.info(
        "directory auth on: tokens file %s, Raft password %s; admin token in %s, e.g.\n"
        '  curl -H "Authorization: Bearer $(cat %s)" %s/v1/nodes',
        auth.tokens,
        raft_password,
        auth.admin,
        auth.admin,
        leaders[0],
    )


def _serve(settings: UpSettings, up: _Launch, stop: threading.Event) -> list[str]:
    """The demo if asked, then the cluster supervised until `stop`; returns the names of the processes that died."""
    gateway = up.gateway
    if settings.demo or settings.demo_and_exit:
        from kvdir.demo import run_demo

        asyncio.run(
            run_demo(up.replica_urls, up.workers.urls, gateway.url if gateway else None, print, token=up.clusters[0].token)
        )
    if settings.demo_and_exit:
        return []
    log.info("kvdir cluster up; Ctrl-C to stop")
    supervisor = _supervisor(up.clusters, up.workers, gateway)
    try:
        while not stop.wait(0.2):
            supervisor.tick(time.monotonic())
    finally:
        died = sorted(supervisor.died)
    return died


def _start_failed(exc: ChildExited | NotReady, temp: bool) -> list[str]:
    """Say why the cluster did not come up, with the last lines of the logs that say more; returns the names of the
    processes whose logs those are (a temporary data dir that holds them is kept)."""
    if isinstance(exc, ChildExited):
        said = f"kvdir up: {exc.name} (pid {exc.pid}) {exit_reason(exc.code)} during start-up"
        if not _has_text(exc.log):
            log.error("%s; its log is empty", said)
            return []
        log.error("%s. Last lines of %s:\n%s", said, exc.log, log_tail(exc.log))
        return [exc.name]
    log.error("kvdir up: %s", exc.reason if temp else exc)
    evidence = []
    for name, path in exc.logs:
        if _has_text(path):
            evidence.append(name)
            log.error("Last lines of %s (%s):\n%s", path, name, log_tail(path, 10))
    if not evidence:
        log.error("(their logs are empty: --log-level info says more)")
    return evidence


def run_up(settings: UpSettings) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("kvdir.client").setLevel(logging.WARNING)  # the demo's clients would each say the shard map
    if not _ports_free(settings):
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
    up = _Launch(clusters, _workers(settings, data_dir, [u for c in clusters for u in c.replica_urls], auth))
    progress = Progress(
        StartState(len(up.replica_urls), settings.workers, settings.gateway), sys.stderr, live=on_terminal(sys.stderr)
    )
    evidence: list[str] = []  # what died: then a temporary data dir holds the only copy of its log, and is kept
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        leaders = _start(settings, up, auth, progress, stop)
        progress.close(f"cluster ready in {progress.elapsed:.1f}s")
        _announce(up, leaders, shard_map, data_dir, auth, raft_password)
        evidence = _serve(settings, up, stop)
        return 0
    except (Interrupted, ChildExited, NotReady) as exc:
        progress.close()
        if stop.is_set():  # a Ctrl-C reaches the children too: one of them dying of it is no failure
            n = len(up.procs())
            up.stop()
            log.error("kvdir up: interrupted; stopped %d process%s", n, "" if n == 1 else "es")
            return 128 + caught[0]
        assert not isinstance(exc, Interrupted)
        evidence = _start_failed(exc, temp)
        return 1
    finally:
        up.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if temp and evidence:
            log.error("kvdir up: kept %s: it holds the logs of %s (remove it when done)", data_dir, ", ".join(evidence))
        elif temp:
            shutil.rmtree(data_dir, ignore_errors=True)
