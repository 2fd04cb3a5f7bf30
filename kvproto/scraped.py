"""Counts kept as plain numbers where they happen (a data structure's ints, a sum over feeds that come and go),
exported as Prometheus counters read at scrape time: the type `rate` and `increase` expect, without a Counter
object in code that has no registry (the worker's pool, which its property tests drive; the gateway's mirror)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["ScrapedCounters"]


class ScrapedCounters(Collector):
    """One counter per `(name, help, read)`: `name` without `_total` (the exposition adds it), `read` called at
    each scrape."""

    def __init__(self, counts: Iterable[tuple[str, str, Callable[[], float]]]) -> None:
        self._counts = tuple(counts)

    def collect(self) -> Iterator[Metric]:
        for name, help_text, read in self._counts:
            yield CounterMetricFamily(name, help_text, value=read())
