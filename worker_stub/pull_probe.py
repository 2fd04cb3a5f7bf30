"""The first pull priced right: an engine measures its pull bandwidth with a probe read before any pull.

The gateway prices a pull to an engine with the bandwidth that engine reported (`pull_gbps`), and before its first
read with `--link-gbps` or its peers' figures: a guess, which sent first pulls to engines that then read at a
fraction of it. So until the engine has a figure, it reads a pull's worth of a peer's registered device memory
(`blocks` blocks per TP rank, through the same transfer engines, all ranks at once, as a pull reads) into scratch
memory of its own, and counts that read as a completed pull's (`Engine.pull_bandwidth`, which its heartbeats
report). The bytes read are dropped: nothing lands in the KV pool, nothing is verified or published.

The source is a peer this engine may pull from by the pull rules (same KV fingerprint and TP size, a tenant it
trusts: `stub_engine.source_refusal`), the first by node id: no engine reads memory a pull plan could not have
sent it to. With no such peer yet (or no directory answering), it looks again at the next round; once the engine
measured (a probe or a real pull), or after `PROBE_TRIES` failed reads, rounds cost nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from kvproto import media
from kvproto.client import DirectoryClient
from kvproto.errors import DirectoryError
from kvproto.ranks import rank_sessions
from kvproto.schemas import NodeInfo
from kvtransfer.bandwidth import PullBandwidth
from kvtransfer.engine import TransferEngine
from worker_stub.config import WorkerSettings
from worker_stub.stub_engine import read_rank, source_refusal

log = logging.getLogger("kvdir.worker")

PROBE_INTERVAL_S = 1.0
"""How often an engine without a measured bandwidth looks for a peer to probe."""

PROBE_TRIES = 3
"""Probe reads that may fail before the engine stops probing (its first pull measures then)."""


def probe_source(settings: WorkerSettings, node_id: str, nodes: list[NodeInfo]) -> NodeInfo | None:
    """The peer `node_id` may read for a probe (None: none yet, or the engine is not listed yet)."""
    me = next((n for n in nodes if n.node_id == node_id), None)
    if me is None:
        return None
    peers = sorted((n for n in nodes if n.node_id != node_id and n.alive and n.transfer_url), key=lambda n: n.node_id)
    return next((n for n in peers if source_refusal(settings, node_id, me, n) is None), None)


class PullProbe:
    """One engine's probe: scratch memory registered with each rank's transfer engine, and `step` for `every`."""

    def __init__(
        self,
        settings: WorkerSettings,
        node_id: str,
        transfers: list[TransferEngine],
        directory: DirectoryClient,
        bandwidth: PullBandwidth,
    ) -> None:
        self.s, self.node_id, self.transfers, self.directory, self.bandwidth = settings, node_id, transfers, directory, bandwidth
        self.block_bytes = settings.block_bytes
        self.blocks = settings.pull_probe_blocks
        # One buffer per rank, as each rank's transfer engine reads into memory registered with it.
        self._scratch = [np.zeros(self.blocks * self.block_bytes, np.uint8) for _ in transfers]
        self.failed = 0  # probe reads that failed
        for transfer, buf in zip(transfers, self._scratch, strict=True):
            transfer.register(buf.ctypes.data, buf.nbytes)

    async def step(self) -> None:
        """Probe a peer if this engine has not measured its bandwidth yet."""
        if self.bandwidth.gbps is not None or self.failed >= PROBE_TRIES:
            return
        try:
            nodes = await self.directory.nodes()
        except DirectoryError:
            return  # the directory is down: not this task's failure; the next round asks again
        peer = probe_source(self.s, self.node_id, nodes)
        if peer is None or peer.transfer_url is None:
            return
        sessions = rank_sessions(peer.regions, peer.transfer_url)
        device = {r.rank: r for r in peer.regions if r.medium == media.tier(media.DEVICE)}  # as a pull's lookup
        reads, nbytes = [], 0
        for rank, (transfer, buf) in enumerate(zip(self.transfers, self._scratch, strict=True)):
            theirs, session = device.get(rank), sessions[rank]
            if theirs is None or session is None or theirs.block_bytes != self.block_bytes:
                log.info(
                    "pull probe: %s has no device region of %d-byte blocks for rank %d", peer.node_id, self.block_bytes, rank
                )
                return
            n = min(self.blocks, theirs.length // theirs.block_bytes)
            local = [buf.ctypes.data + i * self.block_bytes for i in range(n)]
            remote = [theirs.base_addr + i * theirs.block_bytes for i in range(n)]
            reads.append(read_rank(transfer, session, local, remote, [self.block_bytes] * n))
            nbytes += n * self.block_bytes
        t = time.perf_counter()
        outcomes = await asyncio.gather(*reads)
        seconds = time.perf_counter() - t
        errors = [f"rank {rank}: {e}" for rank, (_, e) in enumerate(outcomes) if e is not None]
        if errors:
            self.failed += 1
            log.info("pull probe of %s failed (%s), %d of %d tries", peer.node_id, "; ".join(errors), self.failed, PROBE_TRIES)
            return
        self.bandwidth.add(nbytes, seconds)
        log.info("pull probe of %s: %d bytes in %.1f ms, %.2f GB/s", peer.node_id, nbytes, seconds * 1e3, nbytes / seconds / 1e9)
