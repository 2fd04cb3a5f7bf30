"""The receiving half of decision sharing (the design and the bounds: gateway.peers): peers' notes folded into
the engines' pending prefill here, within bounds that hold whatever a sender claims to be."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from gateway.engine_registry import EngineRegistry, EngineState
from gateway.errors import GatewayError
from gateway.peer_expiry import Expiry, Held
from gateway.peer_wire import MAX_BATCH, MAX_TTL_S, NoteBatch
from kvproto.rate_limit import TokenBucket

log = logging.getLogger("kvdir.gateway.peers")

RECEIVED = ("received", "done", "expired", "unknown_engine", "clamped", "refused", "replayed", "evicted")
"""What the receiver counts, by name (`PeerReceiver.stats`)."""


@dataclass(frozen=True, slots=True)
class PeerBounds:
    """How long a note counts here and how much peers may add (each a gateway flag, `--peer-*`)."""

    ttl_s: float = 10.0
    max_notes: int = 16384
    max_sender_notes: int = 4096
    max_senders: int = 64
    note_rate: float = 4096.0
    max_prompt_tokens: int = 131072
    max_engine_tokens: float = 100_000.0

    def __post_init__(self) -> None:
        if not 0 < self.ttl_s <= MAX_TTL_S:
            raise ValueError(f"ttl_s must be in (0, {MAX_TTL_S:g}]")
        if min(self.max_notes, self.max_sender_notes, self.max_senders, self.max_prompt_tokens) < 1:
            raise ValueError("max_notes, max_sender_notes, max_senders and max_prompt_tokens must be >= 1")
        if self.note_rate <= 0 or self.max_engine_tokens <= 0:
            raise ValueError("note_rate and max_engine_tokens must be > 0")

    @property
    def note_burst(self) -> float:
        """A sender's burst allowance: a second's worth of notes, and at least one full batch."""
        return max(self.note_rate, float(MAX_BATCH))


@dataclass(slots=True)
class _Sender:
    """What is known of one sender: the highest note id seen, its notes held, its rate allowance."""

    last_id: int
    allowance: TokenBucket  # notes a second; its stamp is when the sender last posted
    notes: int = 0


class PeerReceiver:
    """Peers' notes held here: each adds its tokens to its engine's `pending_prefill_tokens` until its ``done`` or
    its expiry takes them off. Event loop only (not thread-safe)."""

    def __init__(
        self, registry: EngineRegistry, me: str, bounds: PeerBounds, on_note: Callable[[str, float], None] | None = None
    ) -> None:
        """`me`: this gateway's sender id (a batch of its own is ignored); `on_note(node_id, tokens)` runs for each
        note folded in."""
        self.registry, self.me, self.bounds, self.on_note = registry, me, bounds, on_note
        self.held: OrderedDict[tuple[str, int], Held] = OrderedDict()  # oldest first
        self.expiry = Expiry()
        self.senders: OrderedDict[str, _Sender] = OrderedDict()  # least recently heard first
        self._by_node: dict[str, list[float]] = {}  # node id -> [peers' tokens held there, notes held there]
        self.stats = dict.fromkeys(RECEIVED, 0)
        self._warned: set[str] = set()  # the kinds of refusal already logged (once each)

    def note_tokens_limit(self, engine: EngineState) -> int:
        """The most tokens one note for `engine` may count: the longest prompt it takes."""
        return engine.max_model_len or self.registry.max_model_len or self.bounds.max_prompt_tokens

    def receive(self, batch: NoteBatch, now: float) -> None:
        """Fold a peer's batch in: its notes add their tokens to the engines here (within the bounds), its dones
        take them off. Raises a 429 `GatewayError` (after taking the dones) when the sender's notes are refused
        whole: over its rate, or a new sender while `max_senders` others are remembered."""
        if batch.sender == self.me:  # this gateway listed among its own peers
            return
        self.expire(now)
        if batch.notes:
            sender = self._sender(batch.sender, now)
            refusal: tuple[str, str] | None = None  # (kind, why)
            if sender is None:
                refusal = (
                    "senders",
                    f"this gateway hears at most {self.bounds.max_senders} peer senders at once; try again later",
                )
            elif sender.allowance.take(now, len(batch.notes)) > 0:  # refused whole: nothing taken
                refusal = ("rate", f"a peer may send at most {self.bounds.note_rate:g} notes a second")
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
        s = self.senders.get(name)
        if s is not None:
            self.senders.move_to_end(name)
            return s
        b = self.bounds
        if len(self.senders) >= b.max_senders:
            idle = next(
                (k for k, v in self.senders.items() if v.notes == 0 and now - v.allowance.stamp > b.ttl_s),
                None,
            )
            if idle is None:
                return None
            del self.senders[idle]
        s = self.senders[name] = _Sender(last_id=-1, allowance=TokenBucket(b.note_rate, b.note_burst, now))
        return s

    def _fold(self, batch: NoteBatch, sender: _Sender, now: float) -> None:
        engines = self.registry.engines
        held = self.held
        stats = self.stats
        b = self.bounds
        for n in batch.notes:
            if n.id <= sender.last_id:  # seen already: repeated, or sent again after its done or expiry
                stats["replayed"] += 1
                continue
            sender.last_id = n.id
            e = engines.get(n.node)
            if e is None or e.epoch != n.epoch:  # not known here (yet), or another incarnation: nothing to add to
                stats["unknown_engine"] += 1
                continue
            if sender.notes >= b.max_sender_notes:
                stats["refused"] += 1
                self._warn("sender", f"a peer holds {b.max_sender_notes} notes here: more are refused")
                continue
            on_node = self._by_node.get(n.node)
            room = b.max_engine_tokens - (on_node[0] if on_node else 0.0)
            tokens = min(n.tokens, float(self.note_tokens_limit(e)), room)
            if tokens <= 0:
                stats["refused"] += 1
                self._warn("engine", f"peers' notes hold {b.max_engine_tokens:g} tokens on engine {n.node}: more are refused")
                continue
            ttl = min(n.ttl_s, b.ttl_s)
            if tokens < n.tokens or ttl < n.ttl_s:
                stats["clamped"] += 1
            while len(held) >= b.max_notes:
                self._remove(next(iter(held)))
                stats["evicted"] += 1
            e.pending_prefill_tokens += tokens
            if self.on_note is not None:
                self.on_note(n.node, tokens)
            key = (batch.sender, n.id)
            h = held[key] = Held(key, e, n.node, tokens, now + ttl)
            self.expiry.push(h)
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
        while (h := self.expiry.first()) is not None and h.expires <= now:
            self._remove(h.key)
            self.stats["expired"] += 1

    def _remove(self, key: tuple[str, int]) -> bool:
        h = self.held.pop(key, None)
        if h is None:
            return False
        h.engine.pending_prefill_tokens -= h.tokens
        self.expiry.remove(h)
        self.senders[key[0]].notes -= 1
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
