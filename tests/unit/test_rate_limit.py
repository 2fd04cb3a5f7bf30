"""kvproto.rate_limit: one bucket taken n at a time (the gateway's peer notes) and buckets per key on a clock (the
directory's linearizable lookups), with the time passed in."""

from __future__ import annotations

import pytest

from kvproto.rate_limit import TokenBucket, TokenBuckets, retry_after


def test_buckets_allow_a_burst_then_the_rate_per_key() -> None:
    now = [100.0]
    b = TokenBuckets(rate=2.0, burst=2.0, clock=lambda: now[0])
    assert b.take("a") == 0.0 and b.take("a") == 0.0
    assert b.take("a") == pytest.approx(0.5)  # empty: one token in half a second
    assert b.take("b") == 0.0  # another key has its own bucket
    now[0] += 0.25
    assert b.take("a") == pytest.approx(0.25)  # a refused request takes nothing
    now[0] += 0.25
    assert b.take("a") == 0.0
    now[0] += 60
    assert [b.take("a") for _ in range(3)][:2] == [0.0, 0.0]  # refilled up to the burst, not beyond


def test_retry_after_is_whole_seconds_and_at_least_one() -> None:
    assert [retry_after(s) for s in (0.01, 1.0, 1.2, 4.99)] == ["1", "1", "2", "5"]
    with pytest.raises(ValueError):
        TokenBuckets(0, 1)


def test_one_bucket_takes_a_batch_whole_or_not_at_all() -> None:
    b = TokenBucket(rate=100.0, burst=300.0, now=0.0)
    assert b.take(0.0, 250) == 0.0 and b.tokens == 50
    assert b.take(0.0, 100) == pytest.approx(0.5)  # 50 short at 100/s; nothing taken
    assert b.take(0.5, 100) == 0.0 and b.tokens == pytest.approx(0.0)
    assert b.take(100.0, 300) == 0.0  # refilled up to the burst only
    assert b.take(100.0, 1) > 0
    with pytest.raises(ValueError):
        TokenBucket(1.0, 0.5, 0.0)
