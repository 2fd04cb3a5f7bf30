"""Poll a condition with a deadline: the only way tests here wait for something to happen."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import Any

import httpx


def wait_for(cond: Callable[[], Any], timeout: float = 15.0, interval: float = 0.05, what: str = "condition") -> Any:
    """Poll `cond` until it returns a truthy value or `timeout` passes (then fail with `what`)."""
    end = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < end:
        try:
            last = cond()
        except (httpx.HTTPError, subprocess.CalledProcessError, ValueError, KeyError) as exc:  # not up yet
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")
