"""What the Raft port decodes: the restricted unpickler, and a real snapshot written and reloaded through it."""

from __future__ import annotations

import io
import os
import pickle
import subprocess

import msgspec
import numpy as np
import pytest
from pysyncobj.node import TCPNode

from directory import raft_transport
from directory.raft_transport import dump, dumps
from kvproto import codec
from kvproto.schemas import Region
from kvproto.state import (
    AnnounceReplica,
    Clear,
    Deregister,
    DirectoryState,
    Expire,
    Heartbeat,
    Noop,
    Publish,
    Register,
    Remove,
)


class _Call:
    def __init__(self, fn: object, *args: object) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (self.fn, self.args)


@pytest.mark.parametrize(
    "fn", [os.system, subprocess.Popen, eval, getattr, __import__, pickle.loads, raft_transport.install, np.load]
)
def test_the_raft_unpickler_builds_no_callable_outside_its_list(fn: object) -> None:
    with pytest.raises(pickle.UnpicklingError, match="not allowed in Raft traffic"):
        raft_transport.safe_loads(dumps(_Call(fn, "true")))
    with pytest.raises(pickle.UnpicklingError):
        raft_transport.safe_load(io.BytesIO(dumps([1, _Call(fn, "true")])))


def test_the_raft_unpickler_refuses_functions_of_the_allowed_modules() -> None:
    from kvproto.state import new_epoch_base

    with pytest.raises(pickle.UnpicklingError):
        raft_transport.safe_loads(dumps(_Call(new_epoch_base, 3)))


def test_every_command_kind_survives_the_raft_unpickler() -> None:
    """An entry is the codec's bytes: what pysyncobj pickles of it is one bytes argument."""
    hashes = np.arange(1, 5, dtype=np.uint64)
    commands = [
        Register(
            "n",
            "inc",
            "http://127.0.0.1:9",
            "127.0.0.1:7",
            (Region(rank=0, base_addr=1, length=2, block_bytes=2, rkey="r"),),
            8,
            16,
            1 << 40,
        ),
        Heartbeat("n", 3, {"queue": 1.5}),
        Deregister("n", None),
        Publish("n", 3, hashes, np.arange(4, dtype=np.uint32), "cpu"),
        Remove("n", 3, hashes),
        Clear("n", 3),
        Expire("n", 3, 7),
        AnnounceReplica("127.0.0.1:1", "http://127.0.0.1:2"),
        Noop(),
    ]
    call = (0, (codec.encode_entry(commands),), {})  # how pysyncobj's @replicated pickles a call
    back = raft_transport.safe_loads(dumps(call))
    assert back[0] == 0 and back[2] == {}
    for a, b in zip(commands, codec.decode_entry(back[1][0]), strict=True):
        assert type(a) is type(b)
        assert repr(a) == repr(b)
    frame = {"type": "append_entries", "term": 2, "entries": [(dumps(call), 5, 2)], "cluster": {TCPNode("127.0.0.1:5")}}
    assert raft_transport.safe_loads(dumps(frame))["cluster"] == {TCPNode("127.0.0.1:5")}


def test_an_entry_of_another_codec_version_is_refused() -> None:
    entry = msgspec.msgpack.encode([codec.VERSION + 1, []])
    with pytest.raises(codec.VersionError, match=f"codec version {codec.VERSION + 1}"):
        codec.decode_entry(entry)
    with pytest.raises(codec.WireError, match="not msgpack"):
        codec.decode_entry(b"\xc1")


def test_kvdir_classes_and_numpy_arrays_are_not_raft_traffic() -> None:
    """Commands, states and arrays travel as codec bytes: a pickle of one is refused, as any other class is."""
    for obj in (Deregister("worker-1", None), DirectoryState(), np.arange(3)):
        with pytest.raises(pickle.UnpicklingError, match="not allowed in Raft traffic"):
            raft_transport.safe_loads(dumps(obj))


def test_install_routes_pysyncobj_through_the_guarded_classes() -> None:
    import pysyncobj.pickle as sopickle
    import pysyncobj.tcp_server as tcp_server
    import pysyncobj.transport as transport

    raft_transport.install(64 << 20, 16)
    assert tcp_server.TcpConnection is raft_transport.GuardedTcpConnection
    assert transport.TcpConnection is raft_transport.GuardedTcpConnection
    assert sopickle.loads is raft_transport.safe_loads and sopickle.load is raft_transport.safe_load
    buf = io.BytesIO()
    dump({"state": b"\x93", "nodes": {TCPNode("127.0.0.1:5")}}, buf)
    buf.seek(0)
    assert sopickle.load(buf) == {"state": b"\x93", "nodes": {TCPNode("127.0.0.1:5")}}
    buf = io.BytesIO()
    dump({"a": np.arange(3)}, buf)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError, match="not allowed in Raft traffic"):
        sopickle.load(buf)


@pytest.mark.parametrize(
    "payload", [_Call(bytes, 1 << 40), _Call(bytearray, 1 << 40), _Call(__import__("_codecs").encode, "x", "latin1")]
)
def test_the_raft_unpickler_refuses_huge_allocations_and_other_codecs(payload: _Call) -> None:
    with pytest.raises(pickle.UnpicklingError):
        raft_transport.safe_loads(dumps(payload))


def test_importing_the_raft_layer_leaves_socket_inet_ntop_working() -> None:
    import socket

    import pysyncobj.win_inet_pton  # noqa: F401  (replaces socket.inet_ntop when first imported)

    assert socket.inet_ntop(socket.AF_INET, b"\x7f\x00\x00\x01") == "127.0.0.1"


class _Held(raft_transport.Snapshot):
    def __init__(self, data: bytes) -> None:
        self.data = data

    def raft_bytes(self) -> bytearray:
        return bytearray(self.data)


def test_a_snapshot_is_written_as_its_bytes_and_loads_as_one_writable_bytearray() -> None:
    """What pysyncobj's snapshot holds of kvdir (`StateMachine._serialize`): written by `dump`, read by `safe_load`."""
    s = DirectoryState()
    s.apply(Register("n", "inc", "http://127.0.0.1:9", epoch_base=1 << 31))
    buf = io.BytesIO()
    raft_transport.dump(({"state": _Held(bytes(codec.encode_state(s)))}, 7, {TCPNode("127.0.0.1:5")}), buf)
    buf.seek(0)
    data, seven, cluster = raft_transport.safe_load(buf)
    assert type(data["state"]) is bytearray and (seven, cluster) == (7, {TCPNode("127.0.0.1:5")})
    assert codec.decode_state(data["state"]).digest() == s.digest()


def test_a_persistent_id_other_than_a_bytearray_is_refused() -> None:
    class _Persisting(pickle.Pickler):
        def persistent_id(self, obj: object) -> object:
            return ("os", "system") if obj == "x" else None

    buf = io.BytesIO()
    _Persisting(buf, 5).dump(["x"])
    with pytest.raises(pickle.UnpicklingError, match="a persistent tuple is not allowed"):
        raft_transport.safe_loads(buf.getvalue())
