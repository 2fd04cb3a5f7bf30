"""kvproto.tasks: a stop that ends tasks which swallow a cancellation, a supervisor that restarts failing ones, and
a loop that survives its failing steps."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import pytest
from prometheus_client import CollectorRegistry

from kvproto.tasks import TaskFailures, cancel_and_wait, every, supervise


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


def test_every_goes_on_after_failing_steps_counting_and_logging_each_with_a_doubling_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[float] = []
    failures: list[int] = []

    async def main() -> None:
        done = asyncio.Event()

        async def step() -> None:
            calls.append(time.monotonic())
            if len(calls) <= 3:
                raise RuntimeError(f"a bug in step {len(calls)}")
            if len(calls) == 5:
                done.set()

        log = logging.getLogger("test.every")
        t = asyncio.create_task(
            every(0.02, step, what="the step", log=log, failed=lambda: failures.append(len(calls)), retry_max_s=0.06)
        )
        try:
            await asyncio.wait_for(done.wait(), 10)
            assert not t.done()  # three failures did not end it
        finally:
            await cancel_and_wait(t)

    asyncio.run(main())
    assert failures == [1, 2, 3]
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    # after failures: 0.02, doubled, then at most 0.06; after a success the interval again (timers may fire 1 ms early)
    assert gaps[0] >= 0.019 and gaps[1] >= 0.039 and gaps[2] >= 0.059 and gaps[3] >= 0.019, gaps
    logged = [r for r in caplog.records if r.name == "test.every"]
    assert [r.getMessage().split(":")[0] for r in logged] == ["the step failed"] * 3
    assert all(r.exc_info is not None for r in logged)  # with the traceback


def test_every_runs_a_plain_function_and_can_wait_one_interval_first() -> None:
    async def main() -> tuple[float, int]:
        ran: list[float] = []
        first = asyncio.Event()

        def step() -> None:
            ran.append(time.monotonic())
            first.set()

        started = time.monotonic()
        t = asyncio.create_task(
            every(0.05, step, what="x", log=logging.getLogger("test.every"), failed=lambda: None, first_now=False)
        )
        try:
            await asyncio.wait_for(first.wait(), 10)
        finally:
            await cancel_and_wait(t)
        return ran[0] - started, len(ran)

    waited, runs = asyncio.run(main())
    assert waited >= 0.049 and runs == 1


def test_task_failures_start_at_zero_and_count_each_failure_of_every_by_task() -> None:
    registry = CollectorRegistry()
    tasks = TaskFailures("kvdir_test", ("sweep", "probe"), registry)

    def count(task: str) -> float | None:
        return registry.get_sample_value("kvdir_test_task_failures_total", {"task": task})

    assert (count("sweep"), count("probe")) == (0.0, 0.0)  # on /metrics before anything failed

    async def main() -> None:
        done = asyncio.Event()
        calls = 0

        def step() -> None:
            nonlocal calls
            calls += 1
            if calls == 3:
                done.set()
            if calls <= 2:
                raise RuntimeError("a bug")

        t = asyncio.create_task(
            every(0.01, step, what="sweep", log=logging.getLogger("test.every"), failed=tasks.failed("sweep"))
        )
        try:
            await asyncio.wait_for(done.wait(), 10)
        finally:
            await cancel_and_wait(t)

    asyncio.run(main())
    assert (count("sweep"), count("probe")) == (2.0, 0.0)
    with pytest.raises(ValueError, match="not one of this service's tasks"):
        tasks.failed("unknown")  # a task without its zero series would be "no data" until it first fails
