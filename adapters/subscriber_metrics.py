"""The Prometheus view of a `kvdir events` process: every engine's decoder, mapper, subscriber and node
session counters, read at scrape time and labelled by node (the lag histogram is `adapters.node_feed`'s)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from adapters.engine_stream import EventsSubscriber


class SubscriberCollector:
    """Reads the process's live `subs` and `failures` (node -> restarts after a failure) at each scrape."""

    def __init__(self, subs: Mapping[str, EventsSubscriber], failures: Mapping[str, int]) -> None:
        self.subs = subs
        self.failures = failures

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Metric]:
        subs = list(self.subs.values())
        ev = CounterMetricFamily("kvdir_events_events", "engine events decoded, by type", labels=["node", "type"])
        rp = CounterMetricFamily("kvdir_events_replays", "replay requests, by outcome", labels=["node", "outcome"])
        counters: dict[str, CounterMetricFamily] = {}
        gauges: dict[str, GaugeMetricFamily] = {}
        fails = CounterMetricFamily(
            "kvdir_events_subscriber_failures",
            "times an engine's subscriber failed and was started again (the other engines go on)",
            labels=["node"],
        )
        for node, count in self.failures.items():
            fails.add_metric([node], count)
        for sub in subs:
            node = sub.node_id
            for name, v in _event_counts(sub):
                ev.add_metric([node, name], v)
            rp.add_metric([node, "ok"], sub.stats.replays_ok)
            rp.add_metric([node, "failed"], sub.stats.replays_failed)
            for name, doc, v in _counters(sub):
                if name not in counters:
                    counters[name] = CounterMetricFamily(f"kvdir_events_{name}", doc, labels=["node"])
                counters[name].add_metric([node], v)
            for name, doc, v in _gauges(sub):
                if name not in gauges:
                    gauges[name] = GaugeMetricFamily(f"kvdir_events_{name}", doc, labels=["node"])
                gauges[name].add_metric([node], v)
        yield ev
        yield rp
        yield fails
        yield from counters.values()
        yield from gauges.values()


def _event_counts(sub: EventsSubscriber) -> tuple[tuple[str, int], ...]:
    d = sub.decode_stats
    return (
        ("stored", d.stored),
        ("removed", d.removed),
        ("cleared", d.cleared),
        ("unknown", d.unknown_events),
        ("malformed", d.malformed_events),
        ("skipped_group", d.skipped_groups),
    )


def _counters(sub: EventsSubscriber) -> tuple[tuple[str, str, int], ...]:
    s, d, m, n = sub.stats, sub.decode_stats, sub.mapper.stats, sub.session.stats
    return (
        ("batches", "event batches (ZMQ messages) applied", s.batches),
        ("duplicates", "batches dropped as duplicates (same seq again)", s.duplicates),
        ("gaps", "gaps in the engine's seq", s.gaps),
        ("resyncs", "resyncs: this node's entries cleared after an unrepaired gap", s.resyncs),
        ("restarts", "engine restarts seen (seq went backwards): a new epoch each", s.restarts),
        ("garbage_frames", "ZMQ messages that were not event batches (skipped)", d.garbage_frames),
        ("unknown_events", "events of an unknown type (skipped)", d.unknown_events),
        ("extra_fields", "event fields nobody here knows (ignored)", d.extra_fields),
        ("missing_parents", "stores whose parent block is unknown (skipped)", m.missing_parents),
        ("unsupported", "stores whose block size or tokens cannot be mapped (skipped)", m.unsupported),
        ("unknown_removals", "removals of engine blocks not in the map (harmless)", m.unknown_removals),
        ("evicted", "engine blocks dropped from the bounded map (and the directory)", m.evicted),
        ("registrations", "registrations with the directory", n.registrations),
        ("published_blocks", "block entries sent to the directory", n.published_blocks),
        ("removed_blocks", "block removals sent to the directory", n.removed_blocks),
        ("directory_clears", "clears of this node's entries sent to the directory", n.directory_clears),
        ("rejected_blocks", "changes the directory refused (dropped)", n.rejected),
    )


def _gauges(sub: EventsSubscriber) -> tuple[tuple[str, str, int], ...]:
    return (
        ("engine_up", "1 while the engine's /health answers", 1 if sub.engine_healthy else 0),
        ("epoch", "this node's current epoch (0: not registered)", sub.epoch or 0),
        ("mapped_blocks", "engine blocks in the hash map", len(sub.mapper)),
        ("last_seq", "the last engine seq applied (-1: none)", -1 if sub.last_seq is None else sub.last_seq),
    )
