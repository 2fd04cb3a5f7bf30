"""Forwarding a completion to the engine the router chose: lookup, retries, streaming, load accounting.

The I/O half of the request path (gateway.router is the pure half). For one
request, `Proxy.complete`:
1. hashes the prompt and asks the directory which engines hold it: the mirror
   while it is fresh, else a replica; a lookup that fails or takes longer than
   `lookup_timeout_s` is answered by the stale mirror while it is at most
   `mirror_stale_lag_s` behind, else routed by load (`fallback`): a request
   never fails because the directory is down;
2. routes it and sends the client's body upstream, re-serialized as compact
   UTF-8 JSON with the router's pull plan added, if any (the gateway has
   already dropped any plan the client sent: gateway.client_request); a
   connection refused before any byte was received marks the engine unhealthy
   and is retried on the next best, until no engine is left (503); an engine
   that fails after that is answered with a 502 (it may have run the request,
   so it is not retried elsewhere);
3. relays the response: read whole (not streamed, or an error status) or
   streamed chunk by chunk as it comes.

The forward goes through the gateway's own keep-alive client (gateway.upstream:
asyncio and httptools), not httpx or httpcore: the forward needs one request
shape, and their layers were most of the gateway's CPU per request
(BENCHMARKS.md, "The gateway's own cost").

What the gateway adds to an engine's reported load is counted by one
`InflightTicket` per request, from just before the request is sent until the
response is over.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from fastapi.responses import Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from gateway.cost import RouteRequest
from gateway.engine_registry import EngineRegistry, EngineState
from gateway.errors import GatewayError
from gateway.lookup import HolderLookup
from gateway.metrics import GatewayMetrics
from gateway.mirror import Mirror
from gateway.peers import PeerNotes
from gateway.router import HolderView, NoEngineAvailable, Route, Router
from gateway.stream_join import StreamError, join, streamable, streamed_body
from gateway.upstream import ConnectFailed, Timeouts, Upstream, UpstreamFailed, UpstreamResponse
from kvproto.client import DirectoryClient
from kvproto.hashing import KvIdentity
from kvproto.schemas import DP_RANK_HEADER

log = logging.getLogger("kvdir.gateway")

_TAIL_BYTES = 65536  # the end of a stream kept to read its final usage chunk
_DP_RANK = DP_RANK_HEADER.lower().encode()
_JSON = (b"content-type", b"application/json")


class InflightTicket:
    """One request's share of an engine's load as the gateway counts it: the only code that changes it.

    Taking the ticket adds 1 to `engine.inflight` and the request's uncached
    prompt tokens to `engine.pending_prefill_tokens`; `first_byte` removes the
    tokens (the prefill is over once the engine answers) and tells
    `on_prefilled` whether it ended well (`ok`), `close` removes both what is
    left and the request (a prefill still open then failed). Both are
    idempotent, so every exit path may call them. `with ticket:` hands the ticket to a block that closes it
    however the block ends; a streamed response's ticket is closed by its relay
    when the stream ends. Event loop only (not thread-safe).
    """

    __slots__ = ("_closed", "_prefilling", "engine", "first_byte_s", "on_prefilled", "sent", "uncached")

    def __init__(self, engine: EngineState, uncached: int, on_prefilled: Callable[[bool], None] | None = None) -> None:
        self.engine = engine
        self.uncached = uncached
        self.on_prefilled = on_prefilled
        self.sent = time.monotonic()  # the ticket is taken as the request is sent
        self.first_byte_s: float | None = None  # sent -> the engine's first answering byte, if it answered
        engine.inflight += 1
        engine.pending_prefill_tokens += uncached
        self._prefilling = True
        self._closed = False

    def first_byte(self, ok: bool = True) -> None:
        """The engine started answering (`ok`; else it failed): the prompt is no longer waiting to be prefilled."""
        if self._prefilling:
            self._prefilling = False
            if ok:
                self.first_byte_s = time.monotonic() - self.sent
            self.engine.pending_prefill_tokens -= self.uncached
            if self.on_prefilled is not None:
                self.on_prefilled(ok)

    def close(self) -> None:
        """The request is over (answered, failed or abandoned)."""
        self.first_byte(ok=False)
        if not self._closed:
            self._closed = True
            self.engine.inflight -= 1

    def __enter__(self) -> InflightTicket:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class KvRequest:
    """What routing needs of a request besides its tokens: its model, its KV identity (docs/protocol.md §1.1),
    why its prompt cannot be hashed as the engine hashes it (None: it can), and the tokens it may generate
    (`max_completion_tokens` or `max_tokens`, which price its decode; None: the router's default)."""

    model: str
    identity: KvIdentity
    unhashed: str | None = None
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Sent:
    """A request on its way: where it went and on what figures, and its ticket."""

    route: Route
    req: RouteRequest
    model: str
    engine: EngineState
    ticket: InflightTicket


@dataclass(frozen=True, slots=True)
class Timing:
    """perf_counter() marks of one request, for the route and added-latency histograms."""

    arrival: float  # the request arrived
    tokenize_s: float  # spent tokenizing (not the gateway's routing cost: an engine tokenizes too)
    start: float  # routing started (before hashing)
    hash_s: float  # spent hashing


def cached_tokens(payload: Any) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` of an OpenAI response, None when absent or not a number."""
    try:
        return int(payload["usage"]["prompt_tokens_details"]["cached_tokens"])
    except (KeyError, TypeError, ValueError):
        return None


def completion_tokens(payload: Any) -> int | None:
    """`usage.completion_tokens` of an OpenAI response, None when absent or not a number."""
    try:
        return int(payload["usage"]["completion_tokens"])
    except (KeyError, TypeError, ValueError):
        return None


def pull_failures(payload: Any) -> list[str]:
    """What the engine said went wrong with its pull (the worker stub's `kvdir.pull_failures`; none from others)."""
    try:
        failures = payload["kvdir"]["pull_failures"]
    except (KeyError, TypeError):
        return []
    return [str(f) for f in failures] if isinstance(failures, list) else []


def _usage_in_tail(tail: bytes) -> Any:
    """The last server-sent event that carries `usage` (vLLM sends it in the final chunk), parsed; None if none does."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            try:
                return json.loads(line[6:])
            except ValueError:
                return None
    return None


def _content_type(upstream: UpstreamResponse, default: str) -> str:
    return next((v.decode("latin-1") for k, v in upstream.headers if k.lower() == b"content-type"), default)


def _json(body: dict[str, Any]) -> bytes:
    """The body as sent upstream: compact UTF-8 JSON; a 400 for NaN or Infinity (Python's parser takes them,
    JSON has no such numbers, and an engine would refuse the request)."""
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except ValueError as exc:
        raise GatewayError(400, f"the request body cannot be forwarded as JSON: {exc}", code="invalid_json") from exc


class Relay(StreamingResponse):
    """A streamed answer relayed as it comes, and stopped as soon as the client goes away (the engine's stream is
    closed, the request's ticket with it). Starlette's StreamingResponse does the same with a task group of two
    tasks per response (uvicorn speaks ASGI 2.3); here one task waits for the disconnect and cancels the relay:
    about 11 µs of CPU per response against 66-97 µs (BENCHMARKS.md, "The gateway's forward on its own
    client")."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        state = {"gone": False, "over": False}

        def client_gone(watcher: asyncio.Future[Message]) -> None:
            # Runs from the loop, so the relay is suspended in stream_response: the cancellation lands there.
            if not state["over"] and not watcher.cancelled() and watcher.exception() is None:
                state["gone"] = True
                task.cancel()

        watcher = asyncio.ensure_future(_disconnect(receive))
        watcher.add_done_callback(client_gone)
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            task.uncancel()
            # Cancelled in `send`, the relay is suspended at its yield: closed now, not when it is collected.
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
        finally:
            state["over"] = True
            watcher.cancel()


async def _disconnect(receive: Receive) -> Message:
    """The client's disconnect (the request's body was read whole before its answer began)."""
    while (message := await receive())["type"] != "http.disconnect":
        pass
    return message


class Proxy:
    """Sends routed requests upstream and relays the answers; one per app, built at startup."""

    def __init__(
        self,
        *,
        router: Router,
        registry: EngineRegistry,
        directory: DirectoryClient,
        upstream: Upstream,
        request_timeout_s: float,
        metrics: GatewayMetrics,
        lookup_timeout_s: float,
        mirror: Mirror | None = None,
        peers: PeerNotes | None = None,
        mirror_stale_lag_s: float = 60.0,
    ) -> None:
        self.router = router
        self.registry = registry
        self.upstream = upstream
        self._timeouts = Timeouts(connect_s=2.0, read_s=request_timeout_s)
        self.metrics = metrics
        self.peers = peers
        self._lookup = HolderLookup(directory, lookup_timeout_s, mirror, mirror_stale_lag_s)

    async def lookup(self, hashes: list[int]) -> tuple[Mapping[str, HolderView], str | None]:
        """Holders by node id, and why the directory did not answer (None: it did, or the stale mirror did).

        From the mirror while it is fresh (gateway.mirror), else from a replica over REST, else from the
        mirror while it is at most `mirror_stale_lag_s` behind, else none (routing by load): see
        gateway.lookup. Each source is counted in kvdir_gateway_lookups_total.
        """
        if not hashes:
            return {}, None
        found = await self._lookup(hashes)
        self.metrics.lookups.labels(found.source).inc()
        if found.cause is not None:
            self.metrics.lookup_failures.labels(found.cause).inc()
        if found.source == "mirror_stale":
            log.info("directory lookup failed (%s): answering from the mirror, %.2f s behind", found.failure, found.lag_s)
        elif found.source == "none":
            log.info("directory lookup failed (%s): routing by load", found.failure)
            return {}, found.failure
        return {h.node_id: h for h in found.holders}, None

    async def complete(
        self,
        path: str,
        raw: dict[str, Any],
        tokens: list[int],
        stream: bool,
        arrival: float,
        tokenize_s: float,
        kv: KvRequest,
    ) -> Response:
        """Route `raw` (the client's body, `tokens` its prompt) to an engine's `path` that serves `kv.model`,
        and relay the answer."""
        t0 = time.perf_counter()
        block_size = self.registry.hash_block_size(kv.model)  # the engines' own, learned from their registrations
        hashes = [] if kv.unhashed is not None else self.router.hashes(tokens, kv.identity, block_size)
        timing = Timing(arrival, tokenize_s, t0, time.perf_counter() - t0)
        self.metrics.tokenize_seconds.observe(tokenize_s)
        holders, lookup_failure = await self.lookup(hashes)
        self.router.learn_block_bytes(self.registry.engines.values())
        req = self.router.request(len(tokens), hashes, kv.max_tokens, kv.model, block_size)
        joined = not stream and streamable(raw)  # sent as a stream, so that its first token shows (gateway.stream_join)
        sent_body = streamed_body(raw) if joined else raw
        route, engine, upstream, ticket = await self._send(path, sent_body, req, kv, holders, lookup_failure, timing)

        decision = route.decision
        self.router.routed(req, decision)
        self.metrics.decisions.labels(decision.reason).inc()
        self.metrics.predicted.inc(decision.predicted_cached_tokens)
        self.metrics.prompt_tokens.inc(len(tokens))
        engine.served += 1
        engine.prompt_tokens += len(tokens)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("routed to %s: %s (%s)", engine.node_id, decision.reason, decision.detail)
        headers = {
            "x-kvdir-node": engine.node_id,
            "x-kvdir-decision": decision.reason,
            "x-kvdir-predicted-cached-tokens": str(decision.predicted_cached_tokens),
        }
        sent = Sent(route, req, kv.model, engine, ticket)
        if upstream.status >= 400:
            self.metrics.upstream_errors.labels(str(upstream.status)).inc()
            ticket.first_byte(ok=False)  # no prompt was computed: followers must not wait for it
            return await self._buffered(upstream, sent, headers)
        if joined and _content_type(upstream, "").startswith("text/event-stream"):
            return await self._joined(upstream, sent, headers, chat=path.endswith("/chat/completions"))
        if not stream:  # (an engine that answered a joined request unstreamed, too: its body is the answer)
            return await self._buffered(upstream, sent, headers)
        return Relay(
            self._relay(upstream, sent),
            status_code=upstream.status,
            headers=headers,
            media_type=_content_type(upstream, "text/event-stream"),
        )

    async def _send(
        self,
        path: str,
        raw: dict[str, Any],
        req: RouteRequest,
        kv: KvRequest,
        holders: Mapping[str, HolderView],
        lookup_failure: str | None,
        timing: Timing,
    ) -> tuple[Route, EngineState, UpstreamResponse, InflightTicket]:
        """Send to the best engine that serves the model, then the next best while connections are refused;
        503 when none is left."""
        exclude: set[str] = set()
        while True:
            try:
                route = self.router.route(
                    req,
                    self.registry.serving(kv.model),
                    holders,
                    lookup_failure=lookup_failure,
                    unhashed=kv.unhashed,
                    exclude=exclude,
                    now=time.monotonic(),
                )
            except NoEngineAvailable as exc:
                raise GatewayError(503, str(exc), "service_unavailable", "no_engine") from exc
            engine = self.registry.engines[route.decision.node_id]
            body = _json(route.upstream_body(raw))
            ticket = self._ticket(req, engine, route.uncached_tokens)
            self.metrics.route_seconds.observe(time.perf_counter() - timing.start)
            self.metrics.added_seconds.observe(time.perf_counter() - timing.arrival - timing.tokenize_s - timing.hash_s)
            try:
                upstream = await self._post(engine, path, body)
            except ConnectFailed as exc:
                ticket.close()
                self.registry.mark_unhealthy(engine.node_id)
                self.metrics.upstream_errors.labels("connect").inc()
                exclude.add(engine.node_id)
                log.warning("engine %s unreachable (%s): retrying on the next best", engine.node_id, exc)
                continue
            except UpstreamFailed as exc:
                ticket.close()
                raise self._failed(engine, exc) from exc
            except BaseException:
                ticket.close()
                raise
            return route, engine, upstream, ticket

    def _ticket(self, req: RouteRequest, engine: EngineState, uncached: int) -> InflightTicket:
        """The request's ticket on `engine`, its prefill announced to the router and the peers, who hear when it ends."""
        key = self.router.prefilling(req, engine.node_id, engine.epoch, time.monotonic())
        note = self.peers.routed(engine.node_id, engine.epoch, uncached) if self.peers else -1

        def prefilled(ok: bool) -> None:
            self.router.prefilled(key, time.monotonic(), ok=ok)
            if self.peers is not None:
                self.peers.prefilled(note)

        return InflightTicket(engine, uncached, prefilled)

    async def _post(self, engine: EngineState, path: str, body: bytes) -> UpstreamResponse:
        """POST `body` (JSON) to `path` on `engine`: the response once its headers are in, its body still to read."""
        headers = [_JSON]
        if engine.dp_rank is not None:  # one rank of a data-parallel engine: its API server routes by this header
            headers.append((_DP_RANK, b"%d" % engine.dp_rank))
        return await self.upstream.post(engine.origin, path, headers, body, self._timeouts)

    def _failed(self, engine: EngineState, exc: Exception) -> GatewayError:
        """The 502 for an engine that failed after the request was sent (it may have run: not retried elsewhere)."""
        self.metrics.upstream_errors.labels("error").inc()
        log.warning("engine %s failed: %s", engine.node_id, exc)
        return GatewayError(502, f"the engine failed: {exc}", "upstream_error", "engine_failed")

    def _record(self, sent: Sent, payload: Any, events: int = 0) -> None:
        """What the answer (`payload`, parsed; `events` its stream's events, if streamed) tells: the cached
        tokens the engine reported against the prediction; for a pull plan, whether the engine served it (the
        status page lists those that fell short); and, once its first byte came, its TTFT and its length, which
        the router learns from (gateway.ttft_learner)."""
        engine, decision = sent.engine, sent.route.decision
        reported = cached_tokens(payload)
        if reported is not None:
            engine.cached_tokens += reported
            self.metrics.reported.inc(reported)
            self.metrics.prediction_error.observe(abs(decision.predicted_cached_tokens - reported))
        if decision.pull_from is not None:
            self.metrics.pulled(
                time.monotonic(),
                engine.node_id,
                decision.pull_from,
                decision.predicted_cached_tokens,
                reported,
                pull_failures(payload),
            )
        observed = sent.ticket.first_byte_s
        if observed is None:
            return
        o = self.router.observe(sent.route, sent.req, observed, reported)
        self.metrics.ttft_estimate_error.observe(o.predicted_s - o.observed_s)
        log.debug(
            "first byte from %s: %.4f s, estimated %.4f s (work %.0f tokens, %.0f running, fixed %.4f s)",
            engine.node_id,
            o.observed_s,
            o.predicted_s,
            o.work_tokens,
            o.running,
            o.fixed_s,
        )
        generated = completion_tokens(payload)
        if generated is None and events > 0:
            generated = events  # one event per token, about (vLLM, the stub): no usage was asked for
        if generated is not None:
            self.router.learner.outputs.observe(sent.model, generated)

    async def _buffered(self, upstream: UpstreamResponse, sent: Sent, headers: dict[str, str]) -> Response:
        """A response read whole (a non-streamed request, or any error status), then answered at once: no TTFT
        is observed (its first byte is its last)."""
        with sent.ticket as ticket:
            try:
                content = await upstream.aread()
            except UpstreamFailed as exc:
                raise self._failed(sent.engine, exc) from exc
            finally:
                ticket.first_byte()
                ticket.first_byte_s = None
                await upstream.aclose()
            payload = None
            if upstream.status < 400:
                try:
                    payload = json.loads(content)
                except ValueError:
                    pass
            self._record(sent, payload)
        return Response(
            content,
            status_code=upstream.status,
            headers=headers,
            media_type=_content_type(upstream, "application/json"),
        )

    async def _joined(self, upstream: UpstreamResponse, sent: Sent, headers: dict[str, str], chat: bool) -> Response:
        """A non-streamed request's answer, streamed from the engine (its prefill ends at the first chunk) and
        joined into one body (gateway.stream_join); an error event in the stream is answered as an error."""
        with sent.ticket as ticket:
            try:
                content = await upstream.aread(on_first=ticket.first_byte)
            except UpstreamFailed as exc:
                raise self._failed(sent.engine, exc) from exc
            finally:
                ticket.first_byte(ok=False)
                await upstream.aclose()
            try:
                answer = join(content, chat)
            except StreamError as exc:
                self.metrics.upstream_errors.labels(str(exc.status)).inc()
                log.warning("engine %s answered with an error in its stream: %s", sent.engine.node_id, exc)
                return Response(
                    json.dumps(exc.body).encode(), status_code=exc.status, headers=headers, media_type="application/json"
                )
            self._record(sent, answer)
        return Response(json.dumps(answer, ensure_ascii=False).encode(), headers=headers, media_type="application/json")

    async def _relay(self, upstream: UpstreamResponse, sent: Sent) -> AsyncIterator[bytes]:
        """The upstream stream, chunk by chunk as it comes; a break mid-stream ends it (the client sees a short stream)."""
        with sent.ticket as ticket:
            tail = b""
            events = 0
            try:
                async for chunk in upstream.aiter_stream():
                    ticket.first_byte()
                    tail = (tail + chunk)[-_TAIL_BYTES:]
                    events += chunk.count(b"data: {")
                    yield chunk
            except UpstreamFailed as exc:
                self.metrics.upstream_errors.labels("stream").inc()
                log.warning("stream from %s broke: %s", sent.engine.node_id, exc)
            finally:
                ticket.first_byte(ok=False)
                await upstream.aclose()
                self._record(sent, _usage_in_tail(tail), events - 1)  # less the role's (chat) or the usage's event
