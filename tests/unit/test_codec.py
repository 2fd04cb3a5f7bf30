"""The watch stream's codec and the change feed, without sockets: a mirror built from a snapshot and fed the
encoded commands gives the same results and state as the replica, whatever the commands and the cut."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from directory.changefeed import Ahead, ChangeFeed, Compacted
from kvproto import codec
from kvproto.codec import (
    MAX_NODES,
    VERSION,
    BatchFrame,
    FrameReader,
    SnapshotFrame,
    TickFrame,
    WireError,
    batch_frame,
    capture,
    decode_command,
    encode_command,
    frame,
    group_of,
    snapshot_frame_parts,
    snapshot_message,
    snapshot_of,
    state_from,
    tick_frame,
)
from kvproto.schemas import Region
from kvproto.state import (
    EPOCH_BASE_BITS,
    AnnounceReplica,
    Clear,
    Command,
    Deregister,
    DirectoryState,
    Expire,
    Heartbeat,
    Noop,
    Publish,
    Register,
    Remove,
    command_size,
    new_epoch_base,
)

NODES = ["n0", "n1", "n2"]
HASHES = [0, 2**64 - 1, *range(1, 9)]

node = st.sampled_from(NODES)
epoch = st.integers(0, 6)
hashes = st.lists(st.sampled_from(HASHES), max_size=6).map(lambda xs: np.asarray(xs, dtype=np.uint64))
commands = st.one_of(
    st.builds(
        Register,
        node,
        st.sampled_from(["a", "b"]),
        st.just("http://127.0.0.1:1"),
        st.sampled_from([None, "tcp://127.0.0.1:2"]),
        st.sampled_from([(), (Region(rank=0, base_addr=4096, length=1 << 20, rkey=7, block_bytes=512),)]),
        st.sampled_from([None, 4, 16]),
        st.sampled_from([None, 16]),
        st.sampled_from([0, 1 << 31]),
    ),
    st.builds(Heartbeat, node, epoch, st.sampled_from([None, {"running": 1.0, "waiting": 2}])),
    st.builds(Deregister, node, st.one_of(st.none(), epoch)),
    hashes.flatmap(
        lambda h: st.builds(
            Publish,
            node,
            epoch,
            st.just(h),
            st.lists(st.integers(0, 20), min_size=len(h), max_size=len(h)).map(lambda s: np.asarray(s, dtype=np.uint32)),
            st.sampled_from([None, "cpu"]),
        )
    ),
    st.builds(Remove, node, epoch, hashes),
    st.builds(Clear, node, epoch),
    st.builds(Expire, node, epoch, st.integers(0, 4)),
    st.builds(AnnounceReplica, st.just("127.0.0.1:9"), st.just("http://127.0.0.1:8")),
    st.just(Noop()),
)


def _roundtrip(cmd: Command) -> Command:
    (f,) = FrameReader().feed(batch_frame(1, [cmd]))
    assert isinstance(f, BatchFrame)
    (out,) = f.commands
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(commands, max_size=40), st.integers(0, 40), st.integers(1, 4))
def test_a_mirror_from_a_snapshot_and_the_encoded_commands_equals_the_replica(cmds, cut, merge_threshold) -> None:
    replica = DirectoryState(max_nodes=2, max_entries=12, merge_threshold=merge_threshold)
    cut = min(cut, len(cmds))
    for c in cmds[:cut]:
        replica.apply(c)
    (snap,) = FrameReader().feed(frame(snapshot_message(snapshot_of(replica))))
    assert isinstance(snap, SnapshotFrame)
    mirror = state_from(snap.state, merge_threshold)
    assert mirror.digest() == replica.digest() and mirror.applied == replica.applied == snap.position
    for c in cmds[cut:]:
        assert mirror.apply(_roundtrip(c)) == replica.apply(c)
    assert mirror.digest() == replica.digest()
    assert mirror.epoch_counter == replica.epoch_counter and mirror.replicas == replica.replicas
    assert {n: (x.idx, x.epoch, x.seen, x.load, x.regions) for n, x in mirror.nodes.items()} == {
        n: (x.idx, x.epoch, x.seen, x.load, x.regions) for n, x in replica.nodes.items()
    }


@pytest.mark.parametrize("entries", [0, 5, 300, 20_000])  # columns of msgpack bin8, bin16 and bin32
def test_a_snapshot_frame_in_parts_is_the_frame_byte_for_byte(entries: int) -> None:
    """A watch stream sends a snapshot's columns straight from their arrays (no 80 MB copy holding the GIL
    at 5M entries); the pieces must join to exactly what the encoder writes."""
    s = DirectoryState(max_nodes=32, merge_threshold=64)
    rng = np.random.default_rng(entries)
    for i in range(3):
        s.apply(
            Register(
                f"n{i}",
                "a",
                "http://127.0.0.1:1",
                regions=(Region(rank=0, base_addr=4096, length=1 << 20, rkey=i, block_bytes=512),),
            )
        )
    if entries:
        s.apply(
            Publish(
                "n0", s.nodes["n0"].epoch, rng.integers(1, 2**63, entries, dtype=np.uint64), np.arange(entries, dtype=np.uint32)
            )
        )
    parts = snapshot_frame_parts(*capture(s))
    assert any(isinstance(p, memoryview) for p in parts)
    assert b"".join(parts) == frame(snapshot_message(snapshot_of(s)))


def test_frames_split_anywhere_decode_the_same() -> None:
    data = tick_frame(3, True, 0.5, group=None) + batch_frame(4, [Noop()]) + tick_frame(4, False, 0.5, group=7)
    for cut in range(len(data) + 1):
        reader = FrameReader()
        got = reader.feed(data[:cut]) + reader.feed(data[cut:])
        assert [type(f) for f in got] == [TickFrame, BatchFrame, TickFrame]


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (frame({"k": "nonsense"}), "not a snapshot, batch or tick"),
        (b"\x05\x00\x00\x00\xc1\xc1\xc1\xc1\xc1", "not msgpack"),
        (b"\xff\xff\xff\x7f", "limit"),
    ],
)
def test_malformed_frames_are_refused(data: bytes, why: str) -> None:
    with pytest.raises(WireError, match=why):
        FrameReader().feed(data)


@pytest.mark.parametrize(
    "encoded",
    [["P", "n0", 1, b"\x00" * 7, b"", None], ["P", "n0", 1, b"\x00" * 8, b"", None], ["Z"], ["R", "n0"], [], 7],
)
def test_malformed_commands_are_refused(encoded: object) -> None:
    with pytest.raises(WireError):
        decode_command(encoded)


def test_every_command_kind_has_an_encoding() -> None:
    with pytest.raises(TypeError):
        encode_command(object())  # type: ignore[arg-type]


def test_the_feed_keeps_a_bounded_tail_and_says_when_a_position_is_gone() -> None:
    h = np.arange(4, dtype=np.uint64)
    one = Publish("n", 1, h, h.astype(np.uint32))
    feed = ChangeFeed(max_bytes=2 * command_size(one) + 1)
    for pos in range(1, 6):  # five publishes: the newest 2 fit
        feed.append(pos, [one])
    assert [p for p, _ in feed.after(3)] == [4, 5]
    assert feed.after(5) == []
    with pytest.raises(Compacted, match="oldest kept is 3"):
        feed.after(2)
    feed.reset(9)
    assert feed.after(9) == [] and feed.start == 9
    with pytest.raises(Compacted):
        feed.after(5)


def test_a_deregister_frame_carries_its_epoch_or_none():
    assert encode_command(Deregister("w", 7)) == ["D", "w", 7]
    assert decode_command(["D", "w", 7]) == Deregister("w", 7)
    assert decode_command(["D", "w", None]) == Deregister("w", None)  # an admin's: whatever registration is current
    with pytest.raises(WireError, match="at least length 3, got 2"):
        decode_command(["D", "w"])  # never read as an admin's: the epoch (or None) is always said


# -- the group's identity and positions beyond the feed (issue #29, item 3) -------------------------------


def test_the_group_identity_is_the_first_registrations_random_epoch_base_and_snapshots_carry_it() -> None:
    s = DirectoryState()
    assert group_of(s) is None  # no node ever registered: no identity yet
    s.apply(AnnounceReplica("127.0.0.1:9", "http://127.0.0.1:8"))
    assert group_of(s) is None
    base = new_epoch_base(0x5A5A5A, 3)
    s.apply(Register("n1", "i1", "http://127.0.0.1:1", epoch_base=base))
    group = group_of(s)
    assert group == base >> EPOCH_BASE_BITS and group is not None
    for i in range(5):  # later registrations draw other bases: the counter, and so the identity, keep the first
        s.apply(Register(f"m{i}", "i1", "http://127.0.0.1:1", epoch_base=new_epoch_base(i + 1, 3)))
    assert group_of(s) == group
    assert group_of(DirectoryState()) != group_of(s)
    (f,) = FrameReader().feed(frame(snapshot_message(snapshot_of(s))))
    assert isinstance(f, SnapshotFrame) and f.group == group and group_of(state_from(f.state)) == group
    (t,) = FrameReader().feed(tick_frame(s.applied, True, 0.5, group=group))
    assert isinstance(t, TickFrame) and t.group == group


def test_a_position_beyond_the_feed_is_ahead_not_an_empty_answer() -> None:
    feed = ChangeFeed(max_bytes=1 << 20)
    feed.append(1, [Noop()])
    assert feed.after(1) == [] and [p for p, _ in feed.after(0)] == [1]
    with pytest.raises(Ahead, match="beyond this replica's"):
        feed.after(2)  # before: [] (as if caught up), and the stream ticked on
    assert issubclass(Ahead, Compacted)
    assert feed.after(2, wait_ahead=True) == []  # a consumer of this very group: it waits for position 2
    feed.append(2, [Noop()])
    feed.append(3, [Noop()])
    assert [p for p, _ in feed.after(2, wait_ahead=True)] == [3]


# -- every decoded frame is checked (issue #29, item 4) ----------------------------------------------------


def _good_state() -> DirectoryState:
    s = DirectoryState(max_nodes=8)
    s.apply(Register("n1", "i1", "http://127.0.0.1:1", capacity_blocks=100, epoch_base=new_epoch_base(99)))
    s.apply(Register("n2", "i1", "http://127.0.0.1:2", epoch_base=new_epoch_base(98)))
    s.apply(Register("n3", "i1", "http://127.0.0.1:3", epoch_base=new_epoch_base(97)))
    s.apply(Register("n4", "i1", "http://127.0.0.1:4", epoch_base=new_epoch_base(96)))
    s.apply(Deregister("n2", None))  # index 1 free
    e1 = s.nodes["n1"].epoch
    s.apply(Publish("n1", e1, np.asarray([1, 2, 3], np.uint64), np.asarray([0, 5, 99], np.uint32)))
    s.apply(Publish("n3", s.nodes["n3"].epoch, np.asarray([2, 7], np.uint64), np.asarray([1, 2**32 - 1], np.uint32)))
    return s


def _snap() -> dict[str, object]:
    snap = snapshot_of(_good_state())
    assert state_from(snap).digest() == _good_state().digest()  # the unmodified snapshot passes every check
    return snap


def _node_row(snap: dict[str, object], node_id: str) -> list[object]:
    return next(row for row in snap["nodes"] if row[0] == node_id)  # type: ignore[attr-defined]


def _set_holder(snap: dict[str, object], i: int, idx: int) -> None:
    holders = np.frombuffer(snap["holders"], "<u4").copy()  # type: ignore[arg-type]
    holders[i] = idx
    snap["holders"] = holders.tobytes()


def _huge_index(snap: dict[str, object]) -> None:
    """The attack of the issue: a node index near 2**32 (every bound that would admit it raised to match)."""
    snap["max_nodes"] = snap["next_idx"] = 2**32
    _node_row(snap, "n1")[1] = 2**32 - 1
    snap["free_idx"] = []
    _set_holder(snap, 0, 2**32 - 1)


def _unregistered_holder(snap: dict[str, object]) -> None:
    _set_holder(snap, 0, 1)  # n2's index, free since it deregistered


def _slot_beyond_capacity(snap: dict[str, object]) -> None:
    holders = np.frombuffer(snap["holders"], "<u4")  # type: ignore[arg-type]
    slots = np.frombuffer(snap["slots"], "<u4").copy()  # type: ignore[arg-type]
    slots[int(np.flatnonzero(holders == _node_row(snap, "n1")[1])[0])] = 100  # n1 has 100 slots
    snap["slots"] = slots.tobytes()


def _twice(snap: dict[str, object]) -> None:
    for k in ("keys", "holders", "slots"):
        snap[k] = snap[k] + snap[k][-(8 if k == "keys" else 4) :]  # type: ignore[operator]


def _set(key: str, value: object) -> Callable[[dict[str, object]], None]:
    return lambda snap: snap.__setitem__(key, value)


def _row(node_id: str, i: int, value: object) -> Callable[[dict[str, object]], None]:
    return lambda snap: _node_row(snap, node_id).__setitem__(i, value)


@pytest.mark.parametrize(
    ("spoil", "why"),
    [
        (_huge_index, "a mirror holds at most"),
        (_set("max_nodes", MAX_NODES + 1), "a mirror holds at most"),
        (_row("n1", 1, 7), "out of range"),  # an index at or past next_idx
        (_row("n1", 1, -1), r"Expected `int` >= 0 - at `\$.nodes\[0\]\[1\]`"),
        (_row("n3", 1, 0), "listed twice"),  # two nodes on one index
        (_set("free_idx", [1, 1]), "do not partition"),
        (_set("free_idx", []), "do not partition"),
        (_unregistered_holder, "unregistered node indices"),
        (_slot_beyond_capacity, "beyond its node's capacity"),
        (_twice, "listed twice"),
        (_set("keys", b"\x00" * 7), "uint64 array"),
        (_set("holders", [0, 0]), "packed bytes"),
        (_set("max_entries", 2), "over the snapshot's max_entries"),
        (_set("applied", "7"), r"Expected `int`, got `str` - at `\$.applied`"),
        (_set("applied", True), r"Expected `int`, got `bool` - at `\$.applied`"),
        (_set("epoch_counter", -1), r"Expected `int` >= 0 - at `\$.epoch_counter`"),
        (_row("n1", 2, 2**62), "out of range"),  # an epoch the counter never handed out
        (_row("n1", 0, 5), r"Expected `str`, got `int` - at `\$.nodes\[0\]\[0\]`"),
        (_row("n1", 9, {"running": "many"}), r"Expected `float`, got `str` - at `\$.nodes\[0\]\[9\]"),
        (_row("n1", 9, {"running": float("nan")}), r"Expected `float` >= -1.79.* - at `\$.nodes\[0\]\[9\]"),
        (_row("n1", 6, [{"rank": [0]}]), r"at `\$.nodes\[0\]\[6\]\[0\].rank`"),  # a region's
        (_row("n1", 7, "100"), r"Expected `int \| null`, got `str` - at `\$.nodes\[0\]\[7\]`"),
        (_set("replicas", []), r"Expected `object`, got `array` - at `\$.replicas`"),
        (_set("nodes", {}), r"Expected `array`, got `object` - at `\$.nodes`"),
        (lambda snap: snap.pop("nodes"), "nodes"),
        (_set("shard_map", [1, "s0", [], [], "{}", False]), "no shards"),
    ],
    ids=lambda v: v if isinstance(v, str) else getattr(v, "__name__", "spoil"),
)
def test_a_malformed_snapshot_is_refused_before_anything_is_allocated_for_it(spoil, why: str) -> None:
    snap = _snap()
    spoil(snap)
    started = time.monotonic()
    with pytest.raises(WireError, match=f"malformed snapshot.*{why}"):
        state_from(snap)
    assert time.monotonic() - started < 1.0  # before: the huge index sized per-node arrays at 2**32 (tens of GB)


def _v(**fields: object) -> bytes:
    """A frame of this codec's version with these fields."""
    return frame({"v": VERSION, **fields})


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (
            _v(k="tick", position=3, bound_s=0.5, group=None),
            "tick frame: Object missing required field `fresh`",
        ),  # before: a KeyError
        (_v(k="tick", position="3", fresh=True, bound_s=0.5, group=None), r"Expected `int`, got `str` - at `\$.position`"),
        (_v(k="tick", position=3, fresh=1, bound_s=0.5, group=None), r"Expected `bool`, got `int` - at `\$.fresh`"),
        (_v(k="tick", position=3, fresh=True, bound_s=-1.0, group=None), r"Expected `float` >= 0.0 - at `\$.bound_s`"),
        (_v(k="tick", position=3, fresh=True, bound_s=0.5, group="g"), r"got `str` - at `\$.group`"),
        (_v(k="tick", position=3, fresh=True, bound_s=0.5), "tick frame: Object missing required field `group`"),
        (_v(k="tick", position=-1, fresh=True, bound_s=0.5, group=None), r"Expected `int` >= 0 - at `\$.position`"),
        (_v(k="batch", position=3), "batch frame: Object missing required field `commands`"),
        (_v(k="batch", position=3, commands=5), r"Expected `array`, got `int` - at `\$.commands`"),
        (_v(k="snapshot", position=3, state=[1], group=None), r"Expected `object`, got `array` - at `\$.state`"),
        (_v(k="snapshot", state={}, group=None), "snapshot frame: Object missing required field `position`"),
        (frame({"k": "batch", "position": 3, "commands": []}), "batch frame of codec version None"),
        (frame({"v": VERSION + 1, "k": "batch", "position": 3, "commands": []}), f"version {VERSION + 1}; this kvdir reads"),
        (frame([1, 2]), "not a snapshot, batch or tick"),  # type: ignore[arg-type]
    ],
)
def test_frames_with_missing_or_mistyped_fields_are_refused(data: bytes, why: str) -> None:
    """Another codec version's frame is a VersionError, a WireError like every other refusal."""
    with pytest.raises(WireError, match=why):
        FrameReader().feed(data)


@pytest.mark.parametrize(
    "encoded",
    [
        ["P", "n0", "1", b"\x00" * 8, b"\x00" * 4, None],  # a string epoch
        ["P", "n0", 1, b"\x00" * 8, b"\x00" * 4, 5],  # a medium that is no string
        ["P", 7, 1, b"", b"", None],
        ["P", "n0", -1, b"", b"", None],
        ["P", "n0", 2**63, b"", b"", None],
        ["R", "n0", 1, "not bytes"],
        ["H", "n0", 1, {"running": "x"}],
        ["H", "n0", 1, [1, 2]],
        ["H", "n0", True, None],
        ["G", "n0", "i", "http://x", None, {"rank": 0}, None, None, 0],  # regions as a map
        ["G", "n0", "i", "http://x", None, [], -5, None, 0],  # a negative capacity
        ["G", "n0", "i", "http://x", None, [], None, 0, 0],  # a block size of 0
        ["G", "n0", "i", "http://x", 5, [], None, None, 0],
        ["G", "n0", "i", "http://x", None, [], None, None, "0"],
        ["C", "n0", None],
        ["E", "n0", 1, 1.5],
        ["A", "127.0.0.1:1", None],
        ["S", 1, "s0", ["s0"], [["a"]], "{}", False],
        ["S", "1", "s0", ["s0"], [], "{}", False],
        [5, "n0"],
        {"P": 1},
    ],
)
def test_commands_with_mistyped_or_out_of_range_fields_are_refused(encoded: object) -> None:
    with pytest.raises(WireError):
        decode_command(encoded)


def test_a_command_the_log_cannot_carry_is_refused_before_it_is_written() -> None:
    """An epoch of 2**63 encodes (msgpack's uint64) but no replica reads it back (epochs are int64): it would stop
    every replica at its entry, so `check_command` (every write's, in GroupCommitter.submit) refuses it first."""
    good = [Heartbeat("n", (1 << 63) - 1), Publish("n", 3, np.arange(4, dtype=np.uint64), np.arange(4, dtype=np.uint32))]
    # What it returns is the command as the entry carries it: the committer encodes each command once.
    assert codec.encode_entry([codec.check_command(c) for c in good]) == codec.encode_entry(good)
    for bad in (Heartbeat("n", 1 << 63), Heartbeat("n", 1 << 64), Clear("n", -1), Heartbeat("n", 1, {"x": float("nan")})):
        with pytest.raises(WireError, match="the replicated log cannot carry"):
            codec.check_command(bad)
