"""The stream of `GET /v1/watch` (routed in directory.api): the directory's state and then every committed
change, for consumers that keep a mirror.

Without `from`, the stream starts with a snapshot of the state at some position P, then sends every
batch committed after P, in commit order; with `from=N` it sends the batches after N (a consumer
resuming, here or on another replica: positions are the same on every replica). If the batches
after N are no longer kept (directory.changefeed), the answer is 410 and the consumer asks again
without `from`. While nothing changes, a tick every `TICK_S` says the replica's position and whether
it is caught up with a leader (its staleness bound), so a consumer knows how fresh its mirror is.
The frames are directory.watch_codec's.

Entries are keyed per tenant with keys only the replicas can compute (directory.tenancy), so the
stream cannot be cut down to one tenant: a token confined to a tenant is refused (403) and its
holder uses lookups (`POST /v1/lookup`), which apply its tenant.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio.to_thread
from fastapi.responses import StreamingResponse

from directory.changefeed import Compacted
from directory.replica import Replica
from directory.state import Command, DirectoryState
from directory.watch_codec import MEDIA_TYPE, batch_frame, frame, snapshot_message, snapshot_of, tick_frame

log = logging.getLogger("kvdir.directory")

TICK_S = 0.1  # how often an idle stream says where it stands (a consumer's lag resolution)


async def open_stream(replica: Replica, from_: int | None) -> StreamingResponse:
    """The stream from a snapshot (`from_` None) or from position `from_`; Compacted if the changes after
    `from_` are no longer kept. The route (directory.api) checks who may watch."""
    feed = replica.sm.feed

    def start(s: DirectoryState) -> tuple[dict[str, Any] | None, int]:
        if from_ is None:
            return snapshot_of(s), s.applied  # copies, under the lock; encoded in the stream, off it
        feed.after(from_)  # raises Compacted if the changes after `from` are gone
        return None, from_

    snap, position = await replica.read(start)
    return StreamingResponse(_stream(replica, snap, position), media_type=MEDIA_TYPE)


async def _stream(replica: Replica, snap: dict[str, Any] | None, position: int) -> AsyncIterator[bytes]:
    feed = replica.sm.feed
    bound = replica.settings.raft_max_timeout_s
    event = feed.waiter()
    try:
        if snap is not None:
            # After the headers (a consumer knows at once that this replica answers), and off the event
            # loop: a big snapshot takes a while to encode (5M entries: 80 MB).
            yield await anyio.to_thread.run_sync(frame, snapshot_message(snap))
        while True:
            event.clear()

            def after(_: DirectoryState, p: int = position) -> list[tuple[int, list[Command]]]:
                return feed.after(p)

            try:
                batches = await replica.read(after)
            except Compacted as exc:  # a snapshot from the leader replaced this replica's state
                log.info("watch stream at %d ended: %s", position, exc)
                return
            for pos, commands in batches:
                yield batch_frame(pos, commands)
                position = pos
            yield tick_frame(position, replica.raft.fresh_within(bound), bound)
            try:
                await asyncio.wait_for(event.wait(), TICK_S)
            except TimeoutError:
                pass
    finally:
        feed.forget(event)
