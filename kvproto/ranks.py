"""Tensor-parallel ranks in a registration (docs/protocol.md §2.2): which regions, and which transfer session,
each rank of a node has.

A TP engine is one node to the directory: its scheduler allocates a block's slot once for every rank, so
one entry `(hash -> node, slot)` locates the block on all ranks (mirrored slots). Each rank keeps its share
of the KV heads in its own memory, behind its own transfer engine (one process per rank), so a region names
the session it is read through when that is not the node's `transfer_url`. A puller's rank `r` reads from
the holder's rank `r`; holder and puller must have the same rank count (their heads are sliced the same way).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class RankedRegion(Protocol):
    """What these functions read of a region: a `kvproto.schemas.Region` or a directory's `RegionInfo`."""

    @property
    def rank(self) -> int: ...

    @property
    def transfer_url(self) -> str | None: ...


def tp_size(regions: Sequence[RankedRegion]) -> int:
    """The node's tensor-parallel rank count: 1 + its highest region rank (1 for a node without regions)."""
    return 1 + max((r.rank for r in regions), default=0)


def rank_sessions(regions: Sequence[RankedRegion], transfer_url: str | None) -> list[str | None]:
    """Each rank's transfer session, rank order: its regions' `transfer_url`, else the node's."""
    out: list[str | None] = [transfer_url] * tp_size(regions)
    for r in regions:
        if r.transfer_url is not None:
            out[r.rank] = r.transfer_url
    return out


def check_ranks(regions: Sequence[RankedRegion]) -> str | None:
    """Why `regions` do not describe ranks 0..N-1 each behind one session (None if they do).

    Every rank below the highest must have regions (a puller's rank r reads the holder's rank r), and all of
    one rank's regions name the same session (one transfer engine per rank process).
    """
    ranks: dict[int, set[str | None]] = {}
    for r in regions:
        ranks.setdefault(r.rank, set()).add(r.transfer_url)
    if not ranks:
        return None
    missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
    if missing:
        return f"ranks {missing[:8]} have no regions, but rank {max(ranks)} does: ranks are 0..N-1"
    split = sorted(k for k, sessions in ranks.items() if len(sessions) > 1)
    if split:
        return f"rank {split[0]}'s regions name different transfer sessions: a rank has one"
    return None
