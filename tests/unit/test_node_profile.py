"""Node profiles (docs/protocol.md §2.1) in the replicated state: applied with a registration, carried by the
watch stream's frames and snapshots and by Raft entries and snapshots (kvproto.codec, through the Raft port's
unpickler); a layout of another codec version is refused, never guessed at."""

from __future__ import annotations

import numpy as np
import pytest

from directory.raft_transport import dumps, safe_loads
from kvproto.codec import (
    BatchFrame,
    FrameReader,
    SnapshotFrame,
    WireError,
    batch_frame,
    decode_command,
    decode_entry,
    decode_state,
    encode_command,
    encode_entry,
    encode_state,
    frame,
    snapshot_message,
    snapshot_of,
    state_from,
)
from kvproto.schemas import Region
from kvproto.state import OK, DirectoryState, NodeProfile, Publish, Register, command_size

PROFILE = NodeProfile(("Qwen/Qwen3-8B", "ü-lora"), "fp-0123abcd", "acme", False)
SHARED = NodeProfile(("m",), None, "", True)
DP_RANK = NodeProfile(("m",), "fp", "", False, 3)
REGION = Region(rank=0, base_addr=4096, length=1 << 20, block_bytes=512, rkey=7)


def register(node_id: str = "worker-1", inc: str = "inc-1", profile: NodeProfile | None = PROFILE) -> Register:
    # Each node its own engine: an endpoint is one tenant's (DirectoryState refuses another tenant's node on it).
    return Register(node_id, inc, f"http://{node_id}:9", f"tcp://{node_id}:10", (REGION,), 64, 16, 1 << 31, profile)


def _through_frames(cmd: Register) -> Register:
    (f,) = FrameReader().feed(batch_frame(1, [cmd]))
    assert isinstance(f, BatchFrame)
    (out,) = f.commands
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


def test_a_profile_or_register_of_another_layout_is_refused() -> None:
    """A profile or a register with a field more than this codec version's layout (a later version's), or
    without one it must carry: refused in a command and in a snapshot rather than read with fields dropped or
    made up. (A trailing field with a default may be left out and reads as its default: docs/protocol.md §3.3.)"""
    encoded = encode_command(register(profile=PROFILE))
    encoded[9] = [*encoded[9], "later"]
    with pytest.raises(WireError, match="at most length 5, got 6"):
        decode_command(encoded)
    with pytest.raises(WireError, match="at most length 9, got 10"):
        decode_command([*encode_command(register(profile=None)), None])
    with pytest.raises(WireError, match="at least length 4, got 3"):
        decode_command(encode_command(register(profile=None))[:3])
    snap = snapshot_of(_state_with_profiles())
    snap["nodes"][0][11] = [*encode_command(register(profile=PROFILE))[9], "later"]
    with pytest.raises(WireError, match=r"at most length 5, got 6 - at `\$.nodes\[0\]\[11\]`"):  # the profile's
        state_from(snap)


@pytest.mark.parametrize(
    "bad",
    [
        [1, 2],
        "x",
        [["m"], None, 5],
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
    assert isinstance(f, SnapshotFrame)
    mirror = state_from(f.state)
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


def test_snapshot_node_rows_of_another_layout_are_refused() -> None:
    """Rows of eleven fields (the layout before profiles)."""
    snap = snapshot_of(_state_with_profiles())
    snap["nodes"] = [row[:11] for row in snap["nodes"]]
    with pytest.raises(WireError, match=r"Expected `array` of at least length 12, got 11 - at `\$.nodes\[0\]`"):
        state_from(snap)


# -- Raft entries and snapshots ---------------------------------------------------------------------


@pytest.mark.parametrize("profile", [PROFILE, SHARED, DP_RANK, None], ids=["tenant", "shared", "dp-rank", "none"])
def test_register_round_trips_through_a_raft_entry(profile: NodeProfile | None) -> None:
    """As pysyncobj carries a replicated call: (func id, args, kwargs), pickled, through the Raft port's unpickler."""
    cmd = register(profile=profile)
    call = safe_loads(dumps((0, (encode_entry([cmd]),), {})))
    (got,) = decode_entry(call[1][0])
    assert got == cmd and got.profile == profile


def test_a_raft_snapshot_keeps_the_profiles() -> None:
    s = _state_with_profiles()
    clone = decode_state(safe_loads(dumps(encode_state(s))))
    assert clone.digest() == s.digest()
    assert {n: x.profile for n, x in clone.nodes.items()} == {n: x.profile for n, x in s.nodes.items()}
    # The clone goes on like the original: a re-registration of the same incarnation keeps the profile.
    again = register("worker-1", profile=SHARED)
    assert clone.apply(again) == s.apply(again)
    assert clone.nodes["worker-1"].profile == PROFILE


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
