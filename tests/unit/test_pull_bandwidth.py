"""The puller's bandwidth estimate (kvtransfer.bandwidth), the figure its heartbeats report as `pull_gbps`."""

from __future__ import annotations

import math

import pytest

from kvtransfer.bandwidth import PullBandwidth


def test_nothing_is_reported_before_a_read_completed() -> None:
    bw = PullBandwidth()
    assert bw.gbps is None and bw.labels("pull_gbps") == {}
    for nbytes, seconds in [(0, 0.1), (1 << 20, 0.0), (-5, 1.0), (1 << 20, -1.0), (math.nan, 1.0), (1e6, math.inf)]:
        bw.add(nbytes, seconds)  # nothing moved, or nothing measured: not a sample
    assert bw.gbps is None and bw.reads == 0


def test_the_first_read_is_its_own_ratio() -> None:
    bw = PullBandwidth()
    bw.add(4_000_000, 0.002)
    assert bw.gbps == pytest.approx(2.0)
    assert bw.labels("pull_gbps") == {"pull_gbps": bw.gbps}


def test_reads_are_weighed_by_their_bytes_and_old_ones_decay() -> None:
    bw = PullBandwidth(weight=0.5)
    bw.add(8e9, 1.0)  # 8 GB/s over a long read
    bw.add(1e4, 0.001)  # a tiny read, mostly latency (0.01 GB/s): barely moves the figure
    assert bw.gbps == pytest.approx((8e9 * 0.5 + 1e4) / (1.0 * 0.5 + 0.001) / 1e9)
    assert bw.gbps > 7.9
    for _ in range(30):  # the link slowed down: 1 GB/s reads of the same size take over
        bw.add(1e9, 1.0)
    assert bw.gbps == pytest.approx(1.0, rel=1e-6)


def test_weight_one_keeps_the_last_read_only() -> None:
    bw = PullBandwidth(weight=1.0)
    bw.add(1e9, 1.0)
    bw.add(3e9, 1.0)
    assert bw.gbps == pytest.approx(3.0)
    with pytest.raises(ValueError):
        PullBandwidth(weight=0.0)
    with pytest.raises(ValueError):
        PullBandwidth(weight=1.5)
