"""The stream of `GET /v1/watch` (routed in directory.api): the directory's state and then every committed
change, for consumers that keep a mirror.

Without `from`, the stream starts with a snapshot of the state at some position P, then sends every
batch committed after P, in commit order; with `from=N` it sends the batches after N (a consumer
resuming, here or on another replica: positions are the same on every replica). If the batches
after N are no longer kept (directory.changefeed), the answer is 410 and the consumer asks again
without `from`. While nothing changes, a tick every `TICK_S` says the replica's position and whether
it is caught up with a leader (its staleness bound), so a consumer knows how fresh its mirror is.
The frames are directory.watch_codec's.

Positions number one group's log only. A consumer resuming says which group it followed (`group=G`,
watch_codec.group_of, which the snapshot and every tick carry): another group's position (a directory
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
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio.to_thread
from fastapi.responses import StreamingResponse

from directory.changefeed import Ahead, Compacted
from directory.replica import Replica
from directory.state import Command, DirectoryState
from directory.watch_codec import MEDIA_TYPE, batch_frame, frame, group_of, snapshot_message, snapshot_of, tick_frame

log = logging.getLogger("kvdir.directory")

TICK_S = 0.1  # how often an idle stream says where it stands (a consumer's lag resolution)


class ForeignGroup(Compacted):
    """A resume from another group's history (a directory rebuilt, another shard): the consumer re-snapshots."""


class FuturePosition(Compacted):
    """A resume from beyond this replica's position that names no group, so it cannot be told from another
    directory's history: the consumer re-snapshots (or names its group)."""


async def open_stream(replica: Replica, from_: int | None, group: int | None = None) -> StreamingResponse:
    """The stream from a snapshot (`from_` None) or from position `from_` of group `group`; Compacted (or one
    of its kinds above) if the stream cannot go on from there. The route (directory.api) checks who may watch."""
    feed = replica.sm.feed

    def start(s: DirectoryState) -> tuple[dict[str, Any] | None, int]:
        if from_ is None:
            return snapshot_of(s), s.applied  # copies, under the lock; encoded in the stream, off it
        ours = group_of(s)
        if group is not None and group != ours:
            raise ForeignGroup(f"position {from_} of group {group} is not this directory's history (its group is {ours})")
        try:
            feed.after(from_)  # raises Compacted if the changes after `from` are gone
        except Ahead as exc:
            if group is None:
                raise FuturePosition(f"{exc}, and without `group` it cannot be told from another directory's") from exc
        return None, from_

    snap, position = await replica.read(start)
    # Named and ours: a position beyond this replica's is one it will reach (the same log): wait for it.
    stream = _stream(replica, snap, position, wait_ahead=group is not None)
    return StreamingResponse(stream, media_type=MEDIA_TYPE)


async def _stream(replica: Replica, snap: dict[str, Any] | None, position: int, *, wait_ahead: bool) -> AsyncIterator[bytes]:
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

            def after(s: DirectoryState, p: int = position) -> tuple[list[tuple[int, list[Command]]], int | None]:
                return feed.after(p, wait_ahead=wait_ahead), group_of(s)  # the group at the last batch's position

            try:
                batches, group = await replica.read(after)
            except Compacted as exc:  # a snapshot from the leader replaced this replica's state
                log.info("watch stream at %d ended: %s", position, exc)
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
