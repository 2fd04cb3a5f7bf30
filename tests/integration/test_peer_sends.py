"""gateway.peers' sender against a real refused connection: sends never block, a full queue drops, a dead peer is counted."""

from __future__ import annotations

import httpx

from gateway.peers import PeerNotes
from kvdir.local_cluster import free_ports
from tests.support.fakes import registry, run
from tests.support.wait import until


def test_sends_never_block_a_full_queue_drops_and_a_dead_peer_is_counted() -> None:
    async def body(http: httpx.AsyncClient) -> None:
        (port,) = free_ports(1)  # nothing listens there: connections are refused
        p = PeerNotes(registry(http, "a"), [f"http://127.0.0.1:{port}"], queue_size=2)
        assert p.routed("a", 1, 0) == -1  # nothing to prefill: no note
        keys = [p.routed("a", 1, 100) for _ in range(3)]
        assert keys == [0, 1, 2] and p.stats["dropped"] == 1  # before any send: the third did not fit
        p.prefilled(-1)
        assert p.stats["dropped"] == 1
        p.start(lambda: None)
        try:
            await until(lambda: p.stats["send_failures"], "the refused batch to be counted", timeout=10, interval=0.01)
            assert p.stats["sent"] == 0
        finally:
            await p.stop()

    run(body)
