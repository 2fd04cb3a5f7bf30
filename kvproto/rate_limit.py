"""Token buckets per key, for the REST API's rate limits (outside the state machine: clocks are fine here).

`POST /v1/lookup` with `consistency: "linearizable"` commits a no-op through Raft before it answers, so each
one appends a Raft entry: with auth on, every token but an admin's may make at most
`--linearizable-lookups-per-s` of them per second on each replica, in bursts of as many (docs/protocol.md §3).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable


class TokenBuckets:
    """One bucket per key, refilled at `rate` per second up to `burst`; a request takes one token."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"a rate limit needs rate > 0 and burst >= 1, not {rate} and {burst}")
        self.rate, self.burst, self._clock = rate, burst, clock
        self._buckets: dict[Hashable, tuple[float, float]] = {}  # key -> (tokens, when counted)

    def take(self, key: Hashable) -> float:
        """0.0 if `key` may go ahead now (a token is taken), else the seconds until it may (nothing taken)."""
        now = self._clock()
        tokens, then = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        if tokens >= 1:
            self._buckets[key] = (tokens - 1, now)
            return 0.0
        self._buckets[key] = (tokens, now)
        return (1 - tokens) / self.rate


def retry_after(seconds: float) -> str:
    """An HTTP Retry-After value (whole seconds, at least 1) for a wait of `seconds`."""
    return str(max(1, math.ceil(seconds)))
