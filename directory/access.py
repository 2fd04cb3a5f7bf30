"""What a directory route reaches and may do: the app's replica and metrics (FastAPI dependencies), and what
the request's token may write, look up and in which tenant (the tokens themselves are directory.auth's)."""

from __future__ import annotations

import numpy as np
from fastapi import Request

from directory.auth import PRINCIPAL, Principal
from directory.errors import ApiError
from directory.metrics import DirectoryMetrics
from directory.replica import Replica
from directory.tenancy import Tenancy
from kvproto import state as st
from kvproto.rate_limit import TokenBuckets


async def get_replica(request: Request) -> Replica:
    replica: Replica = request.app.state.replica
    return replica


async def get_metrics(request: Request) -> DirectoryMetrics:
    metrics: DirectoryMetrics = request.app.state.metrics
    return metrics


def may_write(request: Request, node_id: str) -> None:
    """403 unless the request's token may write `node_id` (always allowed with auth off)."""
    if not request.app.state.auth:
        return
    principal: Principal | None = request.scope.get(PRINCIPAL)
    if principal is None or not principal.may_write(node_id):
        role = principal.role if principal is not None else "no"
        raise ApiError(403, "forbidden", f"this {role} token may not write node {node_id!r}")


async def may_write_node(request: Request, replica: Replica, node_id: str) -> None:
    """`may_write`, and for a token confined to a tenant 403 when `node_id`'s current registration is another
    tenant's: a node belongs to the tenant that registered it, whatever the token patterns let overlap."""
    may_write(request, node_id)
    principal: Principal | None = request.scope.get(PRINCIPAL) if request.app.state.auth else None
    if principal is None or principal.tenant is None:
        return
    owner = await replica.read(lambda s: _owner(s, node_id))
    if owner is not None and owner != principal.tenant:
        raise ApiError(
            403, "forbidden", f"node {node_id!r} is registered by another tenant: this token is confined to {principal.tenant!r}"
        )


def _owner(state: st.DirectoryState, node_id: str) -> str | None:
    node = state.nodes.get(node_id)
    return None if node is None else st.tenant_of(node.profile)


def may_append(request: Request) -> None:
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


def tenant_of(request: Request, requested: str | None) -> str:
    """The tenant a request acts in (a confined token's own when it names none); 403 for one its token may not use."""
    if not request.app.state.auth:
        return requested or ""
    principal: Principal | None = request.scope.get(PRINCIPAL)
    tenant = principal.tenant_for(requested) if principal is not None else None
    if tenant is None:
        confined = f"; it is confined to tenant {principal.tenant!r}" if principal is not None else ""
        raise ApiError(403, "forbidden", f"this token may not use tenant {requested!r}{confined}")
    return tenant


def tenant_keys(request: Request, hashes: np.ndarray, tenant: str) -> np.ndarray:
    """The directory keys of a tenant's block hashes."""
    tenancy: Tenancy = request.app.state.tenancy
    return tenancy.keys(hashes, tenant)
