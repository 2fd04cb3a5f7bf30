"""Which engine may read KV from which, by tenant (docs/security.md, Tenants): the one rule that the gateway plans
pulls by and that the engines (the worker stub, the vLLM connector) check every plan against.

A pulled block is served from then on as if the engine had computed it, to whoever that engine serves, and only
its source vouches for its bytes (tags and pages validate against what the source itself serves). A shared engine
serves every tenant, so it reads only from shared sources (registered by a token of no tenant): a source a
tenant's token registered could otherwise plant crafted KV under another tenant's prompt. An engine of tenant T
serves T alone: it reads from T's sources and shared ones.
"""

from __future__ import annotations

__all__ = ["tenancy_refusal"]


def tenancy_refusal(*, tenant: str, shared: bool, source: str, source_tenant: str, source_shared: bool) -> str | None:
    """Why an engine of `tenant`, registered `shared` or not, must not read KV from `source` of `source_tenant`
    (registered `source_shared` or not); None: it may."""
    if source_shared:
        return None
    if shared:
        return f"source {source} is of tenant {source_tenant!r} and not shared: a shared engine reads only from shared ones"
    if source_tenant != tenant:
        return f"source {source} is of tenant {source_tenant!r}, this engine of {tenant!r}"
    return None
