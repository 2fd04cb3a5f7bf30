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

Exposure: the routes exist only on a gateway with peers (``--peers``), and a
gateway whose ``--http`` is off loopback does not start with peers but without
``--peer-token-file``: then every POST needs ``Authorization: Bearer <token>``
(the gateway sends its peers the same one). On loopback without a token the
route is open to local users, like the rest of a development cluster.

Hostile or broken peers: every peer holds the same token, so what
one sender may add is bounded here, and the bounds that matter hold whatever
sender names are invented. A note's tokens are clamped to the longest prompt
its engine takes (its ``max_model_len``, else ``--max-prompt-tokens``), its
time to live to this gateway's ``--peer-note-ttl-s``; the tokens all peers'
notes hold on one engine to ``--peer-max-engine-tokens`` (default: the prefill
the engine does in one note's lifetime, so peers can make it look at most one
TTL busier); all notes held to ``--peer-max-notes`` (oldest dropped first),
one sender's to ``--peer-max-sender-notes``; senders heard at once to
``--peer-max-senders`` (a sender is forgotten once it holds no note and was
silent for a TTL: until then a new one is refused with 429); one sender's notes
to ``--peer-note-rate`` per second (429 above). A sender's note ids only grow
(`routed` numbers them, one POST at a time in order), so a note id at or below
the highest one seen from its sender is a replay and refused: a repeated note,
or one sent again after its ``done``. The expiry heap holds exactly the notes
held: a note that ends early leaves no entry behind.
"""

from __future__ import annotations

import asyncio
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

from gateway.engine_registry import EngineRegistry, EngineState
from gateway.errors import GatewayError
from kvproto.rate_limit import TokenBucket
from kvproto.schemas import Origin, parse_origin
from kvproto.tasks import cancel_and_wait, every

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
    """A peer's note as folded in: the engine state its tokens were added to, and its place in the expiry heap."""

    key: tuple[str, int]
    engine: EngineState
    node: str
    tokens: float
    expires: float
    pos: int = -1


@dataclass(slots=True)
class _Sender:
    """What is known of one sender: the highest note id seen, its notes held, its rate allowance."""

    last_id: int
    allowance: TokenBucket  # notes a second; its stamp is when the sender last posted
    notes: int = 0


class _Expiry:
    """A min-heap of held notes by expiry in which each note knows its index, so one that ends early (its
    ``done``, dropped for room) is taken out at once: the heap never holds more than the notes held."""

    __slots__ = ("a",)

    def __init__(self) -> None:
        self.a: list[_Held] = []

    def __len__(self) -> int:
        return len(self.a)

    def push(self, h: _Held) -> None:
        h.pos = len(self.a)
        self.a.append(h)
        self._up(h.pos)

    def first(self) -> _Held | None:
        return self.a[0] if self.a else None

    def remove(self, h: _Held) -> None:
        a, i = self.a, h.pos
        last = a.pop()
        h.pos = -1
        if last is not h:
            a[i] = last
            last.pos = i
            self._up(i)
            self._down(last.pos)

    def _swap(self, i: int, j: int) -> None:
        a = self.a
        a[i], a[j] = a[j], a[i]
        a[i].pos, a[j].pos = i, j

    def _up(self, i: int) -> None:
        a = self.a
        while i > 0:
            parent = (i - 1) // 2
            if a[parent].expires <= a[i].expires:
                return
            self._swap(i, parent)
            i = parent

    def _down(self, i: int) -> None:
        a, n = self.a, len(self.a)
        while True:
            low, left = i, 2 * i + 1
            if left < n and a[left].expires < a[low].expires:
                low = left
            if left + 1 < n and a[left + 1].expires < a[low].expires:
                low = left + 1
            if low == i:
                return
            self._swap(i, low)
            i = low


class PeerNotes(Collector):
    """Both halves of decision sharing for one gateway: `routed`/`prefilled` send, `receive` folds in.

    Event loop only (not thread-safe). `start` the sender and expiry tasks, `stop` them at shutdown.
    Registered in the gateway's metrics registry: it reports its own counters when scraped.
    The bounds on what peers may add are the module's (``Hostile or broken peers``).
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
        max_notes: int = 16384,
        max_sender_notes: int = 4096,
        max_senders: int = 64,
        note_rate: float = 4096.0,
        max_prompt_tokens: int = 131072,
        max_engine_tokens: float = 100_000.0,
        metrics: CollectorRegistry | None = None,
        on_note: Callable[[str, float], None] | None = None,
    ) -> None:
        """`on_note(node_id, tokens)` runs for each peer note folded in (the kvdir policy counts it as recent work)."""
        if not 0 < ttl_s <= MAX_TTL_S or queue_size < 1 or timeout_s <= 0:
            raise ValueError(f"ttl_s must be in (0, {MAX_TTL_S:g}], queue_size >= 1, timeout_s > 0")
        if min(max_notes, max_sender_notes, max_senders, max_prompt_tokens) < 1 or note_rate <= 0 or max_engine_tokens <= 0:
            raise ValueError(
                "max_notes, max_sender_notes, max_senders and max_prompt_tokens must be >= 1, note_rate and max_engine_tokens > 0"
            )
        self.id = uuid.uuid4().hex[:16]  # a restarted gateway's note ids are new ones
        self.registry = registry
        self.on_note = on_note
        self.peers: list[Origin] = [parse_origin(p) for p in peers]
        self.token = token
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.max_notes = max_notes
        self.max_sender_notes = max_sender_notes
        self.max_senders = max_senders
        self.note_rate = note_rate
        self.note_burst = max(note_rate, float(MAX_BATCH))  # a second's worth, and at least one full batch
        self.max_prompt_tokens = max_prompt_tokens
        self.max_engine_tokens = max_engine_tokens
        self._queues: list[asyncio.Queue[Note | int]] = [asyncio.Queue(queue_size) for _ in self.peers]
        self._next = 0
        self._held: OrderedDict[tuple[str, int], _Held] = OrderedDict()  # oldest first
        self._expiry = _Expiry()
        self._senders: OrderedDict[str, _Sender] = OrderedDict()  # least recently heard first
        self._by_node: dict[str, list[float]] = {}  # node id -> [peers' tokens held there, notes held there]
        self._tasks: list[asyncio.Task[None]] = []
        self._http: httpx.AsyncClient | None = None
        self.stats = dict.fromkeys(
            (
                "sent",
                "dropped",
                "send_failures",
                "received",
                "done",
                "expired",
                "unknown_engine",
                "clamped",
                "refused",
                "replayed",
                "evicted",
            ),
            0,
        )
        self._warned: set[str] = set()  # the kinds of refusal already logged (once each)
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

    def note_tokens_limit(self, engine: EngineState) -> int:
        """The most tokens one note for `engine` may count: the longest prompt it takes."""
        return engine.max_model_len or self.registry.max_model_len or self.max_prompt_tokens

    def receive(self, batch: NoteBatch, now: float) -> None:
        """Fold a peer's batch in: its notes add their tokens to the engines here (within the bounds), its dones
        take them off. Raises a 429 `GatewayError` (after taking the dones) when the sender's notes are refused
        whole: over its rate, or a new sender while `max_senders` others are remembered."""
        if batch.sender == self.id:  # this gateway listed among its own peers
            return
        self.expire(now)
        if batch.notes:
            sender = self._sender(batch.sender, now)
            refusal: tuple[str, str] | None = None  # (kind, why)
            if sender is None:
                refusal = ("senders", f"this gateway hears at most {self.max_senders} peer senders at once; try again later")
            else:
                if sender.allowance.take(now, len(batch.notes)) > 0:  # refused whole: nothing taken
                    refusal = ("rate", f"a peer may send at most {self.note_rate:g} notes a second")
                else:
                    self._fold(batch, sender, now)
            if refusal is not None:
                kind, why = refusal
                self.stats["refused"] += len(batch.notes)
                self._done(batch)
                self._warn(kind, f"peer notes refused: {why} (kvdir_gateway_peer_refused_total)")
                raise GatewayError(
                    429, f"{len(batch.notes)} peer notes refused: {why}", "rate_limit_error", "rate_limit_exceeded"
                )
        self._done(batch)

    def _sender(self, name: str, now: float) -> _Sender | None:
        """The sender's state, made for a new one while there is room (forgetting one that holds no note and
        was silent for a TTL); None when there is none."""
        s = self._senders.get(name)
        if s is not None:
            self._senders.move_to_end(name)
            return s
        if len(self._senders) >= self.max_senders:
            idle = next(
                (k for k, v in self._senders.items() if v.notes == 0 and now - v.allowance.stamp > self.ttl_s),
                None,
            )
            if idle is None:
                return None
            del self._senders[idle]
        s = self._senders[name] = _Sender(last_id=-1, allowance=TokenBucket(self.note_rate, self.note_burst, now))
        return s

    def _fold(self, batch: NoteBatch, sender: _Sender, now: float) -> None:
        engines = self.registry.engines
        held = self._held
        stats = self.stats
        for n in batch.notes:
            if n.id <= sender.last_id:  # seen already: repeated, or sent again after its done or expiry
                stats["replayed"] += 1
                continue
            sender.last_id = n.id
            e = engines.get(n.node)
            if e is None or e.epoch != n.epoch:  # not known here (yet), or another incarnation: nothing to add to
                stats["unknown_engine"] += 1
                continue
            if sender.notes >= self.max_sender_notes:
                stats["refused"] += 1
                self._warn("sender", f"a peer holds {self.max_sender_notes} notes here: more are refused")
                continue
            on_node = self._by_node.get(n.node)
            room = self.max_engine_tokens - (on_node[0] if on_node else 0.0)
            tokens = min(n.tokens, float(self.note_tokens_limit(e)), room)
            if tokens <= 0:
                stats["refused"] += 1
                self._warn("engine", f"peers' notes hold {self.max_engine_tokens:g} tokens on engine {n.node}: more are refused")
                continue
            ttl = min(n.ttl_s, self.ttl_s)
            if tokens < n.tokens or ttl < n.ttl_s:
                stats["clamped"] += 1
            while len(held) >= self.max_notes:
                self._remove(next(iter(held)))
                stats["evicted"] += 1
            e.pending_prefill_tokens += tokens
            if self.on_note is not None:
                self.on_note(n.node, tokens)
            key = (batch.sender, n.id)
            h = held[key] = _Held(key, e, n.node, tokens, now + ttl)
            self._expiry.push(h)
            sender.notes += 1
            if on_node is None:
                self._by_node[n.node] = [tokens, 1.0]
            else:
                on_node[0] += tokens
                on_node[1] += 1
        stats["received"] += len(batch.notes)

    def _done(self, batch: NoteBatch) -> None:
        for i in batch.done:
            if self._remove((batch.sender, i)):
                self.stats["done"] += 1

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:  # once per kind: a flood must not flood the log too
            self._warned.add(kind)
            log.warning("%s", message)

    def expire(self, now: float) -> None:
        """Take off the notes whose ``done`` never came."""
        while (h := self._expiry.first()) is not None and h.expires <= now:
            self._remove(h.key)
            self.stats["expired"] += 1

    def _remove(self, key: tuple[str, int]) -> bool:
        h = self._held.pop(key, None)
        if h is None:
            return False
        h.engine.pending_prefill_tokens -= h.tokens
        self._expiry.remove(h)
        self._senders[key[0]].notes -= 1
        on_node = self._by_node[h.node]
        on_node[1] -= 1
        if on_node[1] <= 0:
            del self._by_node[h.node]  # also ends the float residue of the sums
        else:
            on_node[0] -= h.tokens
        return True

    def pending(self) -> dict[str, float]:
        """Peers' pending prefill tokens folded in, by node id."""
        return {node: tokens for node, (tokens, _) in self._by_node.items()}

    def status(self) -> dict[str, Any]:
        """What `GET /v1/peers` answers."""
        self.expire(time.monotonic())
        return {
            "id": self.id,
            "peers": [str(p) for p in self.peers],
            "queued": [q.qsize() for q in self._queues],
            "notes": len(self._held),
            "senders": len(self._senders),
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
            ("clamped", "Peers' notes counted for fewer tokens or a shorter time than they asked"),
            ("refused", "Peers' notes refused: over a sender's rate or count, an engine's tokens, the senders"),
            ("replayed", "Peers' notes refused as seen before (repeated, or sent again after their done)"),
            ("evicted", "Peers' notes dropped, oldest first, to make room for new ones"),
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
        sweep = every(
            min(1.0, self.ttl_s / 4), lambda: self.expire(time.monotonic()), what="peer notes expiry", log=log, first_now=False
        )
        self._tasks.append(asyncio.create_task(sweep, name="peer notes expiry"))

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks)
        self._tasks.clear()
        if self._http is not None:
            await self._http.aclose()
            self._http = None


def routes(peers_of: Callable[[Request], PeerNotes]) -> APIRouter:
    """``POST /v1/peers/notes`` (a peer's batch; 204) and ``GET /v1/peers`` (this gateway's view), on the
    `PeerNotes` that `peers_of` finds for a request (the running gateway's)."""
    api = APIRouter()

    @api.post(NOTES_PATH, status_code=204, include_in_schema=False)
    async def notes(request: Request) -> Response:
        peers = peers_of(request)
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
        peers = peers_of(request)
        return JSONResponse(peers.status())

    return api
