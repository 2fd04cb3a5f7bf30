"""Decision sharing between gateway replicas: each tells the others what it sent where, as it routes.

Why: gateways behind a load balancer each count only their own requests'
pending prefill per engine (gateway.proxy's `InflightTicket`). Requests that
arrive at the same moment at different gateways (a burst, a trace with
whole-second timestamps) each see the same idle engine and all go there; the
simulation measured it (docs/replay.md, "Many gateways": kvdir's TTFT p90 at 4
gateways 3.87 s unshared, 2.50 s shared, 2.51 s at one gateway).

How: on each routing decision with prompt tokens to compute, the gateway
queues a note for every peer: a note id, the engine (node id, epoch), the
tokens it will prefill and a time to live. When the engine answers (the first
byte) or the request fails, a ``done`` for that id follows. One sender task per
peer drains its queue in batches, one HTTP POST at a time (so a peer gets them
in order); a full queue drops the note and counts it: routing never waits on a
peer, and a slow or dead peer costs one bounded queue. A receiving gateway
adds a note's tokens to `EngineState.pending_prefill_tokens` of the same engine
(same node id and epoch) in its own registry, which its policy reads as that
engine's pending prefill; the ``done``, or the note's expiry when the ``done``
was lost, takes them off again (from the same `EngineState`, even if the
registry has replaced it since).

Authentication: with a token (``--peer-token-file``) the POST needs
``Authorization: Bearer <token>`` and the gateway sends its peers the same one.
Without it the route is open, like the completions routes: keep the gateway on
loopback (the default) or a private network.
"""

from __future__ import annotations

import asyncio
import heapq
import hmac
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import httpx
import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import SecretStr

from directory.schemas import Origin, parse_origin
from gateway.engines import EngineRegistry, EngineState
from gateway.errors import GatewayError

__all__ = ["NOTES_PATH", "STATUS_PATH", "Note", "NoteBatch", "PeerNotes", "routes"]

log = logging.getLogger("kvdir.gateway.peers")

NOTES_PATH = "/v1/peers/notes"
STATUS_PATH = "/v1/peers"
MAX_BATCH = 512  # notes (and dones) per POST
MAX_TTL_S = 600.0


class Note(msgspec.Struct, forbid_unknown_fields=True):
    """A peer sent a request with `tokens` prompt tokens to compute to engine `node`@`epoch`."""

    id: Annotated[int, msgspec.Meta(ge=0)]
    node: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    epoch: Annotated[int, msgspec.Meta(ge=0)]
    tokens: Annotated[float, msgspec.Meta(ge=0, le=1e9)]
    ttl_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_TTL_S)]


class NoteBatch(msgspec.Struct, forbid_unknown_fields=True):
    """One POST: new notes, then the ids (of this sender) whose prefill is over."""

    sender: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    notes: Annotated[list[Note], msgspec.Meta(max_length=MAX_BATCH)] = msgspec.field(default_factory=list)
    done: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_BATCH)] = msgspec.field(
        default_factory=list
    )


@dataclass(slots=True)
class _Held:
    """A peer's note as folded in: the engine state its tokens were added to."""

    engine: EngineState
    node: str
    tokens: float
    expires: float


class PeerNotes(Collector):
    """Both halves of decision sharing for one gateway: `routed`/`prefilled` send, `receive` folds in.

    Event loop only (not thread-safe). `start` the sender and expiry tasks, `stop` them at shutdown.
    Registered in the gateway's metrics registry: it reports its own counters when scraped.
    """

    def __init__(
        self,
        registry: EngineRegistry,
        peers: Sequence[str] = (),
        *,
        token: SecretStr | None = None,
        ttl_s: float = 10.0,
        queue_size: int = 1024,
        timeout_s: float = 1.0,
        max_notes: int = 65536,
        metrics: CollectorRegistry | None = None,
        on_note: Callable[[str, float], None] | None = None,
    ) -> None:
        """`on_note(node_id, tokens)` runs for each peer note folded in (the kvdir policy counts it as recent work)."""
        if not 0 < ttl_s <= MAX_TTL_S or queue_size < 1 or timeout_s <= 0 or max_notes < 1:
            raise ValueError(f"ttl_s must be in (0, {MAX_TTL_S:g}], queue_size and max_notes >= 1, timeout_s > 0")
        self.id = uuid.uuid4().hex[:16]  # a restarted gateway's note ids are new ones
        self.registry = registry
        self.on_note = on_note
        self.peers: list[Origin] = [parse_origin(p) for p in peers]
        self.token = token
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.max_notes = max_notes
        self._queues: list[asyncio.Queue[Note | int]] = [asyncio.Queue(queue_size) for _ in self.peers]
        self._next = 0
        self._held: OrderedDict[tuple[str, int], _Held] = OrderedDict()  # oldest first
        self._expiry: list[tuple[float, tuple[str, int]]] = []  # lazily pruned
        self._tasks: list[asyncio.Task[None]] = []
        self._http: httpx.AsyncClient | None = None
        self.stats = dict.fromkeys(("sent", "dropped", "send_failures", "received", "done", "expired", "unknown_engine"), 0)
        if metrics is not None:
            metrics.register(self)

    # -- sending

    def routed(self, node_id: str, epoch: int, tokens: float) -> int:
        """This gateway sent a request with `tokens` to compute to `node_id`@`epoch`: a note for each peer.

        Its id for `prefilled`; -1 (nothing sent) without peers or tokens.
        """
        if not self._queues or tokens <= 0:
            return -1
        key = self._next
        self._next += 1
        self._put(Note(key, node_id, epoch, float(tokens), self.ttl_s))
        return key

    def prefilled(self, key: int) -> None:
        """The request noted as `key` got its first byte or failed: the peers take its tokens off."""
        if key >= 0:
            self._put(key)

    def _put(self, item: Note | int) -> None:
        for q in self._queues:
            try:
                q.put_nowait(item)
            except asyncio.QueueFull:
                self.stats["dropped"] += 1

    async def _send_loop(self, origin: Origin, q: asyncio.Queue[Note | int]) -> None:
        assert self._http is not None
        url = origin.url(NOTES_PATH)
        headers = {"content-type": "application/json"}
        if self.token is not None:
            headers["authorization"] = f"Bearer {self.token.get_secret_value()}"
        warned = False
        while True:
            notes: list[Note] = []
            done: list[int] = []
            item = await q.get()
            while True:
                if isinstance(item, Note):
                    notes.append(item)
                else:
                    done.append(item)
                if len(notes) >= MAX_BATCH or len(done) >= MAX_BATCH or q.empty():
                    break
                item = q.get_nowait()
            body = msgspec.json.encode(NoteBatch(self.id, notes, done))
            try:
                r = await self._http.post(url, content=body, headers=headers)
                ok, why = r.status_code == 204, f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                ok, why = False, f"{type(exc).__name__}: {exc}"
            if ok:
                self.stats["sent"] += len(notes) + len(done)
                warned = False
            else:
                self.stats["send_failures"] += 1
                if not warned:  # once per outage, not once per batch
                    log.warning("peer gateway %s did not take %d notes (%s)", origin, len(notes) + len(done), why)
                    warned = True

    # -- receiving

    def receive(self, batch: NoteBatch, now: float) -> None:
        """Fold a peer's batch in: its notes add their tokens to the engines here, its dones take them off."""
        if batch.sender == self.id:  # this gateway listed among its own peers
            return
        self.expire(now)
        engines = self.registry.engines
        held = self._held
        for n in batch.notes:
            key = (batch.sender, n.id)
            if key in held:
                continue
            while len(held) >= self.max_notes:
                self._remove(next(iter(held)))
            e = engines.get(n.node)
            if e is None or e.epoch != n.epoch:  # not known here (yet), or another incarnation: nothing to add to
                self.stats["unknown_engine"] += 1
                continue
            e.pending_prefill_tokens += n.tokens
            if self.on_note is not None:
                self.on_note(n.node, n.tokens)
            h = _Held(e, n.node, n.tokens, now + n.ttl_s)
            held[key] = h
            heapq.heappush(self._expiry, (h.expires, key))
        self.stats["received"] += len(batch.notes)
        for i in batch.done:
            if self._remove((batch.sender, i)):
                self.stats["done"] += 1

    def expire(self, now: float) -> None:
        """Take off the notes whose ``done`` never came."""
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, key = heapq.heappop(heap)
            if self._remove(key):
                self.stats["expired"] += 1
        if not self._held:
            heap.clear()

    def _remove(self, key: tuple[str, int]) -> bool:
        h = self._held.pop(key, None)
        if h is None:
            return False
        h.engine.pending_prefill_tokens -= h.tokens
        return True

    def pending(self) -> dict[str, float]:
        """Peers' pending prefill tokens folded in, by node id."""
        out: dict[str, float] = {}
        for h in self._held.values():
            out[h.node] = out.get(h.node, 0.0) + h.tokens
        return out

    def status(self) -> dict[str, Any]:
        """What `GET /v1/peers` answers."""
        self.expire(time.monotonic())
        return {
            "id": self.id,
            "peers": [str(p) for p in self.peers],
            "queued": [q.qsize() for q in self._queues],
            "notes": len(self._held),
            "pending_tokens": self.pending(),
            **self.stats,
        }

    def collect(self) -> Iterator[Metric]:
        for name, what in (
            ("sent", "Notes and dones peers took"),
            ("dropped", "Notes and dones dropped: a peer's queue was full"),
            ("send_failures", "Batches a peer did not take (unreachable, refused)"),
            ("received", "Notes received from peers"),
            ("expired", "Peers' notes that expired before their done"),
        ):
            yield CounterMetricFamily(f"kvdir_gateway_peer_{name}", what, value=self.stats[name])
        yield GaugeMetricFamily("kvdir_gateway_peer_notes", "Peers' notes counted now", value=len(self._held))

    # -- lifecycle

    def start(self) -> None:
        """Start a sender per peer and the expiry sweep."""
        if self._queues:
            self._http = httpx.AsyncClient(
                timeout=self.timeout_s, limits=httpx.Limits(max_connections=len(self.peers) + 1), trust_env=False
            )
            for origin, q in zip(self.peers, self._queues, strict=True):
                self._tasks.append(asyncio.create_task(self._send_loop(origin, q), name=f"peer {origin}"))
        self._tasks.append(asyncio.create_task(self._sweep(), name="peer notes expiry"))

    async def _sweep(self) -> None:
        period = min(1.0, self.ttl_s / 4)
        while True:
            await asyncio.sleep(period)
            self.expire(time.monotonic())

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._http is not None:
            await self._http.aclose()
            self._http = None


def routes() -> APIRouter:
    """``POST /v1/peers/notes`` (a peer's batch; 204) and ``GET /v1/peers`` (this gateway's view), on
    ``app.state.peers``."""
    api = APIRouter()

    @api.post(NOTES_PATH, status_code=204, include_in_schema=False)
    async def notes(request: Request) -> Response:
        peers: PeerNotes = request.app.state.peers
        if peers.token is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {peers.token.get_secret_value()}".encode()):
                raise GatewayError(401, "a peer note needs the gateways' bearer token", "authentication_error", "unauthorized")
        try:
            batch = msgspec.json.decode(await request.body(), type=NoteBatch)
        except msgspec.ValidationError as exc:
            raise GatewayError(400, f"the notes are invalid: {exc}") from exc
        except msgspec.DecodeError as exc:
            raise GatewayError(400, "the notes are not valid JSON", code="invalid_json") from exc
        peers.receive(batch, time.monotonic())
        return Response(status_code=204)

    @api.get(STATUS_PATH)
    async def status(request: Request) -> JSONResponse:
        peers: PeerNotes = request.app.state.peers
        return JSONResponse(peers.status())

    return api
