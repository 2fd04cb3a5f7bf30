"""The API never waits for the state-machine lock on the event loop.

The Raft thread holds `StateMachine.lock` while it applies a batch; a handler that took that lock on
the loop froze every request of the replica meanwhile, /healthz included. One real single-node
replica (pysyncobj on loopback), its app driven in-process through `httpx.ASGITransport`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from directory.api import create_app
from directory.config import DirectorySettings
from directory.replica import Replica
from kvdir.local_cluster import free_ports
from tests.support.wait import until

HOLD_LIMIT_S = 10.0  # the lock holder gives up after this long: a loop that blocked fails the test instead of hanging it


@asynccontextmanager
async def _replica_app(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Replica]]:
    http, raft = free_ports(2)
    settings = DirectorySettings(http=f"127.0.0.1:{http}", raft=f"127.0.0.1:{raft}", data_dir=tmp_path, fsync=False)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        replica: Replica = app.state.replica
        await until(lambda: replica.ready, "the single replica to lead", timeout=30.0)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://replica") as client:
            yield client, replica


def _run(scenario: Callable[[Path], Awaitable[None]], tmp_path: Path) -> None:
    asyncio.run(scenario(tmp_path))


def test_requests_are_served_while_the_raft_thread_holds_the_state_lock(tmp_path: Path) -> None:
    async def scenario(tmp_path: Path) -> None:
        async with _replica_app(tmp_path) as (client, replica):
            r = await client.post("/v1/nodes", json={"node_id": "n1", "api_url": "http://127.0.0.1:9"})
            assert r.status_code == 200, r.text
            epoch = r.json()["epoch"]
            blocks = [{"hash": h, "slot": h} for h in range(1, 9)]
            r = await client.post("/v1/blocks", json={"node_id": "n1", "epoch": epoch, "blocks": blocks})
            assert r.status_code == 200, r.text
            lookup = {"hashes": list(range(1, 9))}
            unheld = (await client.post("/v1/lookup", json=lookup)).json()  # the fast path: the lock is free
            assert unheld["holders"] == [{"node_id": "n1", "epoch": epoch, "matched_blocks": 8}]

            # Stand in for the Raft thread in the middle of a long apply.
            held, release = threading.Event(), threading.Event()
            outcome: dict[str, bool] = {}

            def hold() -> None:
                with replica.sm.lock:
                    held.set()
                    outcome["released_by_test"] = release.wait(HOLD_LIMIT_S)

            # Note when a read has gone to a worker thread to wait for the lock.
            waiting = threading.Event()
            read_now = replica.read_now

            def noting_read_now(fn: Any) -> Any:
                waiting.set()
                return read_now(fn)

            replica.read_now = noting_read_now  # type: ignore[method-assign]
            holder = threading.Thread(target=hold, name="stand-in raft thread")
            holder.start()
            try:
                await until(held.is_set, "the stand-in to take the lock", timeout=30.0)
                pending = [
                    asyncio.create_task(client.post("/v1/lookup", json=lookup)),
                    asyncio.create_task(client.get("/v1/nodes/n1")),
                    asyncio.create_task(client.get("/v1/digest")),
                ]
                # A handler that waited for the lock on the loop would freeze this coroutine until the holder gave up.
                await until(lambda: waiting.is_set() or outcome, "a read to wait for the lock off the loop", timeout=30.0)
                assert not outcome, "the event loop was blocked while the state lock was held"
                health = await asyncio.wait_for(client.get("/healthz"), HOLD_LIMIT_S)
                assert health.status_code == 200
                assert not any(t.done() for t in pending), "a read finished while the state lock was held"
            finally:
                release.set()
                holder.join(HOLD_LIMIT_S + 5)
            assert outcome == {"released_by_test": True}, "the event loop was blocked while the lock was held"
            looked, node, digest = await asyncio.wait_for(asyncio.gather(*pending), 30)
            assert looked.status_code == 200 and looked.json() == unheld
            assert node.status_code == 200 and node.json()["blocks"] == 8
            assert digest.status_code == 200 and digest.json()["nodes"] == 1 and digest.json()["entries"] == 8

    _run(scenario, tmp_path)


def test_reads_agree_with_the_state(tmp_path: Path) -> None:
    """The read methods return what the state holds (the API's answers are built from them)."""

    async def scenario(tmp_path: Path) -> None:
        async with _replica_app(tmp_path) as (client, replica):
            r = await client.post("/v1/nodes", json={"node_id": "n1", "api_url": "http://127.0.0.1:9"})
            epoch = r.json()["epoch"]
            await client.post("/v1/blocks", json={"node_id": "n1", "epoch": epoch, "blocks": [{"hash": 5, "slot": 0}]})
            state = replica.state
            assert await replica.counts() == (len(state.nodes), len(state.index)) == (1, 1)
            d = await replica.digest()
            assert (d.digest, d.applied, d.entries, d.nodes) == (state.digest(), state.applied, 1, 1)
            views = await replica.nodes()
            assert [(v.node.node_id, v.node.epoch, v.blocks) for v in views] == [("n1", epoch, 1)]
            assert views[0].node is not state.nodes["n1"]  # a copy: the next command cannot change it under the caller
            assert await replica.node("absent") is None
            assert await replica.has_room_for("n1") and await replica.has_room_for("n2")
            cluster = (await client.get("/v1/cluster")).json()
            assert (cluster["nodes"], cluster["entries"]) == (1, 1)

    _run(scenario, tmp_path)
