"""Stopping background tasks: one way for every service, since cancelling once is not enough.

A task awaiting `asyncio.wait_for` can swallow a cancellation that arrives as the inner await completes
(CPython gh-86296, Python 3.11), and code that catches `CancelledError` to clean up can swallow it too: a
`task.cancel()` followed by one `gather` then waits for a task that goes on running, and the service's
stop hangs. `cancel_and_wait` cancels again until every task has ended.
"""

from __future__ import annotations

import asyncio

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
