"""Group commit: concurrent writes coalesced into few Raft commands, and commands of unknown outcome sent again.

While up to `max_inflight` commands are being committed, new writes queue and leave together in the next
one. Every command is idempotent, so one whose outcome is unknown (leader change, lost callback, timeout)
is simply sent again until its request's deadline. Runs on the event loop; pysyncobj reports outcomes
from its own thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from pysyncobj import FAIL_REASON

from directory.state_machine import StateMachine
from kvproto import codec
from kvproto.errors import CommitTimeout
from kvproto.state import Command, Publish, Remove, Result, command_size

log = logging.getLogger("kvdir.directory")


def _weight(cmd: Command) -> int:
    return len(cmd.hashes) if isinstance(cmd, (Publish, Remove)) else 1


@dataclass(slots=True)
class _Pending:
    cmd: Command
    encoded: msgspec.Raw  # as the log carries it (codec.check_command)
    future: asyncio.Future[Result]
    deadline: float


@dataclass(slots=True)
class _InFlight:
    batch: list[_Pending]
    sent: float


class GroupCommitter:
    """Coalesces concurrent writes into few Raft commands and retries unknown outcomes."""

    def __init__(
        self,
        sm: StateMachine,
        *,
        max_inflight: int = 8,
        max_commands: int = 4096,
        max_weight: int = 65536,
        max_bytes: int = 16 << 20,
        command_timeout: float = 2.0,
        on_commit: Callable[[list[Command], list[Result], float], None] | None = None,
    ) -> None:
        self._sm = sm
        self._max_inflight = max_inflight
        self._max_commands = max_commands
        self._max_weight = max_weight
        self._max_bytes = max_bytes
        self._command_timeout = command_timeout
        self._on_commit = on_commit
        self._queue: deque[_Pending] = deque()
        self._inflight: dict[int, _InFlight] = {}
        # Outcomes reported by the Raft thread, handed to the loop with one wakeup for all that
        # arrive before it runs (a wakeup per command cost more than the rest of its callback).
        self._outcomes: deque[tuple[int, Any, int]] = deque()
        self._wake_pending = False
        self._next_token = 0
        self._wakeup = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._tasks = [asyncio.create_task(self._pump()), asyncio.create_task(self._watchdog())]

    async def submit(self, cmd: Command, timeout: float) -> Result:
        """Commit one command; raises CommitTimeout if it cannot commit before `timeout` s, and codec.WireError at
        once if the replicas could not read it back (`codec.check_command`)."""
        encoded = codec.check_command(cmd)
        fut: asyncio.Future[Result] = self._loop.create_future()
        self._queue.append(_Pending(cmd, encoded, fut, time.monotonic() + timeout))
        self._wakeup.set()
        return await fut

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for p in self._queue:
            if not p.future.done():
                p.future.set_exception(CommitTimeout("replica shutting down"))
        for f in self._inflight.values():
            for p in f.batch:
                if not p.future.done():
                    p.future.set_exception(CommitTimeout("replica shutting down"))

    async def _pump(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue and len(self._inflight) < self._max_inflight:
                self._send(self._take())

    def _take(self) -> list[_Pending]:
        batch: list[_Pending] = []
        weight = size = 0
        now = time.monotonic()
        while self._queue and len(batch) < self._max_commands:
            p = self._queue[0]
            w, b = _weight(p.cmd), command_size(p.cmd)
            if batch and (weight + w > self._max_weight or size + b > self._max_bytes):
                break
            self._queue.popleft()
            if p.future.done():
                continue
            if now > p.deadline:
                p.future.set_exception(CommitTimeout("write not committed before its deadline; retry (writes are idempotent)"))
                continue
            batch.append(p)
            weight += w
            size += b
        return batch

    def _send(self, batch: list[_Pending]) -> None:
        if not batch:
            return
        token = self._next_token
        self._next_token += 1
        self._inflight[token] = _InFlight(batch, time.monotonic())

        def done(result: Any, err: int) -> None:
            self._outcomes.append((token, result, err))
            if not self._wake_pending:
                self._wake_pending = True
                self._loop.call_soon_threadsafe(self._take_outcomes)

        self._sm.apply_batch(codec.encode_entry([p.encoded for p in batch]), callback=done)

    def _take_outcomes(self) -> None:
        self._wake_pending = False  # first: an outcome appended from here on schedules another call
        while self._outcomes:
            self._done(*self._outcomes.popleft())

    def _done(self, token: int, result: Any, err: int) -> None:
        flight = self._inflight.pop(token, None)
        if flight is None:
            return  # the watchdog already gave up on it and re-sent the writes
        if err == FAIL_REASON.SUCCESS:
            elapsed = time.monotonic() - flight.sent
            for p, r in zip(flight.batch, result):
                if not p.future.done():
                    p.future.set_result(r)
            if self._on_commit is not None:
                self._on_commit([p.cmd for p in flight.batch], result, elapsed)
        else:
            log.debug("raft command failed (reason %s), retrying %d writes", err, len(flight.batch))
            self._retry(flight.batch)
        self._wakeup.set()

    def _retry(self, batch: list[_Pending]) -> None:
        def requeue() -> None:
            self._queue.extendleft(reversed(batch))
            self._wakeup.set()

        self._loop.call_later(0.05, requeue)

    async def _watchdog(self) -> None:
        # pysyncobj may never call back under overload: give up on such commands and re-send.
        while True:
            await asyncio.sleep(self._command_timeout / 4)
            now = time.monotonic()
            for token in [t for t, f in self._inflight.items() if now - f.sent > self._command_timeout]:
                log.warning("raft command %d had no answer in %.1fs, re-sending its writes", token, self._command_timeout)
                self._retry(self._inflight.pop(token).batch)
            self._wakeup.set()
