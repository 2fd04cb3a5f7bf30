"""What a registration's regions must satisfy to be stored (no sockets): a region lies below 2**64 and holds a
block; and one spelling per engine endpoint, which the state machine compares between tenants."""

from __future__ import annotations

import msgspec
import pytest

from kvproto.hashing import U64_MAX
from kvproto.schemas import Region, endpoint_key


@pytest.mark.parametrize(
    "fields,why",
    [
        ({"base_addr": U64_MAX, "length": 1, "block_bytes": 1}, "must be below 2\\*\\*64"),
        ({"base_addr": 1 << 63, "length": 1 << 63, "block_bytes": 1}, "must be below 2\\*\\*64"),
        ({"base_addr": 0, "length": 4096, "block_bytes": 8192}, "block_bytes \\(8192\\) must be at most length \\(4096\\)"),
        ({"base_addr": 0, "length": 0, "block_bytes": 1}, "must be at most length"),
    ],
)
def test_a_region_lies_in_the_address_space_and_holds_a_block(fields: dict[str, int], why: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=why):
        msgspec.convert({"rank": 0, **fields}, Region)


def test_regions_at_the_limits_are_accepted() -> None:
    assert msgspec.convert({"rank": 0, "base_addr": U64_MAX - 4096, "length": 4096, "block_bytes": 4096}, Region).length == 4096
    assert msgspec.convert({"rank": 0, "base_addr": 0, "length": U64_MAX, "block_bytes": 1}, Region).length == U64_MAX


@pytest.mark.parametrize(
    "spellings",
    [
        ["http://10.0.0.5:8000", "https://10.0.0.5:8000/", "HTTP://10.0.0.5:8000", "http://10.5:8000", "10.0.0.5:8000",
         "tcp://10.0.0.5:8000", "http://0x0a.0.0.5:8000", "http://[::ffff:10.0.0.5]:8000"],
        ["http://Engine.Example.:80", "http://engine.example", "engine.example:80"],
        ["http://[::1]:9", "[0:0::1]:9", "tcp://[::1]:9/"],
        ["Mooncake-Session", "mooncake-session"],
    ],
)  # fmt: skip
def test_an_endpoint_has_one_spelling(spellings: list[str]) -> None:
    assert len({endpoint_key(s) for s in spellings}) == 1, {s: endpoint_key(s) for s in spellings}


def test_different_endpoints_stay_apart() -> None:
    keys = ["http://10.0.0.5:8000", "http://10.0.0.5:8001", "http://10.0.0.6:8000", "http://engine:8000", "engine:8001"]
    assert len({endpoint_key(k) for k in keys}) == len(keys)
