"""One `kvdir events` process, several engines (adapters.subscriber.Adapter): a subscriber that fails is
started again on its own, the others untouched."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry

from adapters.config import EventsSettings
from adapters.engine_stream import EventsSubscriber
from adapters.node_feed import TASKS
from adapters.subscriber import Adapter
from kvdir.local_cluster import free_ports
from kvproto.schemas import RegisterResponse
from kvproto.tasks import TaskFailures
from tests.support.wait import until


def _tasks() -> TaskFailures:
    return TaskFailures("kvdir_events", TASKS, CollectorRegistry())


def test_a_failed_subscriber_is_started_again_and_the_other_engine_keeps_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    za, zb, api = free_ports(3)
    engines = [
        {"engine_url": f"http://127.0.0.1:{api}", "zmq": f"tcp://127.0.0.1:{za}", "node_id": "a"},
        {"engine_url": f"http://127.0.0.1:{api}", "zmq": f"tcp://127.0.0.1:{zb}", "node_id": "b"},
    ]
    settings = EventsSettings(directory="http://127.0.0.1:1", engines=json.dumps(engines))
    runs: list[tuple[str, int]] = []
    fail_once = {"a"}
    again = asyncio.Event()

    async def receive(self: EventsSubscriber, sub: object) -> None:
        # In place of reading the engine's events: a's first subscriber fails at once (a bug), once.
        runs.append((self.node_id, id(self)))
        if self.node_id in fail_once:
            fail_once.discard(self.node_id)
            raise RuntimeError("a bug in a's subscriber")
        if self.node_id == "a":
            again.set()
        await asyncio.Event().wait()

    async def idle(self: EventsSubscriber, *args: object) -> None:
        await asyncio.Event().wait()  # no directory or engine here: sync and /health probes wait

    monkeypatch.setattr(EventsSubscriber, "_receive_loop", receive)
    monkeypatch.setattr(EventsSubscriber, "_sync_loop", idle)
    monkeypatch.setattr(EventsSubscriber, "_health_loop", idle)
    monkeypatch.setattr(Adapter, "RESTART_FIRST_S", 0.01)
    adapter = Adapter(settings)

    async def main() -> None:
        task = asyncio.create_task(adapter.run())
        try:
            await asyncio.wait_for(again.wait(), 10)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    a_runs = [sub for node, sub in runs if node == "a"]
    b_runs = [sub for node, sub in runs if node == "b"]
    assert len(a_runs) == 2 and a_runs[0] != a_runs[1]  # a fresh subscriber, not the failed one again
    assert len(b_runs) == 1  # b was never restarted
    assert adapter.failures == {"a": 1, "b": 0}


def test_the_model_is_shared_or_per_engine_and_registered_without_a_fingerprint() -> None:
    """`--model` is every engine's, an `--engines` entry's `model` overrides it; the node registers it as the
    model it serves, and no KV fingerprint (an events-fed engine never pulls nor is pulled from)."""
    engines = [
        {"engine_url": "http://127.0.0.1:8000", "zmq": "tcp://127.0.0.1:5557", "node_id": "a"},
        {"engine_url": "http://127.0.0.1:8001", "zmq": "tcp://127.0.0.1:5567", "node_id": "b", "model": "qwen"},
    ]
    settings = EventsSettings(directory="http://127.0.0.1:1", engines=json.dumps(engines), model="llama", namespace="ns")
    a, b = settings.per_engine()
    assert (a.model, b.model) == ("llama", "qwen")
    assert EventsSettings(directory="http://127.0.0.1:1").model is None
    with pytest.raises(ValueError):
        EventsSettings(directory="http://127.0.0.1:1", model="")

    registered: list[dict[str, object]] = []

    class Directory:
        async def register(self, node_id: str, api_url: str, **kw: object) -> RegisterResponse:
            registered.append({"node_id": node_id, **kw})
            return RegisterResponse(node_id=node_id, epoch=1, lease_ttl_s=10.0)

    async def main() -> None:
        for s in (a, b, EventsSettings(directory="http://127.0.0.1:1", node_id="c")):
            sub = EventsSubscriber(s, directory=Directory(), tasks=_tasks())  # type: ignore[arg-type]
            await sub.session.register()

    asyncio.run(main())
    assert [(r["node_id"], list(r["models"]), r.get("fingerprint")) for r in registered] == [  # type: ignore[call-overload]
        ("a", ["llama"], None),
        ("b", ["qwen"], None),
        ("c", [], None),
    ]
    sub = EventsSubscriber(b, directory=Directory(), tasks=_tasks())  # type: ignore[arg-type]
    assert (sub.mapper.namespace, sub.mapper.model) == ("ns", "qwen")


def test_a_message_over_max_message_bytes_is_dropped_and_the_subscriber_keeps_receiving() -> None:
    """Issue #29 item 7c: the bound SUB socket takes whatever a peer sends; a part over --max-message-bytes is
    dropped by ZMQ (its sender disconnected, and reconnecting by itself) instead of being buffered and decoded."""

    import msgspec
    import zmq
    import zmq.asyncio

    from adapters.event_wire import Batch
    from kvproto.client import DirectoryClient

    (port,) = free_ports(1)
    settings = EventsSettings(directory="http://127.0.0.1:1", zmq=f"tcp://127.0.0.1:{port}", max_message_bytes=4096)
    small = msgspec.msgpack.encode([0.0, [], 0])
    big = msgspec.msgpack.encode([0.0, [["BlockRemoved", list(range(1000, 4000)), None]], 0])
    assert len(big) > settings.max_message_bytes > len(small)
    seen: list[int] = []

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        directory = DirectoryClient("http://127.0.0.1:1")
        sub = EventsSubscriber(settings, directory=directory, tasks=_tasks())

        async def record(batch: Batch) -> None:
            seen.append(batch.seq)

        sub.on_batch = record  # type: ignore[method-assign]
        sub.open(ctx)
        assert sub._sub is not None
        receiving = asyncio.create_task(sub._receive_loop(sub._sub))
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.connect(settings.zmq)

        async def send_until_seen(seq: int, what: str) -> None:
            async def sent_and_seen() -> bool:  # PUB drops what it sends before (re)connecting: send until one arrives
                if seq not in seen:
                    await pub.send_multipart([b"kv", seq.to_bytes(8, "big"), small])
                return seq in seen

            await until(sent_and_seen, what, timeout=10, interval=0.02)

        try:
            await send_until_seen(0, "the first small message")
            await pub.send_multipart([b"kv", (1).to_bytes(8, "big"), big])
            await send_until_seen(2, "a small message after the oversized one")
        finally:
            receiving.cancel()
            await asyncio.gather(receiving, return_exceptions=True)
            pub.close(linger=0)
            sub._sub.close(linger=0)
            await directory.aclose()
            ctx.term()

    asyncio.run(main())
    assert 1 not in seen and seen[-1] == 2
