"""Where a block lies on its node: the medium, part of a directory entry's *location* (docs/protocol.md §2.3).

A node may keep a block on its device (GPU memory: the engine uses it as is), in a registered host pool (a
host-to-device copy away) or on disk. An entry holds one location per (block, node): the slot within that
medium's regions, with the medium in the location's top two bits. A device location is its plain slot, so a
node without lower tiers publishes and reads exactly what it did before tiers existed, and the index, the
watch stream and the gateway's mirror carry locations as the u32 slots they always were.

Engines name media their own way (vLLM's KV events say "GPU" and "CPU"): `canonical` maps the names kvdir
accepts to one of `MEDIA`; the directory refuses any other (422), and the state machine, which must apply any
entry of its log, reads an unknown one (none can be committed since) as the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

MEDIA = ("device", "host", "disk")
DEVICE, HOST, DISK = 0, 1, 2
SHIFT = 30
SLOT_MASK = (1 << SHIFT) - 1
MAX_SLOTS = 1 << SHIFT
"""Slots per medium and node: a location keeps the slot in its low 30 bits."""

_ALIASES = {
    "device": DEVICE,
    "gpu": DEVICE,
    "cuda": DEVICE,
    "hbm": DEVICE,
    "host": HOST,
    "cpu": HOST,
    "cpu_pinned": HOST,
    "dram": HOST,
    "disk": DISK,
    "ssd": DISK,
    "nvme": DISK,
}
ACCEPTED = tuple(_ALIASES)


def code_of(label: str | None) -> int:
    """The medium code of a label (None: the device); ValueError for a label kvdir does not know."""
    if label is None:
        return DEVICE
    code = _ALIASES.get(label.lower())
    if code is None:
        raise ValueError(f"medium {label[:64]!r} is not one of {', '.join(ACCEPTED)} (case-insensitive)")
    return code


def applied_code(label: str | None) -> int:
    """`code_of` for the state machine: total and deterministic, an unknown label (in an old log) the device."""
    code = _ALIASES.get(label.lower()) if label is not None else DEVICE
    return DEVICE if code is None else code


def canonical(label: str | None) -> str | None:
    """The canonical name of a label, None for the device (what a publish of device blocks leaves out)."""
    return tier(code_of(label))


def lenient(label: str | None) -> str | None:
    """`canonical` for a label an engine sent, None (the device) for one kvdir does not know: what an adapter
    publishes, so that one engine's unusual name never gets a whole batch refused."""
    return tier(applied_code(label))


def tier(code: int) -> str | None:
    """The `medium` a region or a publish of medium `code` names: None for the device (its default)."""
    return None if code == DEVICE else MEDIA[code]


def location(slot: int, code: int) -> int:
    """The location of `slot` in medium `code`."""
    return (code << SHIFT) | slot


def locations(slots: np.ndarray, code: int) -> np.ndarray:
    """`location` over a uint32 array (the array itself for the device)."""
    if code == DEVICE:
        return slots
    return slots | np.uint32(code << SHIFT)


def split(loc: int) -> tuple[int, int]:
    """(medium code, slot) of a location."""
    return loc >> SHIFT, loc & SLOT_MASK


def medium_name(loc: int) -> str:
    """The medium of a location, by name."""
    return MEDIA[loc >> SHIFT]


class SizedRegion(Protocol):
    """What capacity reads of a region: a `kvproto.schemas.Region` (registered) or a listing's `RegionInfo`."""

    @property
    def length(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def medium(self) -> str | None: ...


def capacity(capacity_blocks: int | None, regions: Sequence[SizedRegion], code: int) -> int | None:
    """Slots a node has in medium `code`, from its registration: the device's `capacity_blocks`, a lower tier's
    from its regions (the fewest whole blocks any of them holds; the regions are read only for a lower tier, so a
    device publish costs nothing more). None: unchecked (a node that registered no regions at all: an events
    adapter, whose entries are metadata only); 0: none registered (a region of no bytes per block, which no API
    accepts but a hostile listing may carry, is none)."""
    if code == DEVICE:
        return capacity_blocks
    mine = [r for r in regions if r.medium == MEDIA[code] and r.block_bytes >= 1]
    if mine:
        return min(r.length // r.block_bytes for r in mine)
    return None if not regions else 0


def total_capacity(capacity_blocks: int | None, regions: Sequence[SizedRegion]) -> int | None:
    """Blocks a node can hold in all its media (`capacity` of each, a tier it registered none of counting 0);
    None while its device capacity is unknown."""
    if capacity_blocks is None:
        return None
    return capacity_blocks + sum(capacity(capacity_blocks, regions, code) or 0 for code in (HOST, DISK))


def out_of_range(slots: np.ndarray, code: int, capacity: int | None, node_id: str) -> str | None:
    """Why a publish of `slots` in medium `code` does not fit the node (None if it does)."""
    if len(slots) == 0:
        return None
    top = int(slots.max())
    if top >= MAX_SLOTS:
        return f"slot {top} out of range: a slot is below 2^{SHIFT} (docs/protocol.md §2.3)"
    if capacity is None or top < capacity:
        return None
    if capacity == 0:
        return f"node {node_id!r} registered no {MEDIA[code]} regions"
    return f"slot out of range: node {node_id!r} has {capacity} {MEDIA[code]} slots"
