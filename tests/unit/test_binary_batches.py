"""Binary batches (docs/protocol.md §3.1): msgpack bodies with packed arrays on publish, remove and lookup.

The real routes over an in-memory replica (tests.support.memory_replica), driven through httpx's
ASGI transport: the same writes as JSON and as binary batches reach the same state, lookups agree,
a malformed batch is refused with a message and changes nothing, and the typed client and the
node session send binary batches unless told otherwise.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest

from directory.api import create_app
from directory.config import DirectorySettings
from kvproto.client import DirectoryClient
from kvproto.errors import InvalidRequestError
from kvproto.hashing import block_hashes
from kvproto.session import NodeSession
from kvproto.state import Publish
from tests.support.memory_replica import MemoryReplica

MSGPACK = {"content-type": "application/msgpack"}
LIMIT = 64  # max_blocks_per_publish and max_hashes_per_lookup here
HIGH = 2**64 - 1


class Recording(httpx.AsyncBaseTransport):
    """Passes requests to the app, noting each one's path and Content-Type as the server receives them."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.seen: list[tuple[str, str | None]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((request.url.path, request.headers.get("content-type")))
        return await self.inner.handle_async_request(request)


@asynccontextmanager
async def serving(**settings: Any) -> AsyncIterator[tuple[httpx.AsyncClient, MemoryReplica, Recording]]:
    app = create_app(
        DirectorySettings(
            max_blocks_per_publish=LIMIT, max_hashes_per_lookup=LIMIT, max_tokens_per_lookup=16 * LIMIT, **settings
        ),
        MemoryReplica,
    )
    async with app.router.lifespan_context(app):
        transport = Recording(httpx.ASGITransport(app=app))
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as http:
            yield http, app.state.replica, transport


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())


def u64(*values: int) -> bytes:
    return np.array(values, dtype="<u8").tobytes()


def u32(*values: int) -> bytes:
    return np.array(values, dtype="<u4").tobytes()


def pack(body: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode(body)


async def register(http: httpx.AsyncClient, node_id: str) -> int:
    r = await http.post("/v1/nodes", json={"node_id": node_id, "api_url": "http://127.0.0.1:9", "incarnation": "i1"})
    assert r.status_code == 200, r.text
    epoch: int = r.json()["epoch"]
    return epoch


async def digest(http: httpx.AsyncClient) -> dict[str, Any]:
    d: dict[str, Any] = (await http.get("/v1/digest")).json()
    return d


# One node's history: publishes (with a hash above 2**63, a repeated hash whose last slot wins, and a
# tenant), then removals. Each step is (path, fields, hashes, slots or None).
HISTORY: list[tuple[str, dict[str, Any], list[int], list[int] | None]] = [
    ("/v1/blocks", {}, [1, 2, 3, HIGH, 2**63], [10, 20, 30, 40, 50]),
    ("/v1/blocks", {"medium": "cpu"}, [5, 6, 5], [60, 70, 80]),
    ("/v1/blocks", {"tenant": "acme"}, [1, 2, 9], [1, 2, 3]),
    ("/v1/blocks/remove", {}, [2, HIGH, 12345], None),
    ("/v1/blocks/remove", {"tenant": "acme"}, [9], None),
]


def json_body(node_id: str, epoch: int, fields: dict[str, Any], hashes: list[int], slots: list[int] | None) -> dict[str, Any]:
    if slots is None:
        return {"node_id": node_id, "epoch": epoch, "hashes": hashes, **fields}
    return {"node_id": node_id, "epoch": epoch, "blocks": [{"hash": h, "slot": s} for h, s in zip(hashes, slots)], **fields}


def binary_body(node_id: str, epoch: int, fields: dict[str, Any], hashes: list[int], slots: list[int] | None) -> bytes:
    body = {"node_id": node_id, "epoch": epoch, "hashes": u64(*hashes), **fields}
    if slots is not None:
        body["slots"] = u32(*slots)
    return pack(body)


def test_binary_and_json_writes_reach_the_same_state() -> None:
    async def scenario() -> None:
        answers: dict[str, list[Any]] = {}
        digests: dict[str, dict[str, Any]] = {}
        for mode in ("json", "binary"):
            async with serving() as (http, _, _):
                epoch = await register(http, "n1")
                answers[mode] = []
                for path, fields, hashes, slots in HISTORY:
                    if mode == "json":
                        r = await http.post(path, json=json_body("n1", epoch, fields, hashes, slots))
                    else:
                        r = await http.post(path, content=binary_body("n1", epoch, fields, hashes, slots), headers=MSGPACK)
                    assert r.status_code == 200, r.text
                    answers[mode].append(r.json())
                digests[mode] = await digest(http)
        assert answers["binary"] == answers["json"]
        assert digests["binary"] == digests["json"]
        assert digests["json"]["entries"] == 7  # 1, 3, 2**63, 5 and 6, and the tenant's 1 and 2

    run(scenario)


def test_binary_publish_hands_the_state_writable_native_arrays() -> None:
    # A read-only view of the body would make the index's numba kernels compile anew on the Raft thread.
    async def scenario() -> None:
        async with serving() as (http, replica, _):
            epoch = await register(http, "n1")
            r = await http.post("/v1/blocks", content=binary_body("n1", epoch, {}, [7, HIGH], [1, 2]), headers=MSGPACK)
            assert r.status_code == 200, r.text
            cmd = replica.commands[-1]
            assert isinstance(cmd, Publish)
            for array, dtype in ((cmd.hashes, np.uint64), (cmd.slots, np.uint32)):
                assert array.flags.writeable and array.flags.c_contiguous and array.dtype == np.dtype(dtype)
            assert cmd.hashes.tolist() == [7, HIGH] and cmd.slots.tolist() == [1, 2]

    run(scenario)


def test_binary_and_json_lookups_find_the_same_holders() -> None:
    tokens = list(range(1000, 1000 + 16 * 6))
    prompt = np.asarray(block_hashes(np.array(tokens, dtype=np.uint32)), dtype=np.uint64).tolist()

    async def scenario() -> None:
        async with serving() as (http, _, _):
            e1, e2 = await register(http, "n1"), await register(http, "n2")
            for node_id, epoch, n in (("n1", e1, 6), ("n2", e2, 3)):
                body = binary_body(node_id, epoch, {}, prompt[:n], list(range(100 * epoch, 100 * epoch + n)))
                assert (await http.post("/v1/blocks", content=body, headers=MSGPACK)).status_code == 200
            await http.post("/v1/blocks", json=json_body("n2", e2, {"tenant": "acme"}, prompt, list(range(6))))
            queries: list[dict[str, Any]] = [
                {"hashes": prompt + [HIGH]},
                {"hashes": prompt[:2], "with_slots": True},
                {"hashes": prompt, "tenant": "acme", "with_slots": True, "consistency": "linearizable"},
                {"hashes": []},
                {"tokens": tokens + [1, 2, 3], "with_slots": True},
                {"tokens": tokens[:40], "block_size": 8, "namespace": "other"},
            ]
            for q in queries:
                as_json = await http.post("/v1/lookup", json=q)
                packed = {k: (u64(*v) if k == "hashes" else u32(*v)) if isinstance(v, list) else v for k, v in q.items()}
                as_binary = await http.post("/v1/lookup", content=pack(packed), headers=MSGPACK)
                assert as_json.status_code == as_binary.status_code == 200, (as_json.text, as_binary.text)
                assert as_binary.headers["content-type"] == "application/json"
                assert as_binary.json() == as_json.json(), q
            full = (await http.post("/v1/lookup", json=queries[0])).json()
            assert [(h["node_id"], h["matched_blocks"]) for h in full["holders"]] == [("n1", 6), ("n2", 3)]

    run(scenario)


def test_lookup_answers_msgpack_when_asked() -> None:
    async def scenario() -> None:
        async with serving() as (http, _, _):
            epoch = await register(http, "n1")
            await http.post("/v1/blocks", json=json_body("n1", epoch, {}, [1, 2], [5, 6]))
            query = {"hashes": [1, 2, 3], "with_slots": True}
            as_json = (await http.post("/v1/lookup", json=query)).json()
            r = await http.post("/v1/lookup", json=query, headers={"accept": "application/json;q=0.5, application/msgpack"})
            assert r.headers["content-type"] == "application/msgpack"
            assert msgspec.msgpack.decode(r.content) == as_json
            assert as_json["holders"] == [{"node_id": "n1", "epoch": epoch, "matched_blocks": 2, "slots": [5, 6]}]

    run(scenario)


def _publish(**overrides: Any) -> bytes:
    return pack({"node_id": "n1", "epoch": 1, "hashes": u64(1, 2), "slots": u32(1, 2), **overrides})


# (path, body, status, error, a phrase of the detail), each sent to a replica where node n1 has epoch 1.
MALFORMED: list[tuple[str, bytes, int, str, str]] = [
    ("/v1/blocks", _publish(hashes=u64(1, 2)[:-1]), 400, "invalid_batch", "15 bytes, not a multiple of 8"),
    ("/v1/blocks", _publish(slots=u32(1, 2) + b"\0\0"), 400, "invalid_batch", "not a multiple of 4"),
    ("/v1/blocks", _publish(slots=u32(1)), 400, "invalid_batch", "2 hashes but 1 slots"),
    ("/v1/blocks", _publish(hashes=[1, 2]), 422, "invalid_request", "Expected `bytes`, got `array`"),
    ("/v1/blocks", _publish(slots="\x01\0\0\0\x02\0\0\0"), 422, "invalid_request", "Expected `bytes`, got `str`"),
    ("/v1/blocks", _publish(epoch="1"), 422, "invalid_request", "Expected `int`, got `str`"),
    ("/v1/blocks", _publish(epoch=0), 422, "invalid_request", ">= 1"),
    ("/v1/blocks", _publish(node_id="bad id"), 422, "invalid_request", "node_id"),
    (
        "/v1/blocks",
        pack({"node_id": "n1", "epoch": 1, "hashes": u64(1)}),
        422,
        "invalid_request",
        "missing required field `slots`",
    ),
    ("/v1/blocks", _publish(hashes=u64(*range(LIMIT + 1)), slots=u32(*range(LIMIT + 1))), 422, "too_many", "the limit is 64"),
    ("/v1/blocks", _publish()[:-3], 400, "invalid_msgpack", "truncated"),
    ("/v1/blocks", _publish() + b"\x00", 400, "invalid_msgpack", "trailing characters"),
    ("/v1/blocks", b"\xc1garbage", 400, "invalid_msgpack", "not valid msgpack"),
    ("/v1/blocks", b"", 400, "invalid_msgpack", "not valid msgpack"),
    ("/v1/blocks", pack([1, 2]), 422, "invalid_request", "Expected `object`, got `array`"),
    ("/v1/blocks/remove", pack({"node_id": "n1", "epoch": 1, "hashes": b"\1" * 12}), 400, "invalid_batch", "12 bytes"),
    ("/v1/blocks/remove", pack({"node_id": "n1", "epoch": 1, "hashes": u64(*range(LIMIT + 1))}), 422, "too_many", "64"),
    ("/v1/blocks/remove", pack({"node_id": "n1", "epoch": 1, "hashes": 5}), 422, "invalid_request", "Expected `bytes`"),
    ("/v1/lookup", pack({"hashes": b"\1" * 9}), 400, "invalid_batch", "not a multiple of 8"),
    ("/v1/lookup", pack({"hashes": u64(*range(LIMIT + 1))}), 422, "too_many", "the limit is 64"),
    ("/v1/lookup", pack({"hashes": u64(1), "tokens": u32(1)}), 422, "invalid_request", "exactly one of"),
    ("/v1/lookup", pack({"tokens": b"\1" * 6}), 400, "invalid_batch", "not a multiple of 4"),
    ("/v1/lookup", pack({"tokens": u32(*range(16 * LIMIT + 1))}), 422, "too_many", "tokens per lookup"),
    ("/v1/lookup", pack({"tokens": u32(*range(16 * LIMIT)), "block_size": 8}), 422, "too_many", "hashes per lookup"),
    ("/v1/lookup", pack({"tokens": u32(*range(64)), "block_size": 0}), 422, "invalid_request", "block_size"),
    ("/v1/lookup", pack({"hashes": u64(1), "consistency": "eventual"}), 422, "invalid_request", "consistency"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "error", "phrase"), MALFORMED, ids=[f"{m[0]}-{i}" for i, m in enumerate(MALFORMED)]
)
def test_a_malformed_binary_batch_is_refused_and_changes_nothing(
    path: str, body: bytes, status: int, error: str, phrase: str
) -> None:
    async def scenario() -> None:
        async with serving() as (http, _, _):
            assert await register(http, "n1") == 1
            assert (await http.post("/v1/blocks", content=_publish(), headers=MSGPACK)).status_code == 200
            before = await digest(http)
            r = await http.post(path, content=body, headers=MSGPACK)
            assert (r.status_code, r.json()["error"]) == (status, error), r.text
            assert phrase in r.json()["detail"], r.text
            assert await digest(http) == before

    run(scenario)


def test_the_content_type_chooses_the_decoder() -> None:
    async def scenario() -> None:
        async with serving() as (http, _, _):
            epoch = await register(http, "n1")
            publish = json_body("n1", epoch, {}, [1], [1])
            for ctype in ("text/plain", "application/octet-stream", "application/x-msgpack"):
                before = await digest(http)
                r = await http.post("/v1/blocks", content=msgspec.json.encode(publish), headers={"content-type": ctype})
                assert (r.status_code, r.json()["error"]) == (415, "unsupported_media_type"), r.text
                assert "application/json (the default) or application/msgpack" in r.json()["detail"]
                assert await digest(http) == before
            # JSON-only routes name what they take.
            r = await http.post("/v1/nodes", content=pack({"node_id": "n2", "api_url": "http://127.0.0.1:9"}), headers=MSGPACK)
            assert r.status_code == 415 and "application/json only" in r.json()["detail"], r.text
            # JSON without a Content-Type, with parameters, and as curl -d sends it (form-urlencoded) all still work.
            for headers in (
                {},
                {"content-type": "application/json; charset=utf-8"},
                {"content-type": "application/x-www-form-urlencoded"},
            ):
                r = await http.post("/v1/blocks", content=msgspec.json.encode(publish), headers=headers)
                assert r.status_code == 200, (headers, r.text)
            # msgpack sent as JSON is just invalid JSON.
            r = await http.post("/v1/blocks", content=binary_body("n1", epoch, {}, [1], [1]))
            assert (r.status_code, r.json()["error"]) == (400, "invalid_json"), r.text

    run(scenario)


def test_the_client_sends_binary_batches_unless_told_otherwise() -> None:
    async def scenario() -> None:
        digests = {}
        for binary in (True, False):
            async with serving() as (_, _, transport):
                async with DirectoryClient("http://replica", transport=transport, binary=binary, tenant="acme") as d:
                    reg = await d.register("n1", "http://127.0.0.1:9", incarnation="i1")
                    assert await d.publish(reg.node_id, reg.epoch, [(1, 10), (2, 20), (HIGH, 30)], medium="gpu") == 3
                    assert await d.remove(reg.node_id, reg.epoch, [2, 99]) == 1
                    found = await d.lookup([1, 2], with_slots=True, linearizable=True)
                    assert [(h.node_id, h.matched_blocks, h.slots) for h in found.holders] == [("n1", 1, [10])]
                    assert (await d.lookup(tokens=list(range(32)))).num_blocks == 2
                    digests[binary] = (await d.request("GET", "/v1/digest"))["digest"]
                body_type = "application/msgpack" if binary else "application/json"
                assert transport.seen == [
                    ("/v1/shards", None),  # once, before the first node write: an unsharded directory
                    ("/v1/nodes", "application/json"),
                    ("/v1/blocks", body_type),
                    ("/v1/blocks/remove", body_type),
                    ("/v1/lookup", body_type),
                    ("/v1/lookup", body_type),
                    ("/v1/digest", None),
                ]
        assert digests[True] == digests[False]

    run(scenario)


def test_the_client_refuses_values_out_of_range_before_sending() -> None:
    async def scenario() -> None:
        async with serving() as (_, _, transport):
            async with DirectoryClient("http://replica", transport=transport) as d:
                for call in (
                    d.publish("n1", 1, [(1, 2**32)]),
                    d.publish("n1", 1, [(-1, 0)]),
                    d.remove("n1", 1, [2**64]),
                    d.lookup(tokens=[2**32]),
                ):
                    with pytest.raises(InvalidRequestError) as err:
                        await call
                    assert err.value.status == 422 and "values (0..2**" in str(err.value)
            assert transport.seen == []

    run(scenario)


def test_the_node_session_flushes_binary_batches() -> None:
    async def scenario() -> None:
        async with serving() as (http, replica, transport):
            async with DirectoryClient("http://replica", transport=transport) as d:
                session = NodeSession(d, "w1", "http://127.0.0.1:9", holdings=lambda: [])
                assert await session.sync() is None  # registers
                session.stored([(h, h + 100) for h in range(1, 11)])
                assert await session.sync() is None
                session.removed([3, 4])
                assert await session.sync() is None
            assert [s for s in transport.seen if s[0].startswith("/v1/blocks")] == [
                ("/v1/blocks", "application/msgpack"),
                ("/v1/blocks/remove", "application/msgpack"),
            ]
            assert (await digest(http))["entries"] == 8
            found = replica.state.lookup(np.array([1, 2, 3], dtype=np.uint64), with_slots=True)
            assert [(h.node_id, h.matched_blocks, h.slots) for h in found] == [("w1", 2, [101, 102])]

    run(scenario)
