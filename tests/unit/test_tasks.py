"""kvproto.tasks: a stop that ends tasks which swallow a cancellation, and a supervisor that restarts failing ones."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import pytest

from kvproto.tasks import cancel_and_wait, supervise


async def _stubborn(swallow: int, ended: list[str]) -> None:
    """Swallows its first `swallow` cancellations, as a task in a wait_for may (gh-86296)."""
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if swallow == 0:
                ended.append("cancelled")
                raise
            swallow -= 1


def test_a_task_that_swallows_cancellations_is_cancelled_until_it_ends() -> None:
    async def main() -> tuple[list[str], bool]:
        ended: list[str] = []
        t = asyncio.create_task(_stubborn(2, ended))
        await asyncio.sleep(0)
        once = asyncio.gather(t, return_exceptions=True)
        t.cancel()  # what a stop that cancels once does: the task goes on
        await asyncio.wait({once}, timeout=0.3)
        hung = not once.done()
        await asyncio.wait_for(cancel_and_wait(t), timeout=5)
        return ended, hung and t.cancelled()

    assert asyncio.run(main()) == (["cancelled"], True)


def test_ended_failed_and_missing_tasks_are_fine() -> None:
    async def boom() -> None:
        raise RuntimeError("the task's own failure")

    async def main() -> None:
        done = asyncio.create_task(asyncio.sleep(0))
        failed = asyncio.create_task(boom())
        await asyncio.sleep(0.01)
        await cancel_and_wait(done, failed, None)
        assert done.done() and isinstance(failed.exception(), RuntimeError)

    asyncio.run(main())


def test_supervise_restarts_a_failing_task_with_a_doubling_backoff_until_it_returns(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[float] = []

    async def run() -> None:
        calls.append(time.monotonic())
        if len(calls) < 4:
            raise RuntimeError(f"failure {len(calls)}")

    failures: list[int] = []

    def failed() -> str:
        failures.append(len(calls))
        return f"the task failed ({len(failures)})"

    log = logging.getLogger("test.supervise")
    asyncio.run(supervise(run, failed, stopping=lambda: False, retry_s=(0.02, 0.05), stable_s=10.0, log=log))
    assert failures == [1, 2, 3] and len(calls) == 4
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    # 0.02, doubled, then at most 0.05 (less 1 ms: the loop may fire a timer within its clock's resolution)
    assert gaps[0] >= 0.019 and gaps[1] >= 0.039 and gaps[2] >= 0.049, gaps
    assert [r.getMessage() for r in caplog.records if r.name == "test.supervise"] == [f"the task failed ({i})" for i in (1, 2, 3)]
    assert all(r.exc_info is not None for r in caplog.records if r.name == "test.supervise")  # with the traceback


def test_supervise_does_not_restart_once_stopping_nor_swallow_a_cancellation() -> None:
    stopping = False

    async def run() -> None:
        nonlocal stopping
        stopping = True
        raise RuntimeError("failed while stopping")

    failed: list[str] = []
    log = logging.getLogger("test.supervise")
    asyncio.run(
        supervise(run, lambda: failed.append("x") or "x", stopping=lambda: stopping, retry_s=(0.01, 0.01), stable_s=1, log=log)
    )
    assert failed == []  # a failure while stopping is the stop's, not a restart

    async def cancelled() -> None:
        t = asyncio.create_task(
            supervise(asyncio.Event().wait, lambda: "x", stopping=lambda: False, retry_s=(0.01, 0.01), stable_s=1, log=log)
        )
        await asyncio.sleep(0.01)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t

    asyncio.run(cancelled())
