"""Real `vllm serve` processes (vLLM's CPU build, $KVDIR_VLLM_VENV) with the kvdir connector, a directory and a gateway.

`make test-vllm` sets KVDIR_VLLM_VENV; without it these tests fail (they are not in the default suite).
Engines (kvtools.vllm_launcher, shared with `kvdir bench vllm`) run a tiny random Llama made here, block size
32 (the CPU attention needs a multiple of 32) for engines, connector and gateway alike.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvdir.local_cluster import Cluster, Gateway, free_ports
from kvtools.vllm_launcher import BLOCK, MODEL, VllmEngine, make_tiny_model, running

__all__ = ["BLOCK", "MODEL", "PROMPT", "Engine", "running_directory", "start_gateway", "vllm_venv"]

ENGINE_NICE = 10
"""The test engines' niceness. A CPU engine decoding runs some 35 threads on these two cores; at the same niceness
the gateway's event loop was seen unscheduled for 8 s under one (2026-12-06), long enough for what a test waits on
to come and go unseen. On a GPU host the engines compute on the GPU and leave the CPUs to the rest."""


class Engine(VllmEngine):
    """A test engine: `VllmEngine` at `ENGINE_NICE`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, nice=ENGINE_NICE, **kwargs)


PROMPT = "the quick brown fox jumps over the lazy dog while a support assistant answers briefly " * 20


def vllm_venv() -> Path:
    venv = os.environ.get("KVDIR_VLLM_VENV")
    if not venv or not (Path(venv) / "bin" / "vllm").exists():
        pytest.fail("KVDIR_VLLM_VENV must name the vLLM venv (`make test-vllm` builds it and sets it)")
    return Path(venv)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """test_first_pull.py, test_tp.py, test_host_tier.py and test_shutdown.py first: their own engines stop before the
    session's two start (two vLLM engines at most)."""
    first = ("test_first_pull.py", "test_tp.py", "test_host_tier.py", "test_shutdown.py")
    items.sort(key=lambda item: first.index(item.path.name) if item.path.name in first else len(first))  # stable


def start_gateway(data: Path, directory: Cluster) -> Gateway:
    """A gateway whose TTFT model makes a busy holder lose to a pull (the tests that provoke a `pull` decision):
    one request per engine and 1 s per request ahead (8 tokens at 8 tokens/s); a slow prefill estimate, so pulling
    beats recomputing. Lookups may take long on two shared cores (past the timeout: routed by load, no plan).
    Those figures are the model's, as given: nothing learned from the engines' TTFTs replaces them, and no stay
    margin holds a request on its busy holder."""
    return Gateway(
        data,
        free_ports(1)[0],
        directory.replica_urls,
        log_level="debug",  # each decision's TTFT formula in gateway.log: a failed routing test prints it
        extra_args=(
            "--tokenizer",
            "engine",
            "--block-size",
            str(BLOCK),
            "--max-running",
            "1",
            "--prefill-tokens-per-s",
            "500",
            "--decode-tokens-per-s",
            "8",
            "--lookup-timeout-s",
            "5",
            "--refresh-s",
            "0.2",
            "--ttft-learn-window",
            "0",
            "--stay-margin-ms",
            "0",
            "--stay-margin-ratio",
            "0",
        ),
    )


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(vllm_venv(), tmp_path_factory.mktemp("model") / MODEL)


@contextlib.contextmanager
def running_directory(data: Path, lease_ttl_s: float = 3.0) -> Iterator[Cluster]:
    """Three directory replicas (a 3 s lease by default: a killed engine's entries go soon) in `data`, stopped on exit."""
    ports = free_ports(6)
    cluster = Cluster(data, ports[:3], ports[3:], lease_ttl_s=lease_ttl_s, log_level="info")
    try:
        cluster.start()
        cluster.wait_ready(60)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_directory(tmp_path_factory.mktemp("directory")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def engines(model: Path, directory: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    logs = tmp_path_factory.mktemp("engines")
    started = {name: Engine(name, vllm_venv(), model, directory.replica_urls, logs) for name in ("vllm-a", "vllm-b")}
    with running(list(started.values())):
        yield started


@pytest.fixture(scope="session")
def gateway(directory: Cluster, engines: dict[str, Engine], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    data = tmp_path_factory.mktemp("gateway")
    g = start_gateway(data, directory)
    try:
        g.wait_ready(60, engines=2)
        yield g
    finally:
        g.stop()
