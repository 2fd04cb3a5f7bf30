"""The watch stream's wire format: the directory's commands and state snapshots as msgpack frames.

`GET /v1/watch` sends a byte stream of frames, each a 4-byte little-endian length and that many
bytes of msgpack (one of the three frame kinds below). A consumer that applies the snapshot and then
every batch, in order, to a `DirectoryState` of its own holds exactly the replicas' state: the
state machine is deterministic, so the same commands give the same state and results. This module is
shared by the replica (which encodes) and the gateway's mirror (which decodes); it carries no
pickle, so a consumer never runs code chosen by whoever sends it bytes.

Frames (msgpack maps; `k` names the kind):
- `{"k": "snapshot", "position": P, "group": G, "state": {...}}`: the whole state at position P.
- `{"k": "batch", "position": P, "commands": [...]}`: the commands that brought the state to P.
- `{"k": "tick", "position": P, "fresh": bool, "bound_s": float, "group": G}`: nothing new up to P; `fresh`
  says whether the sending replica was caught up with a leader within its staleness bound `bound_s`.
`G` is the group's identity (`group_of`), nil before its first registration.

Everything decoded is checked (`WireError` else): the frames' fields, every command's types and ranges,
and a snapshot's internal consistency (node indices within its bounds and at most `MAX_NODES`, every
holder a registered node, every slot within its node's capacity, each (key, node) pair once), so that
whoever can send a consumer bytes cannot make it fail outside `WireError` or allocate by a number it
chose (a node index near 2**32 sized the index's per-node counts at tens of GB).

Commands are lists led by a one-letter tag; hashes are packed little-endian uint64 bytes and slots
uint32, so a publish of n blocks costs two byte strings, not n objects.
"""

from __future__ import annotations

import math
import struct
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

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


class WireError(ValueError):
    """A frame that does not decode to a command, batch or snapshot."""


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
    models, fingerprint, tenant, shared, *rest = _list(v)  # no fifth: a replica of before DP ranks
    if len(rest) > 1:
        raise WireError(f"a profile of {4 + len(rest)} fields")
    dp_rank = _opt_int(rest[0], 0, 65535) if rest else None
    return NodeProfile(tuple(_str(m) for m in _list(models)), _opt_str(fingerprint), _str(tenant), _bool(shared), dp_rank)


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
            profile = _unprofile(f[8]) if len(f) > 8 and f[8] is not None else None  # absent: a replica of before profiles
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
            return Deregister(_str(f[0]), _opt_int(f[1]) if len(f) > 1 else None)  # absent: an older replica
        if tag == "C":
            return Clear(_str(f[0]), _int(f[1]))
        if tag == "E":
            return Expire(_str(f[0]), _int(f[1]), _int(f[2]))
        if tag == "A":
            return AnnounceReplica(_str(f[0]), _str(f[1]))
        if tag == "S":
            return _assign_shards(f)
        if tag == "N":
            return Noop()
    except (TypeError, ValueError, IndexError, AttributeError) as exc:
        raise WireError(f"a malformed command: {exc}") from exc
    raise WireError(f"an unknown command tag {tag!r:.40}")


def _assign_shards(f: list[Any]) -> AssignShards:
    names = tuple(_str(n) for n in _list(f[2]))
    pins = tuple((_str(a), _str(b)) for a, b in (_list(p) for p in _list(f[3])))
    if not names:
        raise ValueError("a shard map of no shards")
    return AssignShards(_int(f[0]), _str(f[1]), names, pins, _str(f[4]), _bool(f[5]) if len(f) > 5 else False)


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
    if type(snap) is not dict:
        raise TypeError(f"a snapshot is a map, not {type(snap).__name__}")
    max_nodes = _int(snap["max_nodes"], 1)
    if max_nodes > MAX_NODES:
        raise ValueError(f"max_nodes {max_nodes}: a mirror holds at most {MAX_NODES} nodes")
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
        f = _list(f)
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
            _unprofile(f[11]) if len(f) > 11 and f[11] is not None else None,
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
    return s


# -- frames ------------------------------------------------------------------------------------


def frame(obj: dict[str, Any]) -> bytes:
    body = _encoder.encode(obj)
    return HEADER.pack(len(body)) + body


def snapshot_message(snap: dict[str, Any]) -> dict[str, Any]:
    """The snapshot frame's message for `snapshot_of`'s result (encode it with `frame`, off the state lock)."""
    return {"k": "snapshot", "position": snap["applied"], "group": _group(snap["epoch_counter"]), "state": snap}


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
    return frame({"k": "batch", "position": position, "commands": [encode_command(c) for c in commands]})


def tick_frame(position: int, fresh: bool, bound_s: float, *, group: int | None) -> bytes:
    return frame({"k": "tick", "position": position, "fresh": fresh, "bound_s": bound_s, "group": group})


def decode_batch(f: dict[str, Any]) -> tuple[int, list[Command]]:
    """A batch frame's position and commands, every one decoded and checked before any is applied."""
    return f["position"], [decode_command(c) for c in f["commands"]]


def _check(obj: Any) -> dict[str, Any]:
    """`obj` if it is a frame whose fields have their types and ranges (a batch's commands and a snapshot's
    state are checked when decoded: `decode_batch`, `state_from`)."""
    if type(obj) is not dict or obj.get("k") not in ("snapshot", "batch", "tick"):
        raise WireError("a frame that is not a snapshot, batch or tick")
    kind = obj["k"]
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
        if "group" in obj:  # absent: a replica of before group identities
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
