"""The Raft write path's encoding and ordering: raw-bytes pickles through the restricted unpickler,
and messages held back until the journal is synced (directory.raft_transport, directory.journal)."""

from __future__ import annotations

import pickle
import socket
import struct
import zlib
from collections.abc import Iterator

import numpy as np
import pytest
from pysyncobj.poller import createPoller

from directory import raft_transport
from kvproto.codec import decode_entry, encode_entry
from kvproto.state import Publish


def test_entries_pickle_bytes_raw_and_decode_with_the_allow_list() -> None:
    hashes = np.arange(1, 1025, dtype=np.uint64) * 0x9E3779B97F4A7C15  # every byte value, as real hashes have
    entry = encode_entry([Publish("n", 3, hashes, np.arange(1024, dtype=np.uint32))])
    call: tuple[int, tuple[bytes], dict[str, object]] = (0, (entry,), {})
    old, new = pickle.dumps(call, 2), raft_transport.dumps(call)
    assert len(new) < hashes.nbytes + 4096 + 1024 < len(old)  # protocol 2 wrote bytes as latin-1 text
    ((cmd,),) = [decode_entry(raft_transport.safe_loads(new)[1][0])]
    assert np.array_equal(cmd.hashes, hashes) and cmd.hashes.dtype == np.uint64
    for refused in (old, pickle.dumps(socket.socket, raft_transport.PICKLE_PROTOCOL)):  # protocol 2's bytes need a codec call
        with pytest.raises(pickle.UnpicklingError, match="not allowed in Raft traffic"):
            raft_transport.safe_loads(refused)


@pytest.fixture
def link() -> Iterator[tuple[raft_transport.GuardedTcpConnection, socket.socket]]:
    """A guarded connection and the socket at its other end, on loopback."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        ours = socket.create_connection(server.getsockname())
        theirs, _ = server.accept()
    conn = raft_transport.GuardedTcpConnection(createPoller("auto"), socket=ours)
    theirs.settimeout(5)
    yield conn, theirs
    conn.disconnect()
    theirs.close()


def _frames(sock: socket.socket, n: int) -> list[dict[str, object]]:
    """The next `n` messages arriving on `sock`, decoded as a peer decodes them."""
    buf, out = b"", list[dict[str, object]]()
    while len(out) < n:
        if len(buf) >= 4 and len(buf) >= 4 + struct.unpack_from("i", buf)[0]:
            size = struct.unpack_from("i", buf)[0]
            out.append(raft_transport.safe_loads(zlib.decompress(buf[4 : 4 + size])))
            buf = buf[4 + size :]
            continue
        chunk = sock.recv(1 << 16)
        assert chunk, "the link closed"
        buf += chunk
    assert not buf
    return out


def test_acknowledgements_wait_for_the_journal_sync_and_keep_their_order(
    link: tuple[raft_transport.GuardedTcpConnection, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    conn, peer = link
    dirty = True
    monkeypatch.setattr(raft_transport, "unsynced", lambda: dirty)
    conn.send({"type": "append_entries", "n": 1})  # a leader's entries promise nothing about its own log
    conn.send({"type": "next_node_idx", "n": 2})  # an acknowledgement: not before the sync
    conn.send({"type": "append_entries", "n": 3})  # behind a held message: waits too, to keep the order
    assert [m["n"] for m in _frames(peer, 1)] == [1]
    peer.setblocking(False)
    with pytest.raises(BlockingIOError):
        peer.recv(1)
    peer.settimeout(5)
    dirty = False
    raft_transport.send_held()
    assert [m["n"] for m in _frames(peer, 2)] == [2, 3]
    conn.send({"type": "next_node_idx", "n": 4})  # synced: straight out
    assert [m["n"] for m in _frames(peer, 1)] == [4]


def test_a_dropped_link_forgets_what_it_held(
    link: tuple[raft_transport.GuardedTcpConnection, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    conn, peer = link
    monkeypatch.setattr(raft_transport, "unsynced", lambda: True)
    conn.send({"type": "next_node_idx", "n": 1})
    conn.disconnect()
    raft_transport.send_held()
    assert peer.recv(1) == b""  # closed, and nothing was sent


def test_messages_of_random_hashes_go_stored_and_text_compressed() -> None:
    hashes = np.random.default_rng(0).integers(0, 2**64 - 1, 4096, dtype=np.uint64, endpoint=True).tobytes()
    text = ("rkey-" + "k" * 250).encode() * 400
    for data, most in ((hashes, len(hashes) + 64), (text, len(text) // 20)):
        sent = raft_transport._compress(data)
        assert zlib.decompress(sent) == data  # what every peer does with it
        assert len(sent) <= most
    assert len(raft_transport._compress(hashes)) > len(hashes)  # stored, not squeezed for nothing
