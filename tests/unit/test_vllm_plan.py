"""The vLLM connector's pure logic (adapters/vllm_plan.py): which blocks to pull, plans, layouts, tag validation."""

from __future__ import annotations

import pytest

from adapters.vllm_plan import (
    TAG_RKEY,
    KvLayout,
    LayerRegion,
    PlanError,
    blocks_to_pull,
    check_tags,
    coalesce,
    page_pieces,
    plan_from_params,
    pull_sources,
    standing,
)
from kvproto.schemas import NodeInfo, PullPlan, RegionInfo


@pytest.mark.parametrize(
    ("prompt", "local", "planned", "expected"),
    [
        (301, 0, 9, (0, 9)),  # 9 full blocks, the last token in the partial 10th
        (288, 0, 9, (0, 8)),  # the last token ends block 9: vLLM computes it, so block 9 is not pulled
        (301, 64, 9, (2, 7)),  # a local hit of two blocks: only the rest
        (301, 288, 9, (9, 0)),  # all local
        (301, 0, 3, (0, 3)),  # the plan covers less than the prompt
        (1, 0, 5, (0, 0)),
    ],
)
def test_blocks_to_pull_skip_local_hits_and_the_last_token(
    prompt: int, local: int, planned: int, expected: tuple[int, int]
) -> None:
    assert blocks_to_pull(prompt, local, planned, 32) == expected


def test_plans_come_from_kv_transfer_params() -> None:
    assert plan_from_params(None) is None
    assert plan_from_params({"other": 1}) is None
    plan = {"source_node": "a", "source_epoch": 7, "slots": [3, 4]}
    assert plan_from_params({"kvdir_pull": plan}) == PullPlan(source_node="a", source_epoch=7, slots=[3, 4])
    with pytest.raises(PlanError, match="kvdir_pull"):
        plan_from_params({"kvdir_pull": {**plan, "slots": [-1]}})


def test_a_layout_survives_the_directory_and_addresses_pages() -> None:
    mine = KvLayout((LayerRegion(1000, 8192, 10), LayerRegion(200_000, 8192, 10)), tags_base=5000)
    fields = ("rank", "base_addr", "length", "rkey", "block_bytes", "layer")
    regions = [RegionInfo(**{f: getattr(r, f) for f in fields}) for r in mine.regions()]
    assert [r.rkey for r in regions] == [0, 0, TAG_RKEY]
    theirs = KvLayout.from_regions(regions)
    assert theirs == mine and mine.compatible(theirs) is None
    local, remote, lengths = page_pieces(mine, theirs, dst_blocks=[1, 3], src_slots=[5, 6])
    assert local == [1000 + 8192, 1000 + 3 * 8192, 200_000 + 8192, 200_000 + 3 * 8192]
    assert remote == [1000 + 5 * 8192, 1000 + 6 * 8192, 200_000 + 5 * 8192, 200_000 + 6 * 8192]
    assert lengths == [8192] * 4
    # Consecutive on both sides: one piece per layer and run.
    assert page_pieces(mine, theirs, dst_blocks=[1, 2, 3, 7], src_slots=[5, 6, 7, 8]) == (
        [1000 + 8192, 1000 + 7 * 8192, 200_000 + 8192, 200_000 + 7 * 8192],
        [1000 + 5 * 8192, 1000 + 8 * 8192, 200_000 + 5 * 8192, 200_000 + 8 * 8192],
        [3 * 8192, 8192, 3 * 8192, 8192],
    )
    other = KvLayout((LayerRegion(0, 4096, 10),), tags_base=0)
    assert mine.compatible(other) == "1 layers, not 2"
    with pytest.raises(PlanError):
        KvLayout.from_regions(regions[:2])  # a worker stub's regions: no tags


def test_tags_must_hold_the_hash_and_not_change_during_the_read() -> None:
    before = [(11, 1), (12, 1), (13, 4), (0, 2)]
    after = [(11, 1), (12, 2), (13, 4), (0, 2)]  # block 1 was rewritten meanwhile
    assert check_tags([11, 12, 13, 14], before, after) == [1, 3]  # block 3 holds no (or another) hash


def test_pieces_join_only_when_both_sides_continue() -> None:
    assert coalesce([0, 16, 32, 64], [100, 116, 200, 216], [16, 16, 16, 16]) == ([0, 32, 64], [100, 200, 216], [32, 16, 16])
    assert coalesce([], [], []) == ([], [], [])


def _node(node_id: str, tenant: str = "", shared: bool = False, connector: bool = True) -> NodeInfo:
    """A registered node; `connector`: with a connector engine's layout (else a worker stub's one region)."""
    layout = KvLayout((LayerRegion(1000, 8192, 10),), tags_base=5000)
    fields = ("rank", "base_addr", "length", "rkey", "block_bytes", "layer")
    regions = [RegionInfo(**{f: getattr(r, f) for f in fields}) for r in layout.regions()]
    return NodeInfo(
        node_id=node_id,
        epoch=4,
        alive=True,
        api_url="http://127.0.0.1:9",
        transfer_url="127.0.0.1:2",
        regions=regions if connector else regions[:1],
        blocks=0,
        fingerprint="fp",
        tenant=tenant,
        shared=shared,
    )


def test_a_shared_engine_may_read_only_shared_sources_and_a_tenants_its_own_and_shared_ones() -> None:
    """A source a tenant's token registered can serve crafted pages whose tags validate: a shared engine, whose
    cache every tenant's requests hit, never reads one; an engine of a tenant reads no other tenant's."""
    nodes = [
        _node("shared-1", shared=True),
        _node("shared-2", shared=True),
        _node("bravo-1", tenant="bravo"),
        _node("bravo-2", tenant="bravo"),
        _node("acme-1", tenant="acme"),
        _node("plain-1"),
        _node("stub-1", connector=False),
    ]

    def readable(me: str) -> dict[str, str | None]:
        return {key[0]: source.refusal for key, source in pull_sources(nodes, me, standing(nodes, me)).items()}

    refused = readable("shared-1")
    assert set(refused) == {"shared-1", "shared-2", "bravo-1", "bravo-2", "acme-1", "plain-1"}  # not the stub
    assert [n for n, why in refused.items() if why is None] == ["shared-1", "shared-2"]
    assert refused["bravo-1"] == "source bravo-1 is of tenant 'bravo' and not shared: a shared engine reads only from shared ones"
    assert refused["plain-1"] is not None
    refused = readable("bravo-1")
    assert [n for n, why in refused.items() if why is None] == ["shared-1", "shared-2", "bravo-1", "bravo-2"]
    assert refused["acme-1"] == "source acme-1 is of tenant 'acme', this engine of 'bravo'"
    refused = readable("plain-1")
    assert [n for n, why in refused.items() if why is None] == ["shared-1", "shared-2", "plain-1"]
    # An engine never in the list reads from none: its tenant is unknown.
    assert standing(nodes, "gone-1") is None
    assert set(readable("gone-1").values()) == {
        "this engine (gone-1) was never in the directory's node list: its tenant is unknown"
    }
    # One the list lacks for a while (its lease lapsed; it registers again) reads by the standing it had.
    lapsed = [n for n in nodes if n.node_id != "bravo-1"]
    kept = pull_sources(lapsed, "bravo-1", standing(nodes, "bravo-1"))
    assert [key[0] for key, source in kept.items() if source.refusal is None] == ["shared-1", "shared-2", "bravo-2"]
    source = pull_sources(nodes, "bravo-1", standing(nodes, "bravo-1"))[("shared-1", 4)]
    assert (source.sessions, source.fingerprint, source.host) == (["127.0.0.1:2"], "fp", None)
    assert source.layouts == [KvLayout((LayerRegion(1000, 8192, 10),), tags_base=5000)]
