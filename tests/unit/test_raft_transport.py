"""What the Raft port decodes: the restricted unpickler, and a real snapshot written and reloaded through it."""

from __future__ import annotations

import io
import os
import pickle
import subprocess

import numpy as np
import pytest
from pysyncobj.node import TCPNode
from pysyncobj.pickle import dump, dumps

from directory import raft_transport
from kvproto.state import AnnounceReplica, Clear, Deregister, Expire, Heartbeat, Noop, Publish, Register, Remove


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
    hashes = np.arange(1, 5, dtype=np.uint64)
    commands = [
        Register("n", "inc", "http://127.0.0.1:9", "127.0.0.1:7", ({"base": 1, "rkey": "r", "len": 2},), 8, 16, 1 << 40),
        Heartbeat("n", 3, {"queue": 1.5}),
        Deregister("n"),
        Publish("n", 3, hashes, np.arange(4, dtype=np.uint32), "cpu"),
        Remove("n", 3, hashes),
        Clear("n", 3),
        Expire("n", 3, 7),
        AnnounceReplica("127.0.0.1:1", "http://127.0.0.1:2"),
        Noop(),
    ]
    call = (0, (commands,), {})  # how pysyncobj's @replicated pickles a call
    back = raft_transport.safe_loads(dumps(call))
    assert back[0] == 0 and back[2] == {}
    for a, b in zip(commands, back[1][0]):
        assert type(a) is type(b)
        assert repr(a) == repr(b)
    frame = {"type": "append_entries", "term": 2, "entries": [(dumps(call), 5, 2)], "cluster": {TCPNode("127.0.0.1:5")}}
    assert raft_transport.safe_loads(dumps(frame))["cluster"] == {TCPNode("127.0.0.1:5")}


def test_install_routes_pysyncobj_through_the_guarded_classes() -> None:
    import pysyncobj.pickle as sopickle
    import pysyncobj.tcp_server as tcp_server
    import pysyncobj.transport as transport

    raft_transport.install(64 << 20, 16)
    assert tcp_server.TcpConnection is raft_transport.GuardedTcpConnection
    assert transport.TcpConnection is raft_transport.GuardedTcpConnection
    assert sopickle.loads is raft_transport.safe_loads and sopickle.load is raft_transport.safe_load
    buf = io.BytesIO()
    dump({"a": np.arange(3)}, buf)
    buf.seek(0)
    assert list(sopickle.load(buf)["a"]) == [0, 1, 2]


@pytest.mark.parametrize(
    "payload", [_Call(bytes, 1 << 40), _Call(bytearray, 1 << 40), _Call(__import__("_codecs").encode, "x", "zlib")]
)
def test_the_raft_unpickler_refuses_huge_allocations_and_other_codecs(payload: _Call) -> None:
    with pytest.raises(pickle.UnpicklingError):
        raft_transport.safe_loads(dumps(payload))


def test_importing_the_raft_layer_leaves_socket_inet_ntop_working() -> None:
    import socket

    import pysyncobj.win_inet_pton  # noqa: F401  (replaces socket.inet_ntop when first imported)

    assert socket.inet_ntop(socket.AF_INET, b"\x7f\x00\x00\x01") == "127.0.0.1"


# Deregister("worker-1") pickled (protocol 4, unframed) under each module name: the name of before the
# move to kvproto, and kvproto's own, as a later release may write it.
def _deregister_pickle(module: bytes) -> bytes:
    return (
        b"\x80\x04\x8c" + bytes([len(module)]) + module + b"\x94\x8c\nDeregister\x94\x93\x94)\x81\x94]\x94\x8c\x08worker-1\x94ab."
    )


def test_a_replica_writes_the_module_names_of_before_and_reads_both() -> None:
    """A rolling upgrade mixes versions: replicas of before the move to kvproto read only `directory.state`."""
    raft_transport.write_wire_names()
    data = dumps((0, (Deregister("worker-1"), raft_transport.kvindex.BlockIndex()), {}))
    assert b"directory.state" in data and b"directory.index" in data and b"kvproto" not in data
    for module in (b"directory.state", b"kvproto.state"):
        assert raft_transport.safe_loads(_deregister_pickle(module)) == Deregister("worker-1")


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("kvproto.state", "np"),
        ("directory.state", "BlockIndex"),
        ("kvproto.client", "DirectoryClient"),
        ("directory.api", "Depends"),
    ],
)
def test_the_raft_unpickler_builds_only_classes_the_replicated_modules_define(module: str, name: str) -> None:
    """Not what they import (numpy, BlockIndex in state), nor anything of other modules of either package."""
    data = b"\x80\x04\x8c" + bytes([len(module)]) + module.encode() + b"\x8c" + bytes([len(name)]) + name.encode() + b"\x93."
    with pytest.raises(pickle.UnpicklingError, match="not allowed in Raft traffic"):
        raft_transport.safe_loads(data)
