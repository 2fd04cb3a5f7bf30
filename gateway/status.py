"""The gateway's status page (`GET /`) and the same figures as JSON (`GET /v1/status`).

What an operator opens to see whether routing works: requests and their rate, routing decisions by reason
over the last minutes, the hit rate and the directory's prediction error over time, each engine's load,
cached blocks and pull bandwidth, the directory's leader and term, the mirror's lag and source, and pulls
with their failures. Plain HTML and CSS with inline SVG drawn here and a meta refresh: nothing is loaded
from elsewhere (GPU clusters are often air-gapped) and no script runs.

Figures over time come from `History`, a bounded ring of `Sample`s (the gateway's cumulative counters at one
moment) that `StatusBoard` takes every `SAMPLE_S` in a task of the app's lifespan: a rate or a ratio over an
interval is the difference of two samples, so nothing is counted twice and a page nobody opened for an hour
still shows the last ten minutes. Rendering is pure (`render_page`, `status_json`: figures in, text out, the
time given in them), which is what the unit tests exercise; `StatusBoard.figures` does the only I/O, the
directory's `GET /v1/cluster` within `CLUSTER_DEADLINE_S`, whose failure is a figure like any other: the page
then says the directory is unreachable.

The page is served on the gateway's public port, so it shows no address (issue #12, item 8): engines are
named by node id, replicas by their place in `--directory` ("replica 2 of 3"). Every string from outside the
gateway (node ids, the engines' pull failure reasons, the directory's error codes) is escaped.
"""

from __future__ import annotations

import asyncio
import html
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from itertools import pairwise
from typing import Any

from prometheus_client import Counter, Histogram

from gateway.engine_registry import EngineRegistry
from gateway.metrics import GatewayMetrics, PullFailure
from gateway.mirror import Mirror
from gateway.peers import PeerNotes
from kvproto.client import DirectoryClient
from kvproto.errors import DirectoryError, DirectoryUnavailable, RequestRejected

log = logging.getLogger("kvdir.gateway")

SAMPLE_S = 5.0  # one sample every this many seconds...
HISTORY = 120  # ...this many kept: the last 10 minutes
CLUSTER_DEADLINE_S = 1.0  # the longest a page waits for the directory's /v1/cluster
REFRESH_S = 5  # the page reloads itself this often
RECENT_S = 60.0  # "recent" figures (rates, hit rate) are over the last minute

# Decision reasons in the order the page stacks them, with their colours (every one of gateway.cost.REASONS).
REASON_COLORS = {
    "affinity": "#2f9e44",
    "pull": "#1971c2",
    "inflight": "#9c36b5",
    "recompute": "#e8590c",
    "balance": "#868e96",
    "unhashed": "#f08c00",
    "fallback": "#e03131",
}
LOOKUP_SOURCES = ("mirror", "rest", "mirror_stale", "none")  # kvdir_gateway_lookups_total{source}
PULL_OUTCOMES = ("full", "short", "unreported")  # kvdir_gateway_pulls_total{outcome}


@dataclass(frozen=True, slots=True)
class Sample:
    """The gateway's cumulative counters at monotonic time `t`."""

    t: float
    decisions: Mapping[str, float]  # routed requests, by reason
    prompt_tokens: float
    predicted_tokens: float  # cached tokens the directory predicted
    reported_tokens: float  # cached tokens the engines reported
    error_tokens: float  # sum of |predicted - reported| over the requests whose engine reported
    reports: float  # those requests
    lookups: Mapping[str, float]  # by source
    upstream_errors: float
    pulls: Mapping[str, float]  # pull plans, by outcome

    @property
    def requests(self) -> float:
        return sum(self.decisions.values())


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


@dataclass(frozen=True, slots=True)
class Window:
    """What happened between two samples."""

    start: float
    end: float
    requests: float
    decisions: Mapping[str, float]
    hit_rate: float | None  # reported cached tokens / prompt tokens routed (None: no prompt tokens)
    predicted_rate: float | None  # predicted cached tokens / prompt tokens routed
    mean_error: float | None  # mean |predicted - reported| cached tokens per request that reported
    lookups: Mapping[str, float]
    upstream_errors: float
    pulls: Mapping[str, float]

    @classmethod
    def between(cls, a: Sample, b: Sample) -> Window:
        def diff(x: Mapping[str, float], y: Mapping[str, float]) -> dict[str, float]:
            return {k: y.get(k, 0.0) - x.get(k, 0.0) for k in sorted(set(x) | set(y))}

        prompt = b.prompt_tokens - a.prompt_tokens
        return cls(
            a.t,
            b.t,
            b.requests - a.requests,
            diff(a.decisions, b.decisions),
            _ratio(b.reported_tokens - a.reported_tokens, prompt),
            _ratio(b.predicted_tokens - a.predicted_tokens, prompt),
            _ratio(b.error_tokens - a.error_tokens, b.reports - a.reports),
            diff(a.lookups, b.lookups),
            b.upstream_errors - a.upstream_errors,
            diff(a.pulls, b.pulls),
        )

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def rate(self) -> float | None:
        """Requests per second."""
        return _ratio(self.requests, self.seconds)


class History:
    """The last `size` samples, oldest first: what the page's figures over time are drawn from."""

    def __init__(self, size: int = HISTORY) -> None:
        self.samples: deque[Sample] = deque(maxlen=size)

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)


@dataclass(frozen=True, slots=True)
class EngineFigures:
    node_id: str
    healthy: bool
    registered: bool  # listed by the directory (False: a static --engine)
    running: float  # as its last heartbeat reported
    waiting: float
    inflight: int  # requests this gateway has there now
    pending_prefill_tokens: float  # this gateway's and its peers' prompt tokens still to be prefilled there
    served: int
    prompt_tokens: int
    cached_tokens: int  # as it reported
    blocks: int  # blocks the directory lists for it
    capacity_blocks: int | None
    can_pull: bool
    pull_gbps: float  # the pull bandwidth it measured (0: none yet)


@dataclass(frozen=True, slots=True)
class DirectoryFigures:
    """The directory as `GET /v1/cluster` and the engine list describe it; replicas by 1-based place in `--directory`."""

    replicas: int  # URLs in --directory
    engine_list_ok: bool  # the gateway's last read of the engine list succeeded
    reachable: bool  # GET /v1/cluster answered
    problem: str | None = None  # why it did not (no address in it)
    answered_by: int | None = None
    leader: int | None = None  # None: no leader known, or one that is not in --directory (`leader_elected`)
    leader_elected: bool = False
    term: int | None = None
    commit_index: int | None = None
    has_quorum: bool | None = None
    nodes: int | None = None
    entries: int | None = None

    @property
    def up(self) -> bool:
        return self.reachable and self.engine_list_ok


@dataclass(frozen=True, slots=True)
class FeedFigures:
    shard: str  # "" for an unsharded directory
    source: int  # 1-based place of the replica it follows among its group's URLs
    replicas: int
    lag_s: float | None  # None: never caught up
    fresh: bool
    position: int


@dataclass(frozen=True, slots=True)
class MirrorFigures:
    lag_s: float | None  # the most stale feed's (None: some feed never caught up)
    max_lag_s: float
    fresh: bool
    feeds: tuple[FeedFigures, ...]
    snapshots: int
    failovers: int
    restarts: int


@dataclass(frozen=True, slots=True)
class PeerFigures:
    peers: int
    sent: int
    dropped: int
    send_failures: int
    received: int
    notes_held: int


@dataclass(frozen=True, slots=True)
class StatusFigures:
    """Everything the page shows, as of monotonic time `now`."""

    now: float
    started: float  # when the gateway started (monotonic)
    policy: str
    current: Sample  # taken at `now`
    history: tuple[Sample, ...]  # oldest first, all before `now`
    engines: tuple[EngineFigures, ...]
    directory: DirectoryFigures
    mirror: MirrorFigures | None  # None: the gateway keeps no mirror
    pull_failures: tuple[PullFailure, ...]  # the latest, oldest first
    peers: PeerFigures | None  # None: no --peers
    span_s: float = SAMPLE_S * HISTORY  # the time the charts cover, up to now

    def windows(self) -> list[Window]:
        """Consecutive samples' differences, the last one up to now."""
        samples = [*self.history, self.current]
        return [Window.between(a, b) for a, b in pairwise(samples) if b.t > a.t]

    def recent(self, seconds: float = RECENT_S) -> Window | None:
        """From the latest sample at least `seconds` old (else the oldest: since the start) up to now; None without one."""
        older = [s for s in self.history if s.t <= self.now - seconds]
        base = older[-1] if older else (self.history[0] if self.history else None)
        return None if base is None or base.t >= self.current.t else Window.between(base, self.current)


# -- reading the figures (the only I/O) -----------------------------------------------------------------


def _by_label(counter: Counter) -> dict[str, float]:
    """A one-label counter's values, by that label's value."""
    return {next(iter(s.labels.values())): s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total")}


def _value(metric: Counter | Histogram, suffix: str) -> float:
    """The sample named `..._{suffix}` of an unlabelled counter or histogram."""
    return sum(s.value for m in metric.collect() for s in m.samples if s.name.endswith(f"_{suffix}"))


def _place(url: object, urls: Sequence[str]) -> int | None:
    """1-based place of `url` among `urls`, None if it is not one of them."""
    if not isinstance(url, str):
        return None
    try:
        return urls.index(url.rstrip("/")) + 1
    except ValueError:
        return None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class StatusBoard:
    """Collects the figures: a sample of the metrics every `sample_s` (`start`/`stop` with the app), and the
    engines, the mirror and the directory's `GET /v1/cluster` on each `figures()`."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        registry: EngineRegistry,
        directory: DirectoryClient,
        policy: str,
        mirror: Mirror | None = None,
        peers: PeerNotes | None = None,
        sample_s: float = SAMPLE_S,
        size: int = HISTORY,
    ) -> None:
        self.metrics, self.registry, self.directory, self.policy = metrics, registry, directory, policy
        self.mirror, self.peers = mirror, peers
        self.sample_s = sample_s
        self.history = History(size)
        self.span_s = sample_s * size
        self.started = time.monotonic()
        self._task: asyncio.Task[None] | None = None

    def sample(self, now: float) -> Sample:
        m = self.metrics
        return Sample(
            now,
            _by_label(m.decisions),
            _value(m.prompt_tokens, "total"),
            _value(m.predicted, "total"),
            _value(m.reported, "total"),
            _value(m.prediction_error, "sum"),
            _value(m.prediction_error, "count"),
            _by_label(m.lookups),
            sum(_by_label(m.upstream_errors).values()),
            _by_label(m.pulls),
        )

    def start(self) -> None:
        self.history.add(self.sample(time.monotonic()))  # the zero every first interval counts from
        self._task = asyncio.create_task(self._loop(), name="status samples")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.sample_s)
            try:
                self.history.add(self.sample(time.monotonic()))
            except Exception:  # a sample that fails (a bug) must not end the history for good
                log.exception("status page: taking a sample failed")

    async def _directory(self) -> DirectoryFigures:
        urls, listed = self.directory.urls, self.registry.directory_ok
        try:
            c = await self.directory.cluster(deadline=CLUSTER_DEADLINE_S)
        except DirectoryUnavailable:
            return DirectoryFigures(len(urls), listed, False, f"no replica answered within {CLUSTER_DEADLINE_S:g} s")
        except RequestRejected as exc:
            return DirectoryFigures(len(urls), listed, False, f"refused: {exc.status} {exc.error}")
        except (DirectoryError, ValueError) as exc:
            return DirectoryFigures(len(urls), listed, False, type(exc).__name__)
        quorum = c.get("has_quorum")
        return DirectoryFigures(
            len(urls),
            listed,
            True,
            answered_by=_place(c.get("self_url"), urls),
            leader=_place(c.get("leader_url"), urls),
            leader_elected=c.get("leader") is not None,
            term=_int(c.get("term")),
            commit_index=_int(c.get("commit_index")),
            has_quorum=quorum if isinstance(quorum, bool) else None,
            nodes=_int(c.get("nodes")),
            entries=_int(c.get("entries")),
        )

    def _mirror(self) -> MirrorFigures | None:
        mirror = self.mirror
        if mirror is None:
            return None
        feeds = tuple(
            FeedFigures(name, f.source + 1, len(f.urls), _finite(f.lag_s()), f.fresh(), f.position)
            for name, f in sorted(mirror.feeds.items())
        )
        return MirrorFigures(
            _finite(mirror.lag_s()),
            mirror.max_lag_s,
            mirror.fresh(),
            feeds,
            mirror.snapshots,
            mirror.failovers,
            mirror.restarts,
        )

    def _peers(self) -> PeerFigures | None:
        p = self.peers
        if p is None or not p.peers:
            return None
        s = p.stats
        return PeerFigures(len(p.peers), s["sent"], s["dropped"], s["send_failures"], s["received"], p.status()["notes"])

    async def figures(self) -> StatusFigures:
        directory = await self._directory()  # first: the page's `now` is after its wait
        now = time.monotonic()
        engines = tuple(
            EngineFigures(
                e.node_id,
                e.healthy,
                e.registered,
                e.running,
                e.waiting,
                e.inflight,
                e.pending_prefill_tokens,
                e.served,
                e.prompt_tokens,
                e.cached_tokens,
                e.blocks,
                e.capacity_blocks,
                e.can_pull,
                e.pull_gbps,
            )
            for e in sorted(self.registry.engines.values(), key=lambda e: e.node_id)
        )
        history = tuple(s for s in self.history.samples if s.t < now)
        # The charts cover the history kept: a young gateway's fill their width instead of its last few pixels.
        span_s = min(self.span_s, max(now - history[0].t if history else 0.0, self.sample_s))
        return StatusFigures(
            now,
            self.started,
            self.policy,
            self.sample(now),
            history,
            engines,
            directory,
            self._mirror(),
            tuple(self.metrics.pull_failures),
            self._peers(),
            span_s,
        )


# -- JSON ---------------------------------------------------------------------------------------------------


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _window_json(w: Window, now: float) -> dict[str, Any]:
    return {
        "age_s": round(now - w.end, 3),
        "seconds": round(w.seconds, 3),
        "requests": w.requests,
        "rate_per_s": _finite(w.rate),
        "decisions": dict(w.decisions),
        "hit_rate": w.hit_rate,
        "predicted_rate": w.predicted_rate,
        "mean_prediction_error_tokens": w.mean_error,
        "lookups": dict(w.lookups),
        "upstream_errors": w.upstream_errors,
        "pulls": dict(w.pulls),
    }


def status_json(f: StatusFigures) -> dict[str, Any]:
    """The figures of the page as one JSON object (times as seconds before `f.now`, no addresses)."""
    c = f.current
    recent = f.recent()
    return {
        "policy": f.policy,
        "uptime_s": round(f.now - f.started, 3),
        "requests": {"total": c.requests, "upstream_errors": c.upstream_errors},
        "decisions": dict(c.decisions),
        "cache": {
            "prompt_tokens": c.prompt_tokens,
            "predicted_cached_tokens": c.predicted_tokens,
            "reported_cached_tokens": c.reported_tokens,
            "hit_rate": _ratio(c.reported_tokens, c.prompt_tokens),
            "mean_prediction_error_tokens": _ratio(c.error_tokens, c.reports),
        },
        "lookups": dict(c.lookups),
        "pulls": {
            **{k: c.pulls.get(k, 0.0) for k in PULL_OUTCOMES},
            "failures": [
                {**{k: v for k, v in asdict(p).items() if k != "at"}, "age_s": round(f.now - p.at, 3)} for p in f.pull_failures
            ],
        },
        "recent": None if recent is None else _window_json(recent, f.now),
        "history": [_window_json(w, f.now) for w in f.windows()],
        "engines": [asdict(e) for e in f.engines],
        "directory": {**asdict(f.directory), "up": f.directory.up},
        "mirror": None
        if f.mirror is None
        else {
            **asdict(f.mirror),
            "lag_s": _finite(f.mirror.lag_s),
            "feeds": [asdict(x) for x in f.mirror.feeds],
        },
        "peers": None if f.peers is None else asdict(f.peers),
    }


# -- HTML ---------------------------------------------------------------------------------------------------


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _n(x: float | None, digits: int = 0) -> str:
    """A number with thousands separators, "–" for none."""
    return "–" if x is None or not math.isfinite(x) else f"{x:,.{digits}f}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x * 100:.1f}%"


def _ago(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


_W, _H = 600, 100  # a chart's drawing area, in SVG units (stretched to the box it is drawn in)


def _x(t: float, now: float, span_s: float) -> float:
    return max(0.0, _W * (1 - (now - t) / span_s))


def _chart(label: str, top: str, body: str, span_s: float, tall: bool = False) -> str:
    """An SVG drawing stretched to its box (`preserveAspectRatio='none'`, strokes unscaled), its labels in HTML
    around it so that they keep their size at any width: the top value above, the time axis below."""
    return (
        f"<figure class='chart{' tall' if tall else ''}'><div class='top'>{_e(top)}</div>"
        f"<svg viewBox='0 0 {_W} {_H}' preserveAspectRatio='none' role='img' aria-label='{_e(label)}'>{body}"
        f"<line x1='0' y1='{_H}' x2='{_W}' y2='{_H}' class='axis' vector-effect='non-scaling-stroke'/></svg>"
        f"<div class='ticks'><span>{_e(_ago(span_s))} ago</span><span>now</span></div></figure>"
    )


def _stacked(windows: Sequence[Window], now: float, span_s: float, label: str) -> str:
    """Decisions per second by reason: one stacked bar per window."""
    rates = [(w, {r: w.decisions.get(r, 0.0) / w.seconds for r in REASON_COLORS}) for w in windows if w.seconds > 0]
    top = max((sum(r.values()) for _, r in rates), default=0.0)
    bars = []
    for w, r in rates:
        x0, x1 = _x(w.start, now, span_s), _x(w.end, now, span_s)
        if x1 <= x0 or top <= 0:
            continue
        y = float(_H)
        for reason, rate in r.items():
            h = _H * rate / top
            if h > 0:
                y -= h
                title = f"{reason}: {w.decisions.get(reason, 0.0):.0f} in {w.seconds:.0f} s, {_ago(now - w.end)} ago"
                bars.append(
                    f"<rect x='{x0:.1f}' y='{y:.1f}' width='{max(x1 - x0 - 0.5, 0.5):.1f}' height='{h:.1f}' "
                    f"fill='{REASON_COLORS[reason]}'><title>{_e(title)}</title></rect>"
                )
    return _chart(label, f"{_n(top, 2)}/s" if top else "no requests yet", "".join(bars), span_s, tall=True)


DASHED = "stroke-dasharray='6 4' "


@dataclass(frozen=True, slots=True)
class _Line:
    name: str
    color: str
    value: Callable[[Window], float | None]
    dashed: bool = False  # drawn over another line it may equal: both stay visible


def _lines(windows: Sequence[Window], now: float, span_s: float, label: str, lines: Sequence[_Line], unit: str) -> str:
    """One polyline per series, a point at each window's end; a window without a value breaks the line. Shares
    ("%") are drawn on 0-100%, the rest from 0 to the largest value."""
    values = [v for w in windows for ln in lines if (v := ln.value(w)) is not None and math.isfinite(v)]
    top = max(values, default=0.0)
    if unit == "%":
        top = max(top, 1.0)
    scale = top if top > 0 else 1.0
    body = []
    for ln in lines:
        runs: list[list[str]] = [[]]
        for w in windows:
            v = ln.value(w)
            if v is None or not math.isfinite(v):
                runs.append([])
                continue
            runs[-1].append(f"{_x(w.end, now, span_s):.1f},{_H - _H * v / scale:.1f}")
        for run in runs:
            if len(run) == 1:  # a lone point: a dash (a circle would be stretched with the drawing)
                x, y = run[0].split(",")
                run = [f"{float(x) - 3:.1f},{y}", f"{float(x) + 3:.1f},{y}"]
            if run:
                body.append(
                    f"<polyline points='{' '.join(run)}' fill='none' stroke='{ln.color}' stroke-width='2' "
                    f"{DASHED if ln.dashed else ''}vector-effect='non-scaling-stroke'/>"
                )
    top_label = (f"{top * 100:.0f}%" if unit == "%" else f"{_n(top, 1)} {unit}") if values else "no data yet"
    return _chart(label, top_label, "".join(body), span_s)


def _legend(items: Iterable[tuple[str, str]]) -> str:
    return "<p class='legend'>" + " ".join(f"<span style='color:{c}'>&#9632;</span> {_e(n)}" for n, c in items) + "</p>"


def _kv(rows: Iterable[tuple[str, str]]) -> str:
    """A two-column table; the values are HTML already (escaped where they came from outside)."""
    return "<table class='kv'>" + "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"


def _replica(place: int | None, of: int) -> str:
    return "–" if place is None else f"replica {place} of {of}"


def _requests_card(f: StatusFigures, recent: Window | None, windows: Sequence[Window]) -> str:
    c = f.current
    rows = [
        ("routed", f"<b id='requests-total'>{_n(c.requests)}</b>"),
        (
            f"rate, last {_ago(recent.seconds)}" if recent else "rate",
            f"<span id='requests-rate'>{_n(recent.rate if recent else None, 2)}</span>/s",
        ),
        ("upstream errors", _n(c.upstream_errors)),
    ]
    chart = _lines(windows, f.now, f.span_s, "requests per second", [_Line("requests/s", "#1971c2", lambda w: w.rate)], "/s")
    return f"<section><h2>Requests</h2>{_kv(rows)}{chart}</section>"


def _decisions_card(f: StatusFigures, recent: Window | None, windows: Sequence[Window]) -> str:
    c = f.current
    items = "".join(
        f"<li data-reason='{_e(r)}'><span style='color:{color}'>&#9632;</span> {_e(r)} "
        f"<b>{_n(c.decisions.get(r, 0.0))}</b>"
        f"{f' <small>({_n(recent.decisions.get(r, 0.0))} in the last {_ago(recent.seconds)})</small>' if recent else ''}</li>"
        for r, color in REASON_COLORS.items()
        if c.decisions.get(r, 0.0) > 0
    )
    return (
        "<section class='wide'><h2>Routing decisions by reason</h2>"
        f"<ul class='reasons' id='decisions'>{items or '<li>none yet</li>'}</ul>"
        f"{_stacked(windows, f.now, f.span_s, 'routing decisions per second, by reason')}</section>"
    )


def _cache_card(f: StatusFigures, recent: Window | None, windows: Sequence[Window]) -> str:
    c = f.current
    rows = [
        ("hit rate (engines' report)", f"<b id='hit-rate'>{_pct(_ratio(c.reported_tokens, c.prompt_tokens))}</b>"),
        ("predicted by the directory", _pct(_ratio(c.predicted_tokens, c.prompt_tokens))),
        (f"hit rate, last {_ago(recent.seconds)}" if recent else "hit rate, recent", _pct(recent.hit_rate if recent else None)),
        (
            "mean |predicted - reported|",
            f"<span id='prediction-error'>{_n(_ratio(c.error_tokens, c.reports), 1)}</span> tokens per request",
        ),
        ("prompt tokens routed", _n(c.prompt_tokens)),
    ]
    hits = [
        _Line("reported", "#2f9e44", lambda w: w.hit_rate),
        _Line("predicted", "#1971c2", lambda w: w.predicted_rate, dashed=True),
    ]
    error = [_Line("mean error", "#e03131", lambda w: w.mean_error)]
    return (
        "<section><h2>Cache hits and the directory's predictions</h2>"
        f"{_kv(rows)}{_lines(windows, f.now, f.span_s, 'hit rate over time', hits, '%')}"
        f"{_legend((ln.name + ' cached tokens / prompt tokens', ln.color) for ln in hits)}"
        f"{_lines(windows, f.now, f.span_s, 'prediction error over time', error, 'tokens')}"
        f"{_legend([('mean |predicted - reported| cached tokens per request', '#e03131')])}</section>"
    )


def _directory_card(f: StatusFigures, recent: Window | None) -> str:
    d = f.directory
    if d.up:
        state = "<b class='ok' id='directory-state'>reachable</b>"
    else:
        why = d.problem if not d.reachable else "the engine list could not be read"
        state = f"<b class='bad' id='directory-state'>unreachable</b> ({_e(why)})"
    if not d.reachable:
        leader = "unknown"
    elif d.leader is not None:
        leader = _replica(d.leader, d.replicas)
    else:
        leader = "a replica not in --directory" if d.leader_elected else "none (an election?)"
    rows = [
        ("directory", state),
        ("leader", f"<b id='leader'>{_e(leader)}</b>"),
        ("term", f"<span id='term'>{_n(d.term)}</span>"),
        ("commit index", _n(d.commit_index)),
        ("quorum", "–" if d.has_quorum is None else ("yes" if d.has_quorum else "<b class='bad'>no</b>")),
        ("nodes, entries", f"{_n(d.nodes)}, {_n(d.entries)}"),
        ("answered by", _e(_replica(d.answered_by, d.replicas))),
    ]
    m = f.mirror
    if m is None:
        rows.append(("mirror", "none: every lookup goes to a replica"))
    else:
        fresh = "<span class='ok'>fresh</span>" if m.fresh else "<b class='bad'>stale</b>"
        rows.append(("mirror lag", f"<span id='mirror-lag'>{_n(m.lag_s, 3)}</span> s, {fresh} (bound {m.max_lag_s:g} s)"))
        for feed in m.feeds:
            name = f"shard {feed.shard}: " if feed.shard else ""
            rows.append(
                (
                    "mirror source",
                    f"<span class='mirror-source'>{_e(name)}{_e(_replica(feed.source, feed.replicas))}</span>, "
                    f"position {_n(feed.position)}, lag {_n(feed.lag_s, 3)} s",
                )
            )
        rows.append(("snapshots, failovers, restarts", f"{m.snapshots}, {m.failovers}, {m.restarts}"))
    c = f.current
    lookups = ", ".join(
        f"{_e(s)} {_n(c.lookups.get(s, 0.0))}"
        + (f" ({_n(recent.lookups.get(s, 0.0))} recent)" if recent and recent.lookups.get(s, 0.0) else "")
        for s in LOOKUP_SOURCES
    )
    rows.append(("lookups by source", f"<span id='lookups'>{lookups}</span>"))
    return f"<section><h2>Directory and mirror</h2>{_kv(rows)}</section>"


def _pulls_card(f: StatusFigures) -> str:
    c = f.current
    planned = sum(c.pulls.get(k, 0.0) for k in PULL_OUTCOMES)
    short = c.pulls.get("short", 0.0)
    rows = [
        ("pull plans sent", f"<b id='pulls-total'>{_n(planned)}</b>"),
        ("served as planned", _n(c.pulls.get("full", 0.0))),
        ("fell short (recomputed)", f"<span id='pulls-failed' class='{'bad' if short else ''}'>{_n(short)}</span>"),
        ("no usage reported", _n(c.pulls.get("unreported", 0.0))),
    ]
    failures = "".join(
        f"<tr><td>{_e(_ago(f.now - p.at))} ago</td><td>{_e(p.node_id)}</td><td>{_e(p.source)}</td>"
        f"<td>{_n(p.reported)} of {_n(p.predicted)}</td><td>{_e(p.reason)}</td></tr>"
        for p in reversed(f.pull_failures)
    )
    table = (
        "<table class='grid' id='pull-failures'><tr><th>when</th><th>to</th><th>from</th><th>cached tokens</th>"
        f"<th>why</th></tr>{failures}</table>"
        if failures
        else "<p>No pull has failed.</p>"
    )
    return f"<section class='wide'><h2>Pulls</h2>{_kv(rows)}{table}</section>"


_UNHEALTHY = "<b class='bad'>no</b>"


def _engines_card(f: StatusFigures) -> str:
    def blocks(e: EngineFigures) -> str:
        if not e.capacity_blocks:
            return _n(e.blocks)
        share = min(1.0, e.blocks / e.capacity_blocks)
        return f"<span class='bar'><span style='width:{share * 100:.0f}%'></span></span> {_n(e.blocks)} / {_n(e.capacity_blocks)}"

    def bandwidth(e: EngineFigures) -> str:
        if not e.can_pull:
            return "cannot pull"
        return f"{e.pull_gbps:.2f} GB/s" if e.pull_gbps > 0 else "none measured"

    rows = "".join(
        f"<tr data-engine='{_e(e.node_id)}'><td>{_e(e.node_id)}</td>"
        f"<td>{'yes' if e.healthy else _UNHEALTHY}</td>"
        f"<td>{_n(e.running)}</td><td>{_n(e.waiting)}</td><td>{e.inflight}</td><td>{_n(e.pending_prefill_tokens)}</td>"
        f"<td>{_n(e.served)}</td><td>{_pct(_ratio(e.cached_tokens, e.prompt_tokens))}</td>"
        f"<td>{blocks(e)}</td><td>{bandwidth(e)}</td></tr>"
        for e in f.engines
    )
    return (
        "<section class='wide'><h2>Engines</h2><table class='grid' id='engines'><tr><th>engine</th><th>healthy</th>"
        "<th>running</th><th>waiting</th><th>in flight here</th><th>prompt tokens to prefill</th><th>served here</th>"
        "<th>cached share</th><th>cached blocks</th><th>pull bandwidth</th></tr>"
        f"{rows or '<tr><td colspan=10>no engine known</td></tr>'}</table></section>"
    )


def _peers_card(p: PeerFigures | None) -> str:
    if p is None:
        return ""
    rows = [
        ("peer gateways", _n(p.peers)),
        ("notes sent, dropped, failed batches", f"{_n(p.sent)}, {_n(p.dropped)}, {_n(p.send_failures)}"),
        ("notes received, held now", f"{_n(p.received)}, {_n(p.notes_held)}"),
    ]
    return f"<section><h2>Peer gateways</h2>{_kv(rows)}</section>"


_CSS = (
    "body{font-family:system-ui,sans-serif;margin:16px;color:#222;background:#f8f9fa}"
    "h1{margin:0 0 4px}h2{font-size:1.05em;margin:0 0 8px}"
    "main{display:grid;grid-template-columns:repeat(auto-fit,minmax(360px,1fr));gap:12px}"
    "section{background:#fff;border:1px solid #dee2e6;border-radius:6px;padding:10px 12px}"
    "section.wide{grid-column:1/-1}"
    "table{border-collapse:collapse}td,th{padding:2px 8px;text-align:left;vertical-align:top}"
    "table.kv th{font-weight:normal;color:#555}table.grid th{border-bottom:1px solid #dee2e6}"
    "table.grid td{border-bottom:1px solid #f1f3f5;white-space:nowrap}table.grid td:last-child{white-space:normal}"
    "figure.chart{margin:8px 0 0}.chart svg{display:block;width:100%;height:80px}.chart.tall svg{height:140px}"
    ".axis{stroke:#adb5bd}.top,.ticks{font-size:.75em;color:#868e96}.ticks{display:flex;justify-content:space-between}"
    ".legend{font-size:.85em;margin:2px 0 6px}.ok{color:#2f9e44}.bad{color:#e03131}"
    ".alert{background:#fff5f5;border:1px solid #ffc9c9;color:#c92a2a;padding:8px 12px;border-radius:6px}"
    ".reasons{list-style:none;padding:0;margin:0;display:flex;flex-wrap:wrap;gap:4px 18px}"
    ".bar{display:inline-block;width:80px;height:9px;background:#e9ecef;border-radius:2px;vertical-align:middle}"
    ".bar span{display:block;height:100%;background:#1971c2;border-radius:2px}"
)


def render_page(f: StatusFigures) -> str:
    """The status page: one HTML document, its charts inline SVG, reloading itself every REFRESH_S."""
    windows = f.windows()
    recent = f.recent()
    alert = (
        ""
        if f.directory.up
        else "<p class='alert' id='directory-alert'>The directory is unreachable: lookups come from the mirror while it is "
        "not too stale, then requests are routed by load alone (decision <i>fallback</i>). No request fails for it.</p>"
    )
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        f"<meta http-equiv='refresh' content='{REFRESH_S}'><meta name='viewport' content='width=device-width'>"
        f"<title>kvdir gateway</title><style>{_CSS}</style></head><body>"
        f"<h1>kvdir gateway</h1><p>policy <b>{_e(f.policy)}</b>, up {_e(_ago(f.now - f.started))}, "
        f"{len(f.engines)} engines; charts over the last {_e(_ago(f.span_s))} "
        f"(<a href='/v1/status'>JSON</a>, <a href='/metrics'>metrics</a>)</p>{alert}<main>"
        f"{_requests_card(f, recent, windows)}{_cache_card(f, recent, windows)}{_directory_card(f, recent)}"
        f"{_decisions_card(f, recent, windows)}{_engines_card(f)}{_pulls_card(f)}{_peers_card(f.peers)}"
        "</main></body></html>"
    )
