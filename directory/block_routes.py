"""The routes of block entries (docs/protocol.md §3): publish, remove, clear and look up.

Entries are keyed per tenant (directory.tenancy): these routes map their hashes to the tenant's keys
before anything goes through Raft.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from directory.access import get_metrics, get_replica, may_append, may_write_node, tenant_keys, tenant_of
from directory.config import DirectorySettings
from directory.decoding import (
    Counted,
    accepts_msgpack,
    body_doc,
    check_count,
    decode,
    decode_batch,
    is_msgpack,
    packed_count,
    u64,
)
from directory.errors import RESPONSES, ApiError, commit
from directory.metrics import DirectoryMetrics
from directory.replica import Replica
from kvproto import binary
from kvproto import state as st
from kvproto.binary import LookupBatch, PublishBatch, RemoveBatch
from kvproto.hashing import KvIdentity, identity_hashes
from kvproto.schemas import (
    ClearRequest,
    Holder,
    LookupRequest,
    LookupResponse,
    PublishRequest,
    PublishResponse,
    RemoveRequest,
    RemoveResponse,
)

router = APIRouter(responses=RESPONSES)


@router.post("/v1/blocks", response_model=PublishResponse, openapi_extra=body_doc(PublishRequest))
async def publish(
    request: Request, replica: Replica = Depends(get_replica), metrics: DirectoryMetrics = Depends(get_metrics)
) -> Any:
    limit = replica.settings.max_blocks_per_publish
    body: PublishRequest | PublishBatch
    if is_msgpack(request):
        body = await decode_batch(request, PublishBatch)
        n = packed_count(body.hashes, binary.U64, "hashes", limit, "blocks_per_publish")
        m = packed_count(body.slots, binary.U32, "slots", limit, "blocks_per_publish")
        if m != n:
            raise ApiError(400, "invalid_batch", f"{n} hashes but {m} slots: give one slot per hash")
    else:
        body = await decode(request, PublishRequest, Counted("blocks", Counted.OBJECTS, limit, "blocks_per_publish"))
        check_count(len(body.blocks), limit, "blocks_per_publish")
    await may_write_node(request, replica, body.node_id)
    tenant = tenant_of(request, body.tenant)
    t0 = time.perf_counter()
    if isinstance(body, PublishBatch):
        hashes, slots = binary.unpack(body.hashes, binary.U64), binary.unpack(body.slots, binary.U32)
    else:
        hashes = u64([b.hash for b in body.blocks], "block hashes")
        slots = np.fromiter((b.slot for b in body.blocks), dtype=np.uint32, count=len(body.blocks))
    keys = tenant_keys(request, hashes, tenant)
    res = await commit(replica, st.Publish(body.node_id, body.epoch, keys, slots, body.medium))
    metrics.write_seconds.labels("publish").observe(time.perf_counter() - t0)
    return JSONResponse({"node_id": body.node_id, "epoch": body.epoch, "stored": res.value})


@router.post("/v1/blocks/remove", response_model=RemoveResponse, openapi_extra=body_doc(RemoveRequest))
async def remove(
    request: Request, replica: Replica = Depends(get_replica), metrics: DirectoryMetrics = Depends(get_metrics)
) -> Any:
    limit = replica.settings.max_blocks_per_publish
    body: RemoveRequest | RemoveBatch
    if is_msgpack(request):
        body = await decode_batch(request, RemoveBatch)
        packed_count(body.hashes, binary.U64, "hashes", limit, "blocks_per_publish")
    else:
        body = await decode(request, RemoveRequest, Counted("hashes", Counted.ARRAY, limit, "blocks_per_publish"))
        check_count(len(body.hashes), limit, "blocks_per_publish")
    await may_write_node(request, replica, body.node_id)
    tenant = tenant_of(request, body.tenant)
    t0 = time.perf_counter()
    hashes = binary.unpack(body.hashes, binary.U64) if isinstance(body, RemoveBatch) else u64(body.hashes, "hashes")
    res = await commit(replica, st.Remove(body.node_id, body.epoch, tenant_keys(request, hashes, tenant)))
    metrics.write_seconds.labels("remove").observe(time.perf_counter() - t0)
    return JSONResponse({"node_id": body.node_id, "epoch": body.epoch, "removed": res.value})


@router.post("/v1/blocks/clear", response_model=RemoveResponse, openapi_extra=body_doc(ClearRequest))
async def clear(request: Request, replica: Replica = Depends(get_replica)) -> Any:
    body = await decode(request, ClearRequest)
    await may_write_node(request, replica, body.node_id)
    res = await commit(replica, st.Clear(body.node_id, body.epoch))
    return JSONResponse({"node_id": body.node_id, "epoch": body.epoch, "removed": res.value})


@router.post("/v1/lookup", response_model=LookupResponse, openapi_extra=body_doc(LookupRequest))
async def lookup(
    request: Request,
    consistency: str | None = Query(None, pattern="^(local|linearizable)$", description="overrides the body field"),
    replica: Replica = Depends(get_replica),
    metrics: DirectoryMetrics = Depends(get_metrics),
) -> Any:
    body = await _lookup_body(request, replica.settings)
    tenant = tenant_of(request, body.tenant)
    hashes = _lookup_hashes(body, replica.settings)
    keys = tenant_keys(request, hashes, tenant)
    mode = consistency or body.consistency
    await _may_read(request, replica, mode)
    t0 = time.perf_counter()
    holders = await replica.lookup(keys, body.with_slots)
    metrics.lookup_seconds.observe(time.perf_counter() - t0)
    metrics.lookups.labels(mode).inc()
    answer = {"num_blocks": len(hashes), "holders": [_holder(h) for h in holders]}
    if accepts_msgpack(request):
        return Response(msgspec.msgpack.encode(answer), media_type=binary.MSGPACK)
    return JSONResponse(answer)


async def _lookup_body(request: Request, s: DirectorySettings) -> LookupRequest | LookupBatch:
    """The lookup's body, JSON or msgpack, its bulk fields counted before they are decoded."""
    if is_msgpack(request):
        return await decode_batch(request, LookupBatch)
    return await decode(
        request,
        LookupRequest,
        Counted("hashes", Counted.ARRAY, s.max_hashes_per_lookup, "hashes_per_lookup"),
        Counted("tokens", Counted.ARRAY, s.max_tokens_per_lookup, "tokens_per_lookup"),
    )


def _lookup_hashes(body: LookupRequest | LookupBatch, s: DirectorySettings) -> np.ndarray:
    """The block hashes looked up: given, or hashed from the tokens given; 422 for neither or both, or over the limits."""
    limit = s.max_hashes_per_lookup
    if (body.hashes is None) == (body.tokens is None):
        raise ApiError(422, "invalid_request", "give exactly one of `hashes` or `tokens`")
    if body.tokens is not None:
        if isinstance(body.tokens, bytes):
            n = packed_count(body.tokens, binary.U32, "tokens", s.max_tokens_per_lookup, "tokens_per_lookup")
            check_count(n // body.block_size, limit, "hashes_per_lookup")
            tokens = binary.unpack(body.tokens, binary.U32)
        else:
            check_count(len(body.tokens) // body.block_size, limit, "hashes_per_lookup")
            tokens = np.array(body.tokens, dtype=np.uint32)
        identity = KvIdentity(body.namespace, body.model, body.adapter, body.cache_salt)
        return np.asarray(identity_hashes(tokens, identity, body.block_size), dtype=np.uint64)
    if isinstance(body.hashes, bytes):
        packed_count(body.hashes, binary.U64, "hashes", limit, "hashes_per_lookup")
        return binary.unpack(body.hashes, binary.U64)
    assert body.hashes is not None
    check_count(len(body.hashes), limit, "hashes_per_lookup")
    return u64(body.hashes, "hashes")


async def _may_read(request: Request, replica: Replica, mode: str) -> None:
    """Whether this replica may answer a lookup in `mode`: a linearizable one commits a no-op first (its token
    permitting), a local one is refused (503) by a replica that may be stale."""
    if mode == "linearizable":
        may_append(request)
        await commit(replica, st.Noop())
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


def _holder(h: Holder) -> dict[str, Any]:
    return {
        "node_id": h.node_id,
        "epoch": h.epoch,
        "matched_blocks": h.matched_blocks,
        **({"slots": h.slots} if h.slots is not None else {}),
    }
