"""The gateway's status page (`GET /`): the figures of gateway.status as one HTML document.

Plain HTML and CSS with inline SVG drawn here and a meta refresh: nothing is loaded from elsewhere (GPU
clusters are often air-gapped) and no script runs. Rendering is pure (figures in, text out, the time given in
them). The page is served on the gateway's public port, so it shows no address nor epoch: engines are named by
node id, replicas by their place in `--directory` ("replica 2 of 3"), pull failures by category. Every string from
outside the gateway (node ids, the directory's error codes) is escaped.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from gateway.status import PULL_OUTCOMES, EngineFigures, PeerFigures, StatusFigures, Window, ratio

REFRESH_S = 5  # the page reloads itself this often

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
        ("hit rate (engines' report)", f"<b id='hit-rate'>{_pct(ratio(c.reported_tokens, c.prompt_tokens))}</b>"),
        ("predicted by the directory", _pct(ratio(c.predicted_tokens, c.prompt_tokens))),
        (f"hit rate, last {_ago(recent.seconds)}" if recent else "hit rate, recent", _pct(recent.hit_rate if recent else None)),
        (
            "mean |predicted - reported|",
            f"<span id='prediction-error'>{_n(ratio(c.error_tokens, c.reports), 1)}</span> tokens per request",
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
        ("its engines here, their blocks", f"{_n(d.nodes)}, {_n(d.entries)}"),
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

    def learned(e: EngineFigures) -> str:
        if not e.ttft_observed:
            return "none observed"
        rate = f"{_n(e.prefill_tokens_per_s)} tokens/s + {e.overhead_s * 1000:.0f} ms; " if e.overhead_s is not None else ""
        err = f"{e.ttft_error_s * 1000:.0f} ms" if e.ttft_error_s is not None else "?"
        share = f" ({_pct(e.ttft_error_ratio)})" if e.ttft_error_ratio is not None else ""
        return f"{rate}error {err}{share} over {_n(e.ttft_observed)}"

    def source(e: EngineFigures) -> str:
        if e.load_source != "scrape":
            return "its heartbeat"
        usage = f", KV {_pct(e.kv_usage)} used" if e.kv_usage is not None else ""
        preempted = f", {_n(e.preemptions)} preempted" if e.preemptions is not None else ""
        return f"its /metrics, {_n(e.load_age_s, 2)} s ago{usage}{preempted}"

    rows = "".join(
        f"<tr data-engine='{_e(e.node_id)}'><td>{_e(e.node_id)}</td>"
        f"<td>{'yes' if e.healthy else _UNHEALTHY}</td>"
        f"<td>{_n(e.running)}</td><td>{_n(e.waiting)}</td><td class='load'>{source(e)}</td>"
        f"<td>{e.inflight}</td><td>{_n(e.pending_prefill_tokens)}</td>"
        f"<td>{_n(e.served)}</td><td>{_pct(ratio(e.cached_tokens, e.prompt_tokens))}</td>"
        f"<td>{blocks(e)}</td><td>{bandwidth(e)}</td><td class='ttft'>{learned(e)}</td></tr>"
        for e in f.engines
    )
    return (
        "<section class='wide'><h2>Engines</h2><table class='grid' id='engines'><tr><th>engine</th><th>healthy</th>"
        "<th>running</th><th>waiting</th><th title='where running and waiting are from: its own /metrics "
        "while a read is fresh (with its KV cache use and preemptions), else its heartbeat'>load from</th>"
        "<th>in flight here</th><th>prompt tokens to prefill</th><th>served here</th>"
        "<th>cached share</th><th>cached blocks</th><th>pull bandwidth</th>"
        "<th title='prefill rate at its load and fixed time, learned from the first bytes observed; median "
        "|estimated - observed| TTFT'>TTFT learned</th></tr>"
        f"{rows or '<tr><td colspan=12>no engine known</td></tr>'}</table></section>"
    )


_MISHASHED = " <b class='bad'>(its model is hashed at another size)</b>"


def _tokenizer_card(f: StatusFigures) -> str:
    """Each engine's block size and how its tokens compare with the gateway's: a mismatch on either is a 0% hit
    rate on that engine, so it is shown, never left to be inferred."""

    def parity(summary: str) -> str:
        bad = summary.startswith(("mismatch", "unverified"))
        return f"<b class='bad'>{_e(summary)}</b>" if bad else _e(summary or "not probed yet")

    rows = "".join(
        f"<tr data-parity='{_e(e.node_id)}'><td>{_e(e.node_id)}</td>"
        f"<td>{e.block_size or 'none registered'}{_MISHASHED if e.block_size_mismatch else ''}</td>"
        f"<td class='parity'>{parity(e.tokenizer_parity)}</td></tr>"
        for e in f.engines
    )
    return (
        "<section class='wide'><h2>Block sizes and tokenizer parity</h2><table class='grid' id='parity'><tr><th>engine</th>"
        "<th>KV block size</th><th title=\"the gateway's tokens for a probe chat and completion against the engine's "
        '/tokenize">tokenizer parity</th></tr>'
        f"{rows or '<tr><td colspan=3>no engine known</td></tr>'}</table></section>"
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
        f"{_decisions_card(f, recent, windows)}{_engines_card(f)}{_tokenizer_card(f)}{_pulls_card(f)}{_peers_card(f.peers)}"
        "</main></body></html>"
    )
