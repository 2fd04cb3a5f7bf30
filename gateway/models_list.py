"""The gateway's GET /v1/models: the union of what the healthy engines list, asked again at most every few seconds.

A client polling /v1/models would otherwise fan out one request per engine per
poll; the merged list is kept for `ttl_s` and shared by every caller meanwhile,
and callers that find it old together wait for one fan-out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Iterable
from typing import Any

import httpx

from gateway.engine_registry import EngineRegistry, EngineState

log = logging.getLogger("kvdir.gateway")

MODELS_TTL_S = 5.0
MODELS_TIMEOUT_S = 2.0

Model = dict[str, Any]  # one entry of an OpenAI model list, as an engine sent it


def merge_models(lists: Iterable[list[Model]]) -> list[Model]:
    """One entry per model id, the first engine's listing of it kept (in the order given); entries without an
    `id` count as one id of their own, so only the first of them is kept."""
    merged: dict[str | None, Model] = {}
    for data in lists:
        for m in data:
            merged.setdefault(m.get("id"), m)
    return list(merged.values())


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:32]} is beyond a double")
    return value


def strict_json(content: bytes) -> Any:
    """`content` as JSON, as the gateway can answer it again: NaN, Infinity and numbers beyond a double (which
    Python's parser takes and its encoder refuses) are a ValueError, and so is nesting past the parser's depth."""
    try:
        return json.loads(content, parse_constant=_not_json, parse_float=_finite)
    except RecursionError as exc:
        raise ValueError("nested deeper than the parser's limit") from exc


class ModelsList:
    """The merged /v1/models of the registry's healthy engines, fetched when older than `ttl_s`.

    An engine that does not answer lists nothing this time; one that answers something other than an OpenAI
    model list in plain JSON (an object whose `data` is a list; no NaN, Infinity or nesting past the parser's
    depth) lists nothing either, with one warning until it answers well again; entries of its list that are not
    objects are skipped.
    """

    def __init__(self, registry: EngineRegistry, http: httpx.AsyncClient, ttl_s: float = MODELS_TTL_S) -> None:
        self.registry = registry
        self.http = http
        self.ttl_s = ttl_s
        self._fetched = -math.inf  # time.monotonic() of the last fetch
        self._data: list[Model] = []
        self._fetch: asyncio.Future[list[Model]] | None = None  # the fan-out under way, shared by its callers
        self._malformed: set[str] = set()  # engines whose last listing was malformed (warned about once)

    async def data(self) -> list[Model]:
        """The merged list, fetched anew when the last one is older than `ttl_s` (once for all callers then)."""
        if time.monotonic() - self._fetched <= self.ttl_s:
            return self._data
        if self._fetch is None:
            self._fetch = asyncio.ensure_future(self._refetch())
        # A caller that goes away (a client disconnecting) leaves the fan-out to the others.
        return await asyncio.shield(self._fetch)

    async def _refetch(self) -> list[Model]:
        try:
            healthy = [e for e in self.registry.engines.values() if e.healthy]
            self._data = merge_models(await asyncio.gather(*(self._listed(e) for e in healthy)))
            self._fetched = time.monotonic()
            self._malformed &= self.registry.engines.keys()
            return self._data
        finally:
            self._fetch = None

    async def _listed(self, engine: EngineState) -> list[Model]:
        try:
            r = await self.http.get(engine.origin.url("/v1/models"), timeout=MODELS_TIMEOUT_S)
        except httpx.HTTPError:
            return []
        try:
            body = strict_json(r.content)
            data = body.get("data") if isinstance(body, dict) else None
            if not isinstance(data, list):
                raise ValueError("not an object with a `data` list")
        except ValueError as exc:
            if engine.node_id not in self._malformed:
                self._malformed.add(engine.node_id)
                log.warning("engine %s listed its models malformed (%s): none of them listed", engine.node_id, exc)
            return []
        self._malformed.discard(engine.node_id)
        return [m for m in data if isinstance(m, dict)]
