"""The directory's one wire codec: Raft log entries, Raft snapshots and the watch stream, in msgpack.

Everything the replicated log carries is encoded here and nowhere else: a Raft entry is a batch of commands
(`encode_entry`), a Raft snapshot the whole state (`encode_state`), and the watch stream sends the same commands
and a snapshot of the same state to the gateways' mirrors (`batch_frame`, `snapshot_frame_parts`). pysyncobj still
pickles its own messages, but what they carry of kvdir's is these bytes: the Raft port's unpickler builds no
kvdir class and no numpy array (directory/raft_transport.py).

Every encoding carries `VERSION`, and every decoder refuses another one (`VersionError`): a replica never
applies an entry, nor loads a snapshot, whose layout it would have to guess, and a mirror refuses a stream it
cannot read (it falls back to asking the directory over REST). Adding a field to a command is a change to
its struct in kvproto.state only, and a version bump; docs/protocol.md §3.3 says how a cluster moves
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

Commands are the msgspec structs of kvproto.state, arrays led by a one-letter tag, decoded against those same
structs (every field's type and range); hashes are packed little-endian uint64 bytes and slots uint32, so a
publish of n blocks costs two byte strings, not n objects.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec
import numpy as np

from kvproto import media
from kvproto.index_levels import FrozenEntries
from kvproto.schemas import Region
from kvproto.state import (
    EPOCH_BASE_BITS,
    MAX_INT,
    AssignShards,
    Command,
    DirectoryState,
    Finite,
    Int64,
    Node,
    NodeProfile,
    U32Array,
    U64Array,
)

HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 30
MEDIA_TYPE = "application/x-kvdir-watch"
MAX_NODES = 1 << 16
"""The most node indices a decoded state may hold (`max_nodes`): a consumer's index allocates per node index
on every lookup. A directory run with a larger --max-nodes cannot be mirrored (the gateway asks it over REST)."""

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


class _ArrayRef(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    """Where one of a Raft snapshot's arrays lies in the blob after its head."""

    code: Annotated[int, msgspec.Meta(ge=0, le=len(_ARRAY_DTYPES) - 1)]  # its type: a position in _ARRAY_DTYPES
    offset: Int64
    count: Int64


def _unpack_arrays(obj: Any, blob: memoryview) -> Any:
    """`_pack_arrays` undone: views of `blob` where it is writable (a bytearray: the index writes in place), copies
    where it is not."""
    if type(obj) is dict:
        if obj.keys() == {"array"}:
            ref = _convert(obj["array"], _ArrayRef, "array reference")
            dtype = _ARRAY_DTYPES[ref.code]
            if ref.offset % _ALIGN or ref.offset + ref.count * dtype.itemsize > len(blob):
                raise WireError(f"an array of {ref.count} at {ref.offset} in a blob of {len(blob)} bytes")
            array = np.frombuffer(blob, dtype=dtype, count=ref.count, offset=ref.offset)
            return array.copy() if blob.readonly else array
        return {k: _unpack_arrays(v, blob) for k, v in obj.items()}
    if type(obj) is list:
        return [_unpack_arrays(v, blob) for v in obj]
    return obj


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


# -- a snapshot's head: what a state holds besides its entries --------------------------------------


_Positive = Annotated[int, msgspec.Meta(ge=1, le=MAX_INT)]
"""A size or a bound: at least 1."""


class _NodeRow(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    """A registered node as a snapshot lists it (kvproto.state.Node's fields, in its order)."""

    node_id: str
    idx: Int64
    epoch: Int64
    incarnation: str
    api_url: str
    transfer_url: str | None
    regions: tuple[Region, ...]
    capacity_blocks: Int64 | None
    block_size: _Positive | None
    load: dict[str, Finite]
    seen: Int64
    profile: NodeProfile | None


_NODE_FIELDS = _NodeRow.__struct_fields__


class _StateHead(msgspec.Struct, frozen=True):
    """A snapshot's head: the state's counters, nodes, replicas and shard map. A map (a snapshot's entry columns
    sit beside these keys); checked field by field when a snapshot is decoded (`state_from`, `decode_state`),
    then across fields by `_state_head`."""

    applied: Int64
    max_nodes: _Positive
    max_entries: _Positive
    epoch_counter: Int64
    free_idx: list[Int64]
    next_idx: Int64
    replicas: dict[str, str]
    shard_map: list[Any] | None  # an AssignShards' fields, untagged
    nodes: list[_NodeRow]


def _enc_hook(obj: Any) -> Any:
    """A command's arrays as their bytes (already little-endian and contiguous: the commands' `__post_init__`):
    a copy while small (cheaper for msgspec than a memoryview), the array's own buffer once large."""
    if isinstance(obj, np.ndarray):
        return obj.tobytes() if obj.nbytes < 1 << 16 else obj.data
    raise TypeError(f"not a directory command's field: {type(obj).__name__}")


_ARRAYS: dict[type, np.dtype[Any]] = {U64Array: np.dtype("<u8"), U32Array: np.dtype("<u4")}


def _dec_hook(kind: type, obj: Any) -> Any:
    """A command's packed array, a writable copy of its bytes (the index's compiled kernels are warmed up for
    writable arrays, kvproto.index.warm_up: a read-only view would compile another signature on the Raft thread);
    the command makes it a plain ndarray."""
    dtype = _ARRAYS.get(kind)
    if dtype is None:
        raise TypeError(f"no decoder for {kind.__name__}")
    if type(obj) is not bytes:
        raise TypeError(f"packed bytes were due, not {type(obj).__name__}")
    if len(obj) % dtype.itemsize:
        raise ValueError(f"a {dtype.name} array of {len(obj)} bytes")
    return np.frombuffer(obj, dtype=dtype).copy().view(kind)


def _column(b: Any, kind: type) -> np.ndarray:
    """A snapshot's entry column, as a plain array."""
    return np.asarray(_dec_hook(kind, b))


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder()
_command_decoder = msgspec.msgpack.Decoder(Command, dec_hook=_dec_hook)
_commands_decoder = msgspec.msgpack.Decoder(list[Command], dec_hook=_dec_hook)
_entry_decoder = msgspec.msgpack.Decoder(tuple[Any, msgspec.Raw])


def encode_command(c: Command) -> list[Any]:
    """A command as the msgpack array it is on the wire (decoded: the lists a watcher's frame holds)."""
    return _decoder.decode(_encoder.encode(c))  # type: ignore[no-any-return]


def decode_command(v: Any) -> Command:
    """The command that `v` (a decoded array, as `encode_command` returns) is, its fields checked; WireError else."""
    return _convert(v, Command)  # type: ignore[no-any-return]


def _convert(v: Any, kind: Any, what: str = "command") -> Any:
    try:
        return msgspec.convert(v, kind, dec_hook=_dec_hook)
    except msgspec.ValidationError as exc:
        raise WireError(f"a malformed {what}: {exc}") from exc


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
    """The state's `_StateHead` as the map it encodes to (built directly: under the state lock, O(nodes))."""
    return {
        "applied": s.applied,
        "max_nodes": s.max_nodes,
        "max_entries": s.max_entries,
        "epoch_counter": s.epoch_counter,
        "free_idx": list(s._free_idx),
        "next_idx": s._next_idx,
        "replicas": dict(s.replicas),
        "shard_map": None if s.shard_map is None else encode_command(s.shard_map)[1:],  # its fields, untagged
        "nodes": [[getattr(n, f) for f in _NODE_FIELDS] for n in s.nodes.values()],
    }


def state_from(snap: dict[str, Any], merge_threshold: int = 16384) -> DirectoryState:
    """A state equal to the one `snapshot_of` described; WireError if `snap` is malformed or inconsistent."""
    try:
        return _state_from(snap, merge_threshold)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, msgspec.ValidationError) as exc:
        raise WireError(f"a malformed snapshot: {exc}") from exc


def _state_from(snap: dict[str, Any], merge_threshold: int) -> DirectoryState:
    s = _state_head(snap, merge_threshold, MAX_NODES)
    _load_entries(s, snap)
    return s


def _state_head(snap: Any, merge_threshold: int, most_nodes: int) -> DirectoryState:
    """A state with the snapshot's nodes, replicas, shard map and counters, checked, and no entries yet."""
    head = msgspec.convert(snap, _StateHead)  # a ValidationError: the callers' malformed snapshot
    max_nodes = head.max_nodes
    if max_nodes > most_nodes:
        raise ValueError(f"max_nodes {max_nodes}: a mirror holds at most {most_nodes} nodes")
    if head.next_idx > max_nodes:
        raise ValueError(f"next_idx {head.next_idx} is out of range [0, {max_nodes}]")
    s = DirectoryState(max_nodes, head.max_entries, merge_threshold)
    s.applied = head.applied
    s.epoch_counter = head.epoch_counter
    s._next_idx = head.next_idx
    s._free_idx = [_below(i, s._next_idx, "a free index") for i in head.free_idx]
    s.replicas = head.replicas
    if head.shard_map is not None:
        s.shard_map = _convert(["S", *head.shard_map], AssignShards, "shard map")
    for row in head.nodes:
        _below(row.idx, s._next_idx, "a node's index")
        _below(row.epoch, s.epoch_counter + 1, "a node's epoch")
        n = Node(*(getattr(row, f) for f in _NODE_FIELDS))
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


def _below(v: int, bound: int, what: str) -> int:
    if v >= bound:
        raise ValueError(f"{what} {v} is out of range [0, {bound})")
    return v


def _load_entries(s: DirectoryState, snap: dict[str, Any]) -> None:
    """The snapshot's entry columns into `s`'s index, each checked against `s`'s nodes."""
    keys, holders, slots = _column(snap["keys"], U64Array), _column(snap["holders"], U32Array), _column(snap["slots"], U32Array)
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
        encoded = _encoder.encode(c)
        _command_decoder.decode(encoded)
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"a {type(c).__name__} the replicated log cannot carry: {exc}") from exc
    return msgspec.Raw(encoded)


def encode_entry(commands: Sequence[Command | msgspec.Raw]) -> bytes:
    """A Raft log entry: a batch of commands that the state machine applies in one call (each a command, or what
    `check_command` made of one)."""
    return _encoder.encode([VERSION, commands])


def decode_entry(data: bytes) -> list[Command]:
    """The commands of an entry `encode_entry` wrote; WireError (VersionError) for anything else."""
    try:
        version, commands = _entry_decoder.decode(data)
        _version(version, "a Raft entry")
        return _commands_decoder.decode(commands)
    except msgspec.ValidationError as exc:
        raise WireError(f"a malformed Raft entry: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise WireError(f"a Raft entry that is not msgpack: {exc}") from exc


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
        s = _state_head(snap["head"], msgspec.convert(index["merge_threshold"], _Positive), MAX_INT)
        s.index.restore(index)
    except msgspec.ValidationError as exc:
        raise WireError(f"a malformed Raft snapshot: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise WireError(f"a Raft snapshot that is not msgpack: {exc}") from exc
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, struct.error) as exc:
        if isinstance(exc, WireError):
            raise
        raise WireError(f"a malformed Raft snapshot: {exc}") from exc
    s.rebuild_endpoints()
    return s


# -- frames ------------------------------------------------------------------------------------


def frame(obj: dict[str, Any] | _Frame) -> bytes:
    """A frame's bytes: its length, then its msgpack (a message map, or one of the frame structs below)."""
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


class _Frame(msgspec.Struct, tag_field="k", frozen=True):
    """A watch stream frame: a msgpack map, its kind in `k` and this codec's version in `v` (checked first,
    `decode_frame`: a frame without one is refused as another version's)."""

    position: Int64
    v: int


class SnapshotFrame(_Frame, tag="snapshot", frozen=True):
    """The whole state at `position` (checked when decoded: `state_from`, off the event loop)."""

    group: Int64 | None
    state: dict[str, Any]


class BatchFrame(_Frame, tag="batch", frozen=True):
    """The commands that brought the state to `position`, every one decoded and checked with the frame."""

    commands: list[Command]


class TickFrame(_Frame, tag="tick", frozen=True):
    """Nothing new up to `position`; `fresh`: the sender was caught up with a leader within `bound_s`."""

    fresh: bool
    bound_s: Annotated[float, msgspec.Meta(ge=0.0, le=sys.float_info.max)]
    group: Int64 | None


Frame = SnapshotFrame | BatchFrame | TickFrame
_frame_decoder = msgspec.msgpack.Decoder(Frame, dec_hook=_dec_hook)


class _Versioned(msgspec.Struct):
    k: Any = None
    v: Any = None


def batch_frame(position: int, commands: list[Command]) -> bytes:
    return frame(BatchFrame(position, VERSION, commands))


def tick_frame(position: int, fresh: bool, bound_s: float, *, group: int | None) -> bytes:
    return frame(TickFrame(position, VERSION, fresh, bound_s, group))


def decode_frame(body: bytes) -> Frame:
    """One frame's msgpack, its fields checked (a batch's commands too; a snapshot's state is checked by
    `state_from`); WireError (VersionError) else. A frame of another version is refused as that, whatever its
    layout: its version is read apart only when the frame does not decode (`_refusal`), so a frame is decoded
    once."""
    try:
        f: Frame = _frame_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise _refusal(body, exc) from exc
    except msgspec.DecodeError as exc:
        raise WireError(f"a frame that is not msgpack: {exc}") from exc
    _version(f.v, f"a {f.__struct_config__.tag} frame")
    return f


def _refusal(body: bytes, exc: msgspec.ValidationError) -> WireError:
    """Why a frame of msgpack does not decode: it is no frame, another version's, or malformed."""
    try:
        head = msgspec.msgpack.decode(body, type=_Versioned)
    except msgspec.ValidationError as not_a_map:
        return WireError(f"a frame that is not a snapshot, batch or tick: {not_a_map}")
    if head.k not in ("snapshot", "batch", "tick"):
        return WireError(f"a frame that is not a snapshot, batch or tick: {head.k!r:.40}")
    try:
        _version(head.v, f"a {head.k} frame")
    except VersionError as other:
        return other
    return WireError(f"a malformed {head.k} frame: {exc}")


class FrameReader:
    """Splits a byte stream into decoded frames (`decode_frame`), whatever the chunking."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self._max = max_frame_bytes

    def feed(self, chunk: bytes) -> list[Frame]:
        self._buf += chunk
        out: list[Frame] = []
        while len(self._buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self._buf)
            if n > self._max:
                raise WireError(f"a frame of {n} bytes (the limit is {self._max})")
            if len(self._buf) < HEADER.size + n:
                break
            body = bytes(self._buf[HEADER.size : HEADER.size + n])
            del self._buf[: HEADER.size + n]
            out.append(decode_frame(body))
        return out
