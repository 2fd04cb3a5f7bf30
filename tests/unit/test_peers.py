"""gateway.peers: peers' notes folded into the engines' pending prefill, ended by a done or by expiry; bounded sends."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from directory.client import DirectoryClient
from directory.schemas import Origin
from gateway.engines import EngineRegistry, EngineState
from gateway.peers import Note, NoteBatch, PeerNotes
from kvdir.launcher import free_ports


def registry(http: httpx.AsyncClient, *ids: str) -> EngineRegistry:
    reg = EngineRegistry(DirectoryClient("http://127.0.0.1:1"), http, [], refresh_s=1.0, unhealthy_s=1.0)
    for i, n in enumerate(ids):
        reg.engines[n] = EngineState(n, Origin("http", "127.0.0.1", 9000 + i), epoch=1)
    return reg


def run(body) -> None:
    async def main() -> None:
        async with httpx.AsyncClient() as http:
            await body(http)

    asyncio.run(main())


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
        p = PeerNotes(reg, max_notes=2)
        p.receive(NoteBatch("g", [Note(i, "a", 1, 10 * (i + 1), 60) for i in range(3)]), 0.0)
        assert reg.engines["a"].pending_prefill_tokens == 50.0  # notes 1 and 2

    run(body)


def test_sends_never_block_a_full_queue_drops_and_a_dead_peer_is_counted() -> None:
    async def body(http: httpx.AsyncClient) -> None:
        (port,) = free_ports(1)  # nothing listens there: connections are refused
        p = PeerNotes(registry(http, "a"), [f"http://127.0.0.1:{port}"], queue_size=2)
        assert p.routed("a", 1, 0) == -1  # nothing to prefill: no note
        keys = [p.routed("a", 1, 100) for _ in range(3)]
        assert keys == [0, 1, 2] and p.stats["dropped"] == 1  # before any send: the third did not fit
        p.prefilled(-1)
        assert p.stats["dropped"] == 1
        p.start()
        try:
            deadline = time.monotonic() + 10
            while p.stats["send_failures"] == 0:
                assert time.monotonic() < deadline, "the refused batch was never counted"
                await asyncio.sleep(0.01)
            assert p.stats["sent"] == 0
        finally:
            await p.stop()

    run(body)


def test_bad_settings_are_refused() -> None:
    async def body(http: httpx.AsyncClient) -> None:
        with pytest.raises(ValueError):
            PeerNotes(registry(http), ttl_s=0)
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
