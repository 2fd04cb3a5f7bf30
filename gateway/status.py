"""The gateway's status figures: sampled over time, served as JSON (`GET /v1/status`) and drawn by the status page
(`GET /`, gateway.status_page).

What an operator opens to see whether routing works: requests and their rate, routing decisions by reason
over the last minutes, the hit rate and the directory's prediction error over time, each engine's load,
cached blocks and pull bandwidth, the directory's leader and term, the mirror's lag and source, and pulls
with their failures.

Figures over time come from `History`, a bounded ring of `Sample`s (the gateway's cumulative counters at one
moment) that `StatusBoard` takes every `SAMPLE_S` in a task of the app's lifespan: a rate or a ratio over an
interval is the difference of two samples, so nothing is counted twice and a page nobody opened for an hour
still shows the last ten minutes. `status_json` (and gateway.status_page's `render_page`) are pure: figures
in, text out, the time given in them, which is what the unit tests exercise; `StatusBoard.figures` does the only I/O, the
directory's `GET /v1/cluster` within `CLUSTER_DEADLINE_S`, whose failure is a figure like any other: the page
then says the directory is unreachable. Its answer (or failure) is kept for `CLUSTER_TTL_S` and shared by the
views meanwhile, and views that find it old together wait for one read: anyone who reaches the public port may
ask for the page, and must not be able to turn that into load on the directory.

Served on the gateway's public port, the figures hold no address: engines are named by node id, replicas by
their place in `--directory` (`_place`), pull failures by a category of what went wrong
(gateway.metrics.failure_category), and the directory's counts are of this gateway's engines only (the
directory's own cover every tenant's).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from itertools import pairwise
from typing import Any

from gateway.engine_registry import EngineRegistry, EngineState
from gateway.metrics import GatewayMetrics, PullFailure, Sample
from gateway.mirror import Mirror
from gateway.peers import PeerNotes
from gateway.router import make_candidate
from gateway.ttft_learner import TtftLearner
from kvproto.client import DirectoryClient
from kvproto.errors import DirectoryError, DirectoryUnavailable, RequestRejected
from kvproto.tasks import cancel_and_wait, every

log = logging.getLogger("kvdir.gateway")

SAMPLE_S = 5.0  # one sample every this many seconds...
HISTORY = 120  # ...this many kept: the last 10 minutes
CLUSTER_DEADLINE_S = 1.0  # the longest a page waits for the directory's /v1/cluster
CLUSTER_TTL_S = 2.0  # the directory's /v1/cluster answer is read at most this often
RECENT_S = 60.0  # "recent" figures (rates, hit rate) are over the last minute

PULL_OUTCOMES = ("full", "short", "unreported")  # kvdir_gateway_pulls_total{outcome}


def ratio(a: float, b: float) -> float | None:
    """a / b, or None where b is not positive (no traffic: no rate, no hit rate)."""
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
            ratio(b.reported_tokens - a.reported_tokens, prompt),
            ratio(b.predicted_tokens - a.predicted_tokens, prompt),
            ratio(b.error_tokens - a.error_tokens, b.reports - a.reports),
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
        return ratio(self.requests, self.seconds)


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
    running: float  # as it last reported them (load_source), this gateway's requests included
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
    # What the gateway learned of it from the TTFTs it observed (gateway.ttft_learner); None: nothing observed.
    prefill_tokens_per_s: float | None = None  # its prefill rate at its present load
    overhead_s: float | None = None  # its fixed time per request
    ttft_observed: int = 0  # first bytes observed
    ttft_error_s: float | None = None  # median |estimated - observed| TTFT, over the last ones
    ttft_error_ratio: float | None = None  # the same over the observed TTFT
    block_size: int = 0  # tokens per KV block, as registered (0: none)
    block_size_mismatch: bool = False  # its model's prompts are hashed at another size (most of its engines')
    tokenizer_parity: str = ""  # its /tokenize against the gateway's tokens (gateway.tokenizer_parity; "": not yet)
    load_source: str = "heartbeat"  # where running and waiting are from: "scrape" (its /metrics, fresh) or "heartbeat"
    load_age_s: float | None = None  # how long ago that read of its /metrics began (None: from its heartbeat)
    kv_usage: float | None = None  # the fraction of its KV cache in use, from its /metrics (None: not read)
    preemptions: float | None = None  # requests it preempted since it started, from its /metrics (None: not read)


def _running(e: EngineState) -> float:
    """Requests running there, the engine's and this gateway's, each counted once (as routing counts them)."""
    c = make_candidate(
        e.node_id,
        e.epoch,
        reported_running=e.running,
        waiting=e.waiting,
        inflight=e.inflight,
        reported_inflight=e.reported_inflight,
        pending_prefill_tokens=0.0,
    )
    return float(c.running + c.inflight)


def _load(e: EngineState, now: float) -> dict[str, Any]:
    """EngineFigures' fields on where its load figures are from, and what only its /metrics tell."""
    scraped = e.load_scraped
    if scraped is None:
        return {}
    return {
        "load_source": "scrape",
        "load_age_s": round(max(0.0, now - e.scraped_at), 3),
        "kv_usage": scraped.kv_usage,
        "preemptions": scraped.preemptions,
    }


@dataclass(frozen=True, slots=True)
class DirectoryFigures:
    """The directory as `GET /v1/cluster` and the engine list describe it; replicas by 1-based place in `--directory`.
    `nodes` and `entries` are of the engines this gateway routes to (listed by the directory), not the directory's."""

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
    nodes: int | None = None  # engines the directory lists that this gateway routes to
    entries: int | None = None  # blocks the directory lists for them

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
        learner: TtftLearner | None = None,
    ) -> None:
        self.metrics, self.registry, self.directory, self.policy = metrics, registry, directory, policy
        self.learner = learner
        self.mirror, self.peers = mirror, peers
        self.sample_s = sample_s
        self.history = History(size)
        self.span_s = sample_s * size
        self.started = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        # The last read of /v1/cluster: when, the engine list's state then, and what it said.
        self._cluster: tuple[float, bool, DirectoryFigures] | None = None
        self._cluster_read: asyncio.Future[DirectoryFigures] | None = None  # the read under way, shared by its callers

    def start(self) -> None:
        self.history.add(self.metrics.sample(time.monotonic()))  # the zero every first interval counts from
        self._task = asyncio.create_task(
            every(
                self.sample_s,
                self._sample,
                what="status page sample",
                log=log,
                failed=self.metrics.tasks.failed("status_sample"),
                first_now=False,
            ),
            name="status samples",
        )

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    def _sample(self) -> None:
        self.history.add(self.metrics.sample(time.monotonic()))

    async def _directory(self) -> DirectoryFigures:
        """The directory's figures: its /v1/cluster as last read (again when older than CLUSTER_TTL_S or when the
        engine list's reads have since failed or recovered, once for every caller then), with the engine list's
        state and counts as they are now."""
        cached = self._cluster
        if cached is not None and time.monotonic() - cached[0] < CLUSTER_TTL_S and cached[1] == self.registry.directory_ok:
            cluster = cached[2]
        else:
            if self._cluster_read is None:
                self._cluster_read = asyncio.ensure_future(self._read_cluster())
            cluster = await asyncio.shield(self._cluster_read)  # a caller that goes away leaves the read to the others
        ours = [e for e in self.registry.engines.values() if e.registered]
        return replace(cluster, engine_list_ok=self.registry.directory_ok, nodes=len(ours), entries=sum(e.blocks for e in ours))

    async def _read_cluster(self) -> DirectoryFigures:
        try:
            listed = self.registry.directory_ok
            figures = await self._cluster_figures()
            self._cluster = (time.monotonic(), listed, figures)
            return figures
        finally:
            self._cluster_read = None

    async def _cluster_figures(self) -> DirectoryFigures:
        """`GET /v1/cluster` as figures (the engine list's are filled in by `_directory`)."""
        urls = self.directory.urls
        try:
            c = await self.directory.cluster(deadline=CLUSTER_DEADLINE_S)
        except DirectoryUnavailable:
            return DirectoryFigures(len(urls), False, False, f"no replica answered within {CLUSTER_DEADLINE_S:g} s")
        except RequestRejected as exc:
            return DirectoryFigures(len(urls), False, False, f"refused: {exc.status} {exc.error}")
        except (DirectoryError, ValueError) as exc:
            return DirectoryFigures(len(urls), False, False, type(exc).__name__)
        if not isinstance(c, dict):
            return DirectoryFigures(len(urls), False, False, "a malformed answer")
        quorum = c.get("has_quorum")
        return DirectoryFigures(
            len(urls),
            False,
            True,
            answered_by=_place(c.get("self_url"), urls),
            leader=_place(c.get("leader_url"), urls),
            leader_elected=c.get("leader") is not None,
            term=_int(c.get("term")),
            commit_index=_int(c.get("commit_index")),
            has_quorum=quorum if isinstance(quorum, bool) else None,
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

    def _learned(self, node_id: str, running: float) -> dict[str, Any]:
        """EngineFigures' learned fields for the engine (none while nothing was observed there)."""
        curve = self.learner.curves.get(node_id) if self.learner is not None else None
        if curve is None or not curve.errors:
            return {}
        out: dict[str, Any] = {
            "ttft_observed": curve.seen,
            "ttft_error_s": curve.median_abs_error_s(),
            "ttft_error_ratio": curve.median_relative_error(),
        }
        if curve.observations:
            out["prefill_tokens_per_s"] = curve.rate(running)
            out["overhead_s"] = curve.overhead_s
        return out

    async def figures(self) -> StatusFigures:
        directory = await self._directory()  # first: the page's `now` is after its wait
        now = time.monotonic()
        mismatched = set(self.registry.mismatched_block_size)
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
                **self._learned(e.node_id, _running(e)),
                block_size=e.block_size,
                block_size_mismatch=e.node_id in mismatched,
                tokenizer_parity=e.parity,
                **_load(e, now),
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
            self.metrics.sample(now),
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
            "hit_rate": ratio(c.reported_tokens, c.prompt_tokens),
            "mean_prediction_error_tokens": ratio(c.error_tokens, c.reports),
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
