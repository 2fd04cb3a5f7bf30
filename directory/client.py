"""Async client of the directory for gateways, workers and adapters.

It knows every replica's URL. Reads go to the replica that last answered,
moving on when one is down. Writes may go to any replica (followers forward
to the Raft leader) and are retried with backoff on the next replica when a
replica is unreachable or answers 503: every write is idempotent, so a retry
after an unknown outcome is safe. 4xx answers are raised at once as
`RequestRejected` subclasses (see directory.errors). With `token`, every
request carries `Authorization: Bearer TOKEN` (the directory's auth_tokens_file).
With `tenant`, publishes, removals and lookups act in that tenant
(directory.tenancy); without it, in the token's tenant if it is confined to
one, else in the shared tenant "".

Publishes, removals and lookups go as binary batches (msgpack with packed
arrays, directory.binary: no JSON number per hash for either side to parse);
`binary=False` sends JSON as humans and older replicas read it. A value out
of range is refused before sending, as the directory would refuse it in JSON
(InvalidRequestError 422).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import httpx
import msgspec
import numpy as np
from pydantic import SecretStr

from directory import binary
from directory.binary import LookupBatch, PublishBatch, RemoveBatch
from directory.errors import DirectoryUnavailable, InvalidRequestError, rejection
from directory.schemas import Consistency, LookupResponse, NodeInfo, Region, RegisterResponse

_RETRY_STATUS = {502, 503, 504}


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
    ) -> None:
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

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> DirectoryClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def request(
        self, method: str, path: str, json: Any = None, *, msgpack: bytes | None = None, deadline: float | None = None
    ) -> Any:
        """Send `json` (or the msgpack body `msgpack`) to the preferred replica, failing over to the others
        until `deadline` seconds pass; returns the JSON answer."""
        headers = {"content-type": binary.MSGPACK} if msgpack is not None else None
        end = time.monotonic() + (self.deadline if deadline is None else deadline)
        delay = 0.02
        attempt = 0
        last: str = "no attempt"
        while True:
            i = (self._preferred + attempt) % len(self.urls)
            url = self.urls[i] + path
            try:
                resp = await self._http.request(method, url, json=json, content=msgpack, headers=headers)
            except httpx.TransportError as exc:
                last = f"{url}: {type(exc).__name__}: {exc}"
            else:
                if resp.status_code < 400:
                    self._preferred = i
                    return resp.json()
                if resp.status_code not in _RETRY_STATUS:
                    try:
                        body = resp.json()
                    except ValueError:
                        body = {"error": "http_error", "detail": resp.text[:500]}
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
        deadline: float | None = None,
    ) -> RegisterResponse:
        """Register (or re-register) a node; the same `incarnation` makes retries return the same epoch."""
        body = {
            "node_id": node_id,
            "api_url": api_url,
            "incarnation": incarnation or uuid.uuid4().hex,
            "transfer_url": transfer_url,
            "regions": [msgspec.to_builtins(r) if isinstance(r, Region) else dict(r) for r in regions],
            "capacity_blocks": capacity_blocks,
            "block_size": block_size,
        }
        return RegisterResponse.model_validate(await self.request("POST", "/v1/nodes", body, deadline=deadline))

    async def heartbeat(
        self, node_id: str, epoch: int, load: Mapping[str, float] | None = None, *, deadline: float | None = None
    ) -> None:
        body = {"epoch": epoch, "load": dict(load) if load else None}
        await self.request("POST", f"/v1/nodes/{node_id}/heartbeat", body, deadline=deadline)

    async def deregister(self, node_id: str, *, deadline: float | None = None) -> int:
        removed: int = (await self.request("DELETE", f"/v1/nodes/{node_id}", deadline=deadline))["removed"]
        return removed

    async def nodes(self, *, deadline: float | None = None) -> list[NodeInfo]:
        return [NodeInfo.model_validate(n) for n in (await self.request("GET", "/v1/nodes", deadline=deadline))["nodes"]]

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
            answer = await self.request("POST", "/v1/blocks", msgpack=msgspec.msgpack.encode(batch), deadline=deadline)
        else:
            body = {
                "node_id": node_id,
                "epoch": epoch,
                "blocks": [{"hash": h, "slot": s} for h, s in blocks],
                "medium": medium,
                **self._tenant,
            }
            answer = await self.request("POST", "/v1/blocks", body, deadline=deadline)
        stored: int = answer["stored"]
        return stored

    async def remove(self, node_id: str, epoch: int, hashes: Iterable[int], *, deadline: float | None = None) -> int:
        if self.binary:
            batch = RemoveBatch(
                node_id=node_id, epoch=epoch, hashes=_pack(hashes, binary.U64, "hashes"), tenant=self._tenant.get("tenant")
            )
            answer = await self.request("POST", "/v1/blocks/remove", msgpack=msgspec.msgpack.encode(batch), deadline=deadline)
        else:
            body = {"node_id": node_id, "epoch": epoch, "hashes": list(hashes), **self._tenant}
            answer = await self.request("POST", "/v1/blocks/remove", body, deadline=deadline)
        removed: int = answer["removed"]
        return removed

    async def clear(self, node_id: str, epoch: int, *, deadline: float | None = None) -> int:
        body = {"node_id": node_id, "epoch": epoch}
        removed: int = (await self.request("POST", "/v1/blocks/clear", body, deadline=deadline))["removed"]
        return removed

    async def lookup(
        self,
        hashes: Sequence[int] | None = None,
        *,
        tokens: Sequence[int] | None = None,
        namespace: str = "",
        block_size: int = 16,
        with_slots: bool = False,
        linearizable: bool = False,
        deadline: float | None = None,
    ) -> LookupResponse:
        """Holders of the longest prefix of `hashes` (or of `tokens`, hashed by the replica)."""
        consistency: Consistency = "linearizable" if linearizable else "local"
        if self.binary:
            batch = LookupBatch(
                hashes=_pack(hashes or (), binary.U64, "hashes") if tokens is None else None,
                tokens=_pack(tokens, binary.U32, "tokens") if tokens is not None else None,
                namespace=namespace,
                block_size=block_size,
                with_slots=with_slots,
                consistency=consistency,
                tenant=self._tenant.get("tenant"),
            )
            answer = await self.request("POST", "/v1/lookup", msgpack=msgspec.msgpack.encode(batch), deadline=deadline)
        else:
            body: dict[str, Any] = {"with_slots": with_slots, "consistency": consistency, **self._tenant}
            if tokens is not None:
                body.update(tokens=list(tokens), namespace=namespace, block_size=block_size)
            else:
                body["hashes"] = list(hashes or [])
            answer = await self.request("POST", "/v1/lookup", body, deadline=deadline)
        return LookupResponse.model_validate(answer)


def _pack(values: Iterable[int], dtype: np.dtype, field: str) -> bytes:
    """`binary.pack`, its range error raised as the directory's answer to the same values in JSON would be."""
    try:
        return binary.pack(values, dtype, field)
    except ValueError as exc:
        raise InvalidRequestError(422, "invalid_request", str(exc)) from exc
