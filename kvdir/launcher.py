"""`kvdir up`: a local cluster on loopback, each component in its own process.

Replica i (1-based) serves HTTP on base_port+i and Raft on base_port+100+i.
Once a leader is elected it prints one JSON line `{"ready": true, ...}` on
stdout, optionally drives a demo, and keeps the cluster up until SIGINT or
SIGTERM; then it stops every process it started, whatever happened.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType

import httpx
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

log = logging.getLogger("kvdir.up")


class UpSettings(BaseSettings):
    """The local cluster (`kvdir up`)."""

    model_config = SettingsConfigDict(env_prefix="KVDIR_", extra="forbid")

    host: str = Field("127.0.0.1", description="address every component binds to (keep it on loopback)")
    base_port: int = Field(8100, ge=1, le=65000, description="replica i serves HTTP on BASE_PORT+i and Raft on BASE_PORT+100+i")
    replicas: int = Field(3, ge=1, le=7, description="directory replicas to start")
    data_dir: Path | None = Field(None, description="where replicas keep state and logs (default: a temporary directory removed on exit)")
    lease_ttl_s: float = Field(10.0, gt=0.2, description="node lease TTL of the directory")
    log_level: str = Field("warning", description="log level of the started processes (their logs go to DATA_DIR/*.log)")
    ready_timeout_s: float = Field(60.0, gt=0, description="give up if no leader is elected within this time")
    demo: bool = Field(False, description="after start-up, drive a short demo workload and print what it did")
    demo_and_exit: bool = Field(False, description="run the demo, then stop everything and exit 0")


class Cluster:
    """The processes of a local cluster; `stop()` ends them all (SIGTERM, then SIGKILL)."""

    def __init__(self, settings: UpSettings, data_dir: Path) -> None:
        self.settings = settings
        self.data_dir = data_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        n = settings.replicas
        self.replica_urls = [f"http://{settings.host}:{settings.base_port + i}" for i in range(1, n + 1)]
        self.raft_addrs = [f"{settings.host}:{settings.base_port + 100 + i}" for i in range(1, n + 1)]

    def start(self) -> None:
        s = self.settings
        for i, (url, raft) in enumerate(zip(self.replica_urls, self.raft_addrs), start=1):
            peers = ",".join(a for a in self.raft_addrs if a != raft)
            cmd = [
                sys.executable, "-m", "kvdir", "directory",
                "--http", url.removeprefix("http://"), "--raft", raft, "--peers", peers,
                "--data-dir", str(self.data_dir / f"replica{i}"),
                "--lease-ttl-s", str(s.lease_ttl_s), "--log-level", s.log_level,
            ]
            logf = open(self.data_dir / f"replica{i}.log", "ab")
            self.procs.append(subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            logf.close()

    def wait_ready(self, timeout: float) -> str:
        """Poll until every replica knows the leader's URL; returns it."""
        end = time.monotonic() + timeout
        with httpx.Client(timeout=1.0) as http:
            while time.monotonic() < end:
                for p in self.procs:
                    if p.poll() is not None:
                        raise RuntimeError(f"a replica exited with code {p.returncode}; see {self.data_dir}/replica*.log")
                leaders = set()
                for url in self.replica_urls:
                    try:
                        leaders.add(http.get(url + "/v1/cluster").json().get("leader_url"))
                    except (httpx.HTTPError, ValueError):
                        leaders.add(None)
                if len(leaders) == 1 and None not in leaders:
                    return leaders.pop()
                time.sleep(0.1)
        raise TimeoutError(f"no leader elected within {timeout}s; see {self.data_dir}/replica*.log")

    def stop(self, grace: float = 5.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        end = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def run_up(settings: UpSettings) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    temp = settings.data_dir is None
    data_dir = Path(tempfile.mkdtemp(prefix="kvdir-up-")) if temp else settings.data_dir
    assert data_dir is not None
    data_dir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    cluster = Cluster(settings, data_dir)
    try:
        cluster.start()
        leader = cluster.wait_ready(settings.ready_timeout_s)
        ready = {"ready": True, "replicas": cluster.replica_urls, "leader": leader, "data_dir": str(data_dir)}
        print(json.dumps(ready), flush=True)
        if settings.demo or settings.demo_and_exit:
            from kvdir.demo import run_demo

            asyncio.run(run_demo(cluster.replica_urls, print))
        if settings.demo_and_exit:
            return 0
        log.info("kvdir cluster up; Ctrl-C to stop")
        while not stop.wait(0.5):
            dead = [p for p in cluster.procs if p.poll() is not None]
            if dead:
                log.error("a replica exited (code %s); see %s", dead[0].returncode, data_dir)
                return 1
        return 0
    except (RuntimeError, TimeoutError) as exc:
        log.error("kvdir up: %s", exc)
        return 1
    finally:
        cluster.stop()
        if temp:
            shutil.rmtree(data_dir, ignore_errors=True)
