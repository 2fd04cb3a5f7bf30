"""The worker stub reads a prefix once per node: a request for blocks another request here is pulling waits for
that read, whichever of the two carries a plan and whichever came first, and both report the prefix cached.

The engine runs with the directory and the transfer engine faked (no sockets): the fake copies the source pool's
bytes in memory, as a transfer engine would over the wire, and holds each read until the test lets it go (a slow
pull), so the second request always arrives while the first read is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import threading
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvproto.hashing import KvIdentity, identity_hashes
from kvproto.schemas import NodeInfo, PullPlan, RegionInfo
from kvtransfer.engine import TransferError
from tests.support.fakes import Directory
from tests.support.wait import until
from worker_stub.config import WorkerSettings
from worker_stub.pool import KVPool
from worker_stub.stub_engine import Engine, EngineCounts, RequestStats

KV = KvIdentity(model="kvdir-stub")
BLOCKS = 4
PREFIX = list(range(BLOCKS * 16))  # the shared prefix: 4 whole blocks
SOURCE = "worker-2"
# A token of prefill takes 1 s: a suffix of a block takes 16 s, so a request still computing its suffix is plainly
# not done when one that waited only for the read is. Decoding is instant.
SETTINGS = WorkerSettings(
    node_id="worker-1", capacity_blocks=16, block_bytes=64, time_scale=1, prefill_tokens_per_s=1, decode_tokens_per_s=1e9
)
FAST = SETTINGS.model_copy(update={"prefill_tokens_per_s": 1e9})  # where no request needs to be seen computing


class Transfer:
    """A transfer engine within one process: each read waits for `release`, then copies the bytes of `source`
    (kept alive here while reads may touch it), or fails."""

    session = "127.0.0.1:1"

    def __init__(self, source: KVPool, fail: bool = False) -> None:
        self.source = source
        self.fail = fail
        self.reads = 0
        self.release = threading.Event()

    def read(self, peer: str, local_addrs: list[int], remote_addrs: list[int], lengths: list[int]) -> None:
        self.reads += 1
        if not self.release.wait(30):
            raise TransferError("the test never released the read")
        if self.fail:
            raise TransferError("connection reset by peer")
        for local, remote, n in zip(local_addrs, remote_addrs, lengths):
            ctypes.memmove(local, remote, n)


def _node(node_id: str, pool: KVPool) -> NodeInfo:
    r = pool.regions[0]
    region = RegionInfo(rank=0, base_addr=r.base_addr, length=r.length, block_bytes=r.block_bytes)
    return NodeInfo(
        node_id=node_id,
        epoch=3,
        alive=True,
        api_url="http://127.0.0.1:9",
        transfer_url="127.0.0.1:2",
        regions=[region],
        blocks=BLOCKS,
        fingerprint=SETTINGS.kv_fingerprint,
    )


def _setup(settings: WorkerSettings = SETTINGS, fail: bool = False) -> tuple[Engine, Transfer, PullPlan]:
    """worker-1's engine and the plan for PREFIX on worker-2, which holds it."""
    source = KVPool(16, 64)
    hashes = identity_hashes(PREFIX, KV, 16)
    lease = source.acquire(hashes)
    for h, slot in lease.new_slots:
        source.fill(h, slot)
    source.commit(lease, hashes)
    source.release(lease)
    mine = KVPool(16, 64)
    transfer = Transfer(source, fail)
    directory: Any = Directory([_node("worker-1", mine), _node(SOURCE, source)])
    transfers: list[Any] = [transfer]
    engine = Engine(settings, mine, transfers, directory, "worker-1", EngineCounts(CollectorRegistry()))
    plan = PullPlan(source_node=SOURCE, source_epoch=3, slots=[source.location(h) or 0 for h in hashes])
    return engine, transfer, plan


def _start(engine: Engine, tokens: list[int], plan: PullPlan | None) -> tuple[asyncio.Task[bytes], RequestStats]:
    stats = RequestStats()

    async def run() -> bytes:
        return b"".join([t async for t in engine.generate(tokens, 1, plan, stats, KV)])

    return asyncio.create_task(run()), stats


async def _cancel(task: asyncio.Task[bytes]) -> None:
    """Stop a request still computing (its lease and claims go as a client's leaving would make them go)."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("follower_plan", [True, False], ids=["follower-with-the-plan", "follower-without-a-plan"])
def test_a_request_for_a_prefix_being_pulled_waits_for_that_read_only(follower_plan: bool) -> None:
    """The first request pulls PREFIX, then computes a suffix of its own (16 s); the second, for PREFIX alone,
    arrives during the read: it is served from that read as soon as it lands, without a read of its own and
    without waiting for the first one's suffix."""

    async def run() -> None:
        engine, transfer, plan = _setup()
        first, first_stats = _start(engine, PREFIX + [7] * 16, plan)
        await until(lambda: transfer.reads == 1, what="the first request's read")
        second, second_stats = _start(engine, PREFIX, plan if follower_plan else None)
        await until(lambda: engine.running == 2, what="the second request at the engine")
        transfer.release.set()
        try:
            assert await asyncio.wait_for(second, 10) == b"t"
            assert not first.done() and first_stats.prefill_s == 0  # still computing its suffix
        finally:
            await _cancel(first)
        assert transfer.reads == 1
        assert (first_stats.pulled_tokens, first_stats.local_cached_tokens) == (len(PREFIX), 0)
        assert (second_stats.cached_tokens, second_stats.local_cached_tokens) == (len(PREFIX), len(PREFIX))
        assert second_stats.pull_failures == []

    asyncio.run(run())


def test_whichever_request_with_the_plan_comes_first_reads_and_the_other_joins() -> None:
    """The gateway gives a follower of an in-flight pull the same plan, and the two may reach the engine in
    either order: the one that arrives first reads, the other waits for that read (not its own)."""

    async def run() -> None:
        engine, transfer, plan = _setup(FAST)
        follower, follower_stats = _start(engine, PREFIX, plan)
        await until(lambda: transfer.reads == 1, what="the follower's read")
        puller, puller_stats = _start(engine, PREFIX + [7] * 19, plan)
        await until(lambda: engine.running == 2, what="the request the follower follows")
        transfer.release.set()
        assert await asyncio.wait_for(asyncio.gather(follower, puller), 10) == [b"t", b"t"]
        assert transfer.reads == 1
        assert (follower_stats.pulled_tokens, follower_stats.local_cached_tokens) == (len(PREFIX), 0)
        assert (puller_stats.pulled_tokens, puller_stats.local_cached_tokens) == (0, len(PREFIX))
        assert puller_stats.pull_failures == []

    asyncio.run(run())


def test_a_failed_read_is_computed_once_and_the_waiter_reports_it_cached() -> None:
    """The read fails: the request that issued it computes the prefix (recompute, never wrong data) and the one
    waiting for the read waits for that computation instead of repeating either."""

    async def run() -> None:
        engine, transfer, plan = _setup(FAST, fail=True)
        first, first_stats = _start(engine, PREFIX, plan)
        await until(lambda: transfer.reads == 1, what="the first request's read")
        second, second_stats = _start(engine, PREFIX + [7] * 16, plan)
        await until(lambda: engine.running == 2, what="the second request at the engine")
        transfer.release.set()
        await asyncio.wait_for(asyncio.gather(first, second), 10)
        assert transfer.reads == 1 and engine.counts.pull_errors._value.get() == 1
        assert (first_stats.cached_tokens, first_stats.pull_failures) == (0, ["transfer: rank 0: connection reset by peer"])
        assert (second_stats.local_cached_tokens, second_stats.pulled_tokens) == (len(PREFIX), 0)
        assert all(engine.pool.verify(h, engine.pool.slot_of(h) or 0) for h in identity_hashes(PREFIX, KV, 16))

    asyncio.run(run())
