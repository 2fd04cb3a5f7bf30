"""The watch stream's wire format: the directory's commands and state snapshots as msgpack frames.

`GET /v1/watch` sends a byte stream of frames, each a 4-byte little-endian length and that many
bytes of msgpack (one of the three frame kinds below). A consumer that applies the snapshot and then
every batch, in order, to a `DirectoryState` of its own holds exactly the replicas' state: the
state machine is deterministic, so the same commands give the same state and results. This module is
shared by the replica (which encodes) and the gateway's mirror (which decodes); it carries no
pickle, so a consumer never runs code chosen by whoever sends it bytes.

Frames (msgpack maps; `k` names the kind):
- `{"k": "snapshot", "position": P, "state": {...}}`: the whole state at position P.
- `{"k": "batch", "position": P, "commands": [...]}`: the commands that brought the state to P.
- `{"k": "tick", "position": P, "fresh": bool, "bound_s": float}`: nothing new up to P; `fresh` says
  whether the sending replica was caught up with a leader within its staleness bound `bound_s`.

Commands are lists led by a one-letter tag; hashes are packed little-endian uint64 bytes and slots
uint32, so a publish of n blocks costs two byte strings, not n objects.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import numpy as np

from directory.state import (
    AnnounceReplica,
    AssignShards,
    Clear,
    Command,
    Deregister,
    DirectoryState,
    Expire,
    Heartbeat,
    Node,
    NodeProfile,
    Noop,
    Publish,
    Register,
    Remove,
)

HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 30
MEDIA_TYPE = "application/x-kvdir-watch"

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


class WireError(ValueError):
    """A frame that does not decode to a command, batch or snapshot."""


def _u64(b: bytes) -> np.ndarray:
    if len(b) % 8:
        raise WireError(f"a uint64 array of {len(b)} bytes")
    return np.frombuffer(b, dtype="<u8").astype(np.uint64, copy=True)


def _u32(b: bytes) -> np.ndarray:
    if len(b) % 4:
        raise WireError(f"a uint32 array of {len(b)} bytes")
    return np.frombuffer(b, dtype="<u4").astype(np.uint32, copy=True)


def _b64(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype="<u8").tobytes()


def _b32(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype="<u4").tobytes()


def _profile(p: NodeProfile) -> list[Any]:
    return [list(p.models), p.fingerprint, p.tenant, p.shared]


def _unprofile(v: Any) -> NodeProfile:
    models, fingerprint, tenant, shared = v
    return NodeProfile(
        tuple(str(m) for m in models), None if fingerprint is None else str(fingerprint), str(tenant), bool(shared)
    )


def encode_command(c: Command) -> list[Any]:
    """A command as a msgpack-ready list."""
    if isinstance(c, Publish):
        return ["P", c.node_id, c.epoch, _b64(c.hashes), _b32(c.slots), c.medium]
    if isinstance(c, Remove):
        return ["R", c.node_id, c.epoch, _b64(c.hashes)]
    if isinstance(c, Heartbeat):
        return ["H", c.node_id, c.epoch, c.load]
    if isinstance(c, Register):
        return [
            "G",
            c.node_id,
            c.incarnation,
            c.api_url,
            c.transfer_url,
            list(c.regions),
            c.capacity_blocks,
            c.block_size,
            c.epoch_base,
            None if c.profile is None else _profile(c.profile),
        ]
    if isinstance(c, Deregister):
        return ["D", c.node_id]
    if isinstance(c, Clear):
        return ["C", c.node_id, c.epoch]
    if isinstance(c, Expire):
        return ["E", c.node_id, c.epoch, c.seen]
    if isinstance(c, AnnounceReplica):
        return ["A", c.raft_addr, c.http_url]
    if isinstance(c, AssignShards):
        return ["S", c.version, c.shard, list(c.names), [list(p) for p in c.pins], c.document, c.bootstrap]
    if isinstance(c, Noop):
        return ["N"]
    raise TypeError(f"not a directory command: {type(c).__name__}")


def decode_command(v: Any) -> Command:
    """The command `encode_command` made `v` from; WireError for anything else."""
    try:
        tag, *f = v
        if tag == "P":
            hashes, slots = _u64(f[2]), _u32(f[3])
            if len(hashes) != len(slots):
                raise WireError(f"a publish of {len(hashes)} hashes and {len(slots)} slots")
            return Publish(str(f[0]), int(f[1]), hashes, slots, f[4])
        if tag == "R":
            return Remove(str(f[0]), int(f[1]), _u64(f[2]))
        if tag == "H":
            return Heartbeat(str(f[0]), int(f[1]), None if f[2] is None else dict(f[2]))
        if tag == "G":
            profile = _unprofile(f[8]) if len(f) > 8 and f[8] is not None else None  # absent: a replica of before profiles
            return Register(str(f[0]), str(f[1]), str(f[2]), f[3], tuple(dict(r) for r in f[4]), f[5], f[6], int(f[7]), profile)
        if tag == "D":
            return Deregister(str(f[0]))
        if tag == "C":
            return Clear(str(f[0]), int(f[1]))
        if tag == "E":
            return Expire(str(f[0]), int(f[1]), int(f[2]))
        if tag == "A":
            return AnnounceReplica(str(f[0]), str(f[1]))
        if tag == "S":
            return _assign_shards(f)
        if tag == "N":
            return Noop()
    except (TypeError, ValueError, IndexError, AttributeError) as exc:
        raise WireError(f"a malformed command: {exc}") from exc
    raise WireError(f"an unknown command tag {tag!r}")


def _assign_shards(f: list[Any]) -> AssignShards:
    names, pins = tuple(str(n) for n in f[2]), tuple((str(a), str(b)) for a, b in f[3])
    return AssignShards(int(f[0]), str(f[1]), names, pins, str(f[4]), bool(f[5]) if len(f) > 5 else False)


# -- snapshots ---------------------------------------------------------------------------------


def snapshot_of(s: DirectoryState) -> dict[str, Any]:
    """Everything that decides the state's future results (call under the state lock)."""
    keys, nodes, slots = s.index.entries()
    return {
        "applied": s.applied,
        "max_nodes": s.max_nodes,
        "max_entries": s.max_entries,
        "epoch_counter": s.epoch_counter,
        "free_idx": list(s._free_idx),
        "next_idx": s._next_idx,
        "replicas": dict(s.replicas),
        "shard_map": None if s.shard_map is None else encode_command(s.shard_map)[1:],
        "nodes": [
            [
                n.node_id,
                n.idx,
                n.epoch,
                n.incarnation,
                n.api_url,
                n.transfer_url,
                list(n.regions),
                n.capacity_blocks,
                n.block_size,
                n.load,
                n.seen,
                None if n.profile is None else _profile(n.profile),
            ]
            for n in s.nodes.values()
        ],
        "keys": _b64(keys),
        "holders": _b32(nodes),
        "slots": _b32(slots),
    }


def state_from(snap: dict[str, Any], merge_threshold: int = 16384) -> DirectoryState:
    """A state equal to the one `snapshot_of` described; WireError if `snap` is malformed."""
    try:
        s = DirectoryState(int(snap["max_nodes"]), int(snap["max_entries"]), merge_threshold)
        s.applied = int(snap["applied"])
        s.epoch_counter = int(snap["epoch_counter"])
        s._free_idx = [int(i) for i in snap["free_idx"]]
        s._next_idx = int(snap["next_idx"])
        s.replicas = {str(k): str(v) for k, v in snap["replicas"].items()}
        if snap.get("shard_map") is not None:
            s.shard_map = _assign_shards(snap["shard_map"])
        for f in snap["nodes"]:
            n = Node(
                str(f[0]),
                int(f[1]),
                int(f[2]),
                str(f[3]),
                str(f[4]),
                f[5],
                tuple(dict(r) for r in f[6]),
                f[7],
                f[8],
                dict(f[9]),
                int(f[10]),
                _unprofile(f[11]) if len(f) > 11 and f[11] is not None else None,
            )
            s.nodes[n.node_id] = n
            s.by_idx[n.idx] = n
        keys, holders, slots = _u64(snap["keys"]), _u32(snap["holders"]), _u32(snap["slots"])
        if not len(keys) == len(holders) == len(slots):
            raise WireError("a snapshot whose keys, holders and slots differ in length")
        unknown = set(np.unique(holders).tolist()) - set(s.by_idx)
        if unknown:
            raise WireError(f"a snapshot with entries of unregistered node indices {sorted(unknown)[:5]}")
        s.index.load(keys, holders, slots)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        if isinstance(exc, WireError):
            raise
        raise WireError(f"a malformed snapshot: {exc}") from exc
    return s


# -- frames ------------------------------------------------------------------------------------


def frame(obj: dict[str, Any]) -> bytes:
    body = _encoder.encode(obj)
    return HEADER.pack(len(body)) + body


def snapshot_message(snap: dict[str, Any]) -> dict[str, Any]:
    """The snapshot frame's message for `snapshot_of`'s result (encode it with `frame`, off the state lock)."""
    return {"k": "snapshot", "position": snap["applied"], "state": snap}


def batch_frame(position: int, commands: list[Command]) -> bytes:
    return frame({"k": "batch", "position": position, "commands": [encode_command(c) for c in commands]})


def tick_frame(position: int, fresh: bool, bound_s: float) -> bytes:
    return frame({"k": "tick", "position": position, "fresh": fresh, "bound_s": bound_s})


class FrameReader:
    """Splits a byte stream into decoded frames (dicts), whatever the chunking."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self._max = max_frame_bytes

    def feed(self, chunk: bytes) -> list[dict[str, Any]]:
        self._buf += chunk
        out: list[dict[str, Any]] = []
        while len(self._buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self._buf)
            if n > self._max:
                raise WireError(f"a frame of {n} bytes (the limit is {self._max})")
            if len(self._buf) < HEADER.size + n:
                break
            body = bytes(self._buf[HEADER.size : HEADER.size + n])
            del self._buf[: HEADER.size + n]
            try:
                obj = _decoder.decode(body)
            except msgspec.DecodeError as exc:
                raise WireError(f"a frame that is not msgpack: {exc}") from exc
            if not isinstance(obj, dict) or obj.get("k") not in ("snapshot", "batch", "tick"):
                raise WireError("a frame that is not a snapshot, batch or tick")
            out.append(obj)
        return out
