"""The vLLM connector's pure logic (adapters/vllm_connector.py), importable and testable without vLLM.

* **Which blocks to pull** (`blocks_to_pull`): only those the engine lacks locally, never the block
  holding the prompt's last token (vLLM always computes that token to sample from it).
* **Pull plans** (`plan_from_params`): the gateway's `PullPlan` inside a request's `kv_transfer_params`.
* **Regions** (`KvLayout`): how an engine's KV memory is described to the directory: per TP rank, one
  region per layer (`layer` set, block `b` of layer `l` at `base_addr + b * block_bytes`) and one *tag*
  region (`rkey` `TAG_RKEY`): 16 bytes per block, `(kvdir hash, generation)` little-endian u64. Ranks are
  mirrored (`mirrored`): the same block id on every rank, each rank's pages holding its share of the heads.
* **Stale-slot validation** (`check_tags`): a reader compares the tags it read before and after the
  pages; see the connector's docstring for why that makes a stale read impossible to miss.
* **Pull sources** (`pull_sources`): the directory's nodes an engine could read from, each with why its tenant
  rules it out for this engine, if it does (kvproto.pull_tenancy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec

from kvproto.pull_tenancy import tenancy_refusal
from kvproto.ranks import rank_sessions, tp_size
from kvproto.schemas import PULL_PLAN_FIELD, NodeInfo, PullPlan, Region

TAG_RKEY = "kvdir-tags"
"""The `rkey` of the region holding the per-block tags (the KV regions have rkey 0)."""
TAG_BYTES = 16  # (hash u64, generation u64)


class PlanError(ValueError):
    """A `kv_transfer_params` pull plan that is malformed (the request is then served without a pull)."""


def plan_from_params(params: Mapping[str, Any] | None) -> PullPlan | None:
    """The pull plan in a request's `kv_transfer_params` (under `PULL_PLAN_FIELD`), None if there is none."""
    if not params or PULL_PLAN_FIELD not in params:
        return None
    try:
        return msgspec.convert(params[PULL_PLAN_FIELD], PullPlan)
    except msgspec.ValidationError as exc:
        raise PlanError(f"{PULL_PLAN_FIELD}: {exc}") from exc


def blocks_to_pull(num_prompt_tokens: int, num_local_tokens: int, planned_blocks: int, block_size: int) -> tuple[int, int]:
    """(first block, count) to pull: the planned blocks past the local hit, short of the prompt's last token.

    `num_local_tokens` is the engine's local prefix-cache hit (whole blocks).
    """
    first = num_local_tokens // block_size
    last = min(planned_blocks, max(0, num_prompt_tokens - 1) // block_size)
    return first, max(0, last - first)


@dataclass(frozen=True, slots=True)
class LayerRegion:
    """One layer's KV pages: block `b` at `base + b * page_bytes`."""

    base: int
    page_bytes: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class KvLayout:
    """An engine's KV memory as the directory holds it: per-layer regions plus the tag region."""

    layers: tuple[LayerRegion, ...]
    tags_base: int

    @property
    def num_blocks(self) -> int:
        return min(r.num_blocks for r in self.layers)

    def regions(self, rank: int = 0, transfer_url: str | None = None, medium: str | None = None) -> list[Region]:
        """The regions of TP rank `rank`, read through `transfer_url` (None: the node's own), in `medium` (None:
        the device; "host": the rank's host tier, docs/protocol.md §2.3)."""
        out = [
            Region(
                rank=rank,
                base_addr=r.base,
                length=r.page_bytes * r.num_blocks,
                block_bytes=r.page_bytes,
                layer=i,
                transfer_url=transfer_url,
                medium=medium,
            )
            for i, r in enumerate(self.layers)
        ]
        out.append(
            Region(
                rank=rank,
                base_addr=self.tags_base,
                length=TAG_BYTES * self.num_blocks,
                block_bytes=TAG_BYTES,
                rkey=TAG_RKEY,
                transfer_url=transfer_url,
                medium=medium,
            )
        )
        return out

    @classmethod
    def from_regions(cls, regions: Sequence[Any], rank: int = 0, medium: str | None = None) -> KvLayout:
        """TP rank `rank`'s layout in `medium` as a peer registered it (`Region`s or the directory's
        `RegionInfo`s); PlanError if that rank has none there."""
        mine = [r for r in regions if r.rank == rank and r.medium == medium]
        layers = sorted((r for r in mine if r.layer is not None and r.rkey == 0), key=lambda r: r.layer)
        tags = [r for r in mine if r.rkey == TAG_RKEY]
        if not layers or len(tags) != 1 or [r.layer for r in layers] != list(range(len(layers))):
            raise PlanError(
                f"the source registered no kvdir connector layout for rank {rank}"
                f"{f' in {medium}' if medium else ''} (per-layer regions and a tag region)"
            )
        return cls(tuple(LayerRegion(r.base_addr, r.block_bytes, r.length // r.block_bytes) for r in layers), tags[0].base_addr)

    def compatible(self, other: KvLayout) -> str | None:
        """Why pages cannot be copied between the two layouts (layer count or page size differ), None if they can."""
        if len(self.layers) != len(other.layers):
            return f"{len(other.layers)} layers, not {len(self.layers)}"
        for i, (a, b) in enumerate(zip(self.layers, other.layers)):
            if a.page_bytes != b.page_bytes:
                return f"layer {i} pages of {b.page_bytes} B, not {a.page_bytes} B"
        return None


def rank_layouts(regions: Sequence[Any], medium: str | None = None) -> list[KvLayout]:
    """Every TP rank's layout in `medium` (None: the device), rank order (kvproto.ranks); PlanError if a rank has
    none there."""
    return [KvLayout.from_regions(regions, rank, medium) for rank in range(tp_size(regions))]


def host_layouts(regions: Sequence[Any]) -> list[KvLayout] | None:
    """Every TP rank's host-tier layout (docs/protocol.md §2.3), None for a source without a host tier."""
    if not any(r.medium == "host" for r in regions):
        return None
    return rank_layouts(regions, "host")


def mirrored(layouts: Sequence[KvLayout]) -> str | None:
    """Why these ranks' layouts are not one engine's mirrored TP layout (None if they are): every rank must have
    the same layers, page sizes and block count, as one block id locates a block on every rank."""
    first = layouts[0]
    for rank, other in enumerate(layouts[1:], 1):
        why = first.compatible(other)
        if why:
            return f"rank {rank} has {why}"
        if other.num_blocks != first.num_blocks:
            return f"rank {rank} has {other.num_blocks} blocks, rank 0 {first.num_blocks}"
    return None


class PullSource(NamedTuple):
    """A pull source as the directory lists it."""

    sessions: list[str | None]  # each TP rank's transfer session
    layouts: list[KvLayout]  # each TP rank's KV layout
    fingerprint: str | None  # its registered KV fingerprint
    host: list[KvLayout] | None  # each TP rank's host-tier layout (None: it has no host tier)
    refusal: str | None  # why this engine may not read it, by tenant (None: it may)


class Standing(NamedTuple):
    """An engine's own registration as far as pulls go: its tenant and whether it is shared."""

    tenant: str
    shared: bool


def standing(nodes: Sequence[NodeInfo], node_id: str) -> Standing | None:
    """`node_id`'s standing as `nodes` list it, None if they do not list it."""
    me = next((n for n in nodes if n.node_id == node_id), None)
    return None if me is None else Standing(me.tenant, me.shared)


def pull_sources(nodes: Sequence[NodeInfo], node_id: str, me: Standing | None) -> dict[tuple[str, int], PullSource]:
    """The connector engines among `nodes` by (node id, epoch), as the engine `node_id` of standing `me` may use them:
    each says whether its tenant rules it out for this engine (all are ruled out while `me` is unknown)."""
    out: dict[tuple[str, int], PullSource] = {}
    for n in nodes:
        if not n.transfer_url:
            continue
        try:
            layouts, host = rank_layouts(n.regions), host_layouts(n.regions)
        except PlanError:  # not a connector engine (a worker stub, an events-fed engine): never a source here
            continue
        if me is None:
            refusal: str | None = f"this engine ({node_id}) was never in the directory's node list: its tenant is unknown"
        else:
            refusal = tenancy_refusal(
                tenant=me.tenant, shared=me.shared, source=n.node_id, source_tenant=n.tenant, source_shared=n.shared
            )
        out[(n.node_id, n.epoch)] = PullSource(rank_sessions(n.regions, n.transfer_url), layouts, n.fingerprint, host, refusal)
    return out


def coalesce(local: Sequence[int], remote: Sequence[int], lengths: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """The same bytes in fewer pieces: a piece that continues the previous one on both sides joins it.

    A transfer engine's cost is mostly per piece (Mooncake over TCP: tens of microseconds each, measured),
    and an engine allocates runs of consecutive blocks, so a prefix's pages are often a few long runs.
    """
    out_l: list[int] = []
    out_r: list[int] = []
    out_n: list[int] = []
    for lo, re, n in zip(local, remote, lengths):
        if out_n and out_l[-1] + out_n[-1] == lo and out_r[-1] + out_n[-1] == re:
            out_n[-1] += n
        else:
            out_l.append(lo)
            out_r.append(re)
            out_n.append(n)
    return out_l, out_r, out_n


def page_pieces(
    mine: KvLayout, theirs: KvLayout, dst_blocks: Sequence[int], src_slots: Sequence[int]
) -> tuple[list[int], list[int], list[int]]:
    """(local, remote, lengths) of every layer's page of every block, coalesced: one batched read."""
    local, remote, lengths = [], [], []
    for a, b in zip(mine.layers, theirs.layers):
        for dst, src in zip(dst_blocks, src_slots):
            local.append(a.base + dst * a.page_bytes)
            remote.append(b.base + src * b.page_bytes)
            lengths.append(a.page_bytes)
    return coalesce(local, remote, lengths)


def check_tags(expected: Sequence[int], before: Sequence[tuple[int, int]], after: Sequence[tuple[int, int]]) -> list[int]:
    """Indices of the blocks whose pages are not known good: tag hash not the expected one, or the tag changed.

    A holder zeroes a block's hash and bumps its generation before it writes the block, and sets the hash
    once the block's KV is complete; so equal tags before and after the read, holding the expected hash,
    mean the pages read were that block's complete KV throughout.
    """
    return [i for i, (h, b, a) in enumerate(zip(expected, before, after)) if b[0] != h or a != b]


def complete_on_every_rank(complete: Sequence[tuple[int, int]], ranks: int) -> list[tuple[int, int]]:
    """The (block, hash) pairs that each of `ranks` TP ranks reported complete this step, in first-report order:
    only those hold the block's whole KV. A rank whose pull failed does not report the pulled blocks, so they
    are not published while vLLM recomputes them (no rank may be the only one holding a block)."""
    counts: dict[tuple[int, int], int] = {}
    for pair in complete:
        counts[pair] = counts.get(pair, 0) + 1
    return [pair for pair, n in counts.items() if n >= ranks]
