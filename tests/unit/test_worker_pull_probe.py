"""The worker stub's pull bandwidth probe (worker_stub.pull_probe), with the directory and the transfer engine faked
(no sockets): which peer it reads, what it reads and where to, and that a measured engine reads nothing more."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvproto.errors import DirectoryUnavailable
from kvproto.schemas import NodeInfo, RegionInfo
from kvtransfer.bandwidth import PullBandwidth
from kvtransfer.engine import TransferError
from tests.support.fakes import Directory
from worker_stub.config import WorkerSettings
from worker_stub.pull_probe import PROBE_TRIES, PullProbe, probe_source

SETTINGS = WorkerSettings(node_id="worker-1", capacity_blocks=8, block_bytes=64, time_scale=0, pull_probe_blocks=4)


class Transfer:
    """Records what is registered and read; `fail` makes reads raise as a transfer engine does."""

    session = "127.0.0.1:1"

    def __init__(self) -> None:
        self.registered: list[tuple[int, int]] = []
        self.reads: list[tuple[str, list[int], list[int], list[int]]] = []
        self.fail = False

    def register(self, addr: int, length: int) -> None:
        self.registered.append((addr, length))

    def read(self, peer: str, local_addrs: list[int], remote_addrs: list[int], lengths: list[int]) -> None:
        if self.fail:
            raise TransferError("connection refused")
        self.reads.append((peer, local_addrs, remote_addrs, lengths))


def node(node_id: str, *, fingerprint: str | None = None, tenant: str = "", medium: str | None = None, **kw: Any) -> NodeInfo:
    regions = [RegionInfo(rank=0, base_addr=1 << 40, length=8 * 64, block_bytes=64, medium=medium)]
    fields: dict[str, Any] = dict(
        node_id=node_id,
        epoch=3,
        alive=True,
        api_url="http://127.0.0.1:9",
        transfer_url=f"127.0.0.1:{100 + len(node_id)}",
        regions=regions,
        blocks=0,
        fingerprint=fingerprint or SETTINGS.kv_fingerprint,
        tenant=tenant,
    )
    return NodeInfo(**(fields | kw))


def test_the_source_is_the_first_peer_a_pull_plan_could_name() -> None:
    me = node("worker-1")
    assert probe_source(SETTINGS, "worker-1", [node("worker-2")]) is None  # not listed itself: its tenant is unknown
    assert probe_source(SETTINGS, "worker-1", [me]) is None  # no peer
    refused = [
        node("a-other-model", fingerprint="stub-other"),
        node("b-other-tenant", tenant="t2"),
        node("c-dead", alive=False),
        node("d-no-transfer", transfer_url=None),
    ]
    assert probe_source(SETTINGS, "worker-1", [me, *refused]) is None
    chosen = probe_source(SETTINGS, "worker-1", [me, *refused, node("z-peer"), node("y-peer")])
    assert chosen is not None and chosen.node_id == "y-peer"


def _probe(nodes: list[NodeInfo]) -> tuple[PullProbe, Transfer, PullBandwidth]:
    transfer, bandwidth = Transfer(), PullBandwidth()
    directory: Any = Directory(nodes)
    return PullProbe(SETTINGS, "worker-1", [transfer], directory, bandwidth), transfer, bandwidth  # type: ignore[list-item]


def test_a_probe_reads_a_pull_of_a_peers_device_memory_into_its_own_scratch_and_measures_it() -> None:
    probe, transfer, bandwidth = _probe([node("worker-1"), node("worker-2")])
    ((scratch, length),) = transfer.registered
    assert length == 4 * 64  # pull_probe_blocks blocks of block_bytes, registered with the rank's transfer engine
    asyncio.run(probe.step())
    ((peer, local, remote, lengths),) = transfer.reads
    assert peer == "127.0.0.1:108"  # worker-2's transfer session
    assert local == [scratch + i * 64 for i in range(4)]  # the scratch memory, never the KV pool
    assert remote == [(1 << 40) + i * 64 for i in range(4)] and lengths == [64] * 4
    assert bandwidth.gbps is not None and bandwidth.reads == 1
    asyncio.run(probe.step())
    assert len(transfer.reads) == 1  # measured: no more probes


def test_a_probe_reads_only_a_device_region_of_the_same_block_size() -> None:
    for peer in (
        node("worker-2", medium="host"),
        node("worker-2", regions=[RegionInfo(rank=0, base_addr=0, length=512, block_bytes=32)]),
    ):
        probe, transfer, bandwidth = _probe([node("worker-1"), peer])
        asyncio.run(probe.step())
        assert transfer.reads == [] and bandwidth.gbps is None


@pytest.mark.parametrize("blocks", [2, 4])
def test_a_probe_reads_no_more_than_the_peers_region_holds(blocks: int) -> None:
    small = RegionInfo(rank=0, base_addr=1 << 40, length=blocks * 64, block_bytes=64)
    probe, transfer, _ = _probe([node("worker-1"), node("worker-2", regions=[small])])
    asyncio.run(probe.step())
    ((_, _, remote, _),) = transfer.reads
    assert len(remote) == min(blocks, 4)


def test_a_failed_probe_measures_nothing_and_is_tried_again_a_bounded_number_of_times() -> None:
    probe, transfer, bandwidth = _probe([node("worker-1"), node("worker-2")])
    transfer.fail = True
    asyncio.run(probe.step())
    assert bandwidth.gbps is None  # a failed read measures a timeout, not a link
    transfer.fail = False
    asyncio.run(probe.step())
    assert bandwidth.gbps is not None and len(transfer.reads) == 1
    # A source whose reads keep failing is given up after PROBE_TRIES: the engine's first pull measures then.
    probe, transfer, bandwidth = _probe([node("worker-1"), node("worker-2")])
    transfer.fail = True
    for _ in range(PROBE_TRIES + 2):
        asyncio.run(probe.step())
    assert probe.failed == PROBE_TRIES and bandwidth.gbps is None


def test_a_directory_that_does_not_answer_is_no_probe_failure() -> None:
    """Not a bug of the task (which `every` would count and log with a traceback every round): the next round asks."""

    class Down:
        async def nodes(self, *, deadline: float | None = None) -> list[NodeInfo]:
            raise DirectoryUnavailable("no replica answered")

    transfer, bandwidth = Transfer(), PullBandwidth()
    probe = PullProbe(SETTINGS, "worker-1", [transfer], Down(), bandwidth)  # type: ignore[list-item, arg-type]
    asyncio.run(probe.step())
    assert transfer.reads == [] and probe.failed == 0
