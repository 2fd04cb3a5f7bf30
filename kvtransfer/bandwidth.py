"""The puller's measured pull bandwidth, reported to the gateway as a load label (`pull_gbps`).

The gateway prices a pull to an engine with this figure instead of its configured `--link-gbps` (gateway.router),
so it must describe the reads that engine actually completes. Pure: the caller times its reads and passes the
bytes and seconds of each one that completed (a failed read measures a timeout, not a link).
"""

from __future__ import annotations

import math

__all__ = ["PullBandwidth"]


class PullBandwidth:
    """Bytes over seconds of the recent completed reads: both sums decay by `1 - weight` per read.

    A ratio of decayed sums rather than an average of per-read rates weighs each read by its size: a one-block
    read, mostly latency, moves the figure less than a long prefix that measures the link. The per-read latency
    stays in the figure, which makes it conservative for short pulls. One writer; readers of `gbps` on other
    threads see the last value computed (one attribute, replaced whole).
    """

    def __init__(self, weight: float = 0.2) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self._bytes = 0.0
        self._seconds = 0.0
        self.gbps: float | None = None  # GB/s (1e9 bytes), None until a read completed
        self.reads = 0

    def add(self, nbytes: float, seconds: float) -> None:
        """Count one completed read; reads of no bytes or no measurable time (or not finite) are ignored."""
        if not (nbytes > 0 and seconds > 0 and math.isfinite(nbytes) and math.isfinite(seconds)):
            return
        keep = 1.0 - self.weight
        self._bytes = self._bytes * keep + nbytes
        self._seconds = self._seconds * keep + seconds
        self.reads += 1
        self.gbps = self._bytes / self._seconds / 1e9

    def labels(self, name: str) -> dict[str, float]:
        """`{name: gbps}` for a heartbeat's load, or nothing before the first read (the gateway keeps its default)."""
        return {} if self.gbps is None else {name: self.gbps}
