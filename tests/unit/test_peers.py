"""gateway.peers: peers' notes folded into the engines' pending prefill, ended by a done or by expiry; bounded sends."""

from __future__ import annotations

import httpx
import pytest
from pydantic import ValidationError

from gateway.config import GatewaySettings
from gateway.engine_registry import EngineState
from gateway.errors import GatewayError
from gateway.peers import MAX_BATCH, Note, NoteBatch, PeerBounds, PeerNotes
from kvproto.schemas import Origin
from tests.support.fakes import registry, run


def test_notes_add_pending_prefill_until_done_or_expiry() -> None:
    async def body(http: httpx.AsyncClient) -> None:
        reg = registry(http, "a", "b")
        p = PeerNotes(reg)
        a, b = reg.engines["a"], reg.engines["b"]
        a.pending_prefill_tokens = 100.0  # this gateway's own
        p.receive(NoteBatch("g1", [Note(0, "a", 1, 500, 10), Note(1, "b", 1, 300, 2), Note(2, "zz", 1, 9, 10)]), 0.0)
        assert (a.pending_prefill_tokens, b.pending_prefill_tokens) == (600.0, 300.0)
        assert p.pending() == {"a": 500.0, "b": 300.0} and p.stats["unknown_engine"] == 1
        p.receive(NoteBatch("g1", [Note(0, "a", 1, 500, 10)]), 0.5)  # a repeated note counts once
        p.receive(NoteBatch("g2", [Note(0, "a", 2, 50, 10)]), 0.5)  # another epoch: the engine restarted since
        assert a.pending_prefill_tokens == 600.0
        p.receive(NoteBatch("g1", done=[0, 7]), 1.0)  # 7: unknown, ignored
        assert a.pending_prefill_tokens == 100.0 and p.stats["done"] == 1
        p.expire(2.0)  # note 1's done was lost: its ttl ends it
        assert b.pending_prefill_tokens == 0.0 and p.stats["expired"] == 1
        # An engine the registry replaced meanwhile: the tokens come off the state they were added to.
        p.receive(NoteBatch("g1", [Note(3, "a", 1, 40, 10)]), 3.0)
        old = reg.engines["a"]
        reg.engines["a"] = EngineState("a", Origin("http", "127.0.0.1", 9000), epoch=1)
        p.receive(NoteBatch("g1", done=[3]), 3.5)
        assert old.pending_prefill_tokens == 100.0 and reg.engines["a"].pending_prefill_tokens == 0.0
        p.receive(NoteBatch(p.id, [Note(9, "a", 1, 1, 10)]), 4.0)  # its own notes (listed among its peers): ignored
        assert p.pending() == {} and p.stats["received"] == 6 and p.stats["unknown_engine"] == 2

    run(body)


def test_the_table_is_bounded_oldest_first() -> None:
    async def body(http: httpx.AsyncClient) -> None:
        reg = registry(http, "a")
        p = PeerNotes(reg, bounds=PeerBounds(max_notes=2))
        p.receive(NoteBatch("g", [Note(i, "a", 1, 10 * (i + 1), 60) for i in range(3)]), 0.0)
        assert reg.engines["a"].pending_prefill_tokens == 50.0  # notes 1 and 2

    run(body)


def test_bad_settings_are_refused() -> None:
    async def body(http: httpx.AsyncClient) -> None:
        with pytest.raises(ValueError):
            PeerNotes(registry(http), bounds=PeerBounds(ttl_s=0))
        with pytest.raises(ValueError):
            PeerNotes(registry(http), ["http://127.0.0.1:1/path"])

    run(body)


def test_each_note_folded_in_reaches_the_policy_once() -> None:
    async def body(http: httpx.AsyncClient) -> None:
        reg = registry(http, "a")
        seen: list[tuple[str, float]] = []
        p = PeerNotes(reg, on_note=lambda node, tokens: seen.append((node, tokens)))
        p.receive(NoteBatch("g1", [Note(0, "a", 1, 500, 10), Note(1, "zz", 1, 9, 10)]), 0.0)
        p.receive(NoteBatch("g1", [Note(0, "a", 1, 500, 10)]), 0.1)  # repeated: counted once
        assert seen == [("a", 500)]

    run(body)


# -- hostile or broken peers (issue #29)


def flood(sender: str, node: str = "a", first: int = 0, n: int = MAX_BATCH, tokens: float = 1e9, ttl: float = 600) -> NoteBatch:
    return NoteBatch(sender, [Note(first + i, node, 1, tokens, ttl) for i in range(n)])


def test_a_flood_of_oversized_notes_is_clamped_to_a_prompt_a_ttl_and_the_engines_bound() -> None:
    async def body(http: httpx.AsyncClient) -> None:
        reg = registry(http, "a", "b")
        p = PeerNotes(reg, bounds=PeerBounds(ttl_s=10, max_prompt_tokens=4096, max_engine_tokens=100_000))
        p.receive(flood("g1"), 0.0)  # 512 notes of 1e9 tokens for 600 s: 5.1e11 tokens before
        a = reg.engines["a"]
        assert a.pending_prefill_tokens == 100_000 and p.pending() == {"a": 100_000}
        # 24 notes of 4,096 tokens, then 1,696 in a 25th; the other 487 would find no room.
        assert len(p.receiver.held) == 25 and p.stats["refused"] == 487 and p.stats["clamped"] == 25
        assert (
            max(h.tokens for h in p.receiver.held.values()) == 4096 and max(h.expires for h in p.receiver.held.values()) == 10.0
        )
        # An engine's own max_model_len is the bound of its notes.
        reg.engines["b"].max_model_len = 1000
        p.receive(NoteBatch("g1", [Note(10_000, "b", 1, 5000, 1)]), 0.0)
        assert reg.engines["b"].pending_prefill_tokens == 1000
        # Invented senders add nothing more to the full engine.
        for k in range(20):
            p.receive(flood(f"churn{k}"), 0.0)
        assert a.pending_prefill_tokens == 100_000 and len(p.receiver.held) == 26
        p.expire(10.0)  # everything asked for 600 s and counts 10 s at most
        assert a.pending_prefill_tokens == 0 and p.pending() == {} and len(p.receiver.expiry) == 0

    run(body)


def test_a_note_is_refused_again_after_its_done_and_ids_below_the_highest() -> None:
    async def body(http: httpx.AsyncClient) -> None:
        reg = registry(http, "a")
        p = PeerNotes(reg)
        a = reg.engines["a"]
        p.receive(NoteBatch("g", [Note(5, "a", 1, 100, 10), Note(5, "a", 1, 100, 10)]), 0.0)  # twice in one batch
        assert a.pending_prefill_tokens == 100 and p.stats["replayed"] == 1
        p.receive(NoteBatch("g", done=[5]), 1.0)
        assert a.pending_prefill_tokens == 0
        p.receive(NoteBatch("g", [Note(5, "a", 1, 100, 10), Note(3, "a", 1, 100, 10)]), 2.0)  # after its done; older
        assert a.pending_prefill_tokens == 0 and p.stats["replayed"] == 3 and p.receiver.held == {}
        p.expire(20.0)
        p.receive(NoteBatch("g", [Note(4, "a", 1, 100, 10)]), 20.0)  # after expiry too: the sender is remembered
        assert a.pending_prefill_tokens == 0 and p.stats["replayed"] == 4
        p.receive(NoteBatch("g", [Note(6, "a", 1, 100, 10)]), 20.0)  # the next id counts
        assert a.pending_prefill_tokens == 100

    run(body)


def test_the_expiry_heap_holds_no_more_than_the_notes_after_a_flood() -> None:
    async def body(http: httpx.AsyncClient) -> None:
        reg = registry(http, "a")
        p = PeerNotes(reg, bounds=PeerBounds(max_notes=1000, max_senders=1000, max_engine_tokens=1e12))
        for k in range(100):  # 51,200 notes from 100 senders: before, 1,000 held and 51,200 heap entries
            p.receive(flood(f"s{k}", tokens=10, ttl=10), k * 0.01)
            assert len(p.receiver.expiry) == len(p.receiver.held) <= 1000
        assert len(p.receiver.held) == 1000 and p.stats["evicted"] == 50_200
        assert reg.engines["a"].pending_prefill_tokens == 10_000 == sum(p.pending().values())
        # Notes ended by their done leave nothing behind either (the first one made room by dropping the oldest).
        for k in range(100):
            p.receive(NoteBatch("d", [Note(k, "a", 1, 10, 10)], done=[k]), 1.0)
        assert len(p.receiver.expiry) == len(p.receiver.held) == 999
        # The heap still pops in expiry order: the latest flood's notes (at 0.99 + 10) last.
        p.expire(10.985)
        assert len(p.receiver.held) == len(p.receiver.expiry) == 512 and {s for s, _ in p.receiver.held} == {"s99"}
        p.expire(11.0)
        assert len(p.receiver.expiry) == 0 and reg.engines["a"].pending_prefill_tokens == 0

    run(body)


def test_invented_senders_are_bounded_and_each_sender_by_rate_and_count() -> None:
    async def body(http: httpx.AsyncClient) -> None:
        reg = registry(http, "a")
        p = PeerNotes(
            reg, bounds=PeerBounds(ttl_s=5, max_senders=3, max_sender_notes=600, note_rate=1000, max_engine_tokens=1e12)
        )
        for k in range(3):
            p.receive(flood(f"s{k}", tokens=1, ttl=5), 0.0)
        with pytest.raises(GatewayError) as exc:  # a 4th sender while 3 hold notes
            p.receive(flood("s3", tokens=1), 0.0)
        assert exc.value.status == 429 and "at most 3 peer senders" in exc.value.message
        assert len(p.receiver.senders) == 3 and len(p.receiver.held) == 3 * MAX_BATCH
        # A sender's rate: 1,000 a second (burst 1,000): 512 more now is over it; its dones still count.
        with pytest.raises(GatewayError) as exc:
            p.receive(NoteBatch("s0", [Note(1000 + i, "a", 1, 1, 5) for i in range(MAX_BATCH)], done=[0, 1]), 0.0)
        assert exc.value.status == 429 and exc.value.code == "rate_limit_exceeded"
        assert p.stats["done"] == 2 and p.receiver.senders["s0"].notes == 510
        # 0.6 s later the allowance is back over 512, and the sender's count (600) cuts the batch at 90 more.
        p.receive(NoteBatch("s0", [Note(2000 + i, "a", 1, 1, 5) for i in range(MAX_BATCH)]), 0.6)
        assert p.receiver.senders["s0"].notes == 600 and p.stats["refused"] == 2 * MAX_BATCH + 422
        # A sender is forgotten once it holds nothing and was silent for a TTL: then a new one has room.
        with pytest.raises(GatewayError):
            p.receive(flood("s4", tokens=1), 4.9)  # their notes still count
        p.expire(5.0)  # s1's and s2's notes (from 0.0) are over, s0's (0.6) not yet
        with pytest.raises(GatewayError):
            p.receive(flood("s4", tokens=1), 5.0)  # s1 and s2 hold nothing, but spoke 5 s ago only
        p.receive(flood("s4", tokens=1), 5.1)
        assert set(p.receiver.senders) == {"s0", "s2", "s4"} and p.receiver.senders["s4"].notes == MAX_BATCH


def test_the_gateway_settings_refuse_peers_off_loopback_without_a_token(tmp_path) -> None:
    token = tmp_path / "peer-token"
    token.write_text("t0ken\n")
    peers = "http://10.0.0.2:8100"
    for host in ("0.0.0.0", "10.0.0.1", "[::]", "gateway"):
        with pytest.raises(ValidationError, match="not on loopback, but there is no peer token"):
            GatewaySettings(http=f"{host}:8100", peers=peers)
        assert GatewaySettings(http=f"{host}:8100", peers=peers, peer_token_file=token).peer_token is not None
        GatewaySettings(http=f"{host}:8100")  # no peers: no notes route, nothing to protect
    for host in ("127.0.0.1", "127.3.0.1", "[::1]", "localhost"):
        GatewaySettings(http=f"{host}:8100", peers=peers)
    s = GatewaySettings(prefill_tokens_per_s=2000, peer_note_ttl_s=3)
    assert s.peer_engine_tokens == 6000 and GatewaySettings(peer_max_engine_tokens=5).peer_engine_tokens == 5
    with pytest.raises(ValidationError, match="at most peer_max_notes"):
        GatewaySettings(peer_max_notes=10, peer_max_sender_notes=11)
