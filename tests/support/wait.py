"""Poll a condition with a deadline: the only way tests here wait for something to happen (`wait_for` in
synchronous tests, `until` inside an event loop)."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

_NOT_UP_YET = (httpx.HTTPError, subprocess.CalledProcessError, ValueError, KeyError)


def wait_for(cond: Callable[[], Any], timeout: float = 15.0, interval: float = 0.05, what: str = "condition") -> Any:
    """Poll `cond` until it returns a truthy value or `timeout` passes (then fail with `what`)."""
    end = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < end:
        try:
            last = cond()
        except _NOT_UP_YET as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


async def until(
    cond: Callable[[], Any | Awaitable[Any]], what: str = "condition", timeout: float = 15.0, interval: float = 0.05
) -> Any:
    """`wait_for` inside an event loop: poll `cond` (a function, or a coroutine function) without blocking the loop
    until it returns a truthy value or `timeout` passes (then fail with `what`)."""
    end = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < end:
        try:
            last = cond()
            if inspect.isawaitable(last):
                last = await last
        except _NOT_UP_YET as exc:
            last = exc
        else:
            if last:
                return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")
