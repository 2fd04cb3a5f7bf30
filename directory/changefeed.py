"""The replica's change feed: the last committed command batches, by log position, for `GET /v1/watch`.

A position is `DirectoryState.applied`, the count of commands applied since the directory's
beginning: part of the replicated state (snapshots carry it), so every replica gives the same
position to the same batch, and a watcher that followed one replica resumes on another. The Raft
thread appends each batch right after applying it (`StateMachine.apply_batch`), under the state lock,
so a snapshot taken under that lock and the feed never disagree on what came after it.

The feed keeps at most `max_bytes` of batches (by `command_size`; at least the newest batch): a
watcher that falls further behind, or a replica that installs a snapshot from its leader (which
skips batches this replica never saw), makes older positions unavailable, and the watcher
re-snapshots (410 on `GET /v1/watch?from=N`).

A position beyond the feed's is `Ahead`: either the replica lags the one the watcher followed, or the
watcher followed another directory (one rebuilt from empty data dirs, a reused shard name) whose
history this one never had. Only the group's identity (kvproto.codec.group_of) tells the two
apart: the stream (directory.watch) waits for a lagging replica of the watcher's own group and
refuses every other future position (410).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from kvproto.state import Command, command_size


class Compacted(LookupError):
    """The changes after a position are no longer kept: take a snapshot."""


class Ahead(Compacted):
    """A position this replica has not reached: from its own future, or from another directory's history."""


def _weight(commands: list[Command]) -> int:
    return sum(command_size(c) for c in commands)


@dataclass
class ChangeFeed:
    """Committed batches after `start` (exclusive), newest last; wakes watchers on the event loop."""

    max_bytes: int
    start: int = 0
    position: int = 0
    batches: deque[tuple[int, list[Command]]] = field(default_factory=deque)
    _weight: int = 0
    _waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = field(default_factory=set)

    def append(self, position: int, commands: list[Command]) -> None:
        """Record the batch that brought the state to `position` (Raft thread, under the state lock)."""
        self.batches.append((position, commands))
        self.position = position
        self._weight += _weight(commands)
        while self._weight > self.max_bytes and len(self.batches) > 1:
            dropped, old = self.batches.popleft()
            self._weight -= _weight(old)
            self.start = dropped
        self._wake()

    def reset(self, position: int) -> None:
        """The state was replaced by a snapshot at `position`: nothing before it can be replayed."""
        self.batches.clear()
        self._weight = 0
        self.start = self.position = position
        self._wake()

    def after(self, position: int, *, wait_ahead: bool = False) -> list[tuple[int, list[Command]]]:
        """The batches that follow `position` (under the state lock); Compacted if some are gone, Ahead if
        `position` is beyond this feed's (none yet with `wait_ahead`: the caller knows it will come)."""
        if position < self.start:
            raise Compacted(f"position {position} is no longer kept (the oldest kept is {self.start})")
        if position > self.position:
            if wait_ahead:
                return []
            raise Ahead(f"position {position} is beyond this replica's ({self.position})")
        if position == self.position:
            return []
        # Batches are in order, and a watcher asks for the newest ones: scan from the newest end.
        out: list[tuple[int, list[Command]]] = []
        for pos, commands in reversed(self.batches):
            if pos <= position:
                break
            out.append((pos, commands))
        out.reverse()
        return out

    def waiter(self) -> asyncio.Event:
        """An event set at the next append or reset; release it with `forget`."""
        event = asyncio.Event()
        self._waiters.add((asyncio.get_running_loop(), event))
        return event

    def forget(self, event: asyncio.Event) -> None:
        self._waiters = {w for w in self._waiters if w[1] is not event}

    def _wake(self) -> None:
        for loop, event in list(self._waiters):
            if not loop.is_closed():
                loop.call_soon_threadsafe(event.set)
