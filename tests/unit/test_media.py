"""Where a block lies (kvproto.media, docs/protocol.md §2.3): a location is the slot with its medium in the top
bits; the directory keeps one location per (block, node), checks each medium's slots against the regions the
node registered in it, and the wire schemas take engines' names for media."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from kvproto import media
from kvproto.binary import PublishBatch
from kvproto.codec import snapshot_of, state_from
from kvproto.schemas import PublishRequest, Region, RegionInfo, RegisterRequest
from kvproto.state import INVALID, DirectoryState, Publish, Register

HOST = media.location(0, media.HOST)


def _regions(host_blocks: int | None) -> tuple[Region, ...]:
    device = Region(rank=0, base_addr=0, length=64 * 8, block_bytes=64)
    if host_blocks is None:
        return (device,)
    return device, Region(rank=0, base_addr=4096, length=64 * host_blocks, block_bytes=64, medium="host")


def _state(host_blocks: int | None = 4) -> tuple[DirectoryState, int]:
    st = DirectoryState()
    r = st.apply(Register("a", "i1", "http://a", regions=_regions(host_blocks), capacity_blocks=8))
    return st, r.value


def _publish(st: DirectoryState, epoch: int, hashes: list[int], slots: list[int], medium: str | None = None):
    return st.apply(Publish("a", epoch, np.asarray(hashes, np.uint64), np.asarray(slots, np.uint32), medium))


def _slots(st: DirectoryState, hashes: list[int]) -> list[int] | None:
    [holder] = st.lookup(np.asarray(hashes, np.uint64), True)
    return holder.slots


@pytest.mark.parametrize(
    ("label", "code"),
    [(None, media.DEVICE), ("GPU", media.DEVICE), ("device", media.DEVICE), ("CPU", media.HOST), ("host", media.HOST)]
    + [("cpu_pinned", media.HOST), ("disk", media.DISK), ("NVMe", media.DISK)],
)
def test_engines_names_for_media_map_to_one_code(label: str | None, code: int) -> None:
    assert media.code_of(label) == media.applied_code(label) == code
    assert media.canonical(label) == (None if code == media.DEVICE else media.MEDIA[code])


def test_an_unknown_medium_is_refused_by_the_api_and_read_as_the_device_from_an_old_log() -> None:
    with pytest.raises(ValueError, match="'floppy' is not one of device"):
        media.code_of("floppy")
    assert media.applied_code("floppy") == media.DEVICE
    with pytest.raises(msgspec.ValidationError, match="floppy"):
        msgspec.convert({"node_id": "a", "epoch": 1, "blocks": [], "medium": "floppy"}, PublishRequest)
    with pytest.raises(msgspec.ValidationError, match="floppy"):
        msgspec.convert({"node_id": "a", "epoch": 1, "hashes": b"", "slots": b"", "medium": "floppy"}, PublishBatch)
    assert msgspec.convert({"node_id": "a", "epoch": 1, "blocks": [], "medium": "CPU"}, PublishRequest).medium == "host"
    assert msgspec.convert({"rank": 0, "base_addr": 0, "length": 8, "block_bytes": 8, "medium": "GPU"}, Region).medium is None


def test_a_slot_or_a_capacity_past_2_to_the_30_does_not_decode() -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"node_id": "a", "epoch": 1, "blocks": [{"hash": 1, "slot": 2**30}]}, PublishRequest)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"node_id": "a", "api_url": "http://a", "capacity_blocks": 2**30 + 1}, RegisterRequest)


def test_a_block_moves_between_media_keeping_one_location_per_node() -> None:
    st, e = _state()
    assert _publish(st, e, [1, 2], [5, 6]).ok
    assert _slots(st, [1, 2]) == [5, 6]  # device locations are plain slots
    assert _publish(st, e, [2], [3], "host").ok  # evicted to the host tier
    assert _slots(st, [1, 2]) == [5, media.location(3, media.HOST)]
    assert [media.split(loc) for loc in _slots(st, [1, 2]) or []] == [(media.DEVICE, 5), (media.HOST, 3)]
    assert _publish(st, e, [2], [7]).ok  # loaded back: the device wins
    assert _slots(st, [1, 2]) == [5, 7] and len(st.index) == 2


def test_each_medium_is_checked_against_the_regions_the_node_registered_there() -> None:
    st, e = _state(host_blocks=4)
    r = _publish(st, e, [1], [4], "host")
    assert r.status == INVALID and "has 4 host slots" in r.detail
    assert _publish(st, e, [1], [3], "host").ok
    r = _publish(st, e, [2], [8])
    assert r.status == INVALID and "has 8 device slots" in r.detail
    st, e = _state(host_blocks=None)
    r = _publish(st, e, [1], [0], "host")
    assert r.status == INVALID and "registered no host regions" in r.detail
    # A node with no regions at all (an events adapter: metadata only) may say any medium.
    st2 = DirectoryState()
    e2 = st2.apply(Register("b", "i1", "http://b")).value
    assert st2.apply(Publish("b", e2, np.asarray([1], np.uint64), np.asarray([9], np.uint32), "disk")).ok


def test_a_snapshot_carries_lower_tier_locations_and_refuses_one_past_its_medium() -> None:
    st, e = _state(host_blocks=4)
    assert _publish(st, e, [1], [2], "host").ok
    again = state_from(snapshot_of(st))
    assert _slots(again, [1]) == [media.location(2, media.HOST)]
    snap = snapshot_of(st)
    snap["slots"] = np.asarray([media.location(4, media.HOST)], "<u4").tobytes()
    with pytest.raises(ValueError, match="beyond its node's capacity in its medium"):
        state_from(snap)
    snap["slots"] = np.asarray([3 << media.SHIFT], "<u4").tobytes()
    with pytest.raises(ValueError, match="in no medium"):
        state_from(snap)


def test_an_adapter_publishes_an_engines_unknown_medium_as_the_device() -> None:
    assert (media.lenient("CPU"), media.lenient("GPU"), media.lenient("LocalDiskBackend"), media.lenient(None)) == (
        "host",
        None,
        None,
        None,
    )


def test_a_nodes_capacity_over_its_media_is_one_sum_whatever_carries_its_regions() -> None:
    """The directory (a registration's regions) and the gateway (the listing's records) count alike: the device's
    blocks, plus each lower tier's fewest whole blocks, disk included."""
    fields: list[dict[str, Any]] = [
        {"rank": 0, "base_addr": 0, "length": 8 << 20, "block_bytes": 1 << 20},
        {"rank": 0, "base_addr": 1 << 30, "length": 4 << 20, "block_bytes": 1 << 20, "medium": "host"},
        {"rank": 0, "base_addr": 2 << 30, "length": 16 << 20, "block_bytes": 1 << 20, "medium": "disk"},
    ]
    registered = [Region(**r) for r in fields]
    listed = [RegionInfo(**r) for r in fields]
    for carried in (registered, listed):
        assert [media.capacity(8, carried, code) for code in (media.DEVICE, media.HOST, media.DISK)] == [8, 4, 16]
        assert media.total_capacity(8, carried) == 28
        assert media.total_capacity(8, carried[:1]) == 8  # no lower tier registered
        assert media.total_capacity(None, carried) is None
