"""An engine endpoint (API origin, transfer session) belongs to one tenant in the state machine: refused to
another tenant's node, shared by one tenant's nodes (data-parallel ranks), released with its last node, and
rebuilt, never replicated, when a snapshot is loaded (a Raft snapshot or the watch stream's)."""

from __future__ import annotations

import pytest

from directory import errors, raft_transport
from kvproto import codec
from kvproto.schemas import Region, endpoint_key
from kvproto.state import (
    ENDPOINT_TAKEN,
    Deregister,
    DirectoryState,
    Expire,
    NodeProfile,
    Register,
)

API = "http://10.0.0.5:8000"


def reg(
    node_id: str,
    tenant: str,
    api_url: str = API,
    transfer_url: str | None = None,
    regions: tuple[dict[str, object], ...] = (),
    *,
    shared: bool = False,
    inc: str = "inc",
) -> Register:
    return Register(node_id, inc, api_url, transfer_url, regions, 64, 16, 1 << 31, NodeProfile((), "fp", tenant, shared))


def region(rank: int, session: str | None) -> Region:
    return Region(rank=rank, base_addr=4096, length=1 << 20, block_bytes=4096, rkey=0, transfer_url=session)


@pytest.mark.parametrize(
    "spelling",
    [API, "http://10.0.0.5:8000/", "HTTP://10.0.0.5:8000", "https://10.0.0.5:8000", "http://10.5:8000",
     "http://0x0a.0.0.5:8000", "http://[::ffff:10.0.0.5]:8000"],
)  # fmt: skip
def test_another_tenants_node_cannot_take_an_engines_origin(spelling: str) -> None:
    s = DirectoryState()
    assert s.apply(reg("acme-0", "acme")).ok
    res = s.apply(reg("bravo-0", "bravo", spelling))
    assert res.status == ENDPOINT_TAKEN and "another tenant" in res.detail and "acme" not in res.detail, res
    assert errors._STATUS[ENDPOINT_TAKEN] == 409
    assert list(s.nodes) == ["acme-0"]
    # Nor the shared tenant's, nor a shared node (it counts as its registrant's tenant).
    assert s.apply(reg("any-0", "", spelling, shared=True)).status == ENDPOINT_TAKEN


def test_one_tenants_nodes_share_an_origin_and_names_stay_apart() -> None:
    s = DirectoryState()
    for rank in range(3):  # data-parallel ranks behind one API server
        assert s.apply(reg(f"acme-{rank}", "acme")).ok
    assert s.endpoint_holders(endpoint_key(API)) == {"acme": {"acme-0", "acme-1", "acme-2"}}
    assert s.apply(reg("bravo-0", "bravo", "http://10.0.0.5:8001")).ok  # another port: another engine
    assert s.apply(reg("bravo-1", "bravo", "http://10.0.0.6:8000")).ok
    assert s.apply(reg("bravo-2", "bravo", "http://engine.example:8000")).ok  # names are not resolved


def test_transfer_sessions_belong_to_one_tenant() -> None:
    s = DirectoryState()
    assert s.apply(
        reg("acme-0", "acme", transfer_url="10.0.0.5:15000", regions=(region(0, None), region(1, "10.0.0.5:15001")))
    ).ok
    for transfer_url, regions in (
        ("10.0.0.5:15000", ()),
        ("tcp://10.0.0.5:15001", ()),
        ("10.0.0.9:15000", (region(0, None), region(1, "10.0.0.5:15000"))),
    ):
        res = s.apply(reg("bravo-0", "bravo", "http://10.0.0.9:8000", transfer_url, regions))
        assert res.status == ENDPOINT_TAKEN, (transfer_url, regions)
    # An API origin is an endpoint like a transfer session: one tenant's transfer port is not another's API.
    assert s.apply(reg("bravo-0", "bravo", "http://10.0.0.5:15000")).status == ENDPOINT_TAKEN
    assert s.apply(reg("acme-1", "acme", "http://10.0.0.7:8000", "10.0.0.5:15000")).ok


def test_an_endpoint_is_released_with_its_last_node() -> None:
    s = DirectoryState()
    assert s.apply(reg("acme-0", "acme")).ok and s.apply(reg("acme-1", "acme")).ok
    assert s.apply(Deregister("acme-0", None)).ok
    assert s.apply(reg("bravo-0", "bravo")).status == ENDPOINT_TAKEN  # acme-1 still holds it
    epoch = s.nodes["acme-1"].epoch
    assert s.apply(Expire("acme-1", epoch, s.nodes["acme-1"].seen)).value is True
    assert s.endpoint_holders(endpoint_key(API)) == {}
    assert s.apply(reg("bravo-0", "bravo")).ok
    # Re-registering elsewhere releases the old endpoint too.
    assert s.apply(reg("bravo-0", "bravo", "http://10.0.0.8:8000", inc="restart")).ok
    assert s.apply(reg("acme-2", "acme")).ok


def test_a_node_may_move_its_own_endpoint_to_another_tenant() -> None:
    """A re-registration (an unconfined token naming another tenant) is not refused by the node's own hold."""
    s = DirectoryState()
    assert s.apply(reg("n", "acme")).ok
    assert s.apply(reg("n", "bravo", inc="again")).ok
    assert s.endpoint_holders(endpoint_key(API)) == {"bravo": {"n"}}
    assert s.apply(reg("acme-0", "acme")).status == ENDPOINT_TAKEN


def _populated() -> DirectoryState:
    s = DirectoryState()
    assert s.apply(reg("acme-0", "acme", transfer_url="10.0.0.5:15000")).ok
    assert s.apply(reg("acme-1", "acme")).ok
    assert s.apply(reg("bravo-0", "bravo", "http://10.0.0.6:8000", regions=(region(0, "10.0.0.6:15000"),))).ok
    return s


def _holders(s: DirectoryState) -> dict[str, dict[str, set[str]]]:
    keys = ("10.0.0.5:8000", "10.0.0.5:15000", "10.0.0.6:8000", "10.0.0.6:15000")
    return {k: s.endpoint_holders(k) for k in keys}


def test_the_index_is_rebuilt_from_a_raft_snapshot_and_never_written() -> None:
    s = _populated()
    data = codec.encode_state(s)
    assert b"10.0.0.5:15000" in data and b"_endpoints" not in data  # the nodes' endpoints, not the derived index
    loaded = codec.decode_state(raft_transport.safe_loads(raft_transport.dumps(data)))  # as Raft carries it
    assert _holders(loaded) == _holders(s) and _holders(s)["10.0.0.5:8000"] == {"acme": {"acme-0", "acme-1"}}
    assert loaded.apply(reg("bravo-1", "bravo", transfer_url="10.0.0.5:15000")).status == ENDPOINT_TAKEN
    assert loaded.apply(reg("acme-2", "acme", "http://10.0.0.6:8000")).status == ENDPOINT_TAKEN


def test_the_index_is_rebuilt_from_a_watch_snapshot() -> None:
    s = _populated()
    mirror = codec.state_from(codec.snapshot_of(s))
    assert _holders(mirror) == _holders(s)
    # The mirror applies the next commands with the replicas' results.
    assert mirror.apply(reg("bravo-1", "bravo")).status == ENDPOINT_TAKEN == s.apply(reg("bravo-1", "bravo")).status
