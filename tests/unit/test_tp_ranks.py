"""Tensor-parallel ranks in a registration (kvproto.ranks, docs/protocol.md §2.2) and the vLLM connector's pure
TP logic (adapters/vllm_plan.py): each rank's regions and session, mirrored layouts, and what a step's rank
reports add up to."""

from __future__ import annotations

import msgspec
import pytest

from adapters.vllm_plan import (
    TAG_RKEY,
    KvLayout,
    LayerRegion,
    PlanError,
    complete_on_every_rank,
    mirrored,
    rank_layouts,
)
from kvproto.ranks import check_ranks, rank_sessions, tp_size
from kvproto.schemas import RegionInfo, RegisterRequest


def region(rank: int, session: str | None = None, layer: int | None = None) -> RegionInfo:
    return RegionInfo(rank=rank, base_addr=4096 * (rank + 1), length=1 << 16, block_bytes=1024, layer=layer, transfer_url=session)


def test_a_node_without_regions_or_with_rank_0_only_is_tp_1() -> None:
    assert tp_size([]) == 1 and rank_sessions([], "s0") == ["s0"]
    assert tp_size([region(0), region(0)]) == 1 and check_ranks([region(0)]) is None


def test_each_rank_reads_through_its_own_session_else_the_nodes() -> None:
    regions = [region(0), region(1, "s1"), region(2, "s2"), region(3)]
    assert tp_size(regions) == 4
    assert rank_sessions(regions, "s0") == ["s0", "s1", "s2", "s0"]
    assert check_ranks(regions) is None


@pytest.mark.parametrize(
    ("regions", "why"),
    [
        ([region(0), region(2)], "ranks [1] have no regions"),
        ([region(1, "s1")], "ranks [0] have no regions"),
        ([region(0), region(1, "s1"), region(1, "other")], "rank 1's regions name different transfer sessions"),
        ([region(0), region(1, "s1"), region(1)], "rank 1's regions name different transfer sessions"),
    ],
)
def test_ranks_with_gaps_or_two_sessions_are_refused(regions: list[RegionInfo], why: str) -> None:
    assert why in (check_ranks(regions) or "")


def test_a_registration_with_inconsistent_ranks_does_not_decode() -> None:
    """Refused where every registration is decoded (the directory answers 422 with the reason)."""
    body = {
        "node_id": "n",
        "api_url": "http://127.0.0.1:1",
        "regions": [
            {"rank": 0, "base_addr": 0, "length": 64, "block_bytes": 64},
            {"rank": 2, "base_addr": 0, "length": 64, "block_bytes": 64},
        ],
    }
    with pytest.raises(msgspec.ValidationError, match=r"ranks are 0\.\.N-1"):
        msgspec.convert(body, RegisterRequest)
    body["regions"][1]["rank"] = 1  # type: ignore[index]
    body["regions"][1]["transfer_url"] = "127.0.0.1:2"  # type: ignore[index]
    got = msgspec.convert(body, RegisterRequest)
    assert rank_sessions(got.regions, "127.0.0.1:1") == ["127.0.0.1:1", "127.0.0.1:2"]


def _layout(base: int, pages: tuple[int, ...] = (512, 512), blocks: int = 8) -> KvLayout:
    return KvLayout(tuple(LayerRegion(base + i * 65536, p, blocks) for i, p in enumerate(pages)), base + 1_000_000)


def test_every_ranks_layout_round_trips_through_its_regions() -> None:
    layouts = [_layout(1 << 20), _layout(2 << 20), _layout(3 << 20)]
    regions = [r for rank, lay in enumerate(layouts) for r in lay.regions(rank, f"s{rank}" if rank else None)]
    assert all(r.transfer_url == (f"s{r.rank}" if r.rank else None) for r in regions)
    assert sum(r.rkey == TAG_RKEY for r in regions) == 3
    assert rank_layouts(regions) == layouts
    assert check_ranks(regions) is None and mirrored(layouts) is None
    with pytest.raises(PlanError, match="rank 1"):
        rank_layouts([r for r in regions if not (r.rank == 1 and r.rkey == TAG_RKEY)])


@pytest.mark.parametrize(
    ("other", "why"),
    [
        (_layout(2 << 20, pages=(512, 256)), "rank 1 has layer 1 pages of 256 B, not 512 B"),
        (_layout(2 << 20, pages=(512,)), "rank 1 has 1 layers, not 2"),
        (_layout(2 << 20, blocks=4), "rank 1 has 4 blocks, rank 0 8"),
    ],
)
def test_ranks_that_are_not_mirrored_are_named(other: KvLayout, why: str) -> None:
    assert mirrored([_layout(1 << 20), other]) == why


def test_a_block_is_complete_only_once_every_rank_reported_it() -> None:
    both = [(5, 50), (6, 60), (5, 50), (6, 60)]
    assert complete_on_every_rank(both, 2) == [(5, 50), (6, 60)]
    one_failed = [(5, 50), (6, 60), (5, 50)]  # rank 1's pull of block 6 failed: it did not report it
    assert complete_on_every_rank(one_failed, 2) == [(5, 50)]
    assert complete_on_every_rank(one_failed, 1) == [(5, 50), (6, 60)]
