"""Each engine's load read from the engine itself: its Prometheus `/metrics`, every `--load-scrape-s`.

A heartbeat's load labels are what the engine's kvdir side chose to report, up to a heartbeat (plus a refresh)
old: the vLLM connector's scheduler half cannot see vLLM's whole queue. The engine's own scheduler gauges are the
truth (kvproto.engine_metrics names them: vLLM's, SGLang's; the worker stub exports vLLM's), so the gateway reads
them, with the moment the read began and the requests it had in flight there then (`EngineState.scraped_inflight`:
gateway.router.make_candidate counts its own requests once from it). While a read is fresh its figures are routed
on; past `stale_s` (or for an engine whose `/metrics` never answered) the heartbeat's are, as before.

Every engine is read on its own schedule, in a task of its own, each read bounded by `SCRAPE_TIMEOUT_S`: a slow or
dead engine delays only its own reads, and one that fails is read again after a delay doubling from two
intervals up to `RETRY_MAX_S` (an engine without `/metrics` costs a request every half minute, not four a second). A
data-parallel engine's read names its rank in `DP_RANK_HEADER` (the worker stub answers for that rank) and takes
the series labelled with its rank (vLLM labels them `engine`, one API server for all its ranks).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvproto.engine_metrics import FAMILIES
from kvproto.schemas import DP_RANK_HEADER
from kvproto.tasks import cancel_and_wait, every

if TYPE_CHECKING:
    from gateway.engine_registry import EngineState

__all__ = ["EngineLoad", "LoadScraper", "parse_load"]

log = logging.getLogger("kvdir.gateway")

SCRAPE_TIMEOUT_S = 1.0  # one read, connect to last byte
MAX_BODY_BYTES = 16 << 20  # a /metrics answer longer than this is not read (vLLM's: ~100 KB per DP rank)
RETRY_MAX_S = 30.0  # an engine whose reads keep failing is read at least this often
STALE_INTERVALS = 4  # a read is routed on for this many intervals (at least STALE_MIN_S), then the heartbeat's
STALE_MIN_S = 2.0

# Only the lines of the series read are parsed: vLLM's answer is mostly histograms.
_PREFIXES = tuple(
    name for f in FAMILIES for name in (f.running, f.waiting, *f.kv_usage, *((f.preemptions,) if f.preemptions else ()))
)


class ScrapeFailed(Exception):
    """An engine's `/metrics` did not give its load: no answer, an error status, or none of the series read."""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine's load as its own metrics gave it; a figure it did not export is None."""

    family: str  # kvproto.engine_metrics.EngineSeries.family: whose names they were
    running: float
    waiting: float
    kv_usage: float | None  # fraction of its KV cache in use, 0..1
    preemptions: float | None  # since it started


Series = list[tuple[dict[str, str], float]]


def _finite(value: float) -> float:
    """A figure as routing may count it: a negative or non-finite one (outside input) is 0."""
    return value if 0.0 < value < math.inf else 0.0


def _figure(series: Series | None, label: str, rank: int | None, *, mean: bool = False) -> float | None:
    """One figure of the engine at data-parallel `rank` from a metric's series: where they are labelled with ranks,
    the rank's own (None if it has none); else (or for `rank` None: the whole engine) the sum over ranks, or their
    `mean` (a usage fraction). Several series of one rank (SGLang's TP ranks repeat the scheduler's) count once."""
    if not series:
        return None
    by_rank: dict[str, float] = {}
    for labels, value in series:
        key = labels.get(label, "")
        by_rank[key] = max(by_rank.get(key, 0.0), _finite(value))
    if rank is not None and by_rank.keys() != {""}:
        return by_rank.get(str(rank))
    total = sum(by_rank.values())
    return total / len(by_rank) if mean else total


def _samples(text: str) -> dict[str, Series]:
    """The samples of the series read, by name (a prefix's longer names, `_created` ones, are dropped)."""
    wanted = set(_PREFIXES)
    lines = "\n".join(line for line in text.splitlines() if line.startswith(_PREFIXES))
    out: dict[str, Series] = {}
    for family in text_string_to_metric_families(lines + "\n"):
        for s in family.samples:
            if s.name in wanted:
                out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def parse_load(text: str, dp_rank: int | None) -> EngineLoad | None:
    """The load in an engine's Prometheus text, of the first family (vLLM's, then SGLang's) whose running and
    waiting gauges it has, for data-parallel rank `dp_rank` (None: the whole engine); None when it has neither
    family's. ValueError for text that is not Prometheus' format."""
    samples = _samples(text)
    for f in FAMILIES:
        running = _figure(samples.get(f.running), f.rank_label, dp_rank)
        waiting = _figure(samples.get(f.waiting), f.rank_label, dp_rank)
        if running is None or waiting is None:
            continue
        usages = (_figure(samples.get(name), f.rank_label, dp_rank, mean=True) for name in f.kv_usage)
        usage = next((u for u in usages if u is not None), None)
        preempted = _figure(samples.get(f.preemptions), f.rank_label, dp_rank) if f.preemptions else None
        return EngineLoad(f.family, running, waiting, None if usage is None else min(usage, 1.0), preempted)
    return None


class LoadScraper:
    """Reads every known engine's `/metrics` into its EngineState (`scraped`, `scraped_at`, `scraped_inflight`,
    `scraped_until`), in the background, every `interval_s`. Runs on the gateway's event loop, as do the
    request path and the registry's refresh, so an EngineState is never written from two threads."""

    def __init__(self, engines: Mapping[str, EngineState], http: httpx.AsyncClient, interval_s: float) -> None:
        """`engines`: the registry's (EngineRegistry.engines), read at every tick."""
        self.engines = engines
        self.http = http
        self.interval_s = interval_s
        self.stale_s = max(STALE_MIN_S, STALE_INTERVALS * interval_s)
        self._due: dict[str, float] = {}  # node id -> when to read it next
        self._failing: dict[str, float] = {}  # node id -> the delay before its next read, while reads fail
        self._reads: dict[str, asyncio.Task[None]] = {}  # node id -> its read under way
        self._task: asyncio.Task[None] | None = None

    def start(self, failed: Callable[[], object]) -> None:
        tick = every(self.interval_s, lambda: self.tick(time.monotonic()), what="engine load reads", log=log, failed=failed)
        self._task = asyncio.create_task(tick, name="engine load")

    async def stop(self) -> None:
        await cancel_and_wait(self._task, *self._reads.values())

    def tick(self, now: float) -> None:
        """Start a read of every engine due one and not being read; forget engines no longer known."""
        engines = self.engines
        for gone in [k for k in self._due if k not in engines]:
            del self._due[gone]
            self._failing.pop(gone, None)
        for node_id, e in engines.items():
            if node_id in self._reads or now < self._due.get(node_id, 0.0):
                continue
            self._reads[node_id] = asyncio.create_task(self._read(e))

    async def _read(self, e: EngineState) -> None:
        try:
            await self._read_once(e)
        finally:
            self._reads.pop(e.node_id, None)

    async def _read_once(self, e: EngineState) -> None:
        began = time.monotonic()
        inflight = e.inflight  # before the request goes: the engine's figures include at most these of ours
        try:
            async with asyncio.timeout(SCRAPE_TIMEOUT_S):
                load = parse_load(await self._get(e), e.dp_rank)
            if load is None:
                raise ScrapeFailed("its /metrics has no running and waiting gauges of vLLM's or SGLang's")
        except (ScrapeFailed, httpx.HTTPError, TimeoutError, ValueError, UnicodeDecodeError) as exc:
            delay = min(RETRY_MAX_S, 2 * self._failing.get(e.node_id, self.interval_s))
            if e.node_id not in self._failing:
                log.info(
                    "engine %s: load not read from the engine (%s): its heartbeat's figures are used",
                    e.node_id,
                    str(exc) or type(exc).__name__,
                )
            self._failing[e.node_id] = delay
            self._due[e.node_id] = began + delay
            return
        if self._failing.pop(e.node_id, None) is not None:
            log.info("engine %s: load read from its /metrics again", e.node_id)
        e.scraped, e.scraped_at, e.scraped_inflight = load, began, inflight
        e.scraped_until = began + self.stale_s
        self._due[e.node_id] = began + self.interval_s

    async def _get(self, e: EngineState) -> str:
        headers = {DP_RANK_HEADER: str(e.dp_rank)} if e.dp_rank is not None else {}
        async with self.http.stream("GET", e.origin.url("/metrics"), headers=headers, timeout=SCRAPE_TIMEOUT_S) as r:
            if r.status_code != 200:
                raise ScrapeFailed(f"/metrics answered {r.status_code}")
            body = bytearray()
            async for chunk in r.aiter_bytes():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise ScrapeFailed(f"/metrics answered more than {MAX_BODY_BYTES} bytes")
        return body.decode()
