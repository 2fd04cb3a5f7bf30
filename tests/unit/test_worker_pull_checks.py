"""The worker stub's checks of a pull plan's source before it reads a byte, on its engine with the directory and
the transfer engines faked (no sockets): what no directory would list is listed here, and every refusal is a
counted recompute with the right output, never an error."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

from prometheus_client import CollectorRegistry

from kvproto.hashing import KvIdentity
from kvproto.schemas import NodeInfo, PullPlan, RegionInfo
from tests.support.fakes import Directory
from worker_stub.config import WorkerSettings
from worker_stub.pool import KVPool
from worker_stub.stub_engine import Engine, EngineCounts, RequestStats

BLOCKS = 4
TOKENS = list(range(BLOCKS * 16))
SETTINGS = WorkerSettings(node_id="worker-1", capacity_blocks=8, block_bytes=64, time_scale=0)
SOURCE = "worker-2"


class Transfer:
    """A transfer engine that encodes each piece as the TCP engine's wire does (u64 address and length) and
    records the reads; the bytes it "reads" are left as they were (so they fail verification)."""

    session = "127.0.0.1:1"

    def __init__(self) -> None:
        self.reads: list[list[int]] = []

    def read(self, peer: str, local_addrs: list[int], remote_addrs: list[int], lengths: list[int]) -> None:
        for remote, n in zip(remote_addrs, lengths):
            struct.pack("!QQ", remote, n)
        self.reads.append(remote_addrs)


def node(node_id: str, *, base_addr: int = 1 << 40, tenant: str = "", shared: bool = False) -> NodeInfo:
    region = RegionInfo(rank=0, base_addr=base_addr, length=8 * 64, block_bytes=64)
    return NodeInfo(
        node_id=node_id,
        epoch=3,
        alive=True,
        api_url="http://127.0.0.1:9",
        transfer_url="127.0.0.1:2",
        regions=[region],
        blocks=BLOCKS,
        fingerprint=SETTINGS.kv_fingerprint,
        tenant=tenant,
        shared=shared,
    )


def serve(nodes: list[NodeInfo]) -> tuple[Engine, Transfer, RequestStats, bytes]:
    """One request with a plan naming SOURCE's slots 0..3, on worker-1 that sees `nodes`."""
    transfer = Transfer()
    directory: Any = Directory(nodes)
    engine = Engine(SETTINGS, KVPool(8, 64), [transfer], directory, "worker-1", EngineCounts(CollectorRegistry()))  # type: ignore[list-item]
    plan = PullPlan(source_node=SOURCE, source_epoch=3, slots=list(range(BLOCKS)))
    stats = RequestStats()

    async def run() -> bytes:
        return b"".join([t async for t in engine.generate(TOKENS, 3, plan, stats, KvIdentity(model="kvdir-stub"))])

    return engine, transfer, stats, asyncio.run(run())


def test_a_source_region_past_the_64_bit_address_space_is_a_counted_recompute() -> None:
    engine, transfer, stats, out = serve([node("worker-1"), node(SOURCE, base_addr=(1 << 64) - 64)])
    assert out == b"the" and stats.completion_tokens == 3
    assert transfer.reads == [] and stats.pulled_tokens == 0
    assert stats.pull_failures == [
        f"source's rank 0 device region [{(1 << 64) - 64}, +512) lies outside the 64-bit address space"
    ]
    assert engine.counts.pull_errors._value.get() == 1
    assert engine.pool.cached_blocks == BLOCKS  # computed instead


def test_a_shared_engine_refuses_a_tenants_source_and_a_tenants_engine_another_tenants() -> None:
    for me, source in (
        (node("worker-1", shared=True), node(SOURCE, tenant="bravo")),
        (node("worker-1", shared=True), node(SOURCE)),
        (node("worker-1", tenant="acme"), node(SOURCE, tenant="bravo")),
    ):
        engine, transfer, stats, out = serve([me, source])
        assert out == b"the" and transfer.reads == [] and stats.pulled_tokens == 0
        assert engine.counts.pull_refused._value.get() == 1, stats.pull_failures
        assert stats.pull_failures[0].startswith(f"source {SOURCE} is of tenant {source.tenant!r}")
    # Not listed itself (yet): which tenants' KV it may read is unknown, so it reads none.
    engine, transfer, stats, _ = serve([node(SOURCE, shared=True)])
    assert engine.counts.pull_refused._value.get() == 1 and transfer.reads == []
    assert stats.pull_failures == ["this engine (worker-1) is not in the directory's node list yet: its tenant is unknown"]


def test_a_source_it_may_read_is_read() -> None:
    for me, source in (
        (node("worker-1", shared=True), node(SOURCE, shared=True)),
        (node("worker-1", tenant="bravo"), node(SOURCE, shared=True)),
        (node("worker-1", tenant="bravo"), node(SOURCE, tenant="bravo")),
    ):
        engine, transfer, stats, _ = serve([me, source])
        assert len(transfer.reads) == 1 and engine.counts.pull_refused._value.get() == 0, stats.pull_failures
