"""NodeSession against a real one-replica directory: registration by incarnation, the pending net change,
re-registration and republishing after a 409, and the back-off after rejections."""

from __future__ import annotations

import asyncio
from typing import Any

from kvproto.client import DirectoryClient
from kvproto.schemas import Region
from kvproto.session import NodeSession
from tests.support.wait import until

NODE = "session-1"
API = "http://127.0.0.1:9"


async def _held(client: DirectoryClient, hashes: list[int]) -> dict[int, int]:
    """hash -> the epoch of NODE's entry, for each of `hashes` NODE holds (linearizable reads)."""
    out: dict[int, int] = {}
    for h in hashes:
        res = await client.lookup([h], linearizable=True)
        for x in res.holders:
            if x.node_id == NODE:
                out[h] = x.epoch
    return out


def _session(client: DirectoryClient, holds: dict[int, int], **kw: Any) -> NodeSession:
    return NodeSession(client, NODE, API, holdings=lambda: [(h, s, None) for h, s in holds.items()], block_size=16, **kw)


def test_register_publish_and_a_removal_cancels_a_pending_store(file_directory) -> None:
    c = file_directory

    async def go() -> None:
        async with DirectoryClient(c.replica_urls) as client:
            region = Region(rank=0, base_addr=4096, length=1 << 20, block_bytes=4096)
            s = _session(client, {}, regions=[region], capacity_blocks=256)
            epoch = await s.register()
            assert await s.register() == epoch  # a retry of the same incarnation: the same epoch
            nodes = {n.node_id: n for n in await client.nodes()}
            assert nodes[NODE].epoch == epoch
            s.stored([(11, 1), (12, 2), (13, 3)])
            s.removed([12])  # cancels the pending store of 12
            s.stored([(12, 4)])  # ... and this cancels that removal
            s.removed([13])
            assert s.pending_stores == {11: None, 12: None} and s.pending_removals == {13}
            assert await s.sync() is None and s.pending == 0
            assert await _held(client, [11, 12, 13]) == {11: epoch, 12: epoch}
            slots = (await client.lookup([12], with_slots=True, linearizable=True)).holders[0].slots
            assert slots == [4]
            s.removed([11])
            assert await s.sync() is None
            assert await _held(client, [11, 12]) == {12: epoch}
            assert s.stats.published_blocks == 2 and s.stats.removed_blocks == 2 and s.stats.registrations == 2
            await s.close()
            assert NODE not in {n.node_id for n in await client.nodes()}

    asyncio.run(go())


def test_a_409_after_a_registration_elsewhere_reregisters_and_republishes(file_directory) -> None:
    c = file_directory

    async def go() -> None:
        async with DirectoryClient(c.replica_urls) as client:
            holds = {21: 1, 22: 2}
            s = _session(client, holds)
            assert await s.sync() is None  # the first registration publishes the holdings
            first = s.epoch
            assert first is not None and await _held(client, [21, 22]) == {21: first, 22: first}
            # Another incarnation of the node registers: a new epoch, and our entries are gone.
            other = await client.register(NODE, API, incarnation="someone-else")
            assert other.epoch != first and await _held(client, [21, 22]) == {}
            assert not await s.heartbeat() and s.need_register  # the heartbeat's 409
            s.need_register = False  # as if the heartbeat had not run: the flush must see the 409 itself
            holds[23] = 3
            s.stored([(23, 3)])
            assert await s.sync() == 0.0 and s.need_register and s.entries_lost
            assert await s.sync() is None
            second = s.epoch
            assert second not in (None, first, other.epoch)
            assert await _held(client, [21, 22, 23]) == {21: second, 22: second, 23: second}
            assert s.stats.registrations == 2

    asyncio.run(go())


def test_an_expired_lease_is_renewed_by_registering_again(make_cluster) -> None:
    c = make_cluster(1, lease_ttl_s=1.0)

    async def go() -> None:
        async with DirectoryClient(c.replica_urls) as client:
            holds = {31: 7}
            s = _session(client, holds, load=lambda: {"running": 1.0})
            assert await s.sync() is None
            assert await s.heartbeat()
            await until(lambda: _held(client, [31]), what="the entry published")

            async def expired() -> bool:
                return not await _held(client, [31])

            await until(expired, what="the lease to run out")  # no heartbeats from here on
            task = asyncio.create_task(s.run(interval=0.05, heartbeat_interval=0.1, failed=lambda: None))
            try:
                await until(lambda: _held(client, [31]), what="the entry republished")
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            assert s.stats.registrations >= 2 and s.registered

    asyncio.run(go())


def test_rejections_drop_the_round_and_back_off(file_directory) -> None:
    c = file_directory

    async def go() -> None:
        async with DirectoryClient(c.replica_urls) as client:
            s = _session(client, {}, retry_first_s=0.05, retry_max_s=0.15)
            assert await s.sync() is None
            delays = []
            for _ in range(3):
                s.stored([(41, 1), (2**64, 1)])  # the directory refuses the hash out of range (422)
                delays.append(await s.sync())
            assert delays == [0.05, 0.1, 0.15]
            assert s.pending == 0 and s.stats.rejected == 6  # both entries of each round dropped, counted
            assert s.registered and await _held(client, [41]) == {}
            s.stored([(41, 1)])
            assert await s.sync() is None
            s.stored([(2**64, 1)])
            assert await s.sync() == 0.05  # a success reset the back-off

    asyncio.run(go())


def test_a_round_that_raises_is_counted_and_the_session_publishes_on(file_directory) -> None:
    """A `collect` that raises (a bug in the engine's bookkeeping) ended the session's task for good, silently: the
    node stopped publishing and heartbeating. Now each such round is counted and logged, and the next one runs."""
    c = file_directory
    failures: list[float] = []
    collects = 0

    def collect() -> None:
        nonlocal collects
        collects += 1
        if collects <= 2:
            raise RuntimeError(f"a bug in collect {collects}")

    async def go() -> None:
        async with DirectoryClient(c.replica_urls) as client:
            s = _session(client, {51: 3}, collect=collect, retry_first_s=0.02, retry_max_s=0.05)
            task = asyncio.create_task(s.run(interval=0.05, heartbeat_interval=0.5, failed=lambda: failures.append(1)))
            try:
                await until(lambda: _held(client, [51]), what="the entry published after two failed rounds")
                assert not task.done()
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())
    assert len(failures) == 2 and collects >= 3
