"""When a `Feed` leaves its source (gateway.mirror): for a replica shown to be caught up, not merely because
the source's ticks say "not caught up" (during an election every replica says so). The replicas here are
small HTTP servers on 127.0.0.1 that speak the watch stream's wire format with a chosen freshness: a real
cluster cannot be held in the "every replica stale" or "only one stale" state on demand."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from gateway.mirror import Feed
from kvproto.codec import MEDIA_TYPE, frame, group_of, snapshot_message, snapshot_of, tick_frame
from kvproto.state import DirectoryState, Register, new_epoch_base
from tests.support.wait import until

TICK_S = 0.05


def _state() -> DirectoryState:
    """A state with one node: a group with an identity (one without can only be followed from a snapshot)."""
    state = DirectoryState()
    state.apply(Register("n1", "i1", "http://127.0.0.1:1", epoch_base=new_epoch_base(12345)))
    return state


class FakeReplica:
    """Answers `GET /v1/watch`: a snapshot of a one-node state (without `from`), then ticks saying `fresh`."""

    def __init__(self, fresh: bool) -> None:
        self.fresh = fresh
        self.requests: list[str] = []
        self.url = ""
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> FakeReplica:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        for w in self._writers:
            w.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            target = (await reader.readline()).decode().split(" ")[1]
            while (await reader.readline()) not in (b"\r\n", b""):
                pass
            self.requests.append(target)
            writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: {MEDIA_TYPE}\r\nConnection: close\r\n\r\n".encode())
            state = _state()
            if "from=" not in target:
                writer.write(frame(snapshot_message(snapshot_of(state))))
            while self._server is not None and self._server.is_serving():
                writer.write(tick_frame(state.applied, self.fresh, 0.5, group=group_of(state)))
                await writer.drain()
                await asyncio.sleep(TICK_S)
        except (ConnectionError, IndexError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()


def _run(scenario: Callable[[FakeReplica, FakeReplica], Awaitable[None]], a_fresh: bool, b_fresh: bool) -> None:
    async def main() -> None:
        async with FakeReplica(a_fresh) as a, FakeReplica(b_fresh) as b:
            await scenario(a, b)

    asyncio.run(main())


def test_a_source_stale_like_every_other_replica_is_kept() -> None:
    async def scenario(a: FakeReplica, b: FakeReplica) -> None:
        feed = Feed([a.url, b.url], None, max_lag_s=0.3)
        feed.start()
        try:
            await until(lambda: feed.state is not None, "the snapshot", timeout=5.0)
            # A stale source is asked about once per probe round: a third question to B means the feed took B's
            # first two answers ("not caught up" too) and kept A each time.
            await until(lambda: sum("from=" in t for t in b.requests) >= 3, "B to be asked three times", timeout=5.0)
            assert feed.failovers == 0 and a.requests == ["/v1/watch"]
            assert not feed.fresh()  # still stale: the gateway's lookups go over REST meanwhile
        finally:
            await feed.stop()

    _run(scenario, a_fresh=False, b_fresh=False)


def test_a_stale_source_is_left_for_a_replica_that_is_caught_up() -> None:
    async def scenario(a: FakeReplica, b: FakeReplica) -> None:
        feed = Feed([a.url, b.url], None, max_lag_s=0.3)
        feed.start()
        try:
            await until(feed.fresh, "a fresh feed, from B", timeout=5.0)
            assert feed.failovers == 1 and feed.snapshots == 1  # resumed from its position on B, no new snapshot
            assert b.requests[-1] == f"/v1/watch?from=1&group={group_of(_state())}"
        finally:
            await feed.stop()

    _run(scenario, a_fresh=False, b_fresh=True)


def test_a_failure_of_any_kind_restarts_the_feed_from_a_snapshot_and_is_counted(monkeypatch) -> None:
    """An exception the feed does not expect (here the snapshot's decoding raising RuntimeError once) used to end
    its task for good, the gateway on REST lookups until restarted; now it is logged, counted, and the feed
    snapshots again from the next replica."""
    import gateway.mirror

    real, calls = gateway.mirror.state_from, []

    def flaky(snap: dict[str, object]) -> DirectoryState:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("an unexpected failure")
        return real(snap)

    monkeypatch.setattr(gateway.mirror, "state_from", flaky)

    async def scenario(a: FakeReplica, b: FakeReplica) -> None:
        feed = Feed([a.url, b.url], None, max_lag_s=0.3)
        feed.start()
        try:
            await until(feed.fresh, "a fresh feed after the failure", timeout=5.0)
            assert feed.restarts == 1 and feed.snapshots == 1 and len(calls) == 2
            assert a.requests == ["/v1/watch"] and b.requests[0] == "/v1/watch"  # the next replica, from a snapshot
            assert feed._task is not None and not feed._task.done()
        finally:
            await feed.stop()

    _run(scenario, a_fresh=True, b_fresh=True)
