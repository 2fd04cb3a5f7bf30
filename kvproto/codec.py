"""The directory's one wire codec: Raft log entries, Raft snapshots and the watch stream, in msgpack.

Everything the replicated log carries is encoded here and nowhere else: a Raft entry is a batch of commands
(`encode_entry`), a Raft snapshot the whole state (`encode_state`), and the watch stream sends the same commands
and a snapshot of the same state to the gateways' mirrors (`batch_frame`, `snapshot_frame_parts`). pysyncobj still
pickles its own messages, but what they carry of kvdir's is these bytes: the Raft port's unpickler builds no
kvdir class and no numpy array (directory/raft_transport.py).

Every encoding carries `VERSION`, and every decoder refuses another one (`VersionError`): a replica never
applies an entry, nor loads a snapshot, whose layout it would have to guess, and a mirror refuses a stream it
cannot read (it falls back to asking the directory over REST). Adding a field to a command is a change here
only (`encode_command`, `decode_command`) and a version bump; docs/protocol.md §3.3 says how a cluster moves
across one.

The watch stream (`GET /v1/watch`) is a byte stream of frames, each a 4-byte little-endian length and that many
bytes of msgpack (one of the three frame kinds below). A consumer that applies the snapshot and then every
batch, in order, to a `DirectoryState` of its own holds exactly the replicas' state: the state machine is
deterministic, so the same commands give the same state and results. It carries no pickle, so a consumer never
runs code chosen by whoever sends it bytes.

Frames (msgpack maps; `k` names the kind, `v` is `VERSION`):
- `{"k": "snapshot", "position": P, "group": G, "state": {...}}`: the whole state at position P.
- `{"k": "batch", "position": P, "commands": [...]}`: the commands that brought the state to P.
- `{"k": "tick", "position": P, "fresh": bool, "bound_s": float, "group": G}`: nothing new up to P; `fresh`
  says whether the sending replica was caught up with a leader within its staleness bound `bound_s`.
`G` is the group's identity (`group_of`), nil before its first registration.

Everything a watcher decodes is checked (`WireError` else): the frames' fields, every command's types and
ranges, and a snapshot's internal consistency (node indices within its bounds and at most `MAX_NODES`, every
holder a registered node, every slot within its node's capacity, each (key, node) pair once), so that whoever
can send a consumer bytes cannot make it fail outside `WireError` or allocate by a number it chose (a node
index near 2**32 sized the index's per-node counts at tens of GB). A Raft snapshot comes from this replica's
own disk or from its authenticated leader: its nodes are checked the same way, and its index is restored as
the leader's was partitioned (`BlockIndex.restore`), not re-sorted (5M entries: 1.6 s of the Raft thread).

Commands are lists led by a one-letter tag; hashes are packed little-endian uint64 bytes and slots
uint32, so a publish of n blocks costs two byte strings, not n objects.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from kvproto import media
from kvproto.index_levels import FrozenEntries
from kvproto.state import (
    EPOCH_BASE_BITS,
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
MAX_NODES = 1 << 16
"""The most node indices a decoded state may hold (`max_nodes`): a consumer's index allocates per node index
on every lookup. A directory run with a larger --max-nodes cannot be mirrored (the gateway asks it over REST)."""
MAX_INT = (1 << 63) - 1  # epochs, counts and positions are int64 on every replica

VERSION = 1
"""The layout of every entry, snapshot and frame this module writes; decoders read this one only."""

_ARRAY_DTYPES = (np.dtype("<u8"), np.dtype("<u4"), np.dtype("<i8"))
"""The array types of a Raft snapshot's index, by their code (position here)."""
_ALIGN = 8
_HEAD_LEN = struct.Struct("<Q")


def _pad(n: int) -> int:
    return -n % _ALIGN


def _pack_arrays(obj: Any, arrays: list[np.ndarray], at: list[int]) -> Any:
    """`obj` with each array replaced by `{"array": [code, offset, count]}`, the array appended to `arrays` at the
    blob offset `at[0]` (8-byte aligned)."""
    if isinstance(obj, np.ndarray):
        if obj.ndim != 1 or obj.dtype not in _ARRAY_DTYPES:
            raise TypeError(f"an array of {obj.dtype} and {obj.ndim} dimensions in a snapshot")
        ref = {"array": [_ARRAY_DTYPES.index(obj.dtype), at[0], len(obj)]}
        arrays.append(obj)
        at[0] += obj.nbytes + _pad(obj.nbytes)
        return ref
    if isinstance(obj, dict):
        return {k: _pack_arrays(v, arrays, at) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_pack_arrays(v, arrays, at) for v in obj]
    return obj


def _unpack_arrays(obj: Any, blob: memoryview) -> Any:
    """`_pack_arrays` undone: views of `blob` where it is writable (a bytearray: the index writes in place), copies
    where it is not."""
    if type(obj) is dict:
        if obj.keys() == {"array"}:
            code, offset, count = _fields(obj["array"], 3, "an array reference")
            dtype = _ARRAY_DTYPES[_int(code, 0, len(_ARRAY_DTYPES) - 1)]
            if _int(offset) % _ALIGN or offset + _int(count) * dtype.itemsize > len(blob):
                raise WireError(f"an array of {count} at {offset} in a blob of {len(blob)} bytes")
            array = np.frombuffer(blob, dtype=dtype, count=count, offset=offset)
            return array.copy() if blob.readonly else array
        return {k: _unpack_arrays(v, blob) for k, v in obj.items()}
    if type(obj) is list:
        return [_unpack_arrays(v, blob) for v in obj]
    return obj


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


class WireError(ValueError):
    """Bytes that do not decode to a command, entry, snapshot or frame."""


class VersionError(WireError):
    """Bytes written by another version of this codec."""


def _version(v: Any, what: str) -> None:
    if v != VERSION:
        raise VersionError(f"{what} of codec version {v!r:.20}; this kvdir reads version {VERSION} only")


def group_of(s: DirectoryState) -> int | None:
    """The Raft group's identity: the high bits of its epoch counter, which are the random epoch base its
    first registration committed (kvproto.state.new_epoch_base: drawn by the replica that took it, the
    same on every replica, and never changed by later registrations). None until a node registers.

    A directory rebuilt from empty data dirs, and a group that reuses a shard's name, draw a new base: a
    watcher that knows the group it followed can tell the replica it resumes on is another directory."""
    return _group(s.epoch_counter)


def _group(epoch_counter: int) -> int | None:
    return (epoch_counter >> EPOCH_BASE_BITS) or None


# -- checks: what a frame holds, before it is used -----------------------------------------------


def _int(v: Any, lo: int = 0, hi: int = MAX_INT) -> int:
    if type(v) is not int:  # a bool is no count
        raise TypeError(f"an integer was due, not {type(v).__name__}")
    if not lo <= v <= hi:
        raise ValueError(f"{v} is out of range [{lo}, {hi}]")
    return v


def _opt_int(v: Any, lo: int = 0, hi: int = MAX_INT) -> int | None:
    return None if v is None else _int(v, lo, hi)


def _str(v: Any) -> str:
    if type(v) is not str:
        raise TypeError(f"a string was due, not {type(v).__name__}")
    return v


def _opt_str(v: Any) -> str | None:
    return None if v is None else _str(v)


def _bool(v: Any) -> bool:
    if type(v) is not bool:
        raise TypeError(f"a boolean was due, not {type(v).__name__}")
    return v


def _list(v: Any) -> list[Any]:
    if type(v) is not list:
        raise TypeError(f"a list was due, not {type(v).__name__}")
    return v


def _number(v: Any) -> float | int:
    if type(v) not in (int, float) or not math.isfinite(v):
        raise ValueError(f"a finite number was due, not {v!r:.40}")
    return v  # type: ignore[no-any-return]


def _load(v: Any) -> dict[str, float]:
    if type(v) is not dict:
        raise TypeError(f"a load map was due, not {type(v).__name__}")
    return {_str(k): _number(x) for k, x in v.items()}


def _regions(v: Any) -> tuple[dict[str, Any], ...]:
    out = []
    for r in _list(v):
        if type(r) is not dict:
            raise TypeError(f"a region map was due, not {type(r).__name__}")
        for k, x in r.items():
            _str(k)
            if x is not None and type(x) not in (int, str, bool, float):
                raise TypeError(f"a region's {k!r} is a {type(x).__name__}")
        out.append(dict(r))
    return tuple(out)


def _bytes(v: Any) -> bytes:
    if type(v) is not bytes:
        raise TypeError(f"packed bytes were due, not {type(v).__name__}")
    return v


def _u64(b: bytes) -> np.ndarray:
    b = _bytes(b)
    if len(b) % 8:
        raise WireError(f"a uint64 array of {len(b)} bytes")
    return np.frombuffer(b, dtype="<u8").astype(np.uint64, copy=True)


def _u32(b: bytes) -> np.ndarray:
    b = _bytes(b)
    if len(b) % 4:
        raise WireError(f"a uint32 array of {len(b)} bytes")
    return np.frombuffer(b, dtype="<u4").astype(np.uint32, copy=True)


def _b64(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype="<u8").tobytes()


def _b32(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype="<u4").tobytes()


def _profile(p: NodeProfile) -> list[Any]:
    return [list(p.models), p.fingerprint, p.tenant, p.shared, p.dp_rank]


def _unprofile(v: Any) -> NodeProfile:
    models, fingerprint, tenant, shared, dp_rank = _fields(v, 5, "a profile")
    return NodeProfile(
        tuple(_str(m) for m in _list(models)), _opt_str(fingerprint), _str(tenant), _bool(shared), _opt_int(dp_rank, 0, 65535)
    )


def _fields(v: Any, n: int, what: str) -> list[Any]:
    """`v` if it is a list of `n` fields (one more or less is another layout: another codec version)."""
    if len(_list(v)) != n:
        raise WireError(f"{what} of {len(v)} fields, not {n}")
    return v  # type: ignore[no-any-return]


_ARITY = {"P": 5, "R": 3, "H": 3, "G": 9, "D": 2, "C": 2, "E": 3, "A": 2, "S": 6, "N": 0}
"""Each command tag's number of fields after the tag."""


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
        return ["D", c.node_id, c.epoch]
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
    """The command `encode_command` made `v` from, its fields checked; WireError for anything else."""
    try:
        tag, *f = _list(v)
        if tag not in _ARITY:
            raise WireError(f"an unknown command tag {tag!r:.40}")
        _fields(f, _ARITY[tag], f"a {tag!r} command")
        if tag == "P":
            hashes, slots = _u64(f[2]), _u32(f[3])
            if len(hashes) != len(slots):
                raise WireError(f"a publish of {len(hashes)} hashes and {len(slots)} slots")
            return Publish(_str(f[0]), _int(f[1]), hashes, slots, _opt_str(f[4]))
        if tag == "R":
            return Remove(_str(f[0]), _int(f[1]), _u64(f[2]))
        if tag == "H":
            return Heartbeat(_str(f[0]), _int(f[1]), None if f[2] is None else _load(f[2]))
        if tag == "G":
            profile = None if f[8] is None else _unprofile(f[8])
            return Register(
                _str(f[0]),
                _str(f[1]),
                _str(f[2]),
                _opt_str(f[3]),
                _regions(f[4]),
                _opt_int(f[5]),
                _opt_int(f[6], 1),
                _int(f[7]),
                profile,
            )
        if tag == "D":
            return Deregister(_str(f[0]), _opt_int(f[1]))
        if tag == "C":
            return Clear(_str(f[0]), _int(f[1]))
        if tag == "E":
            return Expire(_str(f[0]), _int(f[1]), _int(f[2]))
        if tag == "A":
            return AnnounceReplica(_str(f[0]), _str(f[1]))
        if tag == "S":
            return _assign_shards(f)
        return Noop()
    except (TypeError, ValueError, IndexError, AttributeError) as exc:
        raise WireError(f"a malformed command: {exc}") from exc


def _assign_shards(f: list[Any]) -> AssignShards:
    names = tuple(_str(n) for n in _list(f[2]))
    pins = tuple((_str(a), _str(b)) for a, b in (_list(p) for p in _list(f[3])))
    if not names:
        raise ValueError("a shard map of no shards")
    return AssignShards(_int(f[0]), _str(f[1]), names, pins, _str(f[4]), _bool(f[5]))


# -- snapshots ---------------------------------------------------------------------------------


def snapshot_of(s: DirectoryState) -> dict[str, Any]:
    """Everything that decides the state's future results (call under the state lock; O(entries): a watch
    stream takes `capture` under the lock and `complete`s it off the lock)."""
    return complete(*capture(s))


def capture(s: DirectoryState) -> tuple[dict[str, Any], FrozenEntries]:
    """The state's snapshot less its entries, and its entries frozen (copy-on-write, kvproto.index): under the
    state lock, in O(nodes + partitions) rather than O(entries)."""
    return _head(s), s.index.frozen()


def complete(head: dict[str, Any], entries: FrozenEntries) -> dict[str, Any]:
    """`snapshot_of`'s result from `capture`'s: O(entries), on any thread, without the state lock."""
    return {**head, **{name: column.tobytes() for name, column in _columns(entries).items()}}


def _columns(entries: FrozenEntries) -> dict[str, np.ndarray]:
    """A snapshot's entry fields, in their order, as the little-endian arrays their bytes are."""
    keys, nodes, slots = entries.entries()
    return {
        "keys": np.ascontiguousarray(keys, dtype="<u8"),
        "holders": np.ascontiguousarray(nodes, dtype="<u4"),
        "slots": np.ascontiguousarray(slots, dtype="<u4"),
    }


def _head(s: DirectoryState) -> dict[str, Any]:
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
    }


def state_from(snap: dict[str, Any], merge_threshold: int = 16384) -> DirectoryState:
    """A state equal to the one `snapshot_of` described; WireError if `snap` is malformed or inconsistent."""
    try:
        return _state_from(snap, merge_threshold)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise WireError(f"a malformed snapshot: {exc}") from exc


def _state_from(snap: dict[str, Any], merge_threshold: int) -> DirectoryState:
    s = _state_head(snap, merge_threshold, MAX_NODES)
    _load_entries(s, snap)
    return s


def _state_head(snap: dict[str, Any], merge_threshold: int, most_nodes: int) -> DirectoryState:
    """A state with the snapshot's nodes, replicas, shard map and counters, checked, and no entries yet."""
    if type(snap) is not dict:
        raise TypeError(f"a snapshot is a map, not {type(snap).__name__}")
    max_nodes = _int(snap["max_nodes"], 1)
    if max_nodes > most_nodes:
        raise ValueError(f"max_nodes {max_nodes}: a mirror holds at most {most_nodes} nodes")
    s = DirectoryState(max_nodes, _int(snap["max_entries"], 1), merge_threshold)
    s.applied = _int(snap["applied"])
    s.epoch_counter = _int(snap["epoch_counter"])
    s._next_idx = _int(snap["next_idx"], 0, max_nodes)
    s._free_idx = [_int(i, 0, s._next_idx - 1) for i in _list(snap["free_idx"])]
    replicas = snap["replicas"]
    if type(replicas) is not dict:
        raise TypeError(f"replicas are a map, not {type(replicas).__name__}")
    s.replicas = {_str(k): _str(v) for k, v in replicas.items()}
    if snap.get("shard_map") is not None:
        s.shard_map = _assign_shards(_list(snap["shard_map"]))
    for f in _list(snap["nodes"]):
        f = _fields(f, 12, "a node")
        n = Node(
            _str(f[0]),
            _int(f[1], 0, s._next_idx - 1),
            _int(f[2], 0, s.epoch_counter),
            _str(f[3]),
            _str(f[4]),
            _opt_str(f[5]),
            _regions(f[6]),
            _opt_int(f[7]),
            _opt_int(f[8], 1),
            _load(f[9]),
            _int(f[10]),
            None if f[11] is None else _unprofile(f[11]),
        )
        if n.node_id in s.nodes or n.idx in s.by_idx:
            raise ValueError(f"node {n.node_id!r:.40} or its index {n.idx} is listed twice")
        s.nodes[n.node_id] = n
        s.by_idx[n.idx] = n
    if len(s.nodes) > max_nodes:
        raise ValueError(f"{len(s.nodes)} nodes, over the snapshot's max_nodes {max_nodes}")
    # Every index below next_idx is a node's or free, exactly once: what registrations take indices from.
    if len(s._free_idx) + len(s.by_idx) != s._next_idx or set(s._free_idx) & set(s.by_idx):
        raise ValueError(f"node indices and free indices do not partition [0, {s._next_idx})")
    return s


def _load_entries(s: DirectoryState, snap: dict[str, Any]) -> None:
    """The snapshot's entry columns into `s`'s index, each checked against `s`'s nodes."""
    keys, holders, slots = _u64(snap["keys"]), _u32(snap["holders"]), _u32(snap["slots"])
    if not len(keys) == len(holders) == len(slots):
        raise ValueError("keys, holders and slots differ in length")
    if len(keys) > s.max_entries:
        raise ValueError(f"{len(keys)} entries, over the snapshot's max_entries {s.max_entries}")
    if len(keys):
        # Per node index (at most MAX_NODES), so these arrays are small whatever the holders say.
        registered = np.zeros(max(s._next_idx, 1), dtype=bool)
        # Slots per node index and medium (kvproto.media: a location's top bits name its medium).
        capacity = np.full((max(s._next_idx, 1), len(media.MEDIA)), media.MAX_SLOTS, dtype=np.int64)
        for n in s.nodes.values():
            registered[n.idx] = True
            for code in range(len(media.MEDIA)):
                cap = media.capacity(n.capacity_blocks, n.regions, code)
                if cap is not None:
                    capacity[n.idx, code] = cap
        beyond = holders >= len(registered)
        if beyond.any() or not registered[holders].all():
            unknown = np.unique(holders[beyond | ~registered[np.minimum(holders, len(registered) - 1)]])
            raise ValueError(f"entries of unregistered node indices {unknown[:5].tolist()}")
        codes = slots >> np.uint32(media.SHIFT)
        if (codes >= len(media.MEDIA)).any():
            raise ValueError("a location in no medium")
        if ((slots & np.uint32(media.SLOT_MASK)).astype(np.int64) >= capacity[holders, codes]).any():
            raise ValueError("a slot beyond its node's capacity in its medium")
        order = np.lexsort((holders, keys))  # the order `load` sorts in: given sorted, its sort is a pass
        keys, holders, slots = keys[order], holders[order], slots[order]
        if ((keys[1:] == keys[:-1]) & (holders[1:] == holders[:-1])).any():
            raise ValueError("a (key, node) entry listed twice")
    s.index.load(keys, holders, slots)
    s.rebuild_endpoints()


# -- Raft: log entries and snapshots -------------------------------------------------------------


def check_command(c: Command) -> msgspec.Raw:
    """`c` as a log entry carries it, once it is known to read back as every replica will read it (checked as
    `decode_entry` checks it); WireError else. A command that did not would stop every replica at its entry (an
    epoch of 2**63 encodes as msgpack's uint64 and fails the int64 check), so none enters the log
    (`GroupCommitter.submit`, which hands the bytes to `encode_entry` rather than encode the command again)."""
    try:
        encoded = _encoder.encode(encode_command(c))
        decode_command(_decoder.decode(encoded))
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"a {type(c).__name__} the replicated log cannot carry: {exc}") from exc
    return msgspec.Raw(encoded)


def encode_entry(commands: Sequence[Command | msgspec.Raw]) -> bytes:
    """A Raft log entry: a batch of commands that the state machine applies in one call (each a command, or what
    `check_command` made of one)."""
    return _encoder.encode([VERSION, [c if isinstance(c, msgspec.Raw) else encode_command(c) for c in commands]])


def decode_entry(data: bytes) -> list[Command]:
    """The commands of an entry `encode_entry` wrote; WireError (VersionError) for anything else."""
    try:
        entry = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise WireError(f"a Raft entry that is not msgpack: {exc}") from exc
    version, commands = _fields(entry, 2, "a Raft entry")
    _version(version, "a Raft entry")
    return [decode_command(c) for c in _list(commands)]


def encode_state(s: DirectoryState) -> bytearray:
    """A Raft snapshot: the state's nodes as the watch stream sends them, and its index as it is partitioned
    (`BlockIndex.export`), so that loading it rebuilds no partition. Laid out as an 8-byte head length, the msgpack
    head (arrays named by code, offset and count), then the arrays' bytes, each at an 8-byte aligned offset, so
    that `decode_state` can load them as aligned views. O(entries): Raft takes it in the child it forks to write a
    snapshot (directory/journal.py), never on its own thread when there is a data dir."""
    arrays: list[np.ndarray] = []
    index = _pack_arrays(s.index.export(), arrays, [0])
    head = _encoder.encode({"v": VERSION, "head": _head(s), "index": index})
    start = _HEAD_LEN.size + len(head) + _pad(_HEAD_LEN.size + len(head))
    out = bytearray(start + sum(a.nbytes + _pad(a.nbytes) for a in arrays))
    out[: _HEAD_LEN.size + len(head)] = _HEAD_LEN.pack(len(head)) + head
    at = start
    for a in arrays:
        out[at : at + a.nbytes] = np.ascontiguousarray(a).data.cast("B")
        at += a.nbytes + _pad(a.nbytes)
    return out


def decode_state(data: bytes | bytearray) -> DirectoryState:
    """The state `encode_state` wrote; WireError (VersionError) if the bytes are another version's or malformed.
    From a bytearray (as Raft loads a snapshot) the index's arrays are views of it, not copies."""
    try:
        view = memoryview(data)
        (n,) = _HEAD_LEN.unpack_from(view)
        snap = _decoder.decode(view[_HEAD_LEN.size : _HEAD_LEN.size + n])
        if type(snap) is not dict:
            raise TypeError(f"a Raft snapshot is a map, not {type(snap).__name__}")
        _version(snap.get("v"), "a Raft snapshot")
        start = _HEAD_LEN.size + n + _pad(_HEAD_LEN.size + n)
        index = _unpack_arrays(snap["index"], view[start:])
        s = _state_head(snap["head"], _int(index["merge_threshold"], 1), MAX_INT)
        s.index.restore(index)
    except msgspec.DecodeError as exc:
        raise WireError(f"a Raft snapshot that is not msgpack: {exc}") from exc
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, struct.error) as exc:
        if isinstance(exc, WireError):
            raise
        raise WireError(f"a malformed Raft snapshot: {exc}") from exc
    s.rebuild_endpoints()
    return s


# -- frames ------------------------------------------------------------------------------------


def frame(obj: dict[str, Any]) -> bytes:
    body = _encoder.encode(obj)
    return HEADER.pack(len(body)) + body


def snapshot_message(snap: dict[str, Any]) -> dict[str, Any]:
    """The snapshot frame's message for `snapshot_of`'s result (encode it with `frame`, off the state lock)."""
    return {"v": VERSION, "k": "snapshot", "position": snap["applied"], "group": _group(snap["epoch_counter"]), "state": snap}


def snapshot_frame_parts(head: dict[str, Any], entries: FrozenEntries) -> list[bytes | memoryview]:
    """`frame(snapshot_message(complete(head, entries)))` as pieces that join to the same bytes, the entry
    columns as views of their arrays rather than copies.

    At 5M entries the frame is 80 MB, and each copy of it (the columns' `tobytes`, the encoder's output, the
    length header's concatenation) is a memcpy that holds the GIL: on a loaded two-core machine, long enough
    that the replica's Raft thread missed its heartbeats and the followers elected another leader. Here only
    the head (nodes, replicas: small) is encoded; the columns go out as they are.
    """
    columns = _columns(entries)
    # The columns are the last fields of the last field: encoded empty, they end the message, after map headers
    # that already count them.
    body = _encoder.encode(snapshot_message({**head, **dict.fromkeys(columns, b"")}))
    empty = b"".join(_encoder.encode(name) + _bin_header(0) for name in columns)
    parts: list[bytes | memoryview] = []
    prefix = body[: len(body) - len(empty)]
    for name, column in columns.items():
        parts += [prefix + _encoder.encode(name) + _bin_header(column.nbytes), column.data.cast("B")]
        prefix = b""
    parts[0] = HEADER.pack(sum(len(p) for p in parts)) + parts[0]
    return parts


def _bin_header(n: int) -> bytes:
    """msgpack's header of `n` bytes of binary (bin8, bin16 or bin32), as msgspec writes it."""
    return b"\xc4" + bytes([n]) if n < 256 else b"\xc5" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xc6" + n.to_bytes(4, "big")


def batch_frame(position: int, commands: list[Command]) -> bytes:
    return frame({"v": VERSION, "k": "batch", "position": position, "commands": [encode_command(c) for c in commands]})


def tick_frame(position: int, fresh: bool, bound_s: float, *, group: int | None) -> bytes:
    return frame({"v": VERSION, "k": "tick", "position": position, "fresh": fresh, "bound_s": bound_s, "group": group})


def decode_batch(f: dict[str, Any]) -> tuple[int, list[Command]]:
    """A batch frame's position and commands, every one decoded and checked before any is applied."""
    return f["position"], [decode_command(c) for c in f["commands"]]


def _check(obj: Any) -> dict[str, Any]:
    """`obj` if it is a frame whose fields have their types and ranges (a batch's commands and a snapshot's
    state are checked when decoded: `decode_batch`, `state_from`)."""
    if type(obj) is not dict or obj.get("k") not in ("snapshot", "batch", "tick"):
        raise WireError("a frame that is not a snapshot, batch or tick")
    kind = obj["k"]
    _version(obj.get("v"), f"a {kind} frame")
    try:
        _int(obj["position"])
        if kind == "tick":
            _bool(obj["fresh"])
            if _number(obj["bound_s"]) < 0:
                raise ValueError(f"a negative bound_s {obj['bound_s']}")
        elif kind == "batch":
            _list(obj["commands"])
        elif type(obj["state"]) is not dict:
            raise TypeError(f"a snapshot's state is a map, not {type(obj['state']).__name__}")
        if kind != "batch":
            _opt_int(obj["group"])
    except KeyError as exc:
        raise WireError(f"a {kind} frame without {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise WireError(f"a malformed {kind} frame: {exc}") from exc
    return obj


class FrameReader:
    """Splits a byte stream into decoded frames (dicts, their fields checked: `_check`), whatever the chunking."""

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
            out.append(_check(obj))
        return out
