"""The directory's REST API (docs/protocol.md §3) on FastAPI.

Over 400 lines: one route per endpoint of docs/protocol.md §3, with the body decoding and error
mapping they share; the logic is in Replica and the state.

Every error is JSON `{"error": ..., "detail": ...}`: 400 malformed JSON or msgpack,
404 unknown node, 409 stale epoch or expired node (register again), 413 body
too large, 415 a Content-Type the route does not take, 422 invalid fields or
limits, 429 node limit, 503 not committed in time (retry: every write is
idempotent) or, for a local lookup, a replica without a leader or catching up
with it (try another), 507 index full. A 500 means a bug.
With `auth_tokens_file` set, 401 without a known bearer token and 403 for a
role, node or tenant the token may not use (directory.auth).

Entries are keyed per tenant (directory.tenancy): publish, remove and lookup
map their hashes to the tenant's keys here, before anything goes through Raft.
Those three also take binary batches (kvproto.binary), chosen by Content-Type.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import msgspec
import numpy as np
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from directory import watch
from directory.auth import PRINCIPAL, BearerAuth, Principal
from directory.changefeed import Compacted
from directory.config import DirectorySettings
from directory.metrics import DirectoryMetrics
from directory.replica import NodeView, Replica
from directory.tenancy import Tenancy
from kvproto import binary, shardmap, watch_codec
from kvproto import state as st
from kvproto.addresses import is_loopback, parse_hostport
from kvproto.binary import LookupBatch, PublishBatch, RemoveBatch
from kvproto.errors import CommitTimeout
from kvproto.hashing import KvIdentity, identity_hashes
from kvproto.http_limits import BodyLimit
from kvproto.offline_docs import add_offline_docs
from kvproto.rate_limit import TokenBuckets, retry_after
from kvproto.schemas import (
    MAX_LOAD_LABELS,
    ClearRequest,
    DeregisterResponse,
    ErrorResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    LookupRequest,
    LookupResponse,
    NodeInfo,
    NodesResponse,
    PublishRequest,
    PublishResponse,
    RegisterRequest,
    RegisterResponse,
    RemoveRequest,
    RemoveResponse,
    request_schemas,
)

log = logging.getLogger("kvdir.directory")

_STATUS = {
    st.STALE_EPOCH: 409,
    st.UNKNOWN_NODE: 409,
    st.NODE_LIMIT: 429,
    st.INDEX_FULL: 507,
    st.INVALID: 422,
    st.WRONG_SHARD: 409,
}
_ERRORS = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "body_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
}
_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 409, 410, 413, 415, 422, 429, 503, 507)
}


class ApiError(Exception):
    def __init__(self, status: int, error: str, detail: object = None, *, retry_after_s: float | None = None) -> None:
        self.status, self.error, self.detail = status, error, detail
        self.retry_after_s = retry_after_s  # sent as Retry-After (503s say 1 s without it)


def _error(status: int, error: str, detail: object = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": error, "detail": jsonable_encoder(detail)}, status_code=status, headers=headers)


async def _replica(request: Request) -> Replica:
    replica: Replica = request.app.state.replica
    return replica


async def _metrics(request: Request) -> DirectoryMetrics:
    metrics: DirectoryMetrics = request.app.state.metrics
    return metrics


async def _commit(replica: Replica, cmd: st.Command) -> st.Result:
    try:
        res = await replica.submit(cmd)
    except CommitTimeout as exc:
        raise ApiError(503, "commit_timeout", str(exc)) from exc
    if not res.ok:
        raise ApiError(_STATUS.get(res.status, 422), res.status, res.detail)
    return res


def _may_write(request: Request, node_id: str) -> None:
    """403 unless the request's token may write `node_id` (always allowed with auth off)."""
    if not request.app.state.auth:
        return
    principal: Principal | None = request.scope.get(PRINCIPAL)
    if principal is None or not principal.may_write(node_id):
        role = principal.role if principal is not None else "no"
        raise ApiError(403, "forbidden", f"this {role} token may not write node {node_id!r}")


def _may_append(request: Request) -> None:
    """429 once the request's token has used up its linearizable lookups (each appends a Raft entry); never
    for an admin's token, nor with auth off (anyone may write then anyway)."""
    buckets: TokenBuckets | None = request.app.state.linearizable_buckets
    principal: Principal | None = request.scope.get(PRINCIPAL)
    if buckets is None or principal is None or principal.role == "admin":
        return
    wait = buckets.take(principal.line)
    if wait > 0:
        raise ApiError(
            429,
            "rate_limited",
            f"this token's linearizable lookups are limited to {buckets.rate:g} per second on this replica "
            f"(--linearizable-lookups-per-s; each appends a Raft entry): retry in {wait:.2f}s, or look up locally",
            retry_after_s=wait,
        )


def _tenant(request: Request, requested: str | None) -> str:
    """The tenant a request acts in (a confined token's own when it names none); 403 for one its token may not use."""
    if not request.app.state.auth:
        return requested or ""
    principal: Principal | None = request.scope.get(PRINCIPAL)
    tenant = principal.tenant_for(requested) if principal is not None else None
    if tenant is None:
        confined = f"; it is confined to tenant {principal.tenant!r}" if principal is not None else ""
        raise ApiError(403, "forbidden", f"this token may not use tenant {requested!r}{confined}")
    return tenant


def _keys(request: Request, hashes: np.ndarray, tenant: str) -> np.ndarray:
    """The directory keys of a tenant's block hashes."""
    tenancy: Tenancy = request.app.state.tenancy
    return tenancy.keys(hashes, tenant)


def _check_count(n: int, limit: int, what: str) -> None:
    if n > limit:
        raise ApiError(
            422, "too_many", f"{n} {what.replace('_', ' ')} in one request; the limit is {limit} (KVDIR_MAX_{what.upper()})"
        )


BodyT = TypeVar("BodyT", bound=msgspec.Struct)


class Counted:
    """A bulk field of a request body and its limit, counted on the raw JSON before anything in it is decoded."""

    ARRAY, OBJECTS, MAPPING = "array", "objects", "mapping"

    def __init__(self, field: str, shape: str, limit: int, what: str) -> None:
        self.field, self.shape, self.limit, self.what = field, shape, limit, what

    def bound(self, raw: bytes) -> int:
        """At least the number of elements in `raw`, exact for a valid field. Every element of an array is
        followed by a comma but the last; every object element has a "{"; every entry of a mapping a ":".
        Counting more only refuses what the decoder would, since it stops at the first invalid element."""
        if self.shape == self.ARRAY:
            return raw.count(b",") + 1 if raw.startswith(b"[") else 0
        return raw.count(b"{" if self.shape == self.OBJECTS else b":")


# curl -d sends form-urlencoded unless told otherwise: taken as JSON, as before content types were checked.
_JSON_TYPES = frozenset({binary.JSON, "application/x-www-form-urlencoded"})


def _is_msgpack(request: Request, *, binary_ok: bool = True) -> bool:
    """Whether the body is a binary batch (Content-Type application/msgpack); JSON is the default, also
    without a Content-Type. 415 for any other type, or msgpack where a route takes JSON only."""
    ctype = request.headers.get("content-type")
    media = ctype.split(";", 1)[0].strip().lower() if ctype is not None else binary.JSON
    if media in _JSON_TYPES or media.endswith("+json"):
        return False
    if media == binary.MSGPACK and binary_ok:
        return True
    accepted = f"{binary.JSON} (the default) or {binary.MSGPACK}" if binary_ok else f"{binary.JSON} only"
    raise ApiError(415, "unsupported_media_type", f"Content-Type {ctype!r}: this route takes {accepted}")


async def _decode(request: Request, body_type: type[BodyT], *counted: Counted) -> BodyT:
    """The request's JSON body as `body_type`, its bulk fields refused (422 too_many) before they are decoded.

    Decoding costs about 2 ms per MiB here (msgspec: 8 MiB, 4 million hashes, in ~15 ms) and per-element
    validation runs on at most the limit's worth of elements, so no body, however large, holds the GIL
    long enough to starve the Raft thread into an election (pydantic took 3 s for 400,000 blocks).
    """
    _is_msgpack(request, binary_ok=False)
    body = await request.body()
    try:
        try:
            fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
        except msgspec.ValidationError:
            msgspec.json.decode(body, type=msgspec.Raw)  # not an object; but is it JSON at all (else 400)?
            raise
        for c in counted:
            raw = fields.get(c.field)
            if raw is not None:
                _check_count(c.bound(bytes(raw)), c.limit, c.what)
        return msgspec.json.decode(body, type=body_type)
    except msgspec.ValidationError as exc:
        raise ApiError(422, "invalid_request", f"{body_type.__name__}: {exc}") from exc
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ApiError(400, "invalid_json", f"the request body is not valid JSON: {exc}") from exc


async def _decode_batch(request: Request, body_type: type[BodyT]) -> BodyT:
    """The request's msgpack body as `body_type`: its packed arrays are bytes, counted by `_packed_count`."""
    body = await request.body()
    try:
        return msgspec.msgpack.decode(body, type=body_type)
    except msgspec.ValidationError as exc:
        raise ApiError(422, "invalid_request", f"{body_type.__name__}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ApiError(400, "invalid_msgpack", f"the request body is not valid msgpack: {exc}") from exc


def _packed_count(packed: bytes, dtype: np.dtype, field: str, limit: int, what: str) -> int:
    """How many values a packed array holds: 400 for a partial value, 422 too_many over `limit`."""
    try:
        n = binary.count(packed, dtype, field)
    except ValueError as exc:
        raise ApiError(400, "invalid_batch", str(exc)) from exc
    _check_count(n, limit, what)
    return n


def _u64(values: list[int], what: str) -> np.ndarray:
    try:
        return np.array(values, dtype=np.uint64)
    except OverflowError as exc:
        raise ApiError(422, "invalid_request", f"{what} must be unsigned 64-bit integers (0..2**64-1)") from exc


def _body_doc(body_type: type[msgspec.Struct]) -> dict[str, Any]:
    """The OpenAPI request body of a route that decodes `body_type` itself (see `_decode`)."""
    ref = {"$ref": f"#/components/schemas/{body_type.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


router = APIRouter(responses=_RESPONSES)


@router.post("/v1/nodes", response_model=RegisterResponse, openapi_extra=_body_doc(RegisterRequest))
async def register(request: Request, replica: Replica = Depends(_replica)) -> Any:
    limit = replica.settings.max_regions_per_node
    body = await _decode(request, RegisterRequest, Counted("regions", Counted.OBJECTS, limit, "regions_per_node"))
    _check_count(len(body.regions), limit, "regions_per_node")
    _may_write(request, body.node_id)
    profile, warnings = _profile(request, body)
    shard_index = await _shard_index(replica)
    if not await replica.has_room_for(body.node_id):
        # Refused here, before Raft: a flood of registrations over the limit must not fill the Raft log.
        # The state machine still enforces the limit on every replica (this replica's view may lag).
        raise ApiError(429, st.NODE_LIMIT, f"the directory holds its maximum of {replica.settings.max_nodes} nodes")
    cmd = st.Register(
        node_id=body.node_id,
        incarnation=body.incarnation or uuid.uuid4().hex,
        api_url=body.api_url,
        transfer_url=body.transfer_url,
        regions=tuple(msgspec.structs.asdict(r) for r in body.regions),
        capacity_blocks=body.capacity_blocks,
        block_size=body.block_size,
        epoch_base=st.new_epoch_base(secrets.randbits(st.EPOCH_RANDOM_BITS), shard_index),
        profile=profile,
    )
    res = await _commit(replica, cmd)
    log.info("node %s registered with epoch %d%s", body.node_id, res.value, f" ({'; '.join(warnings)})" if warnings else "")
    return JSONResponse(
        {"node_id": body.node_id, "epoch": res.value, "lease_ttl_s": replica.settings.lease_ttl_s, "warnings": warnings}
    )


def _profile(request: Request, body: RegisterRequest) -> tuple[st.NodeProfile, list[str]]:
    """The registration's profile (docs/protocol.md §2.1), its tenant decided by the token, and what it lacks.

    `shared` (every tenant's gateway routes to the engine) is for a token not confined to a tenant: 403 else.
    """
    tenant = _tenant(request, body.tenant)
    if body.shared and request.app.state.auth:
        principal: Principal | None = request.scope.get(PRINCIPAL)
        if principal is None or principal.tenant is not None:
            raise ApiError(403, "forbidden", "a token confined to a tenant may not register a shared engine")
    warnings = []
    if not body.models:
        warnings.append("no models: gateways learn what the engine serves from its /v1/models")
    if body.fingerprint is None:
        warnings.append("no fingerprint: the engine is never a pull source nor a pull destination")
    models = tuple(dict.fromkeys(body.models))
    return st.NodeProfile(models, body.fingerprint, tenant, body.shared), warnings


async def _shard_index(replica: Replica) -> int:
    """This group's index in its shard map (0 unsharded); 503 while a sharded group has not committed its map:
    it must not admit a node that the map homes elsewhere."""
    if replica.settings.shard_map is None:
        return 0
    committed = await replica.read(lambda s: s.shard_map)
    if committed is None:
        raise ApiError(503, "not_ready", "this shard has not committed its shard map yet: retry")
    names = committed.names
    return names.index(committed.shard) if committed.shard in names else 0


# `{node_id:path}`: a node id may hold "/" (schemas.NODE_ID_PATTERN), which a client sends percent-encoded
# (kvproto.client) and the server decodes before routing, so the id spans path segments.
@router.post("/v1/nodes/{node_id:path}/heartbeat", response_model=HeartbeatResponse, openapi_extra=_body_doc(HeartbeatRequest))
async def heartbeat(request: Request, node_id: str, replica: Replica = Depends(_replica)) -> Any:
    body = await _decode(request, HeartbeatRequest, Counted("load", Counted.MAPPING, MAX_LOAD_LABELS, "load_labels"))
    _may_write(request, node_id)
    res = await _commit(replica, st.Heartbeat(node_id, body.epoch, body.load))
    return JSONResponse({"node_id": node_id, "epoch": res.value})


@router.delete("/v1/nodes/{node_id:path}", response_model=DeregisterResponse)
async def deregister(
    request: Request,
    node_id: str,
    epoch: int | None = Query(
        None,
        ge=1,
        le=(1 << 63) - 1,
        description="the registration it ends: 409 if the node has registered again since; omitted: whatever is current",
    ),
    replica: Replica = Depends(_replica),
) -> Any:
    _may_write(request, node_id)
    try:
        res = await _commit(replica, st.Deregister(node_id, epoch))
    except ApiError as exc:
        if exc.error == st.UNKNOWN_NODE:
            raise ApiError(404, "not_found", exc.detail) from exc
        raise
    log.info("node %s deregistered, %d entries dropped", node_id, res.value)
    return JSONResponse({"node_id": node_id, "removed": res.value})


def _node_info(view: NodeView) -> dict[str, Any]:
    node = view.node
    return {
        "node_id": node.node_id,
        "epoch": node.epoch,
        "alive": True,
        "api_url": node.api_url,
        "transfer_url": node.transfer_url,
        "regions": list(node.regions),
        "capacity_blocks": node.capacity_blocks,
        "block_size": node.block_size,
        "blocks": view.blocks,
        "load": node.load,
        **_profile_info(node.profile),
    }


def _profile_info(p: st.NodeProfile | None) -> dict[str, Any]:
    if p is None:
        return {"models": [], "fingerprint": None, "tenant": "", "shared": False}
    return {"models": list(p.models), "fingerprint": p.fingerprint, "tenant": p.tenant, "shared": p.shared}


@router.get("/v1/nodes", response_model=NodesResponse)
async def nodes(replica: Replica = Depends(_replica)) -> Any:
    return JSONResponse({"nodes": [_node_info(v) for v in await replica.nodes()]})


@router.get("/v1/nodes/{node_id:path}", response_model=NodeInfo)
async def node(node_id: str, replica: Replica = Depends(_replica)) -> Any:
    view = await replica.node(node_id)
    if view is None:
        raise ApiError(404, "not_found", f"node {node_id!r} is not registered")
    return JSONResponse(_node_info(view))


@router.post("/v1/blocks", response_model=PublishResponse, openapi_extra=_body_doc(PublishRequest))
async def publish(request: Request, replica: Replica = Depends(_replica), metrics: DirectoryMetrics = Depends(_metrics)) -> Any:
    limit = replica.settings.max_blocks_per_publish
    body: PublishRequest | PublishBatch
    if _is_msgpack(request):
        body = await _decode_batch(request, PublishBatch)
        n = _packed_count(body.hashes, binary.U64, "hashes", limit, "blocks_per_publish")
        m = _packed_count(body.slots, binary.U32, "slots", limit, "blocks_per_publish")
        if m != n:
            raise ApiError(400, "invalid_batch", f"{n} hashes but {m} slots: give one slot per hash")
    else:
        body = await _decode(request, PublishRequest, Counted("blocks", Counted.OBJECTS, limit, "blocks_per_publish"))
        _check_count(len(body.blocks), limit, "blocks_per_publish")
    _may_write(request, body.node_id)
    tenant = _tenant(request, body.tenant)
    t0 = time.perf_counter()
    if isinstance(body, PublishBatch):
        hashes, slots = binary.unpack(body.hashes, binary.U64), binary.unpack(body.slots, binary.U32)
    else:
        hashes = _u64([b.hash for b in body.blocks], "block hashes")
        slots = np.fromiter((b.slot for b in body.blocks), dtype=np.uint32, count=len(body.blocks))
    keys = _keys(request, hashes, tenant)
    res = await _commit(replica, st.Publish(body.node_id, body.epoch, keys, slots, body.medium))
    metrics.write_seconds.labels("publish").observe(time.perf_counter() - t0)
    return JSONResponse({"node_id": body.node_id, "epoch": body.epoch, "stored": res.value})


@router.post("/v1/blocks/remove", response_model=RemoveResponse, openapi_extra=_body_doc(RemoveRequest))
async def remove(request: Request, replica: Replica = Depends(_replica), metrics: DirectoryMetrics = Depends(_metrics)) -> Any:
    limit = replica.settings.max_blocks_per_publish
    body: RemoveRequest | RemoveBatch
    if _is_msgpack(request):
        body = await _decode_batch(request, RemoveBatch)
        _packed_count(body.hashes, binary.U64, "hashes", limit, "blocks_per_publish")
    else:
        body = await _decode(request, RemoveRequest, Counted("hashes", Counted.ARRAY, limit, "blocks_per_publish"))
        _check_count(len(body.hashes), limit, "blocks_per_publish")
    _may_write(request, body.node_id)
    tenant = _tenant(request, body.tenant)
    t0 = time.perf_counter()
    hashes = binary.unpack(body.hashes, binary.U64) if isinstance(body, RemoveBatch) else _u64(body.hashes, "hashes")
    res = await _commit(replica, st.Remove(body.node_id, body.epoch, _keys(request, hashes, tenant)))
    metrics.write_seconds.labels("remove").observe(time.perf_counter() - t0)
    return JSONResponse({"node_id": body.node_id, "epoch": body.epoch, "removed": res.value})


@router.post("/v1/blocks/clear", response_model=RemoveResponse, openapi_extra=_body_doc(ClearRequest))
async def clear(request: Request, replica: Replica = Depends(_replica)) -> Any:
    body = await _decode(request, ClearRequest)
    _may_write(request, body.node_id)
    res = await _commit(replica, st.Clear(body.node_id, body.epoch))
    return JSONResponse({"node_id": body.node_id, "epoch": body.epoch, "removed": res.value})


def _accepts_msgpack(request: Request) -> bool:
    """Whether the client asked for a msgpack answer (`Accept: application/msgpack`); else JSON."""
    accept = request.headers.get("accept", "")
    return any(r.split(";", 1)[0].strip().lower() == binary.MSGPACK for r in accept.split(","))


@router.post("/v1/lookup", response_model=LookupResponse, openapi_extra=_body_doc(LookupRequest))
async def lookup(
    request: Request,
    consistency: str | None = Query(None, pattern="^(local|linearizable)$", description="overrides the body field"),
    replica: Replica = Depends(_replica),
    metrics: DirectoryMetrics = Depends(_metrics),
) -> Any:
    s = replica.settings
    limit = s.max_hashes_per_lookup
    body: LookupRequest | LookupBatch
    if _is_msgpack(request):
        body = await _decode_batch(request, LookupBatch)
    else:
        body = await _decode(
            request,
            LookupRequest,
            Counted("hashes", Counted.ARRAY, limit, "hashes_per_lookup"),
            Counted("tokens", Counted.ARRAY, s.max_tokens_per_lookup, "tokens_per_lookup"),
        )
    tenant = _tenant(request, body.tenant)
    if (body.hashes is None) == (body.tokens is None):
        raise ApiError(422, "invalid_request", "give exactly one of `hashes` or `tokens`")
    if body.tokens is not None:
        if isinstance(body.tokens, bytes):
            n = _packed_count(body.tokens, binary.U32, "tokens", s.max_tokens_per_lookup, "tokens_per_lookup")
            _check_count(n // body.block_size, limit, "hashes_per_lookup")
            tokens = binary.unpack(body.tokens, binary.U32)
        else:
            _check_count(len(body.tokens) // body.block_size, limit, "hashes_per_lookup")
            tokens = np.array(body.tokens, dtype=np.uint32)
        identity = KvIdentity(body.namespace, body.model, body.adapter, body.cache_salt)
        hashes = np.asarray(identity_hashes(tokens, identity, body.block_size), dtype=np.uint64)
    elif isinstance(body.hashes, bytes):
        _packed_count(body.hashes, binary.U64, "hashes", limit, "hashes_per_lookup")
        hashes = binary.unpack(body.hashes, binary.U64)
    else:
        assert body.hashes is not None
        _check_count(len(body.hashes), limit, "hashes_per_lookup")
        hashes = _u64(body.hashes, "hashes")
    keys = _keys(request, hashes, tenant)
    mode = consistency or body.consistency
    if mode == "linearizable":
        _may_append(request)
        await _commit(replica, st.Noop())
    elif not replica.has_leader:
        # Cut off from the leader (a partition, an election): this replica's view may be falling
        # behind, so refuse rather than serve it; clients try another replica. See "Staleness".
        raise ApiError(503, "no_leader", "this replica knows no leader: its entries may be stale; try another replica")
    elif not replica.caught_up:
        # It follows a leader but has not applied what that leader had committed (restarted, or just
        # resumed from a stall): refuse as well, until it has caught up.
        raise ApiError(
            503, "catching_up", "this replica is catching up with its leader: its entries may be stale; try another replica"
        )
    t0 = time.perf_counter()
    holders = await replica.lookup(keys, body.with_slots)
    metrics.lookup_seconds.observe(time.perf_counter() - t0)
    metrics.lookups.labels(mode).inc()
    out = [
        {
            "node_id": h.node_id,
            "epoch": h.epoch,
            "matched_blocks": h.matched,
            **({"slots": h.slots} if h.slots is not None else {}),
        }
        for h in holders
    ]
    answer = {"num_blocks": len(hashes), "holders": out}
    if _accepts_msgpack(request):
        return Response(msgspec.msgpack.encode(answer), media_type=binary.MSGPACK)
    return JSONResponse(answer)


@router.get(
    "/v1/watch",
    response_class=Response,
    responses={200: {"content": {watch_codec.MEDIA_TYPE: {}}, "description": "a stream of frames (docs/protocol.md §3.2)"}},
)
async def watch_changes(
    request: Request,
    from_: int | None = Query(None, alias="from", ge=0),
    group: int | None = Query(
        None,
        ge=1,
        le=watch_codec.MAX_INT,
        description="the group the consumer followed (a snapshot's or tick's `group`): 410 foreign_group for another's",
    ),
    replica: Replica = Depends(_replica),
) -> Response:
    """A snapshot and every committed change after it (or the changes after position `from`): directory.watch."""
    principal: Principal | None = request.scope.get(PRINCIPAL)
    if principal is not None and principal.tenant is not None:
        raise ApiError(
            403,
            "forbidden",
            f"a token confined to tenant {principal.tenant!r} may not follow the watch stream, which carries "
            "every tenant's entries: use POST /v1/lookup",
        )
    try:
        key = (
            f"token line {principal.line}"
            if principal is not None
            else f"address {request.client.host if request.client else '?'}"
        )
        return await watch.open_stream(replica, request.app.state.watchers, key, from_, group)
    except watch.TooManyWatchers as exc:
        raise ApiError(429, "too_many_watchers", str(exc), retry_after_s=5.0) from exc
    except watch.ForeignGroup as exc:
        raise ApiError(410, "foreign_group", f"{exc}: watch again without `from` for a snapshot") from exc
    except watch.FuturePosition as exc:
        raise ApiError(410, "future_position", f"{exc}: watch again without `from` for a snapshot, or name the group") from exc
    except Compacted as exc:
        raise ApiError(410, "compacted", f"{exc}: watch again without `from` for a snapshot") from exc


@router.get("/v1/shards")
async def shards(replica: Replica = Depends(_replica)) -> Any:
    """The shard map this group has committed and which shard it is; version 0 for a directory that is not sharded."""
    committed = await replica.read(lambda s: s.shard_map)
    if committed is None:
        if replica.settings.shard_map is not None:
            raise ApiError(503, "not_ready", "this shard has not committed its shard map yet: retry")
        return JSONResponse({"version": 0, "shard": None, "shards": {}, "nodes": {}})
    return JSONResponse({**json.loads(committed.document), "shard": committed.shard})


@router.put("/v1/shards")
async def change_shards(request: Request, replica: Replica = Depends(_replica)) -> Any:
    """Commit a newer shard map in this group (admin only): it drops the nodes the map homes elsewhere.

    Commit a change to the shards in `shardmap.apply_order` (`kvdir shards apply` does): shards that
    give nodes away before those that take them.
    """
    principal: Principal | None = request.scope.get(PRINCIPAL)
    if request.app.state.auth and (principal is None or principal.role != "admin"):
        raise ApiError(403, "forbidden", "only an admin token may change the shard map")
    committed = await replica.read(lambda s: s.shard_map)
    shard = committed.shard if committed is not None else replica.settings.shard
    if shard is None:
        raise ApiError(422, "not_sharded", "this directory is not sharded: start its replicas with --shard-map-file and --shard")
    try:
        new = shardmap.parse(await request.body())
    except shardmap.ShardMapError as exc:
        raise ApiError(422, "invalid_request", str(exc)) from exc
    if committed is not None and new.version <= committed.version:
        raise ApiError(409, "stale_map", f"shard map version {new.version} is not newer than this shard's ({committed.version})")
    res = await _commit(replica, st.AssignShards.of(new, shard))
    log.info("shard %s: shard map version %d committed, %d nodes dropped", shard, new.version, res.value)
    return JSONResponse({"shard": shard, "version": new.version, "dropped": res.value})


@router.get("/v1/cluster")
async def cluster(replica: Replica = Depends(_replica)) -> Any:
    status = replica.status()
    counts = await replica.counts()
    status["nodes"], status["entries"] = counts.nodes, counts.entries
    return JSONResponse(status)


@router.get("/v1/digest")
async def digest(replica: Replica = Depends(_replica)) -> Any:
    """A digest of nodes and entries, equal on replicas that applied the same commands."""
    d = await replica.digest()
    return JSONResponse({"digest": d.digest, "applied": d.applied, "entries": d.entries, "nodes": d.nodes})


@router.get("/healthz")
async def healthz() -> Any:
    return JSONResponse({"ok": True})


@router.get("/readyz")
async def readyz(replica: Replica = Depends(_replica)) -> Any:
    if not replica.ready:
        raise ApiError(503, "not_ready", "no Raft leader known yet, or not caught up with it")
    return JSONResponse({"ok": True, "leader": replica.status()["leader"]})


@router.get("/metrics")
async def metrics_endpoint(metrics: DirectoryMetrics = Depends(_metrics)) -> Response:
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def create_app(settings: DirectorySettings, replica_factory: Callable[[DirectorySettings], Replica] = Replica) -> FastAPI:
    """The ASGI app of one replica; the Raft node starts and stops with the app's lifespan."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        replica = replica_factory(settings)
        metrics = DirectoryMetrics(replica)
        await replica.start(on_commit=metrics.on_commit)
        app.state.replica, app.state.metrics = replica, metrics
        app.state.watchers = watch.Watchers(
            settings.watch_max_streams, settings.watch_max_streams_per_token, settings.watch_stall_s, metrics
        )
        log.info("replica %s serving %s (peers: %s)", settings.raft, settings.url, settings.peers or "none")
        try:
            yield
        finally:
            await replica.stop()

    app = FastAPI(title="kvdir directory", version="1", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.include_router(router)
    add_offline_docs(app)  # behind the bearer token with auth on, as the schema it renders (directory.auth)
    generate_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        # The request bodies are msgspec Structs that the routes decode themselves: add their schemas.
        schema = generate_openapi()
        schema.setdefault("components", {}).setdefault("schemas", {}).update(request_schemas())
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(
        BodyLimit,
        too_large=lambda limit: _error(413, "body_too_large", f"request bodies are limited to {limit} bytes"),
        limit=settings.max_body_bytes,
    )
    tokens = settings.auth_tokens
    app.state.auth = tokens is not None
    rate = settings.linearizable_lookups_per_s
    app.state.linearizable_buckets = TokenBuckets(rate, max(1.0, rate)) if tokens is not None and rate > 0 else None
    app.state.tenancy = settings.tenancy
    if tokens is not None:
        # Added last, so outermost: an unauthenticated request is refused before its body is read.
        app.add_middleware(BearerAuth, tokens=tokens)
        log.info("bearer-token auth on: %d tokens from %s", len(tokens), settings.auth_tokens_file)
    elif not is_loopback(parse_hostport(settings.http)[0]):
        log.warning("auth is off (no --auth-tokens-file) on %s: any client that reaches it may write", settings.http)
    if settings.tenant_secret_file is not None:
        log.info(
            "tenant keys from %s (fingerprint %s: equal on every replica)",
            settings.tenant_secret_file,
            settings.tenancy.fingerprint(),
        )

    def count(request: Request, error: str) -> None:
        m = getattr(request.app.state, "metrics", None)
        if m is not None:
            m.rejected.labels(error).inc()

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        count(request, exc.error)
        if exc.retry_after_s is not None:
            headers: dict[str, str] | None = {"Retry-After": retry_after(exc.retry_after_s)}
        else:
            headers = {"Retry-After": "1"} if exc.status == 503 else None
        return _error(exc.status, exc.error, exc.detail, headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            count(request, "invalid_json")
            return _error(400, "invalid_json", "the request body is not valid JSON")
        count(request, "invalid_request")
        detail = [{"loc": e.get("loc"), "msg": e.get("msg"), "type": e.get("type")} for e in errors[:20]]
        return _error(422, "invalid_request", detail)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = _ERRORS.get(exc.status_code, "http_error")
        count(request, error)
        return _error(exc.status_code, error, exc.detail)

    return app
