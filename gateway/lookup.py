"""Where a request's holders come from: the mirror, a replica, the stale mirror, or nowhere.

Apart from the proxy (gateway.proxy), which counts and logs each answer, so that `kvdir bench mirror`
can ask exactly what the gateway would have asked at each moment of a run with faults.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import NamedTuple

from gateway.mirror import Mirror
from kvproto.client import DirectoryClient
from kvproto.errors import DirectoryError
from kvproto.schemas import Holder


class Found(NamedTuple):
    holders: Sequence[Holder]
    source: str  # "mirror", "rest", "mirror_stale" or "none" (kvdir_gateway_lookups_total's label)
    cause: str | None = None  # why REST failed: "timeout" or "error"
    failure: str | None = None  # what REST answered, for the log line
    lag_s: float = 0.0  # how far behind the mirror was, for "mirror_stale"


class HolderLookup:
    """The mirror while it is fresh; else a replica over REST within `timeout_s`; else (an election, a
    partition, the directory down) the mirror while it is at most `stale_lag_s` behind; else none.

    A stale view beats none: its holders may have evicted what it lists (the engine then recomputes,
    and a pull from a fenced epoch is refused), but routing blind loses every cached prefix.
    """

    def __init__(self, directory: DirectoryClient, timeout_s: float, mirror: Mirror | None, stale_lag_s: float) -> None:
        self.directory = directory
        self.timeout_s = timeout_s
        self.mirror = mirror
        self.stale_lag_s = stale_lag_s

    async def __call__(self, hashes: list[int]) -> Found:
        mirror = self.mirror
        if mirror is not None and mirror.fresh() and (found := await mirror.lookup(hashes)) is not None:
            return Found(found, "mirror")
        try:
            res = await asyncio.wait_for(self.directory.lookup(hashes, with_slots=True), self.timeout_s)
        except TimeoutError:
            cause, failure = "timeout", f"no answer within --lookup-timeout-s {self.timeout_s:g} s"
        except DirectoryError as exc:  # its message can be empty (a bare timeout from the transport): name its type
            cause, failure = "error", f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        else:
            return Found(res.holders, "rest")
        if (
            mirror is not None
            and (lag := mirror.lag_s()) <= self.stale_lag_s
            and (found := await mirror.lookup(hashes)) is not None
        ):
            return Found(found, "mirror_stale", cause, failure, lag)
        return Found((), "none", cause, failure)
