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
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Gauge
from pydantic import SecretStr

from gateway.engine_registry import EngineRegistry
from gateway.errors import GatewayError
from gateway.peer_receiver import PeerBounds, PeerReceiver
from gateway.peer_sender import PeerSender
from gateway.peer_wire import MAX_BATCH, NOTES_PATH, STATUS_PATH, Note, NoteBatch
from kvproto.schemas import Origin, parse_origin
from kvproto.scraped import ScrapedCounters
from kvproto.tasks import cancel_and_wait, every

__all__ = ["MAX_BATCH", "NOTES_PATH", "STATUS_PATH", "Note", "NoteBatch", "PeerBounds", "PeerNotes", "routes"]

log = logging.getLogger("kvdir.gateway.peers")

DEFAULT_BOUNDS = PeerBounds()

_COUNTERS = (
    ("sent", "Notes and dones peers took"),
    ("dropped", "Notes and dones dropped: a peer's queue was full"),
    ("send_failures", "Batches a peer did not take (unreachable, refused)"),
    ("received", "Notes received from peers"),
    ("expired", "Peers' notes that expired before their done"),
    ("clamped", "Peers' notes counted for fewer tokens or a shorter time than they asked"),
    ("refused", "Peers' notes refused: over a sender's rate or count, an engine's tokens, the senders"),
    ("replayed", "Peers' notes refused as seen before (repeated, or sent again after their done)"),
    ("evicted", "Peers' notes dropped, oldest first, to make room for new ones"),
)


class PeerNotes:
    """Both halves of decision sharing for one gateway: `routed`/`prefilled` send (`PeerSender`), `receive` folds
    in (`PeerReceiver`), and an expiry sweep ends the notes whose ``done`` was lost.

    Event loop only (not thread-safe). `start` the sender and expiry tasks, `stop` them at shutdown.
    Its counts go to the gateway's metrics registry as counters read at each scrape (`ScrapedCounters`).
    """

    def __init__(
        self,
        registry: EngineRegistry,
        peers: Sequence[str] = (),
        *,
        token: SecretStr | None = None,
        bounds: PeerBounds = DEFAULT_BOUNDS,
        queue_size: int = 1024,
        timeout_s: float = 1.0,
        metrics: CollectorRegistry | None = None,
        on_note: Callable[[str, float], None] | None = None,
    ) -> None:
        """`on_note(node_id, tokens)` runs for each peer note folded in (the kvdir policy counts it as recent work)."""
        self.id = uuid.uuid4().hex[:16]  # a restarted gateway's note ids are new ones
        self.token, self.bounds = token, bounds
        self.sender = PeerSender(self.id, [parse_origin(p) for p in peers], token, bounds.ttl_s, queue_size, timeout_s)
        self.receiver = PeerReceiver(registry, self.id, bounds, on_note)
        self._sweep: asyncio.Task[None] | None = None
        if metrics is not None:
            metrics.register(ScrapedCounters((f"kvdir_gateway_peer_{name}", what, self._count(name)) for name, what in _COUNTERS))
            Gauge("kvdir_gateway_peer_notes", "Peers' notes counted now", registry=metrics).set_function(
                lambda: len(self.receiver.held)
            )

    @property
    def peers(self) -> list[Origin]:
        return self.sender.peers

    def routed(self, node_id: str, epoch: int, tokens: float) -> int:
        """A note for every peer (`PeerSender.routed`): its id for `prefilled`, -1 if none was sent."""
        return self.sender.routed(node_id, epoch, tokens)

    def prefilled(self, key: int) -> None:
        self.sender.prefilled(key)

    def receive(self, batch: NoteBatch, now: float) -> None:
        """Fold a peer's batch in (`PeerReceiver.receive`: a 429 `GatewayError` when its notes are refused whole)."""
        self.receiver.receive(batch, now)

    def expire(self, now: float) -> None:
        self.receiver.expire(now)

    def pending(self) -> dict[str, float]:
        return self.receiver.pending()

    @property
    def stats(self) -> dict[str, int]:
        """Every count, the sender's and the receiver's, by name."""
        return {**self.sender.stats, **self.receiver.stats}

    def status(self) -> dict[str, Any]:
        """What `GET /v1/peers` answers."""
        self.expire(time.monotonic())
        return {
            "id": self.id,
            "peers": [str(p) for p in self.sender.peers],
            "queued": [q.qsize() for q in self.sender.queues],
            "notes": len(self.receiver.held),
            "senders": len(self.receiver.senders),
            "pending_tokens": self.pending(),
            **self.stats,
        }

    def _count(self, name: str) -> Callable[[], float]:
        """A reader of one count, from the half that keeps it (each keeps one dict, counted in place)."""
        counts = self.sender.stats if name in self.sender.stats else self.receiver.stats
        return lambda: counts[name]

    def start(self, failed: Callable[[], object]) -> None:
        """Start a sender per peer and the expiry sweep (`failed`: counts a failed sweep)."""
        self.sender.start()
        sweep = every(
            min(1.0, self.bounds.ttl_s / 4),
            lambda: self.expire(time.monotonic()),
            what="peer notes expiry",
            log=log,
            failed=failed,
            first_now=False,
        )
        self._sweep = asyncio.create_task(sweep, name="peer notes expiry")

    async def stop(self) -> None:
        await cancel_and_wait(self._sweep)
        self._sweep = None
        await self.sender.stop()


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
