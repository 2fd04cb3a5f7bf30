"""kvproto.tasks: a stop that ends tasks which swallow a cancellation."""

from __future__ import annotations

import asyncio

from kvproto.tasks import cancel_and_wait


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
