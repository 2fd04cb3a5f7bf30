"""Moving KV-cache bytes between worker processes: the transfer engines, by name.

A worker that holds KV blocks *registers* the memory they live in; a worker
that wants them *reads* byte ranges of that memory straight into its own
buffers (one-sided: the holder's Python code is not involved per read). Two
engines implement the same small `TransferEngine` protocol (kvtransfer.engine):

* `MooncakeEngine` (kvtransfer.mooncake): the Mooncake Transfer Engine (TCP
  here, RDMA where the hardware exists) -- the one to use.
* `TcpEngine` (kvtransfer.tcp): a thin stdlib fallback with the same semantics,
  for machines where Mooncake cannot be installed, and as a second
  implementation that keeps the protocol honest.

Memory is named by integer addresses (``arr.ctypes.data`` of a numpy array);
the caller keeps every registered or destination buffer alive while an engine
may touch it. Every failure of a read surfaces as `TransferError`, within a
bounded time, never as a hang.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtransfer.engine import TransferEngine
from kvtransfer.mooncake import MooncakeEngine
from kvtransfer.tcp import TcpEngine

__all__ = ["ENGINES", "create_engine"]

ENGINES: dict[str, Callable[..., TransferEngine]] = {"mooncake": MooncakeEngine, "tcp": TcpEngine}


def create_engine(name: str, host: str, **options: Any) -> TransferEngine:
    """The engine called `name` on `host` (options, e.g. timeout_s, go to its constructor)."""
    try:
        factory = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown transfer engine {name!r}; valid: {', '.join(sorted(ENGINES))}") from None
    return factory(host, **options)
