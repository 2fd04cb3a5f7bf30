"""Token buckets, for the servers' rate limits (outside the state machine: clocks are fine here).

`TokenBucket` is one allowance, taken `n` at a time with the time passed in: the gateway's peer notes
(gateway.peers: a sender's notes per second) use it. `TokenBuckets` keeps one per key on a clock: the
directory's linearizable lookups per bearer token (`POST /v1/lookup` with `consistency: "linearizable"`
commits a no-op through Raft, so each appends a Raft entry; docs/protocol.md §3).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable


def _check(rate: float, burst: float) -> None:
    if rate <= 0 or burst < 1:
        raise ValueError(f"a rate limit needs rate > 0 and burst >= 1, not {rate} and {burst}")


class TokenBucket:
    """Refilled at `rate` per second up to `burst`, starting full at `now`."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        _check(rate, burst)
        self.rate, self.burst, self.tokens, self.stamp = rate, burst, burst, now

    def take(self, now: float, n: float = 1.0) -> float:
        """0.0 if `n` tokens may be taken at `now` (they are), else the seconds until they may (nothing taken)."""
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= n:
            self.tokens -= n
            return 0.0
        return (n - self.tokens) / self.rate


class TokenBuckets:
    """One `TokenBucket` per key, on `clock`; a request takes one token."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        _check(rate, burst)
        self.rate, self.burst, self._clock = rate, burst, clock
        self._buckets: dict[Hashable, TokenBucket] = {}

    def take(self, key: Hashable) -> float:
        """0.0 if `key` may go ahead now (a token is taken), else the seconds until it may (nothing taken)."""
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(self.rate, self.burst, now)
        return bucket.take(now)


def retry_after(seconds: float) -> str:
    """An HTTP Retry-After value (whole seconds, at least 1) for a wait of `seconds`."""
    return str(max(1, math.ceil(seconds)))
