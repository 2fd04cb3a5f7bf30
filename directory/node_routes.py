"""The routes of nodes (docs/protocol.md §3): registration, heartbeats, deregistration and the node list."""

from __future__ import annotations

import logging
import secrets
import uuid
from typing import Any

import msgspec
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from directory.access import get_replica, may_write_node, tenant_of
from directory.auth import PRINCIPAL, Principal
from directory.decoding import Counted, body_doc, check_count, decode
from directory.errors import RESPONSES, ApiError, commit
from directory.node_list import NodeList, view_of
from directory.replica import Replica
from kvproto import state as st
from kvproto.schemas import (
    EPOCH_MAX,
    MAX_LOAD_LABELS,
    DeregisterResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    NodeInfo,
    NodesResponse,
    RegisterRequest,
    RegisterResponse,
)

log = logging.getLogger("kvdir.directory")

router = APIRouter(responses=RESPONSES)


@router.post("/v1/nodes", response_model=RegisterResponse, openapi_extra=body_doc(RegisterRequest))
async def register(request: Request, replica: Replica = Depends(get_replica)) -> Any:
    limit = replica.settings.max_regions_per_node
    body = await decode(request, RegisterRequest, Counted("regions", Counted.OBJECTS, limit, "regions_per_node"))
    check_count(len(body.regions), limit, "regions_per_node")
    _check_size(body, replica)
    await may_write_node(request, replica, body.node_id)
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
        regions=tuple(body.regions),
        capacity_blocks=body.capacity_blocks,
        block_size=body.block_size,
        epoch_base=st.new_epoch_base(secrets.randbits(st.EPOCH_RANDOM_BITS), shard_index),
        profile=profile,
    )
    res = await commit(replica, cmd)
    log.info("node %s registered with epoch %d%s", body.node_id, res.value, f" ({'; '.join(warnings)})" if warnings else "")
    return JSONResponse(
        {"node_id": body.node_id, "epoch": res.value, "lease_ttl_s": replica.settings.lease_ttl_s, "warnings": warnings}
    )


def _check_size(body: RegisterRequest, replica: Replica) -> None:
    """422 for a registration over the size limits: every replica and gateway keeps it, and every node list
    carries it."""
    sessions = {body.transfer_url, *(r.transfer_url for r in body.regions)} - {None}
    check_count(len(sessions), replica.settings.max_transfer_urls_per_node, "transfer_urls_per_node")
    size, limit = len(msgspec.json.encode(body)), replica.settings.max_registration_bytes
    if size > limit:
        raise ApiError(
            422,
            "too_large",
            f"the registration takes {size} bytes; the limit is {limit} (--max-registration-bytes, KVDIR_MAX_REGISTRATION_BYTES)",
        )


def _profile(request: Request, body: RegisterRequest) -> tuple[st.NodeProfile, list[str]]:
    """The registration's profile (docs/protocol.md §2.1), its tenant decided by the token, and what it lacks.

    `shared` (every tenant's gateway routes to the engine) is for a token not confined to a tenant: 403 else.
    """
    tenant = tenant_of(request, body.tenant)
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
    return st.NodeProfile(models, body.fingerprint, tenant, body.shared, body.dp_rank), warnings


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
@router.post("/v1/nodes/{node_id:path}/heartbeat", response_model=HeartbeatResponse, openapi_extra=body_doc(HeartbeatRequest))
async def heartbeat(request: Request, node_id: str, replica: Replica = Depends(get_replica)) -> Any:
    body = await decode(request, HeartbeatRequest, Counted("load", Counted.MAPPING, MAX_LOAD_LABELS, "load_labels"))
    await may_write_node(request, replica, node_id)
    res = await commit(replica, st.Heartbeat(node_id, body.epoch, body.load))
    return JSONResponse({"node_id": node_id, "epoch": res.value})


@router.delete("/v1/nodes/{node_id:path}", response_model=DeregisterResponse)
async def deregister(
    request: Request,
    node_id: str,
    epoch: int | None = Query(
        None,
        ge=1,
        le=EPOCH_MAX,
        description="the registration it ends: 409 if the node has registered again since; omitted: whatever is current",
    ),
    replica: Replica = Depends(get_replica),
) -> Any:
    await may_write_node(request, replica, node_id)
    try:
        res = await commit(replica, st.Deregister(node_id, epoch))
    except ApiError as exc:
        if exc.error == st.UNKNOWN_NODE:
            raise ApiError(404, "not_found", exc.detail) from exc
        raise
    log.info("node %s deregistered, %d entries dropped", node_id, res.value)
    return JSONResponse({"node_id": node_id, "removed": res.value})


def _node_list(request: Request) -> NodeList:
    node_list: NodeList = request.app.state.node_list
    return node_list


_JSON = "application/json"


@router.get("/v1/nodes", response_model=NodesResponse, responses={304: {"description": "unchanged since the ETag given"}})
async def nodes(request: Request) -> Any:
    """Every node this token may see (docs/protocol.md §3); 304 to an `If-None-Match` of the current ETag."""
    etag, body = await _node_list(request).answer(view_of(request), request.headers.get("if-none-match"))
    if body is None:
        return Response(status_code=304, headers={"ETag": etag})
    return Response(body, media_type=_JSON, headers={"ETag": etag})


@router.get("/v1/nodes/{node_id:path}", response_model=NodeInfo)
async def node(request: Request, node_id: str) -> Any:
    body = await _node_list(request).one(view_of(request), node_id)
    if body is None:
        raise ApiError(404, "not_found", f"node {node_id!r} is not registered")
    return Response(body, media_type=_JSON)
