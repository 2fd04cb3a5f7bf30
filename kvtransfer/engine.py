"""What every transfer engine is: the `TransferEngine` protocol, its one error, and the checks of a read's batch
that the engines share (kvtransfer.backends picks an engine by name)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

DEFAULT_TIMEOUT_S = 10.0

LOGGER = "kvtransfer.backends"
"""The engines log under one name, the package's entry point, whichever module they live in."""


class TransferError(Exception):
    """A read did not complete: peer gone or stalled, range not registered, engine closed."""


@runtime_checkable
class TransferEngine(Protocol):
    """Moves KV bytes between processes: registers local memory, reads remote memory."""

    @property
    def session(self) -> str:
        """What peers pass as `peer` to `read` to reach this engine, e.g. "127.0.0.1:PORT"."""
        ...

    def register(self, addr: int, length: int) -> None:
        """Expose [addr, addr+length) of this process to peers' reads (addr = buffer address)."""
        ...

    def read(self, peer: str, local_addrs: list[int], remote_addrs: list[int], lengths: list[int]) -> None:
        """Copy peer's registered remote_addrs[i] .. +lengths[i] to local_addrs[i], for all i.

        Raises TransferError on any failure; then the destination holds unspecified bytes.
        """
        ...

    def close(self) -> None:
        """Stop serving and drop connections; idempotent."""
        ...


def check_batch(local_addrs: Sequence[int], remote_addrs: Sequence[int], lengths: Sequence[int]) -> None:
    """Caller bugs (mismatched lists, negative lengths) are ValueErrors, not transfer failures."""
    if not (len(local_addrs) == len(remote_addrs) == len(lengths)):
        raise ValueError(
            f"local_addrs, remote_addrs and lengths differ in size: {len(local_addrs)}, {len(remote_addrs)}, {len(lengths)}"
        )
    if any(n < 0 for n in lengths):
        raise ValueError("lengths must be >= 0")
