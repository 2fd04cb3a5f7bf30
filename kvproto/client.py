"""Async client of the directory for gateways, workers and adapters.

It knows every replica's URL. Reads go to the replica that last answered,
moving on when one is down. Writes may go to any replica (followers forward
to the Raft leader) and are retried with backoff on the next replica when a
replica is unreachable or answers 503: every write is idempotent, so a retry
after an unknown outcome is safe. 4xx answers are raised at once as
`RequestRejected` subclasses (see kvproto.errors). With `token`, every
request carries `Authorization: Bearer TOKEN` (the directory's auth_tokens_file).
With `tenant`, publishes, removals and lookups act in that tenant
(directory.tenancy); without it, in the token's tenant if it is confined to
one, else in the shared tenant "".

Publishes, removals and lookups go as binary batches (msgpack with packed
arrays, kvproto.binary: no JSON number per hash for either side to parse);
`binary=False` sends JSON as humans and older replicas read it. A value out
of range is refused before sending, as the directory would refuse it in JSON
(InvalidRequestError 422).

Sharded directories (docs/scale-out.md) need nothing from the caller: the client reads the
shard map (`GET /v1/shards`) from the replicas it was given before its first node write or
lookup. A node's writes then go to the node's home shard, and lookups and node listings go to
every shard and are merged (the shards' holders are disjoint). A `wrong_shard` answer makes it
reread the map and try the new home once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import httpx
import msgspec
import numpy as np
from pydantic import SecretStr, ValidationError

from kvproto import binary
from kvproto.binary import LookupBatch, PublishBatch, RemoveBatch
from kvproto.errors import (
    DirectoryError,
    DirectoryUnavailable,
    InvalidRequestError,
    MalformedAnswer,
    WrongShardError,
    rejection,
)
from kvproto.hashing import KvIdentity
from kvproto.schemas import Consistency, LookupResponse, NodeInfo, Region, RegisterResponse
from kvproto.shardmap import ShardMap

_RETRY_STATUS = {502, 503, 504}
T = TypeVar("T")
log = logging.getLogger("kvdir.client")


def _segment(node_id: str) -> str:
    """`node_id` as one path segment: percent-encoded, "/" included (the directory's node routes accept it)."""
    return urllib.parse.quote(node_id, safe="")


class DirectoryClient:
    """One shared connection pool to all replicas. Safe for concurrent use from one event loop."""

    def __init__(
        self,
        urls: Sequence[str] | str,
        *,
        timeout: float = 2.0,
        deadline: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
        token: str | SecretStr | None = None,
        tenant: str = "",
        binary: bool = True,
        sharded: bool = True,
    ) -> None:
        """`sharded=False`: talk to these replicas only, as one group, without reading a shard map."""
        if isinstance(urls, str):
            urls = [u for u in urls.split(",") if u.strip()]
        if not urls:
            raise ValueError("DirectoryClient needs at least one replica URL")
        self.urls = [u.strip().rstrip("/") for u in urls]
        self.deadline = deadline
        self.binary = binary
        self._tenant = {"tenant": tenant} if tenant else {}  # omitted: the directory picks the token's default
        self._preferred = 0
        if isinstance(token, SecretStr):
            token = token.get_secret_value()
        headers = {"Authorization": f"Bearer {token}"} if token else None
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout),
            headers=headers,
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=8),
            transport=transport,
        )
        self._options: dict[str, Any] = dict(
            timeout=timeout, deadline=deadline, transport=transport, token=token, tenant=tenant, binary=binary, sharded=False
        )
        self._sharded = sharded
        self._map: ShardMap | None = None
        self._map_read = False
        self._map_lock: asyncio.Lock | None = None
        self._shards: dict[str, DirectoryClient] = {}
        self._nodes: tuple[str, list[NodeInfo]] | None = None  # the last node list and its ETag (one group's)

    async def aclose(self) -> None:
        for c in self._shards.values():
            await c.aclose()
        await self._http.aclose()

    # -- shards -------------------------------------------------------------------

    async def shard_map(self, *, refresh: bool = False) -> ShardMap | None:
        """The directory's shard map, or None if it is not sharded (read once, again with `refresh`)."""
        if not self._sharded:
            return None
        if self._map_read and not refresh:
            return self._map
        if self._map_lock is None:
            self._map_lock = asyncio.Lock()
        async with self._map_lock:
            if not self._map_read or refresh:
                doc = await self.request("GET", "/v1/shards")  # version 0: not sharded, one group
                m = None if not doc.get("version") else ShardMap.model_validate({k: v for k, v in doc.items() if k != "shard"})
                if m is not None and (self._map is None or m.version != self._map.version):
                    log.info("shard map version %d: %d shards", m.version, len(m.shards))
                self._map, self._map_read = m, True
        return self._map

    def _shard(self, name: str) -> DirectoryClient:
        assert self._map is not None
        client = self._shards.get(name)
        if client is None or client.urls != self._map.urls(name):
            client = self._shards[name] = DirectoryClient(self._map.urls(name), **self._options)
        return client

    def _home(self, node_id: str) -> DirectoryClient:
        """The client of `node_id`'s home shard under the map last read (sharded directories only)."""
        assert self._map is not None
        return self._shard(self._map.home(node_id))

    async def _node_request(
        self,
        node_id: str,
        method: str,
        path: str,
        json: Any = None,
        *,
        msgpack: bytes | None = None,
        deadline: float | None = None,
    ) -> Any:
        """`request` to the node's home shard (these replicas if not sharded); after a wrong_shard answer,
        reread the map and try the node's new home once."""
        if await self.shard_map() is None:
            return await self.request(method, path, json, msgpack=msgpack, deadline=deadline)
        try:
            return await self._home(node_id).request(method, path, json, msgpack=msgpack, deadline=deadline)
        except WrongShardError:
            await self.shard_map(refresh=True)
            return await self._home(node_id).request(method, path, json, msgpack=msgpack, deadline=deadline)

    async def _each_shard(self, call: Callable[[DirectoryClient], Awaitable[T]]) -> dict[str, T | DirectoryError]:
        """`call` on every shard at once, by shard name: its answer, or the DirectoryError it failed with."""
        assert self._map is not None
        names = self._map.names
        results = await asyncio.gather(*(call(self._shard(n)) for n in names), return_exceptions=True)
        out: dict[str, T | DirectoryError] = {}
        for name, r in zip(names, results):
            if isinstance(r, BaseException) and not isinstance(r, DirectoryError):
                raise r
            out[name] = r
        return out

    async def _every_shard(self, call: Callable[[DirectoryClient], Awaitable[T]], *, all_needed: bool) -> list[T]:
        """`call` on every shard at once. Shards that fail are left out unless `all_needed` (or every shard failed)."""
        out: list[T] = []
        failed: list[DirectoryError] = []
        for name, r in (await self._each_shard(call)).items():
            if isinstance(r, DirectoryError):
                log.debug("shard %s: %s", name, r)
                failed.append(r)
            else:
                out.append(r)
        if failed and (all_needed or not out):
            raise failed[0]
        return out

    async def __aenter__(self) -> DirectoryClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def request(
        self, method: str, path: str, json: Any = None, *, msgpack: bytes | None = None, deadline: float | None = None
    ) -> Any:
        """Send `json` (or the msgpack body `msgpack`) to the preferred replica, failing over to the others
        until `deadline` seconds pass; returns the JSON answer."""
        return (await self._send(method, path, json, msgpack=msgpack, deadline=deadline)).json()

    async def _send(
        self,
        method: str,
        path: str,
        json: Any = None,
        *,
        msgpack: bytes | None = None,
        deadline: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """`request`, returning the first answer below 400 itself (a 304 included)."""
        headers = dict(headers or {})
        if msgpack is not None:
            headers["content-type"] = binary.MSGPACK
        end = time.monotonic() + (self.deadline if deadline is None else deadline)
        delay = 0.02
        attempt = 0
        last: str = "no attempt"
        while True:
            i = (self._preferred + attempt) % len(self.urls)
            url = self.urls[i] + path
            try:
                resp = await self._http.request(method, url, json=json, content=msgpack, headers=headers or None)
            except httpx.TransportError as exc:
                last = f"{url}: {type(exc).__name__}: {exc}"
            else:
                if resp.status_code < 400:
                    self._preferred = i
                    return resp
                if resp.status_code not in _RETRY_STATUS:
                    try:
                        body = resp.json()
                    except ValueError:
                        body = {"error": "http_error", "detail": resp.text[:500]}
                    # A replica's rate limit (linearizable lookups, per token and replica) is not a refusal of the
                    # request: another replica may take it now, this one after its Retry-After; the deadline holds.
                    if not (resp.status_code == 429 and isinstance(body, dict) and body.get("error") == "rate_limited"):
                        raise rejection(resp.status_code, body.get("error", "http_error"), body.get("detail"))
                last = f"{url}: {resp.status_code} {resp.text[:200]}"
            attempt += 1
            if time.monotonic() >= end:
                raise DirectoryUnavailable(f"no directory replica answered {method} {path} in time; last: {last}")
            if attempt % len(self.urls) == 0:  # every replica tried once: back off
                await asyncio.sleep(min(delay, max(0.0, end - time.monotonic())) * (0.5 + random.random()))
                delay = min(delay * 2, 0.5)

    # -- nodes --------------------------------------------------------------------

    async def register(
        self,
        node_id: str,
        api_url: str,
        *,
        incarnation: str | None = None,
        transfer_url: str | None = None,
        regions: Iterable[Region | Mapping[str, Any]] = (),
        capacity_blocks: int | None = None,
        block_size: int | None = None,
        models: Iterable[str] = (),
        fingerprint: str | None = None,
        shared: bool = False,
        dp_rank: int | None = None,
        deadline: float | None = None,
    ) -> RegisterResponse:
        """Register (or re-register) a node; the same `incarnation` makes retries return the same epoch.

        `models`, `fingerprint`, `shared` and `dp_rank` are its profile (docs/protocol.md §2.1); its tenant is
        the client's.
        """
        body: dict[str, Any] = {
            "node_id": node_id,
            "api_url": api_url,
            "incarnation": incarnation or uuid.uuid4().hex,
            "transfer_url": transfer_url,
            "regions": [msgspec.to_builtins(r) if isinstance(r, Region) else dict(r) for r in regions],
            "capacity_blocks": capacity_blocks,
            "block_size": block_size,
            "models": list(models),
            "fingerprint": fingerprint,
            "shared": shared,
            "dp_rank": dp_rank,
            **self._tenant,
        }
        return RegisterResponse.model_validate(await self._node_request(node_id, "POST", "/v1/nodes", body, deadline=deadline))

    async def heartbeat(
        self, node_id: str, epoch: int, load: Mapping[str, float] | None = None, *, deadline: float | None = None
    ) -> None:
        body = {"epoch": epoch, "load": dict(load) if load else None}
        await self._node_request(node_id, "POST", f"/v1/nodes/{_segment(node_id)}/heartbeat", body, deadline=deadline)

    async def deregister(self, node_id: str, epoch: int | None, *, deadline: float | None = None) -> int:
        """End the registration of `epoch` (the node's entries go with it); the number of entries dropped.

        A registration made since is left alone (409, `StaleEpochError`), so a retried or late deregistration never
        drops a newer one. `epoch=None` ends whatever registration is current: for an operator, never an engine.
        """
        path = f"/v1/nodes/{_segment(node_id)}" + ("" if epoch is None else f"?epoch={int(epoch)}")
        removed: int = (await self._node_request(node_id, "DELETE", path, deadline=deadline))["removed"]
        return removed

    async def nodes(self, *, deadline: float | None = None) -> list[NodeInfo]:
        """Every registered node (of every shard) that the token may see. The last answer is kept with its ETag and
        handed out again (the same NodeInfo objects: do not change them) when the replica answers 304: a poll of an
        unchanged directory costs neither side an encoding nor a parse."""
        if await self.shard_map() is not None:
            parts = await self._every_shard(lambda c: c.nodes(deadline=deadline), all_needed=True)
            return [n for part in parts for n in part]
        cached = self._nodes
        condition = {"if-none-match": cached[0]} if cached is not None else None
        resp = await self._send("GET", "/v1/nodes", deadline=deadline, headers=condition)
        if resp.status_code == 304 and cached is not None:
            return list(cached[1])
        nodes = _decoded(lambda r: [NodeInfo.model_validate(n) for n in r.json()["nodes"]], resp, "node list")
        etag = resp.headers.get("etag")
        self._nodes = (etag, nodes) if etag else None
        return list(nodes)

    async def nodes_by_shard(self, *, deadline: float | None = None) -> dict[str, list[NodeInfo] | DirectoryError]:
        """Every registered node by shard name ("" for an unsharded directory), or the error of a shard that did
        not answer: for callers that go on with the others (a gateway's engine list while one shard is down).
        Raises only when no shard answered."""
        if await self.shard_map() is None:
            return {"": await self.nodes(deadline=deadline)}
        out = await self._each_shard(lambda c: c.nodes(deadline=deadline))
        failed = [a for a in out.values() if isinstance(a, DirectoryError)]
        if len(failed) == len(out):
            raise failed[0]
        return out

    def home_shard(self, node_id: str) -> str:
        """The name of `node_id`'s home shard under the map last read ("" for an unsharded directory)."""
        return "" if self._map is None else self._map.home(node_id)

    async def cluster(self, *, deadline: float | None = None) -> dict[str, Any]:
        cluster: dict[str, Any] = await self.request("GET", "/v1/cluster", deadline=deadline)
        return cluster

    # -- blocks -------------------------------------------------------------------

    async def publish(
        self,
        node_id: str,
        epoch: int,
        blocks: Iterable[tuple[int, int]],
        medium: str | None = None,
        *,
        deadline: float | None = None,
    ) -> int:
        """Publish (hash, slot) pairs; returns how many entries were new."""
        if self.binary:
            pairs = list(blocks)
            batch = PublishBatch(
                node_id=node_id,
                epoch=epoch,
                hashes=_pack((h for h, _ in pairs), binary.U64, "block hashes"),
                slots=_pack((s for _, s in pairs), binary.U32, "slots"),
                medium=medium,
                tenant=self._tenant.get("tenant"),
            )
            answer = await self._node_request(
                node_id, "POST", "/v1/blocks", msgpack=msgspec.msgpack.encode(batch), deadline=deadline
            )
        else:
            body = {
                "node_id": node_id,
                "epoch": epoch,
                "blocks": [{"hash": h, "slot": s} for h, s in blocks],
                "medium": medium,
                **self._tenant,
            }
            answer = await self._node_request(node_id, "POST", "/v1/blocks", body, deadline=deadline)
        stored: int = answer["stored"]
        return stored

    async def remove(self, node_id: str, epoch: int, hashes: Iterable[int], *, deadline: float | None = None) -> int:
        if self.binary:
            batch = RemoveBatch(
                node_id=node_id, epoch=epoch, hashes=_pack(hashes, binary.U64, "hashes"), tenant=self._tenant.get("tenant")
            )
            answer = await self._node_request(
                node_id, "POST", "/v1/blocks/remove", msgpack=msgspec.msgpack.encode(batch), deadline=deadline
            )
        else:
            body = {"node_id": node_id, "epoch": epoch, "hashes": list(hashes), **self._tenant}
            answer = await self._node_request(node_id, "POST", "/v1/blocks/remove", body, deadline=deadline)
        removed: int = answer["removed"]
        return removed

    async def clear(self, node_id: str, epoch: int, *, deadline: float | None = None) -> int:
        body = {"node_id": node_id, "epoch": epoch}
        removed: int = (await self._node_request(node_id, "POST", "/v1/blocks/clear", body, deadline=deadline))["removed"]
        return removed

    async def lookup(
        self,
        hashes: Sequence[int] | None = None,
        *,
        tokens: Sequence[int] | None = None,
        namespace: str = "",
        identity: KvIdentity | None = None,
        block_size: int = 16,
        with_slots: bool = False,
        linearizable: bool = False,
        deadline: float | None = None,
    ) -> LookupResponse:
        """Holders of the longest prefix of `hashes` (or of `tokens`, hashed by the replica under `identity`,
        else under `namespace` alone).

        Sharded: every shard is asked at once and the holders merged, longest first. A shard that does
        not answer is left out of a local lookup (its holders are missed, the rest still route) and
        fails a linearizable one."""
        consistency: Consistency = "linearizable" if linearizable else "local"
        kv = identity if identity is not None else KvIdentity(namespace)
        named = {"namespace": kv.namespace, "model": kv.model, "adapter": kv.adapter, "cache_salt": kv.cache_salt}
        body: dict[str, Any] | None = None
        packed: bytes | None = None
        if self.binary:
            batch = LookupBatch(
                hashes=_pack(hashes or (), binary.U64, "hashes") if tokens is None else None,
                tokens=_pack(tokens, binary.U32, "tokens") if tokens is not None else None,
                **named,
                block_size=block_size,
                with_slots=with_slots,
                consistency=consistency,
                tenant=self._tenant.get("tenant"),
            )
            packed = msgspec.msgpack.encode(batch)
        else:
            body = {"with_slots": with_slots, "consistency": consistency, **self._tenant}
            if tokens is not None:
                body.update(tokens=list(tokens), **named, block_size=block_size)
            else:
                body["hashes"] = list(hashes or [])
        if await self.shard_map() is None:
            answer = await self.request("POST", "/v1/lookup", body, msgpack=packed, deadline=deadline)
            return _decoded(LookupResponse.model_validate, answer, "lookup")
        answers = await self._every_shard(
            lambda c: c.request("POST", "/v1/lookup", body, msgpack=packed, deadline=deadline), all_needed=linearizable
        )
        parts = [_decoded(LookupResponse.model_validate, a, "lookup") for a in answers]
        holders = sorted((h for p in parts for h in p.holders), key=lambda h: -h.matched_blocks)
        return LookupResponse(num_blocks=parts[0].num_blocks, holders=holders)


def _decoded(decode: Callable[[Any], T], answer: Any, what: str) -> T:
    """`decode(answer)` of a replica's answer; MalformedAnswer when it is not what the protocol allows (a hostile or broken
    replica), which callers treat as any other replica failure instead of a crash of theirs."""
    try:
        return decode(answer)
    except ValidationError as exc:
        e = exc.errors()[0]
        where = ".".join(str(x) for x in e["loc"])
        raise MalformedAnswer(f"a replica's {what} does not follow the protocol: {where}: {e['msg']}") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise MalformedAnswer(f"a replica's {what} does not follow the protocol: {exc!r}") from exc


def _pack(values: Iterable[int], dtype: np.dtype, field: str) -> bytes:
    """`binary.pack`, its range error raised as the directory's answer to the same values in JSON would be."""
    try:
        return binary.pack(values, dtype, field)
    except ValueError as exc:
        raise InvalidRequestError(422, "invalid_request", str(exc)) from exc
