"""A cleanly stopped engine deregisters its node (issue #43): its entries go at once, not when its lease ends.

The directory here has a 60 s lease, so only the connector's own deregistration can remove the node within the
few seconds the test allows; the engine is this module's own (the conftest runs it before the session's two)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.wait import wait_for
from tests.vllm.conftest import Engine, running_directory, vllm_venv
from tests.vllm.test_connector import _node, _served


def test_a_cleanly_stopped_engine_is_gone_from_the_directory_at_once(
    model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    with running_directory(tmp_path_factory.mktemp("shutdown-directory"), lease_ttl_s=60.0) as directory:
        engine = Engine("stopping", vllm_venv(), model, directory.replica_urls, tmp_path_factory.mktemp("shutdown-engine"))
        try:
            engine.start()
            engine.wait_ready()
            wait_for(lambda: _node(directory, "stopping"), what="the engine registered", timeout=60)
            _served(engine, directory)  # it holds blocks: they must go with it
            t0 = time.monotonic()
            engine.stop()  # SIGTERM: vLLM shuts down, and with it the connector's scheduler half
            stopped_s = time.monotonic() - t0
            assert _node(directory, "stopping") is None, f"still listed {stopped_s:.1f} s after SIGTERM (lease 60 s)"
            assert stopped_s < 30
        finally:
            engine.stop()
