"""Background tasks: supervised while they run, and stopped one way for every service, since cancelling once is
not enough.

A task awaiting `asyncio.wait_for` can swallow a cancellation that arrives as the inner await completes
(CPython gh-86296, Python 3.11), and code that catches `CancelledError` to clean up can swallow it too: a
`task.cancel()` followed by one `gather` then waits for a task that goes on running, and the service's
stop hangs. `cancel_and_wait` cancels again until every task has ended.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

RECANCEL_S = 0.1
"""How long a cancelled task has to end before it is cancelled again."""


async def cancel_and_wait(*tasks: asyncio.Task[object] | asyncio.Future[object] | None) -> None:
    """Cancel each task (None: none started) until it has ended; their outcomes are dropped (a failure was the
    task's to report)."""
    pending = {t for t in tasks if t is not None and not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    for ended in tasks:
        if ended is not None and not ended.cancelled():
            ended.exception()  # retrieved, so that asyncio logs no "exception was never retrieved"


async def supervise(
    run: Callable[[], Awaitable[object]],
    failed: Callable[[], str],
    *,
    stopping: Callable[[], bool],
    retry_s: tuple[float, float],
    stable_s: float,
    log: logging.Logger,
) -> None:
    """`run` until it returns, started again whatever else ends it (a cancellation, or `stopping()`, aside): a task
    that dies silently leaves its service on stale state for good. Each failure calls `failed` (the caller counts it,
    fails over...; it returns the log line), is logged with its traceback, and `run` restarts after a backoff that
    doubles while it keeps failing within `stable_s` of its start, from `retry_s[0]` to at most `retry_s[1]`."""
    delay = retry_s[0]
    while not stopping():
        started = time.monotonic()
        try:
            await run()
            return
        except Exception:
            if stopping():
                return
            log.exception("%s", failed())
        delay = retry_s[0] if time.monotonic() - started >= stable_s else min(delay * 2, retry_s[1])
        await asyncio.sleep(delay)
