"""Background tasks: supervised while they run (`supervise` for a task that should run for good, `every` for one
that does a step at an interval), and stopped one way for every service, since cancelling once is not enough.

A task awaiting `asyncio.wait_for` can swallow a cancellation that arrives as the inner await completes
(CPython gh-86296, Python 3.11), and code that catches `CancelledError` to clean up can swallow it too: a
`task.cancel()` followed by one `gather` then waits for a task that goes on running, and the service's
stop hangs. `cancel_and_wait` cancels again until every task has ended.

A task that fails and is restarted must be seen to fail on /metrics, not only in the log: each service counts its
tasks' failures in one `TaskFailures` counter, by task, with every task's series at zero from the start.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter

RECANCEL_S = 0.1
"""How long a cancelled task has to end before it is cancelled again."""


class TaskFailures:
    """The failures of one service's background tasks, by task (`{service}_task_failures_total{task=...}`), each
    series created at zero for the tasks the service runs (a rate over no series is "no data" to an alert)."""

    def __init__(self, service: str, tasks: Iterable[str], registry: CollectorRegistry) -> None:
        self._counter = Counter(
            f"{service}_task_failures_total",
            "Failures of background tasks (each logged with its traceback, the task carrying on), by task",
            ["task"],
            registry=registry,
        )
        self._tasks = tuple(tasks)
        for task in self._tasks:
            self._counter.labels(task)

    def failed(self, task: str) -> Callable[[], None]:
        """What `every` (or `supervise`'s caller) calls on each failure of `task`, one of `tasks`."""
        if task not in self._tasks:
            raise ValueError(f"{task!r} is not one of this service's tasks {self._tasks}")
        return self._counter.labels(task).inc


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


async def every(
    interval_s: float,
    step: Callable[[], object],
    *,
    what: str,
    log: logging.Logger,
    failed: Callable[[], object],
    retry_max_s: float | None = None,
    first_now: bool = True,
) -> None:
    """`step` (a function, or a coroutine function) every `interval_s`, the first at once or after one interval, for
    as long as the task runs (stop it with `cancel_and_wait`). A step that raises is counted (`failed`) and logged
    with its traceback as `what` failing: one bad round (a bug, a malformed answer) never ends the loop and leaves
    its service on stale state for good. With `retry_max_s` the next try comes after a backoff that doubles while
    steps keep failing, from `interval_s` to at most `retry_max_s`."""
    delay = interval_s
    if not first_now:
        await asyncio.sleep(interval_s)
    while True:
        try:
            done = step()
            if inspect.isawaitable(done):
                await done
        except Exception:
            failed()
            log.exception("%s failed: trying again in %.1fs", what, delay)
            if retry_max_s is not None:
                await asyncio.sleep(delay)
                delay = min(delay * 2, max(interval_s, retry_max_s))
                continue
        delay = interval_s
        await asyncio.sleep(interval_s)
