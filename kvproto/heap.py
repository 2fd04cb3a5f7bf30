"""Keeping a server's long-lived objects out of the cyclic garbage collector's full passes.

A full (generation 2) collection walks every container object the process holds while the event
loop waits. A kvdir server holds a great many of them once started (modules, pydantic and
FastAPI models, numba's typing tables), nearly all alive until it exits, so full passes were the
better part of a gateway's p99 (BENCHMARKS.md, "Garbage-collection pauses", has the figures).
Frozen once startup is over, they are skipped; what requests create is collected as before.
"""

from __future__ import annotations

import gc
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)


def freeze_long_lived() -> int:
    """Collect what is garbage now, then move every object still alive out of the collector's reach;
    returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("%d objects alive after startup frozen out of the cyclic collector", frozen)
    return frozen


def frozen_after_startup(app: ASGIApp) -> ASGIApp:
    """`app`, with `freeze_long_lived` run once its lifespan startup is over, just before the server accepts
    requests: what startup built (a replica's Raft node, the index kernels, clients) is frozen with the rest."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            return await app(scope, receive, send)

        async def sending(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                freeze_long_lived()
            await send(message)

        await app(scope, receive, sending)

    return wrapped
