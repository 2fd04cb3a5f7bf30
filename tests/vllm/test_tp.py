"""Tensor-parallel vLLM engines (TP 2, one worker process per rank) with the kvdir connector (issue #31).

Each rank's worker registers its own KV memory, tags and transfer session; the scheduler registers them all
under one epoch, the slots mirrored; a pull plan makes rank r read the holder's rank r, and a block is loaded
only when every rank's read validated. This module's engines are its own: two TP 2 engines A and B, then a
TP 1 engine C in B's place (the conftest runs it right after test_first_pull.py: at most two engines at a time).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from mooncake.engine import TransferEngine as NativeEngine

from kvdir.local_cluster import Cluster, Gateway
from kvtools.vllm_launcher import make_tiny_model
from kvtransfer.backends import create_engine
from tests.support.wait import wait_for
from tests.vllm.conftest import BLOCK, MODEL, PROMPT, Engine, running_directory, start_gateway, vllm_venv
from tests.vllm.test_connector import (
    FAILED,
    PULL,
    REFUSED,
    _decisions,
    _holder,
    _node,
    _plan,
    _recomputed,
    _served,
    keep_busy,
    wait_gateway_sees_running,
)

TAGS = "kvdir-tags"


class Engines:
    """A and B at TP 2; `tp1` stops B and starts C at TP 1 (two engines at most)."""

    def __init__(self, model: Path, directory: Cluster, logs: Path) -> None:
        self.model, self.directory, self.logs = model, directory, logs
        self.a = Engine("tp2-a", vllm_venv(), model, directory.replica_urls, logs, tp=2)
        self.b = Engine("tp2-b", vllm_venv(), model, directory.replica_urls, logs, tp=2)
        self.c: Engine | None = None

    def tp1(self) -> Engine:
        if self.c is None:
            self.b.stop()
            self.c = Engine("tp1-c", vllm_venv(), self.model, self.directory.replica_urls, self.logs)
            self.c.start()
            self.c.wait_ready()
        return self.c

    def stop(self) -> None:
        for e in (self.a, self.b, self.c):
            if e is not None:
                e.stop()


@pytest.fixture(scope="module")
def tp_directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_directory(tmp_path_factory.mktemp("tp-directory")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with two KV heads: at TP 2 each rank holds one (with one head, both ranks would hold the same
    replicated head, and a rank reading the other rank's pages would go unnoticed)."""
    return make_tiny_model(vllm_venv(), tmp_path_factory.mktemp("tp-model") / MODEL, kv_heads=2)


@pytest.fixture(scope="module")
def tp(tp_model: Path, tp_directory: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    e = Engines(tp_model, tp_directory, tmp_path_factory.mktemp("tp-engines"))
    try:
        e.a.start()
        e.b.start()
        e.a.wait_ready()
        e.b.wait_ready()
        yield e
    finally:
        e.stop()


def _rank_regions(node: dict[str, Any], rank: int) -> tuple[str, list[dict[str, Any]]]:
    """Rank `rank`'s session and regions as the directory lists them."""
    regions = [r for r in node["regions"] if r["rank"] == rank]
    sessions = {r["transfer_url"] or node["transfer_url"] for r in regions}
    assert len(sessions) == 1, sessions
    return sessions.pop(), regions


def _read(session: str, base: int, block_bytes: int, slots: list[int]) -> np.ndarray:
    """The `block_bytes` at each of `slots` in a holder's registered region at `base`, one row per slot."""
    te = create_engine("mooncake", "127.0.0.1")
    try:
        buf = np.zeros((len(slots), block_bytes), dtype=np.uint8)
        te.register(buf.ctypes.data, buf.nbytes)
        te.read(
            session,
            [buf.ctypes.data + block_bytes * i for i in range(len(slots))],
            [base + block_bytes * s for s in slots],
            [block_bytes] * len(slots),
        )
    finally:
        te.close()
    return buf


def _read_tags(session: str, tags_base: int, slots: list[int]) -> list[int]:
    return [int(h) for h in _read(session, tags_base, 16, slots).view("<u8")[:, 0]]


@contextmanager
def _tag_zeroed(session: str, tags_base: int, slot: int) -> Iterator[None]:
    """One block's tag hash overwritten in a holder's rank memory (Mooncake lets any peer write registered memory),
    by a transfer engine of this process that lives until the block ends: one torn down meanwhile was seen to hold
    the holder's transfer thread for 6 s (B's read of that rank timed out at 5 s, and every block recomputed)."""
    te = NativeEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    zero = np.zeros(2, dtype="<u8")
    assert te.register_memory(zero.ctypes.data, zero.nbytes) == 0
    try:
        assert te.transfer_sync_write(session, zero.ctypes.data, tags_base + 16 * slot, 8) == 0
        yield
    finally:
        te.unregister_memory(zero.ctypes.data)


def test_a_tp2_engine_registers_every_ranks_memory_under_one_epoch(tp: Engines) -> None:
    hashes, holder = _served(tp.a, tp.directory)
    node = _node(tp.directory, tp.a.name)
    assert node is not None
    (s0, r0), (s1, r1) = _rank_regions(node, 0), _rank_regions(node, 1)
    assert s0 != s1 and len(r0) == len(r1) and {r["rank"] for r in node["regions"]} == {0, 1}
    # Rank r holds half the KV heads: the same page size on both ranks, at the same block ids (mirrored).
    assert [r["block_bytes"] for r in r0] == [r["block_bytes"] for r in r1]
    # The one slot list of the directory entry locates the blocks on each rank: both ranks' tags hold the hashes.
    for session, regions in ((s0, r0), (s1, r1)):
        tags = next(r for r in regions if r["rkey"] == TAGS)
        assert _read_tags(session, tags["base_addr"], holder["slots"]) == hashes
    # ... and each rank's pages hold its own head: the same slot's layer-0 page differs between the ranks.
    layer0 = [next(r for r in regions if r["layer"] == 0) for regions in (r0, r1)]
    page = [_read(s, r["base_addr"], r["block_bytes"], holder["slots"][:1]) for s, r in zip((s0, s1), layer0)]
    assert page[0].any() and not np.array_equal(page[0], page[1])


def test_a_prefix_pulled_rank_to_rank_gives_the_recomputed_output(tp: Engines) -> None:
    a, b = tp.a, tp.b
    hashes, holder = _served(a, tp.directory)
    expected = _recomputed(b)
    b.reset_cache()
    pulled = b.metric(PULL)
    out = b.complete(PROMPT, kv_transfer_params=_plan(holder))
    pullable = min(len(hashes), (out["usage"]["prompt_tokens"] - 1) // BLOCK)
    assert (b.metric(PULL) - pulled, b.metric(FAILED)) == (pullable, 0), b.log_lines("pull of")
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= pullable * BLOCK
    assert out["choices"][0]["text"] == expected["choices"][0]["text"]
    # Each rank read its own half: equal page bytes per rank.
    per_rank = [b.metric(f'kvdir_connector_pull_rank_page_bytes_total{{rank="{r}"}}') for r in (0, 1)]
    assert per_rank[0] == per_rank[1] > 0, per_rank


def test_one_ranks_stale_tag_makes_every_rank_recompute(tp: Engines) -> None:
    """Rank 1 of A loses the tag of the prompt's first block between plan and read (as when it reuses the block):
    B's rank 1 finds it stale, rank 0 reads good pages, and vLLM recomputes the prompt on both ranks."""
    a, b = tp.a, tp.b
    _, holder = _served(a, tp.directory)
    expected = _recomputed(b)
    node = _node(tp.directory, a.name)
    assert node is not None
    session, regions = _rank_regions(node, 1)
    b.reset_cache()
    failed, pulled = b.metric(FAILED), b.metric(PULL)
    with _tag_zeroed(session, next(r for r in regions if r["rkey"] == TAGS)["base_addr"], holder["slots"][0]):
        out = b.complete(PROMPT, kv_transfer_params=_plan(holder))
    # The block rank 1 found stale failed on both ranks (counted once); rank 0's good read of it is not a pull.
    assert b.metric(FAILED) - failed == 1, b.log_lines("pull from")
    pullable = min(len(holder["slots"]), (out["usage"]["prompt_tokens"] - 1) // BLOCK)
    assert b.metric(PULL) - pulled == pullable - 1
    assert out["choices"][0]["text"] == expected["choices"][0]["text"]


def test_a_tp1_holder_is_never_a_source_for_a_tp2_engine(tp: Engines, tmp_path_factory: pytest.TempPathFactory) -> None:
    """C (TP 1) holds the prompt. A plan naming it is refused by A's connector (another KV fingerprint: the TP size
    is part of it, and C's pages hold every head), and the gateway never plans it: with C busy, the prompt goes
    to A to be computed, the decision saying why it did not pull."""
    a, c = tp.a, tp.tp1()
    hashes, holder = _served(c, tp.directory)
    expected = _recomputed(a)
    a.reset_cache()
    refused = a.metric(REFUSED)
    out = a.complete(PROMPT, kv_transfer_params=_plan(holder))
    assert out["choices"][0]["text"] == expected["choices"][0]["text"]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # refused before vLLM counted a token
    assert a.metric(REFUSED) - refused == 1 and a.log_lines("not this engine's")
    a.reset_cache()
    wait_for(lambda: _holder(tp.directory, hashes, a.name) is None, what="A's reset blocks gone from the directory", timeout=30)
    gateway: Gateway = start_gateway(tmp_path_factory.mktemp("tp-gateway"), tp.directory)
    try:
        gateway.wait_ready(60, engines=2)
        with ExitStack() as streams, httpx.Client(timeout=180) as http:
            keep_busy(streams, http, c)
            wait_gateway_sees_running(gateway, c.name, 2)
            r = http.post(
                gateway.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
            )
        assert r.status_code == 200, r.text
        assert (r.headers["x-kvdir-node"], r.headers["x-kvdir-decision"] != "pull") == (a.name, True), _decisions(gateway)
        assert f"no pull from {c.name}" in _decisions(gateway)
        assert r.json()["choices"][0]["text"] == expected["choices"][0]["text"]
    finally:
        gateway.stop()
