"""The gateway's GET /v1/models: the union of what the healthy engines list, asked again at most every few seconds.

A client polling /v1/models would otherwise fan out one request per engine per
poll; the merged list is kept for `ttl_s` and shared by every caller meanwhile.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable
from typing import Any

import httpx

from gateway.engine_registry import EngineRegistry, EngineState

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


class ModelsList:
    """The merged /v1/models of the registry's healthy engines, fetched when older than `ttl_s`.

    An engine that does not answer, or not with an OpenAI model list (an object whose `data` is a list),
    lists nothing this time; entries of its list that are not objects are skipped.
    """

    def __init__(self, registry: EngineRegistry, http: httpx.AsyncClient, ttl_s: float = MODELS_TTL_S) -> None:
        self.registry = registry
        self.http = http
        self.ttl_s = ttl_s
        self._fetched = -math.inf  # time.monotonic() of the last fetch
        self._data: list[Model] = []

    async def data(self) -> list[Model]:
        """The merged list, fetched anew when the last one is older than `ttl_s`."""
        if time.monotonic() - self._fetched > self.ttl_s:
            healthy = [e for e in self.registry.engines.values() if e.healthy]
            self._data = merge_models(await asyncio.gather(*(self._listed(e) for e in healthy)))
            self._fetched = time.monotonic()
        return self._data

    async def _listed(self, engine: EngineState) -> list[Model]:
        try:
            body = (await self.http.get(engine.origin.url("/v1/models"), timeout=MODELS_TIMEOUT_S)).json()
        except (httpx.HTTPError, ValueError):
            return []
        data = body.get("data") if isinstance(body, dict) else None
        return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []
