"""The gateway's engine list keeps refreshing whatever a refresh raises (issue #29 item 7d)."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from gateway.engine_registry import EngineRegistry
from gateway.metrics import GatewayMetrics
from kvproto.client import DirectoryClient


def test_an_exception_in_a_refresh_does_not_end_the_refresh_loop(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = 0

    async def main() -> tuple[bool, float]:
        done = asyncio.Event()  # set by the fourth refresh: two failed, two went through

        async def refresh(self: EngineRegistry) -> None:
            nonlocal calls
            calls += 1
            if calls <= 2:
                raise RuntimeError(f"a bug in refresh {calls}")
            if calls >= 4:
                done.set()

        monkeypatch.setattr(EngineRegistry, "refresh", refresh)
        async with httpx.AsyncClient() as http:
            directory = DirectoryClient("http://127.0.0.1:1")
            reg = EngineRegistry(directory, http, [], refresh_s=0.01, unhealthy_s=1.0)
            metrics = GatewayMetrics(reg)
            reg.start(metrics.tasks.failed("engine_refresh"))
            try:
                await asyncio.wait_for(done.wait(), 10)
                assert reg._task is not None
                alive = not reg._task.done()
                counted = metrics.registry.get_sample_value("kvdir_gateway_task_failures_total", {"task": "engine_refresh"})
            finally:
                await reg.stop()
                await directory.aclose()
            assert counted is not None
            return alive, counted

    with caplog.at_level(logging.ERROR, logger="kvdir.gateway"):
        alive, counted = asyncio.run(main())
    assert counted == 2.0
    assert alive  # the loop survived both failures and went on refreshing
    logged = [r for r in caplog.records if "engine refresh failed" in r.getMessage()]
    assert len(logged) == 2 and all(r.exc_info for r in logged)  # with the traceback
