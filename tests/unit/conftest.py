"""What makes a unit test a unit test: no network socket is bound or connected, and no process is started.

A test that needs either belongs in tests/integration (real processes, real sockets on 127.0.0.1); here it
fails at once with the call it made, so "unit" keeps meaning fast and isolated. Socket pairs (asyncio's
self-pipe) and Unix sockets stay allowed: they reach nothing outside the test.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

_NETWORK = (socket.AF_INET, socket.AF_INET6)


class UnitTestIsolation(AssertionError):
    """A unit test reached for the network or a process."""


def _guarded(name: str, real: Any) -> Any:
    def call(self: socket.socket, *args: Any, **kwargs: Any) -> Any:
        if self.family in _NETWORK:
            raise UnitTestIsolation(f"a unit test may not {name} a network socket ({args[:1]}): move it to tests/integration")
        return real(self, *args, **kwargs)

    return call


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("bind", "connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, name, _guarded(name, getattr(socket.socket, name)))

    def no_process(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
        raise UnitTestIsolation(f"a unit test may not start a process ({args[:1]}): move it to tests/integration")

    monkeypatch.setattr(subprocess.Popen, "__init__", no_process)
    yield
