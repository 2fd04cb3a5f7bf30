"""The stream of `GET /v1/watch` (routed in directory.api): the directory's state and then every committed
change, for consumers that keep a mirror.

Without `from`, the stream starts with a snapshot of the state at some position P, then sends every
batch committed after P, in commit order; with `from=N` it sends the batches after N (a consumer
resuming, here or on another replica: positions are the same on every replica). If the batches
after N are no longer kept (directory.changefeed), the answer is 410 and the consumer asks again
without `from`. While nothing changes, a tick every `TICK_S` says the replica's position and whether
it is caught up with a leader (its staleness bound), so a consumer knows how fresh its mirror is.
The frames are kvproto.codec's.

Positions number one group's log only. A consumer resuming says which group it followed (`group=G`,
codec.group_of, which the snapshot and every tick carry): another group's position (a directory
rebuilt from empty data dirs, a shard name reused) is 410 `foreign_group`, whatever its number. With its
own group's, a position beyond this replica's is a replica lagging the one the consumer followed: the
stream waits for it. Without `group` (a consumer of before group identities) a future position cannot be
told from another directory's and is 410 `future_position`. A group has no identity before its first
registration (its state holds no node then, so a snapshot is cheap): it resumes nobody who names one.

Entries are keyed per tenant with keys only the replicas can compute (directory.tenancy), so the
stream cannot be cut down to one tenant: a token confined to a tenant is refused (403) and its
holder uses lookups (`POST /v1/lookup`), which apply its tenant.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio.to_thread
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from directory.changefeed import Ahead, Compacted
from directory.replica import Replica
from kvproto.state import Command, DirectoryState

if TYPE_CHECKING:
    from directory.metrics import DirectoryMetrics
from kvproto.codec import MEDIA_TYPE, batch_frame, capture, group_of, snapshot_frame_parts, tick_frame

log = logging.getLogger("kvdir.directory")

TICK_S = 0.1  # how often an idle stream says where it stands (a consumer's lag resolution)


class ForeignGroup(Compacted):
    """A resume from another group's history (a directory rebuilt, another shard): the consumer re-snapshots."""


class FuturePosition(Compacted):
    """A resume from beyond this replica's position that names no group, so it cannot be told from another
    directory's history: the consumer re-snapshots (or names its group)."""


class TooManyWatchers(Exception):
    """A watch stream over a cap (`Watchers`): 429."""


class Watchers:
    """Who follows the stream on this replica, within its caps, and the snapshot frame they share.

    Each open stream counts against `--watch-max-streams` and its key's `--watch-max-streams-per-token` (the
    token's line, or the client's address with auth off). A snapshot frame is built once (its entries read off
    the state lock: codec.capture) and shared by every stream that starts within `SNAPSHOT_REUSE_S` while
    the feed still holds the changes after it, so twenty watchers joining at once cost one frame, not twenty.
    """

    def __init__(self, max_streams: int, max_per_key: int, stall_s: float, metrics: DirectoryMetrics) -> None:
        self.max_streams, self.max_per_key, self.stall_s = max_streams, max_per_key, stall_s
        self._metrics = metrics
        self._open: dict[str, int] = {}
        self._building = asyncio.Lock()
        self._shared: tuple[list[bytes | memoryview], int, float] | None = None  # (frame's parts, position, made at)

    def __len__(self) -> int:
        return sum(self._open.values())

    def admit(self, key: str) -> None:
        """Count a stream for `key`; TooManyWatchers over a cap."""
        held = self._open.get(key, 0)
        if len(self) >= self.max_streams:
            self._metrics.watch_refused.labels("streams").inc()
            raise TooManyWatchers(f"this replica serves at most {self.max_streams} watch streams (--watch-max-streams)")
        if held >= self.max_per_key:
            self._metrics.watch_refused.labels("per_token").inc()
            raise TooManyWatchers(
                f"this token (or address) holds {held} watch streams already, the most it may "
                "(--watch-max-streams-per-token): one per mirror is enough"
            )
        self._open[key] = held + 1
        self._metrics.watchers.set(len(self))

    def leave(self, key: str) -> None:
        left = self._open.pop(key) - 1
        if left:
            self._open[key] = left
        elif not self._open:
            self._shared = None  # nobody to share it with: its bytes go (a stream still sending holds its own reference)
        self._metrics.watchers.set(len(self))

    def cut(self, reason: str) -> None:
        self._metrics.watch_cut.labels(reason).inc()

    async def snapshot(self, replica: Replica) -> tuple[list[bytes | memoryview], int]:
        """A snapshot frame (in parts: `snapshot_frame_parts`) and its position: the shared one if it is recent and still resumable, else a new one."""
        async with self._building:
            shared = self._shared
            if shared is not None and time.monotonic() - shared[2] < SNAPSHOT_REUSE_S and shared[1] >= replica.sm.feed.start:
                return shared[0], shared[1]
            self._shared = None  # let the old frame go before the new one is built
            captured, position = await replica.read(lambda s: (capture(s), s.applied))
            data = await anyio.to_thread.run_sync(snapshot_frame_parts, *captured)
            self._shared = (data, position, time.monotonic())
            return data, position


SNAPSHOT_REUSE_S = 2.0  # how old a shared snapshot frame may be for a new stream (it catches up from the feed)
CHUNK_BYTES = 256 << 10  # a stream's frames go out in pieces of at most this: what one send may add to a buffer


async def open_stream(
    replica: Replica, watchers: Watchers, key: str, from_: int | None, group: int | None = None
) -> StreamingResponse:
    """The stream from a snapshot (`from_` None) or from position `from_` of group `group`, counted for `key`;
    Compacted (or one of its kinds above) if the stream cannot go on from there, TooManyWatchers over a cap.
    The route (directory.api) checks who may watch."""
    feed = replica.sm.feed

    def resumable(s: DirectoryState, position: int) -> None:
        ours = group_of(s)
        if group is not None and group != ours:
            raise ForeignGroup(f"position {position} of group {group} is not this directory's history (its group is {ours})")
        try:
            feed.after(position)  # raises Compacted if the changes after `from` are gone
        except Ahead as exc:
            if group is None:
                raise FuturePosition(f"{exc}, and without `group` it cannot be told from another directory's") from exc

    if from_ is not None:
        await replica.read(functools.partial(resumable, position=from_))
    watchers.admit(key)
    # Named and ours: a position beyond this replica's is one it will reach (the same log): wait for it.
    stream = _stream(replica, watchers, from_, wait_ahead=group is not None)
    return _WatchResponse(stream, watchers, key)


class _WatchResponse(StreamingResponse):
    """The stream's frames sent in `CHUNK_BYTES` pieces, each of which the consumer must accept within
    `--watch-stall-s` (uvicorn sends a piece once the socket's buffer has drained): a consumer that stops
    reading holds at most a piece and the socket's buffer, and is cut off (logged and counted: the reason
    cannot reach a consumer that does not read). The stream counts against its key until it ends."""

    def __init__(self, stream: AsyncIterator[bytes | memoryview], watchers: Watchers, key: str) -> None:
        super().__init__(stream, media_type=MEDIA_TYPE)
        self._watchers, self._key = watchers, key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._watchers.leave(self._key)

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        stall = self._watchers.stall_s
        async for data in self.body_iterator:
            view = memoryview(data)  # type: ignore[arg-type]
            for i in range(0, len(view), CHUNK_BYTES):
                try:
                    await asyncio.wait_for(
                        send({"type": "http.response.body", "body": view[i : i + CHUNK_BYTES], "more_body": True}), stall
                    )
                except TimeoutError:
                    log.warning(
                        "watch stream of %s cut off: it accepted none of the next %d bytes for %gs (--watch-stall-s)",
                        self._key,
                        len(view) - i,
                        stall,
                    )
                    self._watchers.cut("slow_consumer")
                    return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _stream(
    replica: Replica, watchers: Watchers, from_: int | None, *, wait_ahead: bool
) -> AsyncIterator[bytes | memoryview]:
    feed = replica.sm.feed
    bound = replica.settings.raft_max_timeout_s
    event = feed.waiter()
    try:
        if from_ is None:
            # After the headers (a consumer knows at once that this replica answers), and off the event
            # loop: a big snapshot takes a while to encode (5M entries: 80 MB).
            parts, position = await watchers.snapshot(replica)
            for part in parts:
                yield part
        else:
            position = from_
        while True:
            event.clear()

            def after(s: DirectoryState, p: int = position) -> tuple[list[tuple[int, list[Command]]], int | None]:
                return feed.after(p, wait_ahead=wait_ahead), group_of(s)  # the group at the last batch's position

            try:
                batches, group = await replica.read(after)
            except Compacted as exc:  # fell behind what the feed keeps, or a snapshot from the leader replaced the state
                log.info("watch stream at %d ended: %s", position, exc)
                watchers.cut("compacted")
                return
            for pos, commands in batches:
                yield batch_frame(pos, commands)
                position = pos
            yield tick_frame(position, replica.raft.fresh_within(bound), bound, group=group)
            try:
                await asyncio.wait_for(event.wait(), TICK_S)
            except TimeoutError:
                pass
    finally:
        feed.forget(event)
