"""The watch stream's codec and the change feed, without sockets: a mirror built from a snapshot and fed the
encoded commands gives the same results and state as the replica, whatever the commands and the cut."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from directory.changefeed import ChangeFeed, Compacted
from directory.state import (
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
)
from directory.watch_codec import (
    FrameReader,
    WireError,
    batch_frame,
    decode_command,
    encode_command,
    frame,
    snapshot_message,
    snapshot_of,
    state_from,
    tick_frame,
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
        st.sampled_from([(), ({"base": 4096, "size": 1 << 20, "rkey": 7, "block_bytes": 512},)]),
        st.sampled_from([None, 4, 16]),
        st.sampled_from([None, 16]),
        st.sampled_from([0, 1 << 31]),
    ),
    st.builds(Heartbeat, node, epoch, st.sampled_from([None, {"running": 1.0, "waiting": 2}])),
    st.builds(Deregister, node),
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
    reader = FrameReader()
    (f,) = reader.feed(batch_frame(1, [cmd]))
    (encoded,) = f["commands"]
    return decode_command(encoded)


@settings(max_examples=300, deadline=None)
@given(st.lists(commands, max_size=40), st.integers(0, 40), st.integers(1, 4))
def test_a_mirror_from_a_snapshot_and_the_encoded_commands_equals_the_replica(cmds, cut, merge_threshold) -> None:
    replica = DirectoryState(max_nodes=2, max_entries=12, merge_threshold=merge_threshold)
    cut = min(cut, len(cmds))
    for c in cmds[:cut]:
        replica.apply(c)
    (snap,) = FrameReader().feed(frame(snapshot_message(snapshot_of(replica))))
    mirror = state_from(snap["state"], merge_threshold)
    assert mirror.digest() == replica.digest() and mirror.applied == replica.applied == snap["position"]
    for c in cmds[cut:]:
        assert mirror.apply(_roundtrip(c)) == replica.apply(c)
    assert mirror.digest() == replica.digest()
    assert mirror.epoch_counter == replica.epoch_counter and mirror.replicas == replica.replicas
    assert {n: (x.idx, x.epoch, x.seen, x.load, x.regions) for n, x in mirror.nodes.items()} == {
        n: (x.idx, x.epoch, x.seen, x.load, x.regions) for n, x in replica.nodes.items()
    }


def test_frames_split_anywhere_decode_the_same() -> None:
    data = tick_frame(3, True, 0.5) + batch_frame(4, [Noop()]) + tick_frame(4, False, 0.5)
    for cut in range(len(data) + 1):
        reader = FrameReader()
        got = reader.feed(data[:cut]) + reader.feed(data[cut:])
        assert [f["k"] for f in got] == ["tick", "batch", "tick"]


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
