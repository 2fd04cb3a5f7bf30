"""The transfer host a worker is given: a specific address, never the wildcard (no sockets; the listeners
themselves are tested in tests/integration/test_transfer_exposure.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from worker_stub.config import WorkerSettings


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]"])
def test_worker_refuses_a_wildcard_transfer_host(host: str) -> None:
    with pytest.raises(ValidationError, match="wildcard"):
        WorkerSettings(transfer_host=host)


@pytest.mark.parametrize("host", ["127.0.0.1", "10.1.2.3", "::1", "worker1-transfer"])
def test_worker_accepts_a_specific_transfer_host(host: str) -> None:
    assert WorkerSettings(transfer_host=host).transfer_host == host
