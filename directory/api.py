"""The directory's REST API (docs/protocol.md §3) on FastAPI.

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

The routes are in directory.node_routes, directory.block_routes and directory.cluster_routes; the body
decoding they share in directory.decoding, the error mapping in directory.errors and the token's rights in
directory.access. The logic is in Replica and the state.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import FastAPI

from directory import block_routes, cluster_routes, node_routes, watch
from directory.auth import BearerAuth
from directory.config import DirectorySettings
from directory.errors import add_error_handlers, error_response
from directory.metrics import DirectoryMetrics
from directory.node_list import NodeList
from directory.replica import Replica
from kvproto.addresses import is_loopback, parse_hostport
from kvproto.http_limits import BodyLimit
from kvproto.offline_docs import add_offline_docs
from kvproto.rate_limit import TokenBuckets
from kvproto.schemas import request_schemas

log = logging.getLogger("kvdir.directory")


def create_app(settings: DirectorySettings, replica_factory: Callable[[DirectorySettings], Replica] = Replica) -> FastAPI:
    """The ASGI app of one replica; the Raft node starts and stops with the app's lifespan."""
    app = FastAPI(
        title="kvdir directory", version="1", lifespan=_lifespan(settings, replica_factory), docs_url=None, redoc_url=None
    )
    for routes in (node_routes, block_routes, cluster_routes):
        app.include_router(routes.router)
    add_offline_docs(app)  # behind the bearer token with auth on, as the schema it renders (directory.auth)
    _document_request_bodies(app)
    app.add_middleware(
        BodyLimit,
        too_large=lambda limit: error_response(413, "body_too_large", f"request bodies are limited to {limit} bytes"),
        limit=settings.max_body_bytes,
    )
    _add_auth(app, settings)
    add_error_handlers(app)
    return app


def _lifespan(
    settings: DirectorySettings, replica_factory: Callable[[DirectorySettings], Replica]
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Start the replica, its metrics and its watchers with the app; stop the replica with it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        replica = replica_factory(settings)
        metrics = DirectoryMetrics(replica)
        await replica.start(on_commit=metrics.on_commit, tasks=metrics.tasks)
        app.state.replica, app.state.metrics = replica, metrics
        app.state.node_list = NodeList(replica)
        app.state.watchers = watch.Watchers(
            settings.watch_max_streams, settings.watch_max_streams_per_token, settings.watch_stall_s, metrics
        )
        log.info("replica %s serving %s (peers: %s)", settings.raft, settings.url, settings.peers or "none")
        try:
            yield
        finally:
            await replica.stop()

    return lifespan


def _document_request_bodies(app: FastAPI) -> None:
    """The request bodies are msgspec Structs that the routes decode themselves: add their schemas."""
    generate_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        schema = generate_openapi()
        schema.setdefault("components", {}).setdefault("schemas", {}).update(request_schemas())
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_auth(app: FastAPI, settings: DirectorySettings) -> None:
    """Bearer tokens (`auth_tokens_file`), the linearizable-lookup budget of each, and tenants' keys."""
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
