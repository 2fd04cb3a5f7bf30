"""Node profiles (docs/protocol.md §2.1) in the replicated state: applied with a registration, carried by the
watch stream's frames and snapshots, pickled into Raft entries and snapshots, and read back from entries and
snapshots written before profiles existed."""

from __future__ import annotations

import copyreg
import io
import pickle
from dataclasses import fields
from typing import Any

import numpy as np
import pytest

from directory.raft_transport import PICKLE_PROTOCOL, safe_loads, write_wire_names
from kvproto.state import OK, DirectoryState, Node, NodeProfile, Publish, Register, command_size
from kvproto.watch_codec import (
    FrameReader,
    WireError,
    batch_frame,
    decode_command,
    encode_command,
    frame,
    snapshot_message,
    snapshot_of,
    state_from,
)

PROFILE = NodeProfile(("Qwen/Qwen3-8B", "ü-lora"), "fp-0123abcd", "acme", False)
SHARED = NodeProfile(("m",), None, "", True)
DP_RANK = NodeProfile(("m",), "fp", "", False, 3)
REGION = {"rank": 0, "base_addr": 4096, "length": 1 << 20, "block_bytes": 512, "rkey": 7}


def register(node_id: str = "worker-1", inc: str = "inc-1", profile: NodeProfile | None = PROFILE) -> Register:
    # Each node its own engine: an endpoint is one tenant's (DirectoryState refuses another tenant's node on it).
    return Register(node_id, inc, f"http://{node_id}:9", f"tcp://{node_id}:10", (REGION,), 64, 16, 1 << 31, profile)


def _through_frames(cmd: Register) -> Register:
    (f,) = FrameReader().feed(batch_frame(1, [cmd]))
    (encoded,) = f["commands"]
    out = decode_command(encoded)
    assert isinstance(out, Register)
    return out


# -- the watch stream ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "profile", [PROFILE, SHARED, DP_RANK, NodeProfile(), None], ids=["tenant", "shared", "dp-rank", "empty", "none"]
)
def test_register_round_trips_through_a_watch_frame(profile: NodeProfile | None) -> None:
    cmd = register(profile=profile)
    encoded = encode_command(cmd)
    assert encoded[0] == "G" and len(encoded) == 10
    assert encoded[9] == (
        None if profile is None else [list(profile.models), profile.fingerprint, profile.tenant, profile.shared, profile.dp_rank]
    )
    got = _through_frames(cmd)
    assert got == cmd
    assert got.profile == profile
    if got.profile is not None:
        assert type(got.profile.models) is tuple  # msgpack's lists come back as the dataclass's tuples


def test_a_profile_of_a_replica_of_before_dp_ranks_decodes_without_one() -> None:
    """A profile of four fields, as a replica of before DP ranks sends it, in a command and in a snapshot."""
    encoded = encode_command(register(profile=PROFILE))
    encoded[9] = encoded[9][:4]
    got = decode_command(encoded)
    assert isinstance(got, Register) and got.profile == PROFILE and got.profile.dp_rank is None
    snap = snapshot_of(_state_with_profiles())
    snap["nodes"][0][11] = snap["nodes"][0][11][:4]
    assert state_from(snap).nodes["worker-1"].profile == PROFILE


def test_an_old_profile_pickle_loads_without_a_dp_rank() -> None:
    """A profile's pickled state as the class of before DP ranks wrote it: four values."""
    p = object.__new__(NodeProfile)
    p.__setstate__([("m",), "fp", "t", True])
    assert p == NodeProfile(("m",), "fp", "t", True) and p.dp_rank is None
    for got in _loads_both(pickle.dumps(DP_RANK, PICKLE_PROTOCOL)):
        assert got == DP_RANK


def test_a_register_frame_of_an_older_replica_decodes_without_a_profile() -> None:
    """A "G" command with eight fields, as a replica of before profiles sends it."""
    old = encode_command(register(profile=None))[:9]
    assert len(old) == 9  # the tag and eight fields
    blob = frame({"k": "batch", "position": 1, "commands": [old]})
    (f,) = FrameReader().feed(blob)
    got = decode_command(f["commands"][0])
    assert got == register(profile=None)
    assert isinstance(got, Register) and got.profile is None


@pytest.mark.parametrize(
    "bad",
    [
        [1, 2],
        "x",
        [["m"], None, "t"],
        [5, None, "", False],
        [["m"], None, "", False, "1"],
        [["m"], None, "", False, -1],
        [["m"], None, "", False, 1, 2],
    ],
)
def test_a_malformed_profile_in_a_frame_is_a_wire_error(bad: object) -> None:
    encoded = [*encode_command(register(profile=None))[:9], bad]
    with pytest.raises(WireError, match="malformed command"):
        decode_command(encoded)
    snap = snapshot_of(_state_with_profiles())
    snap["nodes"][0][11] = bad
    with pytest.raises(WireError, match="malformed snapshot"):
        state_from(snap)


def _state_with_profiles() -> DirectoryState:
    s = DirectoryState()
    assert s.apply(register("worker-1", profile=PROFILE)).status == OK
    assert s.apply(register("worker-2", profile=SHARED)).status == OK
    assert s.apply(register("worker-3", profile=None)).status == OK
    epoch = s.nodes["worker-1"].epoch
    hashes = np.asarray([1, 2, 3], dtype=np.uint64)
    assert s.apply(Publish("worker-1", epoch, hashes, np.asarray([0, 1, 2], dtype=np.uint32))).status == OK
    return s


def test_a_snapshot_keeps_the_profiles() -> None:
    s = _state_with_profiles()
    (f,) = FrameReader().feed(frame(snapshot_message(snapshot_of(s))))
    mirror = state_from(f["state"])
    assert mirror.digest() == s.digest()
    assert {n: x.profile for n, x in mirror.nodes.items()} == {
        "worker-1": PROFILE,
        "worker-2": SHARED,
        "worker-3": None,
    }
    # The mirror goes on applying the stream's registrations like the replica.
    cmd = register("worker-4", profile=NodeProfile(("x",), "fp", "bravo", False))
    assert mirror.apply(_through_frames(cmd)) == s.apply(cmd)
    assert mirror.nodes["worker-4"].profile == s.nodes["worker-4"].profile == cmd.profile


def test_a_snapshot_of_an_older_replica_has_nodes_without_profiles() -> None:
    """Snapshot node rows of eleven fields, as a replica of before profiles sends them."""
    snap = snapshot_of(_state_with_profiles())
    snap["nodes"] = [row[:11] for row in snap["nodes"]]
    (f,) = FrameReader().feed(frame(snapshot_message(snap)))
    mirror = state_from(f["state"])
    assert {n: x.profile for n, x in mirror.nodes.items()} == {"worker-1": None, "worker-2": None, "worker-3": None}
    assert mirror.lookup(np.asarray([1, 2, 3], dtype=np.uint64))[0].matched_blocks == 3


# -- pickles: Raft entries and snapshots --------------------------------------------------------------


@pytest.fixture(autouse=True)
def _as_a_replica_pickles() -> None:
    write_wire_names()  # idempotent and process-wide, as in every replica


def _loads_both(data: bytes) -> list[Any]:
    """Unpickled by plain pickle and by the replicas' guarded unpickler."""
    return [pickle.loads(data), safe_loads(data)]


@pytest.mark.parametrize("profile", [PROFILE, SHARED, None], ids=["tenant", "shared", "none"])
def test_register_pickle_round_trip(profile: NodeProfile | None) -> None:
    cmd = register(profile=profile)
    for got in _loads_both(pickle.dumps(cmd, PICKLE_PROTOCOL)):
        assert got == cmd and got.profile == profile


def test_state_pickle_round_trip_keeps_profiles() -> None:
    s = _state_with_profiles()
    for clone in _loads_both(pickle.dumps(s, PICKLE_PROTOCOL)):
        assert clone.digest() == s.digest()
        assert {n: x.profile for n, x in clone.nodes.items()} == {n: x.profile for n, x in s.nodes.items()}
        assert clone.nodes["worker-1"].profile == PROFILE
        # The clone goes on like the original: a re-registration of the same incarnation keeps the profile.
        again = register("worker-1", profile=SHARED)
        assert clone.apply(again) == s.apply(again)
        assert clone.nodes["worker-1"].profile == PROFILE


# Written by directory/state.py (now kvproto/state.py) as it was before profiles (pickle protocol 4, as Raft pickles):
# Register("worker-1", "inc-1", "http://127.0.0.1:9", "tcp://127.0.0.1:10", ({"rank": 0, "base_addr": 4096},), 64, 16, 1 << 31)
OLD_REGISTER = bytes.fromhex(
    "8004958e000000000000008c0f6469726563746f72792e7374617465948c0852656769737465729493942981945d94288c08776f726b65722d"
    "31948c05696e632d31948c12687474703a2f2f3132372e302e302e313a39948c127463703a2f2f3132372e302e302e313a3130947d94288c04"
    "72616e6b944b008c09626173655f61646472944d00107585944b404b108a05000000800065622e"
)
# Node("worker-1", 0, 7, "inc-1", "http://127.0.0.1:9", None, (), 64, 16, {"running": 1.0}, 2)
OLD_NODE = bytes.fromhex(
    "800495e7000000000000008c0f6469726563746f72792e7374617465948c044e6f64659493942981944e7d94288c076e6f64655f6964948c08"
    "776f726b65722d31948c03696478944b008c0565706f6368944b078c0b696e6361726e6174696f6e948c05696e632d31948c076170695f7572"
    "6c948c12687474703a2f2f3132372e302e302e313a39948c0c7472616e736665725f75726c944e8c07726567696f6e7394298c0f6361706163"
    "6974795f626c6f636b73944b408c0a626c6f636b5f73697a65944b108c046c6f6164947d948c0772756e6e696e6794473ff0000000000000738c"
    "047365656e944b02758694622e"
)


def test_an_old_register_pickle_loads_without_a_profile() -> None:
    expected = Register(
        "worker-1", "inc-1", "http://127.0.0.1:9", "tcp://127.0.0.1:10", ({"rank": 0, "base_addr": 4096},), 64, 16, 1 << 31
    )
    for got in _loads_both(OLD_REGISTER):
        assert got == expected and got.profile is None and got.epoch_base == 1 << 31


def test_an_old_register_state_sets_every_field() -> None:
    """`__setstate__` with the eight values an old entry holds, as unpickling calls it."""
    values = ["n", "inc", "http://a", None, (REGION,), 8, 16, 5]
    assert len(values) == len(fields(Register)) - 1
    r = object.__new__(Register)
    r.__setstate__(values)
    assert r == Register("n", "inc", "http://a", None, (REGION,), 8, 16, 5, None)
    # The same, through pickle's own machinery: a pickle as the old class wrote it.
    for got in _loads_both(_old_pickle(r)):
        assert got == r and got.profile is None


def test_an_old_node_pickle_loads_without_a_profile() -> None:
    for got in _loads_both(OLD_NODE):
        assert isinstance(got, Node) and got.profile is None
        assert (got.node_id, got.epoch, got.load, got.seen, got.capacity_blocks) == ("worker-1", 7, {"running": 1.0}, 2, 64)
    n = object.__new__(Node)
    slots = {f.name: getattr(_node(), f.name) for f in fields(Node) if f.name != "profile"}
    n.__setstate__((None, slots))
    assert n == _node() and n.profile is None
    n2 = object.__new__(Node)
    n2.__setstate__(dict(slots))  # a dict alone, as other protocols give
    assert n2 == _node()


def _node() -> Node:
    return Node("worker-1", 0, 7, "inc-1", "http://127.0.0.1:9", None, (), 64, 16, {"running": 1.0}, 2)


class _OldPickler(pickle.Pickler):
    """Pickles registrations and nodes as the classes of before profiles did: a Register's state is the list
    of its eight other fields, a Node's (None, its slots without `profile`)."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is Register:
            return (copyreg.__newobj__, (Register,), [getattr(obj, f.name) for f in fields(Register)][:8])  # type: ignore[attr-defined]
        if type(obj) is Node:
            slots = {f.name: getattr(obj, f.name) for f in fields(Node) if f.name != "profile"}
            return (copyreg.__newobj__, (Node,), (None, slots))  # type: ignore[attr-defined]
        return NotImplemented


def _old_pickle(obj: Any) -> bytes:
    buf = io.BytesIO()
    _OldPickler(buf, PICKLE_PROTOCOL).dump(obj)
    return buf.getvalue()


def test_the_old_pickler_writes_what_the_old_classes_wrote() -> None:
    """The bytes pinned above, from the old directory/state.py, are what `_OldPickler` writes for those values in a replica
    (which writes the wire names of before: `write_wire_names`)."""
    old = Register(
        "worker-1", "inc-1", "http://127.0.0.1:9", "tcp://127.0.0.1:10", ({"rank": 0, "base_addr": 4096},), 64, 16, 1 << 31
    )
    assert _old_pickle(old) == OLD_REGISTER
    assert _old_pickle(_node()) == OLD_NODE


def test_an_old_state_snapshot_loads_with_nodes_without_profiles() -> None:
    s = _state_with_profiles()
    data = _old_pickle(s)
    assert b"NodeProfile" not in data
    for clone in _loads_both(data):
        assert clone.digest() == s.digest()
        assert {n: x.profile for n, x in clone.nodes.items()} == {"worker-1": None, "worker-2": None, "worker-3": None}
        # A node of the old snapshot re-registering (a new incarnation) gets the new profile.
        assert clone.apply(register("worker-3", "inc-2", PROFILE)).status == OK
        assert clone.nodes["worker-3"].profile == PROFILE


# -- DirectoryState.apply ----------------------------------------------------------------------------


def test_apply_stores_the_profile_and_a_retry_keeps_the_first() -> None:
    s = DirectoryState()
    first = s.apply(register("worker-1", "inc-1", PROFILE))
    assert first.status == OK and s.nodes["worker-1"].profile == PROFILE
    # The same incarnation again (a retried request), whatever profile it carries: the same epoch and profile.
    for other in (SHARED, None):
        again = s.apply(register("worker-1", "inc-1", other))
        assert again == first
        assert s.nodes["worker-1"].profile == PROFILE
    # A new incarnation is a new registration: a new epoch, its own profile.
    restarted = s.apply(register("worker-1", "inc-2", SHARED))
    assert restarted.status == OK and restarted.value > first.value
    assert s.nodes["worker-1"].profile == SHARED
    assert s.apply(register("worker-1", "inc-3", None)).status == OK
    assert s.nodes["worker-1"].profile is None


def test_command_size_counts_the_profile() -> None:
    small = command_size(register(profile=None))
    big = command_size(register(profile=NodeProfile(tuple(f"model-{i}" for i in range(100)), "f" * 128, "acme", False)))
    assert big >= small + 100 * 16 + 128
