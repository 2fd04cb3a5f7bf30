"""The routes of the directory's state as a whole (docs/protocol.md §3): the watch stream, the shard map, the
cluster's status and digest, health and metrics."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from directory import watch
from directory.access import get_metrics, get_replica
from directory.auth import PRINCIPAL, Principal
from directory.changefeed import Compacted
from directory.errors import RESPONSES, ApiError, commit
from directory.metrics import DirectoryMetrics
from directory.replica import Replica
from kvproto import codec, shardmap
from kvproto import state as st

log = logging.getLogger("kvdir.directory")

router = APIRouter(responses=RESPONSES)


@router.get(
    "/v1/watch",
    response_class=Response,
    responses={200: {"content": {codec.MEDIA_TYPE: {}}, "description": "a stream of frames (docs/protocol.md §3.2)"}},
)
async def watch_changes(
    request: Request,
    from_: int | None = Query(None, alias="from", ge=0),
    group: int | None = Query(
        None,
        ge=1,
        le=st.MAX_INT,
        description="the group the consumer followed (a snapshot's or tick's `group`): 410 foreign_group for another's",
    ),
    replica: Replica = Depends(get_replica),
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
async def shards(replica: Replica = Depends(get_replica)) -> Any:
    """The shard map this group has committed and which shard it is; version 0 for a directory that is not sharded."""
    committed = await replica.read(lambda s: s.shard_map)
    if committed is None:
        if replica.settings.shard_map is not None:
            raise ApiError(503, "not_ready", "this shard has not committed its shard map yet: retry")
        return JSONResponse({"version": 0, "shard": None, "shards": {}, "nodes": {}})
    return JSONResponse({**json.loads(committed.document), "shard": committed.shard})


@router.put("/v1/shards")
async def change_shards(request: Request, replica: Replica = Depends(get_replica)) -> Any:
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
    res = await commit(replica, st.AssignShards.of(new, shard))
    log.info("shard %s: shard map version %d committed, %d nodes dropped", shard, new.version, res.value)
    return JSONResponse({"shard": shard, "version": new.version, "dropped": res.value})


@router.get("/v1/cluster")
async def cluster(replica: Replica = Depends(get_replica)) -> Any:
    status = replica.status()
    counts = await replica.counts()
    status["nodes"], status["entries"] = counts.nodes, counts.entries
    return JSONResponse(status)


@router.get("/v1/digest")
async def digest(replica: Replica = Depends(get_replica)) -> Any:
    """A digest of nodes and entries, equal on replicas that applied the same commands."""
    d = await replica.digest()
    return JSONResponse({"digest": d.digest, "applied": d.applied, "entries": d.entries, "nodes": d.nodes})


@router.get("/healthz")
async def healthz() -> Any:
    return JSONResponse({"ok": True})


@router.get("/readyz")
async def readyz(replica: Replica = Depends(get_replica)) -> Any:
    if not replica.ready:
        raise ApiError(503, "not_ready", "no Raft leader known yet, or not caught up with it")
    return JSONResponse({"ok": True, "leader": replica.status()["leader"]})


@router.get("/metrics")
async def metrics_endpoint(metrics: DirectoryMetrics = Depends(get_metrics)) -> Response:
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
