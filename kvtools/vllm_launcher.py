"""Real `vllm serve` processes with the kvdir connector, for tests/vllm and `kvdir bench vllm`.

vLLM's CPU build lives in its own venv (`make vllm-install`: `.venv-vllm`, or `$KVDIR_VLLM_VENV`); this module
only starts processes there and talks HTTP to them, so kvdir itself never imports vLLM. Engines run the tiny
random Llama of tests/compose/make_tiny_model.py (no hub access), block size 32 (the CPU attention needs a
multiple of 32), one engine core and one worker per TP rank per engine, each engine in its own process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx

from kvdir.local_cluster import free_ports
from kvtools.bench.proc import stat_fields
from kvtools.faults import slow_link

__all__ = ["BLOCK", "MODEL", "VllmEngine", "make_tiny_model", "running", "vllm_venv"]

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
BLOCK = 32
START_TIMEOUT_S = 300.0  # ~25 s on two idle cores; tests and benches share them


def vllm_venv() -> Path:
    """The venv with vLLM's CPU build: `$KVDIR_VLLM_VENV`, else the checkout's `.venv-vllm`."""
    venv = Path(os.environ.get("KVDIR_VLLM_VENV") or ROOT / ".venv-vllm")
    if not (venv / "bin" / "vllm").exists():
        raise FileNotFoundError(f"no vLLM at {venv}/bin/vllm: `make vllm-install` builds it (or set KVDIR_VLLM_VENV)")
    return venv


def make_tiny_model(venv: Path, out: Path, seed: int | None = None, kv_heads: int = 1, size: str = "tiny") -> Path:
    """Write the tiny random model and its tokenizer into `out` (a few seconds), with the venv's transformers;
    `seed` draws its weights (another seed: another model of the same architecture); `kv_heads` 2 splits its KV
    over two TP ranks (with 1, each rank holds the one head); `size` "bench" makes a ~32M-parameter one
    instead, with the same tokenizer."""
    subprocess.run(
        [
            str(venv / "bin" / "python"),
            str(ROOT / "tests/compose/make_tiny_model.py"),
            str(out),
            *([str(seed)] if seed is not None else []),
            "--kv-heads",
            str(kv_heads),
            "--size",
            size,
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


class VllmEngine:
    """One `vllm serve` with the kvdir connector; `stop` signals its whole process group (API server, engine
    core, worker)."""

    def __init__(
        self,
        name: str,
        venv: Path,
        model: Path,
        directory: list[str],
        log_dir: Path,
        *,
        num_blocks: int = 256,
        connector: dict[str, Any] | None = None,
        served_name: str = MODEL,
        extra_args: tuple[str, ...] = (),
        tp: int = 1,
        nice: int = 0,
    ) -> None:
        """`tp`: tensor-parallel ranks, one worker process each (multiprocessing executor), rank r's OpenMP
        threads bound to CPU r modulo the CPUs here (vLLM's CPU build refuses TP > 1 on one NUMA node unless told).
        `nice`: added to the engine's processes' niceness (`nice -n`), so that processes sharing its CPUs (a
        gateway, the directory) run first when they have work."""
        self.name = name
        self.nice = nice
        self.tp = tp
        self.served_name = served_name
        self.extra_args = extra_args
        self.venv = venv
        self.model = model
        self.directory = directory
        self.num_blocks = num_blocks
        self.connector = connector or {}  # extra kv_connector_extra_config keys
        self.port, self.metrics_port = free_ports(2)
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.log = log_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        extra: dict[str, Any] = {
            "node_id": self.name,
            "api_url": self.url,
            "directory": ",".join(self.directory),
            "heartbeat_interval_s": 0.3,
            "metrics": f"127.0.0.1:{self.metrics_port}",
            **self.connector,
        }
        config = {
            "kv_connector": "KvdirConnector",
            "kv_connector_module_path": "adapters.vllm_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
        env = {
            **os.environ,
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache
            "PYTHONPATH": str(ROOT),
        }
        tp_args: tuple[str, ...] = ()
        if self.tp > 1:
            cpus = sorted(os.sched_getaffinity(0))
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cpus[r % len(cpus)]) for r in range(self.tp))
            tp_args = ("--tensor-parallel-size", str(self.tp), "--distributed-executor-backend", "mp")
        cmd = [
            str(self.venv / "bin" / "vllm"),
            "serve",
            str(self.model),
            "--served-model-name",
            self.served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--enforce-eager",
            "--block-size",
            str(BLOCK),
            "--max-model-len",
            "4096",
            "--num-gpu-blocks-override",
            str(self.num_blocks),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--kv-transfer-config",
            json.dumps(config),
            # A SIGTERM drains for up to this long instead of the API server killing the engine core at once: the
            # connector's scheduler half deregisters the node in the engine core's teardown (docs/engines.md).
            "--shutdown-timeout",
            "5",
            *tp_args,
            *self.extra_args,
        ]
        if self.nice:
            cmd = ["nice", "-n", str(self.nice), *cmd]
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(
                cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Poll /health until it answers 200; RuntimeError if the process exits, TimeoutError after `timeout`."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm {self.name} exited ({self.proc.returncode}); see {self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vllm {self.name} did not answer /health within {timeout} s; see {self.log}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """SIGTERM: to the API server alone, as `docker stop` does, which drains and stops the engine core (a
        second SIGTERM from the group would kill the engine core in its teardown, before the connector deregisters);
        another signal (SIGKILL): the whole process group. SIGKILL whatever is left after a grace period."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            if sig == signal.SIGTERM:
                self.proc.send_signal(sig)
            else:
                os.killpg(self.proc.pid, sig)
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine core and worker, if the API server left them
        except ProcessLookupError:
            pass

    @contextmanager
    def frozen(self, timeout: float = 10.0) -> Iterator[None]:
        """The engine's processes stopped (SIGSTOP) for the block, then resumed (unless killed meanwhile): a source
        that hangs mid-pull, as a hung host or a link that stopped moving looks to a reader.

        The block starts once every thread of the group has stopped, not when the signal is sent: a thread stops
        only when it next runs, and on two busy cores the worker's were seen running 50 ms later, long enough to
        serve a whole pull (7 ms) that a test meant to hang."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)
        try:
            end = time.monotonic() + timeout
            while (running := _running_threads(self.proc.pid)) and time.monotonic() < end:
                time.sleep(0.005)
            if running:
                raise RuntimeError(
                    f"{self.name}: threads {running[:5]} of process group {self.proc.pid} still run {timeout} s after SIGSTOP"
                )
            yield
        finally:
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGCONT)

    @contextmanager
    def slow_link(self, bytes_per_s: float) -> Iterator[list[int]]:
        """Reads from this engine's transfer ports (its pulls' source side) shaped to `bytes_per_s` for the block: a
        source on a slow or congested link, whose reads go on, slowly, instead of hanging (`frozen`). Yields the
        ports shaped. Root only (kvtools.faults.slow_link)."""
        assert self.proc is not None
        ports = slow_link.listening_ports(_group_pids(self.proc.pid))
        if not ports:
            raise RuntimeError(f"{self.name}: no process of group {self.proc.pid} listens on a Mooncake port")
        with slow_link.slow_ports(ports, bytes_per_s):
            yield ports

    def complete(self, prompt: str | list[int], max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
        """A greedy completion; AssertionError with the body unless 200."""
        r = httpx.post(
            self.url + "/v1/completions",
            json={"model": self.served_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra},
            timeout=180,
        )
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    def tokenize(self, prompt: str) -> list[int]:
        r = httpx.post(self.url + "/tokenize", json={"model": self.served_name, "prompt": prompt}, timeout=30)
        r.raise_for_status()
        tokens: list[int] = r.json()["tokens"]
        return tokens

    def reset_cache(self) -> None:
        r = httpx.post(self.url + "/reset_prefix_cache", timeout=30)
        assert r.status_code == 200, r.text

    def metric(self, name: str) -> float:
        """One of the connector's Prometheus counters (0 if it has no sample yet)."""
        for line in httpx.get(self.metrics_url, timeout=5).text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def log_lines(self, needle: str) -> list[str]:
        """Lines of the engine's log that contain `needle` (the connector logs its pull failures there)."""
        try:
            return [ln for ln in self.log.read_text(errors="replace").splitlines() if needle in ln]
        except OSError:
            return []


def _group_pids(pgid: int) -> list[int]:
    """The processes of process group `pgid`, from /proc."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with suppress(OSError, ValueError):  # gone meanwhile
            if int(stat_fields(f"/proc/{pid}/stat")[2]) == pgid:
                out.append(int(pid))
    return out


def _running_threads(pgid: int) -> list[str]:
    """The threads (pid/tid) of process group `pgid` not stopped yet (state T, or gone), from /proc."""
    out = []
    for pid in _group_pids(pgid):
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                if stat_fields(f"/proc/{pid}/task/{tid}/stat")[0] not in "TtZX":
                    out.append(f"{pid}/{tid}")
        except (OSError, ValueError):  # gone meanwhile
            continue
    return out


@contextmanager
def running(engines: Sequence[VllmEngine]) -> Iterator[None]:
    """Every engine started (all at once: they load side by side) and ready; all stopped on exit, however the block
    or a start ends."""
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready()
        yield
    finally:
        for e in engines:
            e.stop()
