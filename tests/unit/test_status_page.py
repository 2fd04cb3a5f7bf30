"""The gateway's status page (gateway/status.py), pure: figures in, HTML and JSON out.

What the page must show is issue #34's item 3; that it never shows an address is issue #12's item 8; every string
from outside the gateway is escaped. tests/integration/test_status_browser.py renders a live one in Chromium.
"""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from gateway.cost import REASONS
from gateway.metrics import GatewayMetrics, PullFailure
from gateway.proxy import _usage_in_tail, pull_failures
from gateway.status import (
    DirectoryFigures,
    EngineFigures,
    FeedFigures,
    History,
    MirrorFigures,
    PeerFigures,
    Sample,
    StatusBoard,
    StatusFigures,
    Window,
    status_json,
)
from gateway.status_page import REASON_COLORS, render_page
from kvproto.client import DirectoryClient

NOW = 1000.0
HOSTILE = "<script>alert('x')</script>&\""


def _sample(t: float, scale: float, **over: Any) -> Sample:
    """Counters as if `scale` x (10 requests, 4,000 prompt tokens, 3,000 cached) had been routed by time `t`."""
    fields: dict[str, Any] = dict(
        t=t,
        decisions={"affinity": 6 * scale, "pull": 2 * scale, "balance": 2 * scale},
        prompt_tokens=4000 * scale,
        predicted_tokens=3200 * scale,
        reported_tokens=3000 * scale,
        error_tokens=200 * scale,
        reports=10 * scale,
        lookups={"mirror": 9 * scale, "rest": scale},
        upstream_errors=0.0,
        pulls={"full": 1.5 * scale, "short": 0.5 * scale},
    )
    fields.update(over)
    return Sample(**fields)


def _engine(node_id: str = "worker-1", **over: Any) -> EngineFigures:
    fields: dict[str, Any] = dict(
        node_id=node_id,
        healthy=True,
        registered=True,
        running=1.0,
        waiting=0.0,
        inflight=2,
        pending_prefill_tokens=350.0,
        served=42,
        prompt_tokens=8000,
        cached_tokens=6000,
        blocks=300,
        capacity_blocks=1000,
        can_pull=True,
        pull_gbps=1.25,
    )
    fields.update(over)
    return EngineFigures(**fields)


UP = DirectoryFigures(
    3, True, True, answered_by=1, leader=2, leader_elected=True, term=7, commit_index=1234, has_quorum=True, nodes=2, entries=900
)
DOWN = DirectoryFigures(3, False, False, "no replica answered within 1 s")
MIRROR = MirrorFigures(0.012, 0.5, True, (FeedFigures("", 2, 3, 0.012, True, 5678),), 1, 0, 0)


def _figures(**over: Any) -> StatusFigures:
    """Ten minutes of history, one sample a minute, 10 requests a minute; two engines; a pull that fell short."""
    history = tuple(_sample(NOW - 600 + 60 * i, float(i)) for i in range(10))
    fields: dict[str, Any] = dict(
        now=NOW,
        started=NOW - 660,
        policy="kvdir",
        current=_sample(NOW, 10.0),
        history=history,
        engines=(_engine("worker-1"), _engine("worker-2", healthy=False, can_pull=False, capacity_blocks=None)),
        directory=UP,
        mirror=MIRROR,
        pull_failures=(PullFailure(NOW - 30, "worker-2", "worker-1", 400, 0, "transfer: timed out"),),
        peers=None,
        span_s=600.0,
    )
    fields.update(over)
    return StatusFigures(**fields)


def _text(page: str, element_id: str) -> str:
    """The text of the element with `element_id` (its tags stripped)."""
    m = re.search(rf"<(\w+)[^>]* id='{element_id}'[^>]*>(.*?)</\1>", page, re.S)
    assert m is not None, f"no element #{element_id}"
    return re.sub(r"<[^>]+>", "", m.group(2))


def test_the_page_shows_totals_rates_decisions_and_the_directory() -> None:
    page = render_page(_figures())
    assert page.startswith("<!doctype html>") and "http-equiv='refresh'" in page
    assert _text(page, "requests-total") == "100"
    assert _text(page, "requests-rate") == "0.17"  # 10 requests in the last minute
    assert _text(page, "hit-rate") == "75.0%"
    assert _text(page, "prediction-error") == "20.0"
    for reason, n in (("affinity", "60"), ("pull", "20"), ("balance", "20")):
        assert re.search(rf"data-reason='{reason}'>.*?<b>{n}</b>", page), reason
    assert "data-reason='fallback'" not in page  # reasons never taken are not listed
    assert _text(page, "leader") == "replica 2 of 3"
    assert _text(page, "term") == "7"
    assert _text(page, "directory-state") == "reachable" and "directory-alert" not in page
    assert "0.012" in _text(page, "mirror-lag")
    assert "replica 2 of 3" in page.split("mirror-source")[1]
    assert "mirror 90" in _text(page, "lookups")
    assert _text(page, "pulls-total") == "20" and _text(page, "pulls-failed") == "5"
    assert "transfer: timed out" in _text(page, "pull-failures") and "30 s ago" in _text(page, "pull-failures")


def test_engines_show_load_cached_blocks_and_pull_bandwidth() -> None:
    page = render_page(_figures())
    rows = dict(re.findall(r"<tr data-engine='([^']+)'>(.*?)</tr>", page))
    assert set(rows) == {"worker-1", "worker-2"}
    one = re.sub(r"<[^>]+>", "|", rows["worker-1"])
    assert "|350|" in one and "|42|" in one and "75.0%" in one and "300 / 1,000" in one and "1.25 GB/s" in one
    assert "width:30%" in rows["worker-1"]  # the cached-blocks bar
    assert "cannot pull" in rows["worker-2"] and "class='bad'>no<" in rows["worker-2"]


def test_engines_show_where_their_load_is_from() -> None:
    scraped = _engine("scraped", load_source="scrape", load_age_s=0.12, kv_usage=0.35, preemptions=3.0)
    page = render_page(_figures(engines=(scraped, _engine("told"))))
    rows = dict(re.findall(r"<tr data-engine='([^']+)'>(.*?)</tr>", page))
    assert "its /metrics, 0.12 s ago, KV 35.0% used, 3 preempted" in rows["scraped"]
    assert "its heartbeat" in rows["told"] and "/metrics" not in rows["told"]


def test_charts_are_inline_svg_over_the_history() -> None:
    page = render_page(_figures())
    assert "<script" not in page and "src=" not in page  # nothing to run, nothing loaded from elsewhere
    svgs = re.findall(r"<svg .*?</svg>", page, re.S)
    assert len(svgs) == 4  # requests/s, decisions by reason, hit rate, prediction error
    decisions = next(s for s in svgs if "by reason" in s)
    assert decisions.count("<rect") == 3 * 10  # three reasons in each of the ten windows
    assert all(c in decisions for c in (REASON_COLORS["affinity"], REASON_COLORS["pull"], REASON_COLORS["balance"]))
    assert "<polyline" in next(s for s in svgs if "hit rate" in s)


def test_a_fresh_gateway_renders_without_history() -> None:
    f = _figures(history=(), current=_sample(NOW, 0.0, decisions={}, pulls={}, lookups={}), pull_failures=(), engines=())
    page = render_page(f)
    assert _text(page, "requests-total") == "0" and _text(page, "hit-rate") == "–"
    assert "no engine known" in page and "none yet" in page and "No pull has failed." in page
    assert json.loads(json.dumps(status_json(f), allow_nan=False))["recent"] is None


def test_an_unreachable_directory_is_said_and_the_page_still_renders() -> None:
    stale = MirrorFigures(None, 0.5, False, (FeedFigures("", 1, 3, None, False, 5678),), 1, 4, 0)
    page = render_page(_figures(directory=DOWN, mirror=stale))
    assert "directory-alert" in page and "unreachable" in _text(page, "directory-alert")
    assert _text(page, "directory-state") == "unreachable"
    assert "no replica answered within 1 s" in page
    assert _text(page, "leader") == "unknown" and _text(page, "term") == "–"
    assert "stale" in page and _text(page, "mirror-lag") == "–"
    assert _text(page, "requests-total") == "100"  # what the gateway knows itself is still there
    # The engine list failing alone (GET /v1/cluster answered) is unreachable too.
    listless = DirectoryFigures(3, False, True, leader=1, leader_elected=True, term=3)
    assert "the engine list could not be read" in render_page(_figures(directory=listless))


def test_leaderless_and_unlisted_leaders_are_named_as_such() -> None:
    none = DirectoryFigures(3, True, True, answered_by=1, leader=None, leader_elected=False, term=9)
    assert _text(render_page(_figures(directory=none)), "leader") == "none (an election?)"
    other = DirectoryFigures(3, True, True, answered_by=1, leader=None, leader_elected=True, term=9)
    assert _text(render_page(_figures(directory=other)), "leader") == "a replica not in --directory"


def test_every_outside_string_is_escaped() -> None:
    f = _figures(
        engines=(_engine(HOSTILE),),
        pull_failures=(PullFailure(NOW - 5, HOSTILE, HOSTILE, 16, None, HOSTILE),),
        directory=DirectoryFigures(3, True, False, HOSTILE),
        mirror=MirrorFigures(1.0, 0.5, False, (FeedFigures(HOSTILE, 1, 3, 1.0, False, 1),), 1, 0, 0),
        policy=HOSTILE,
    )
    page = render_page(f)
    assert "<script" not in page and "alert('x')" not in page
    escaped = "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;&amp;&quot;"
    assert page.count(escaped) >= 7  # policy, engine row (twice), failure (three times), the problem, the shard
    assert f"data-engine='{escaped}'" in page  # quotes escaped inside attributes too


def test_the_page_shows_no_address() -> None:
    """Issue #12, item 8: the page is served to clients, so replicas are places in --directory, engines node ids."""
    page = render_page(_figures(peers=PeerFigures(2, 10, 0, 1, 8, 3)))
    assert "http://" not in page and "127.0.0.1" not in page
    # Nor anything a port could be mistaken for (test_gateway_limits looks for the engine's): counts have separators.
    assert not re.search(r"[1-9]\d{4}", page), re.findall(r"[1-9]\d{4,}", page)
    assert "Peer gateways" in page


def test_json_has_the_same_figures_and_is_strict_json() -> None:
    f = _figures(mirror=MirrorFigures(None, 0.5, False, (FeedFigures("", 1, 3, None, False, 1),), 0, 0, 0))
    data = json.loads(json.dumps(status_json(f), allow_nan=False))
    assert data["requests"]["total"] == 100 and data["decisions"]["affinity"] == 60
    assert data["cache"]["hit_rate"] == 0.75 and data["cache"]["mean_prediction_error_tokens"] == 20
    assert data["directory"]["leader"] == 2 and data["directory"]["term"] == 7 and data["directory"]["up"] is True
    assert data["mirror"]["lag_s"] is None and data["mirror"]["feeds"][0]["source"] == 1
    assert [e["node_id"] for e in data["engines"]] == ["worker-1", "worker-2"]
    assert data["pulls"]["short"] == 5 and data["pulls"]["failures"][0]["age_s"] == 30
    assert "at" not in data["pulls"]["failures"][0]  # monotonic times mean nothing outside the process
    assert len(data["history"]) == 10 and data["history"][-1]["age_s"] == 0 and data["history"][0]["requests"] == 10
    assert data["recent"]["seconds"] == 60 and data["recent"]["rate_per_s"] == 10 / 60
    assert data["uptime_s"] == 660


def test_windows_are_differences_of_samples() -> None:
    w = Window.between(_sample(0.0, 1.0), _sample(10.0, 3.0))
    assert (w.seconds, w.requests, w.rate) == (10.0, 20.0, 2.0)
    assert w.hit_rate == 0.75 and w.predicted_rate == 0.8 and w.mean_error == 20.0
    assert w.decisions == {"affinity": 12.0, "balance": 4.0, "pull": 4.0}
    idle = Window.between(_sample(0.0, 1.0), _sample(10.0, 1.0))
    assert idle.hit_rate is None and idle.mean_error is None and idle.rate == 0.0


def test_recent_is_the_last_minute_or_everything_since_the_start() -> None:
    f = _figures()
    recent = f.recent()
    assert recent is not None and (recent.start, recent.end) == (NOW - 60, NOW)
    young = _figures(history=(_sample(NOW - 20, 0.0),), started=NOW - 20)
    assert young.recent() is not None and young.recent().start == NOW - 20  # type: ignore[union-attr]


def test_the_history_is_bounded() -> None:
    h = History(size=3)
    for i in range(10):
        h.add(_sample(float(i), float(i)))
    assert [s.t for s in h.samples] == [7.0, 8.0, 9.0]


def test_every_decision_reason_has_a_colour() -> None:
    assert set(REASON_COLORS) == REASONS


def _metrics() -> GatewayMetrics:
    return GatewayMetrics(SimpleNamespace(engines={}, directory_ok=True))  # type: ignore[arg-type]


def test_a_sample_reads_the_gateways_counters() -> None:
    m = _metrics()
    m.decisions.labels("affinity").inc(3)
    m.decisions.labels("pull").inc()
    m.prompt_tokens.inc(1000)
    m.predicted.inc(600)
    m.reported.inc(500)
    m.prediction_error.observe(100)
    m.prediction_error.observe(0)
    m.lookups.labels("mirror").inc(4)
    m.upstream_errors.labels("connect").inc()
    m.upstream_errors.labels("502").inc()
    m.pulled(1.0, "w2", "w1", 400, 400, [])
    s = m.sample(5.0)
    assert s.t == 5.0 and s.decisions == {"affinity": 3, "pull": 1} and s.requests == 4
    assert (s.prompt_tokens, s.predicted_tokens, s.reported_tokens) == (1000, 600, 500)
    assert (s.error_tokens, s.reports) == (100, 2)
    assert s.lookups == {"mirror": 4} and s.upstream_errors == 2 and s.pulls == {"full": 1}


def test_pull_outcomes_are_counted_and_failures_kept() -> None:
    m = _metrics()
    m.pulled(1.0, "w2", "w1", 400, 400, [])
    m.pulled(2.0, "w2", "w1", 400, 256, [])
    m.pulled(3.0, "w3", "w1", 400, 400, ["2 blocks failed verification"])
    m.pulled(4.0, "w3", "w1", 400, None, [])
    counts = {s.labels["outcome"]: s.value for s in m.pulls.collect()[0].samples if s.name.endswith("_total")}
    assert counts == {"full": 1, "short": 2, "unreported": 1}
    assert [(p.at, p.reason) for p in m.pull_failures] == [
        (2.0, "the engine reported 256 of 400 predicted cached tokens"),
        (3.0, "blocks failed verification"),
    ]
    for i in range(30):
        m.pulled(10.0 + i, "w2", "w1", 400, 0, [])
    assert len(m.pull_failures) == 20 and m.pull_failures[-1].at == 39.0


def test_pull_failures_are_shown_by_category_without_the_engines_addresses_or_epochs() -> None:
    """The page and /v1/status are on the gateway's public port: an engine's words name its peers' transfer
    addresses and epochs, so only a category of them is kept."""
    m = _metrics()
    said = [
        "transfer: rank 0: cannot connect to 10.1.2.3:15001: ConnectionRefusedError(111)",
        "source worker-1 epoch 987654 is not registered with a transfer URL",
        "transfer: rank 1: cannot connect to 10.1.2.4:15002: reset",
        "something no category names at 10.9.9.9:1 epoch 987654",
    ]
    m.pulled(1.0, "w2", "worker-1", 400, 0, said)
    assert m.pull_failures[-1].reason == "the transfer failed; the source is not registered at that epoch; other"
    f = _figures(pull_failures=tuple(m.pull_failures))
    for shown in (render_page(f), json.dumps(status_json(f))):
        assert "10.1.2" not in shown and "15001" not in shown and "987654" not in shown and "10.9.9.9" not in shown
        assert "the transfer failed" in shown


def test_the_engines_pull_failures_are_read_from_its_answer() -> None:
    assert pull_failures({"kvdir": {"pull_failures": ["transfer: reset", 3]}}) == ["transfer: reset", "3"]
    assert (
        pull_failures({"usage": {}}) == []
        and pull_failures(None) == []
        and pull_failures({"kvdir": {"pull_failures": "x"}}) == []
    )
    tail = b'data: {"choices": []}\n\ndata: {"usage": {"prompt_tokens_details": {"cached_tokens": 32}}, "kvdir": {"pull_failures": []}}\n\ndata: [DONE]\n\n'
    assert _usage_in_tail(tail)["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


def _board(
    handler: Any, urls: list[str], directory_ok: bool = True, engines: dict[str, Any] | None = None
) -> tuple[StatusBoard, DirectoryClient]:
    client = DirectoryClient(urls, transport=httpx.MockTransport(handler), timeout=0.2)
    registry = SimpleNamespace(engines=engines or {}, directory_ok=directory_ok, mismatched_block_size=[])
    return StatusBoard(_metrics(), registry, client, "kvdir"), client  # type: ignore[arg-type]


def test_the_board_names_the_leader_by_its_place_in_the_directory_list() -> None:
    urls = ["http://10.0.0.1:8101", "http://10.0.0.2:8102", "http://10.0.0.3:8103"]

    def cluster(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/cluster"
        body = {"self_url": urls[0], "leader": "10.0.0.3:9103", "leader_url": urls[2] + "/", "term": 12, "commit_index": 99}
        return httpx.Response(200, json={**body, "has_quorum": True, "nodes": 4, "entries": 1000})

    async def main() -> StatusFigures:
        board, client = _board(cluster, urls)
        try:
            return await board.figures()
        finally:
            await client.aclose()

    f = asyncio.run(main())
    assert f.directory == DirectoryFigures(
        3,
        True,
        True,
        None,
        answered_by=1,
        leader=3,
        leader_elected=True,
        term=12,
        commit_index=99,
        has_quorum=True,
        nodes=0,  # this gateway's engines (none here), never the directory's 4 nodes of every tenant
        entries=0,
    )
    page = render_page(f)
    assert _text(page, "leader") == "replica 3 of 3" and "10.0.0" not in page


def test_the_board_counts_only_its_own_engines_and_reads_the_cluster_once_per_ttl(monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory's node and entry counts cover every tenant: the board shows those of the engines it routes to.
    Its /v1/cluster is read at most once per CLUSTER_TTL_S, once for all the views that want it at the same time."""
    asked: list[str] = []

    def cluster(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(200, json={"term": 3, "leader": None, "nodes": 40, "entries": 10**6})

    engines = {
        "a": SimpleNamespace(registered=True, blocks=300),
        "b": SimpleNamespace(registered=True, blocks=200),
        "static-1": SimpleNamespace(registered=False, blocks=0),  # not the directory's
    }

    async def main() -> list[DirectoryFigures]:
        board, client = _board(cluster, ["http://10.0.0.1:8101"], engines=engines)
        try:
            together = await asyncio.gather(*(board._directory() for _ in range(10)))
            again = await board._directory()  # within the TTL: no read
            board.registry.directory_ok = False  # the engine list's reads began to fail: the answer kept is old news
            failing = await board._directory()
            monkeypatch.setattr("gateway.status.CLUSTER_TTL_S", 0.0)
            return [*together, again, failing, await board._directory()]
        finally:
            await client.aclose()

    figures = asyncio.run(main())
    assert asked == ["/v1/cluster"] * 3
    assert all((d.term, d.nodes, d.entries) == (3, 2, 500) for d in figures), figures
    assert [d.engine_list_ok for d in figures[-3:]] == [True, False, False]


def test_the_board_says_why_the_directory_did_not_answer() -> None:
    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    def forbidden(request: httpx.Request) -> httpx.Response:
        return httpx.Response(403, json={"error": "forbidden", "detail": "no"})

    async def main(handler: Any) -> StatusFigures:
        board, client = _board(handler, ["http://10.0.0.1:8101"], directory_ok=False)
        try:
            return await board.figures()
        finally:
            await client.aclose()

    down = asyncio.run(main(refused)).directory
    assert (down.reachable, down.up, down.problem) == (False, False, "no replica answered within 1 s")
    assert asyncio.run(main(forbidden)).directory.problem == "refused: 403 forbidden"
    listed = asyncio.run(main(lambda request: httpx.Response(200, json=[1]))).directory  # a replica's answer, malformed
    assert (listed.reachable, listed.problem) == (False, "a malformed answer")
