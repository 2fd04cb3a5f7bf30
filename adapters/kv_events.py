"""Engine KV events (docs/protocol.md §5): decoding and mapping engine block hashes to ours.

Over 400 lines: both wire encodings of vLLM's and SGLang's events and the hash mapper that consumes
them, tested together against captured frames.

Pure code: no sockets, no clocks. `adapters.subscriber` feeds it ZMQ
frames and sends what it returns to the directory.

Wire format
-----------
One ZMQ multipart message per engine step that has events:
``[topic, seq, payload]``.

* ``topic``: bytes, the publisher's configured topic (vLLM's default is empty).
* ``seq``: 8 bytes, big-endian signed; counts up from 0 per publisher
  (so it restarts at 0 when the engine restarts). The replay socket uses -1
  as its end marker.
* ``payload``: msgpack of an event batch. Positional (msgspec
  ``array_like=True``): ``[ts, events]`` or ``[ts, events, data_parallel_rank]``
  (the rank is left out when None). A map form ``{"ts", "events",
  "data_parallel_rank" | "attn_dp_rank"}`` is accepted too: vLLM's
  ``EventBatch`` dropped ``array_like`` in some revisions.

Each event is decided on its own:

* positional, tagged by class name (msgspec ``array_like=True, tag=True``,
  older vLLM and SGLang): ``["BlockStored", block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium?, lora_name?, extra_keys?, ...]``,
  ``["BlockRemoved", block_hashes, medium?, group_idx?, ...]``,
  ``["AllBlocksCleared"]``;
* a map with a ``"type"`` field (vLLM >= 0.11, the captures in
  shared/data/vllm_kv_events, TensorRT-LLM): ``{"type": "BlockStored",
  "block_hashes": [...], ...}``.

Block hashes are opaque engine values: unsigned 64-bit ints (vLLM's default,
the low 64 bits of a sha256), signed 64-bit ints (SGLang), or raw bytes
(vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: 32-byte digests). They are
only ever compared for equality here.

Never fatal: a message with the wrong frame count, a seq that is not 8
bytes or a payload that is not msgpack of a batch is a *garbage frame*
(counted, skipped). An event of an unknown type is counted and skipped; so
is a malformed one (wrong field types, token count not matching). Fields
nobody here knows are counted as *extra fields* and ignored.

What SGLang sends, and how it differs from vLLM
-----------------------------------------------
Read in sgl-project/sglang, python/sglang/srt/disaggregation/kv_events.py
(stored revisions 006d053f and 612d5790) and
python/sglang/srt/mem_cache/events.py (revision 06f643f4):

* Same ZMQ framing and the same ``ZmqEventPublisher`` (PUB + optional ROUTER
  replay, seq from 0, -1 end marker), copied from vLLM.
* The batch is positional, ``[ts, events]``, with ``attn_dp_rank`` as the
  optional third element in newer revisions (vLLM calls it
  ``data_parallel_rank``).
* Events are positional arrays tagged by class name (``array_like=True,
  tag=True``), never maps. Older revisions: ``["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id]`` and
  ``["BlockRemoved", block_hashes]``. Newer ones add ``medium``,
  ``lora_name``, ``cache_salt`` and ``session_id`` after those: positions 0-4
  are the same as vLLM's, and the later ones are only taken when their type
  fits (a string or None), so an unexpected order costs at worst an identity
  no lookup uses (a miss, never a wrong hit).
* Hashes are signed int64 (``hash_str_to_int64``), so they can be negative.
* One BlockStored per page, coalesced into parent-linked chains; the last
  page of a radix node may be partial, and then ``block_size`` is that
  page's token count. Such a block is not a full block of ours: it is
  skipped (counted as unsupported), like a block of any size that is not a
  multiple of ours. SGLang's default page size is 1: run it with
  ``--page-size`` equal to (or a multiple of) our block size.
* ``token_ids`` may hold pairs (EAGLE bigram keys): malformed here, skipped.

Hash mapping
------------
`HashMapper` keeps, per engine (one mapper per subscriber), engine hash ->
our sequence hashes (docs/protocol.md §1), bounded by an LRU of `max_entries`
engine hashes. A BlockStored's tokens are hashed with our block size and
chained from the sequence hash of its parent (``parent_block_hash``, looked
up in the map; None means the start of a sequence). A parent the map does
not know (evicted from the LRU, or stored before the subscriber started or
during a resync) makes the event a *missing parent*: counted, nothing
published, since the chain cannot be computed. BlockRemoved resolves through
the map; an unknown hash is counted and harmless.

Block sizes: equal sizes map one to one. An engine block size that is a
multiple k of ours splits each engine block into k of our blocks: the
engine hash maps to all k (removing it removes all k) and chains its
children from the last of them. Anything else is unsupported (counted,
skipped).

Several engine hashes may name the same block of ours (the same tokens
under two cache groups or media): ours are reference counted, and a removal
reaches the directory only when no engine hash holds the block any more.
An engine hash evicted from the LRU is removed from the directory too (a
miss is safe, a stale entry is not), so `max_entries` must exceed the
engine's pool (vLLM's num_gpu_blocks, plus offloaded tiers).

KV identity (docs/protocol.md §1.1): a block is hashed under
``KvIdentity(namespace, model, adapter, cache_salt)``, as the gateway hashes a request: the namespace
and model are the subscriber's (``--namespace``, ``--model``; an engine of ``--engines`` may name its
own model), the adapter is the event's ``lora_name`` (``"lora_id=" + id`` when only the deprecated id
is sent: no gateway names an adapter so, a miss), and the cache salt is SGLang's ``cache_salt``
field. vLLM carries the LoRA adapter and the salt inside the per-block ``extra_keys`` instead (vLLM
0.32's ``generate_block_hash_extra_keys``: a tuple of keys per block, msgpack arrays on the wire):

* ``("lora", name, path)``: the adapter (it must agree with ``lora_name`` when both are sent);
* ``("cache_salt", salt)``: the salt, on the request's first block only. A child event carries no
  salt, so it inherits its parent's (each map entry keeps the salt it was hashed under): the whole
  chain is hashed under the salted identity, as the gateway hashes the salted request;
* ``("mm", identifier, offset)``: a multimodal input the block covers, starting ``offset`` tokens
  after the block's first token (negative: before). It is our extra key ``mm:IDENTIFIER:OFFSET``,
  folded into the block's local hash (``kvproto.hashing.mix_extra``), so such a block hashes
  exactly as ``identity_hashes(..., extra=multimodal_extra_keys(...))`` would;
* anything else (``("prompt_embeds", digest)``, kinds nobody here knows) is folded in as the key
  ``raw:`` + the hex of its msgpack: no gateway lookup ever names it, so the block and every later
  block of its chain are misses, never wrong hits.

Older vLLM sent the same keys untagged (the LoRA name as a string, ``(identifier, offset)`` pairs, the
salt as a string on the first block, the embeddings' digest as bytes); those are understood too: a
string equal to the event's ``lora_name`` is the adapter, another string on a root event's first
block is the salt. With an engine block size k times ours, an input's key goes to each of our k
blocks it covers; where that cannot be told from the event (an input that starts in the engine block
and does not visibly continue into the next one: its length is not sent), the later blocks get a key
no lookup names (a miss).

Events for cache groups that are not full attention (``kv_cache_spec_kind``, e.g. sliding window) are
skipped: they say nothing about reusable prefixes.
"""

from __future__ import annotations

import array
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np

from kvproto.hashing import U32_MAX, KvIdentity, chain_hashes, extra_key_bytes, local_hashes, mix_extra, seed_for

EngineHash = int | bytes
"""An engine's block hash: opaque, compared for equality only."""

END_SEQ = -1
"""The seq of the replay socket's end-of-replay marker."""

_seq = struct.Struct(">q")
# Token ids and engine hashes are checked by msgspec in C (strict: a bool is not an int): a loop over
# a 64-block event's 1,024 tokens in Python cost more than everything else the adapter does with it.
_TOKENS = list[Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)]]
_INT_HASHES = list[int]
_U32 = next(c for c in "IL" if array.array(c).itemsize == 4)  # the array typecode of a native uint32


# -- decoded events --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stored:
    """Full blocks stored by the engine: ``len(token_ids) == block_size * len(engine_hashes)``."""

    engine_hashes: tuple[EngineHash, ...]
    parent: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    medium: str | None = None
    cache_salt: str | None = None
    extra_keys: tuple[Any, ...] | None = None  # one entry per engine block, None where there is none
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    engine_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    """AllBlocksCleared: the engine dropped every block (e.g. /reset_prefix_cache)."""


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    """One ZMQ message: the events of one engine step, in order."""

    seq: int
    ts: float | None
    events: tuple[Event, ...]
    topic: bytes = b""
    dp_rank: int | None = None


@dataclass(slots=True)
class DecodeStats:
    """Counters of what decoding saw; the subscriber exports them as Prometheus counters."""

    messages: int = 0  # messages decoded (garbage excluded)
    garbage_frames: int = 0  # messages skipped: wrong frame count, bad seq, bad payload
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    unknown_events: int = 0  # an event type nobody here knows
    malformed_events: int = 0  # a known type with fields of the wrong shape
    extra_fields: int = 0  # fields nobody here knows (ignored)
    skipped_groups: int = 0  # stores of cache groups that are not full attention


class DecodeError(ValueError):
    """A message or payload that is not a KV event batch."""


# -- decoding --------------------------------------------------------------------

_STORED_MAP_KEYS = frozenset(
    {
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "cache_salt",
        "group_idx",
    }
)
_REMOVED_MAP_KEYS = frozenset({"type", "block_hashes", "medium", "group_idx"})
# Known, carry nothing the directory needs: not counted as extra.
_IGNORED_KEYS = frozenset(
    {
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
    }
)
# vLLM's positional field order after the tag; positions past the last are extra.
_STORED_POSITIONS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
)
_REMOVED_POSITIONS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_FULL_ATTENTION = "full_attention"


class _Malformed(Exception):
    pass


def parse_seq(raw: bytes) -> int:
    """An 8-byte big-endian signed sequence number."""
    if not isinstance(raw, (bytes, bytearray, memoryview)) or len(raw) != 8:
        raise DecodeError(f"a seq frame has 8 bytes, got {len(raw) if hasattr(raw, '__len__') else raw!r}")
    seq: int = _seq.unpack(bytes(raw))[0]
    return seq


def encode_seq(seq: int) -> bytes:
    return _seq.pack(seq)


def decode_message(frames: Sequence[bytes], stats: DecodeStats | None = None) -> Batch | None:
    """A ``[topic, seq, payload]`` message -> Batch; None (counted as garbage) if it is not one."""
    stats = stats if stats is not None else DecodeStats()
    try:
        if len(frames) != 3:
            raise DecodeError(f"expected 3 frames, got {len(frames)}")
        topic, raw_seq, payload = frames
        seq = parse_seq(raw_seq)
        ts, events, dp_rank = decode_payload(payload, stats)
    except DecodeError:
        stats.garbage_frames += 1
        return None
    stats.messages += 1
    return Batch(seq=seq, ts=ts, events=events, topic=bytes(topic), dp_rank=dp_rank)


def decode_replay_reply(frames: Sequence[bytes]) -> tuple[int, bytes]:
    """One reply of a replay socket, as a DEALER receives it -> (seq, payload); seq is END_SEQ at the end.

    vLLM and SGLang send ``[b"", seq, payload]`` (and ``[b"", END, b""]`` last);
    TensorRT-LLM puts the topic first: ``[b"", topic, seq, payload]``. A REQ
    socket strips the empty delimiter, so it is optional here.
    """
    parts = list(frames)
    if parts and len(parts) in (3, 4) and len(parts[0]) == 0:
        parts = parts[1:]
    if len(parts) == 3:
        parts = parts[1:]  # topic first
    if len(parts) != 2:
        raise DecodeError(f"a replay reply has [seq, payload], got {len(frames)} frames")
    return parse_seq(parts[0]), bytes(parts[1])


def decode_payload(payload: bytes, stats: DecodeStats | None = None) -> tuple[float | None, tuple[Event, ...], int | None]:
    """msgpack of an event batch -> (ts, events, dp_rank). Raises DecodeError if it is not a batch."""
    stats = stats if stats is not None else DecodeStats()
    try:
        obj = msgspec.msgpack.decode(payload)
    except Exception as exc:  # msgspec.DecodeError, or anything odd in a garbage buffer
        raise DecodeError(f"not msgpack: {exc}") from None
    ts: Any
    dp_rank: Any = None
    if isinstance(obj, list):
        if not 2 <= len(obj) <= 3:
            raise DecodeError(f"a batch array has 2 or 3 elements, got {len(obj)}")
        ts, raw_events = obj[0], obj[1]
        if len(obj) == 3:
            dp_rank = obj[2]
    elif isinstance(obj, dict):
        if "events" not in obj:
            raise DecodeError("a batch map has an 'events' field")
        ts, raw_events = obj.get("ts"), obj["events"]
        dp_rank = obj.get("data_parallel_rank", obj.get("attn_dp_rank"))
        stats.extra_fields += sum(1 for k in obj if k not in ("ts", "events", "data_parallel_rank", "attn_dp_rank"))
    else:
        raise DecodeError(f"a batch is an array or a map, got {type(obj).__name__}")
    if not isinstance(raw_events, list):
        raise DecodeError("a batch's events are an array")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float))):
        raise DecodeError("a batch's ts is a number")
    if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int)):
        dp_rank = None
    events: list[Event] = []
    for raw in raw_events:
        ev = decode_event(raw, stats)
        if ev is not None:
            events.append(ev)
    return (float(ts) if ts is not None else None), tuple(events), dp_rank


def decode_event(raw: Any, stats: DecodeStats | None = None) -> Event | None:
    """One event, positional (tag first) or a map with "type"; None if unknown or malformed (counted)."""
    stats = stats if stats is not None else DecodeStats()
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind, fields = raw[0], _positional(raw[0], raw[1:], stats)
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        kind, fields = raw["type"], raw
        known = {"BlockStored": _STORED_MAP_KEYS, "BlockRemoved": _REMOVED_MAP_KEYS, "AllBlocksCleared": frozenset({"type"})}.get(
            kind
        )
        if known is not None:
            stats.extra_fields += sum(1 for k in raw if k not in known and k not in _IGNORED_KEYS)
    else:
        stats.malformed_events += 1
        return None
    try:
        if kind == "BlockStored":
            if fields is None:
                raise _Malformed
            kind_of_cache = fields.get("kv_cache_spec_kind")
            if kind_of_cache is not None and kind_of_cache != _FULL_ATTENTION:
                stats.skipped_groups += 1
                return None
            ev: Event = _stored(fields)
            stats.stored += 1
        elif kind == "BlockRemoved":
            if fields is None:
                raise _Malformed
            ev = Removed(_hashes(fields.get("block_hashes")), _opt_str(fields.get("medium")), _opt_int(fields.get("group_idx")))
            stats.removed += 1
        elif kind == "AllBlocksCleared":
            ev = Cleared()
            stats.cleared += 1
        else:
            stats.unknown_events += 1
            return None
    except _Malformed:
        stats.malformed_events += 1
        return None
    return ev


def _positional(kind: str, values: list[Any], stats: DecodeStats) -> dict[str, Any] | None:
    names = {"BlockStored": _STORED_POSITIONS, "BlockRemoved": _REMOVED_POSITIONS, "AllBlocksCleared": ()}.get(kind)
    if names is None:
        return None
    if len(values) > len(names):
        stats.extra_fields += len(values) - len(names)
    out = dict(zip(names, values))
    # Past the fields every version shares, keep a value only if its type fits (SGLang's later fields differ).
    for name in ("medium", "lora_name", "kv_cache_spec_kind"):
        if name in out and out[name] is not None and not isinstance(out[name], str):
            del out[name]
    if "extra_keys" in out and out["extra_keys"] is not None and not isinstance(out["extra_keys"], list):
        del out["extra_keys"]
    if "group_idx" in out and not (
        out["group_idx"] is None or (isinstance(out["group_idx"], int) and not isinstance(out["group_idx"], bool))
    ):
        del out["group_idx"]
    if kind == "BlockStored" and len(values) < 4:
        return None
    if kind == "BlockRemoved" and len(values) < 1:
        return None
    return out


def _stored(f: dict[str, Any]) -> Stored:
    hashes = _hashes(f.get("block_hashes"))
    parent = f.get("parent_block_hash")
    if parent is not None:
        parent = _hash(parent)
    tokens = f.get("token_ids")
    size = f.get("block_size")
    if not isinstance(tokens, list) or isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise _Malformed
    try:
        msgspec.convert(tokens, _TOKENS)
    except msgspec.ValidationError:
        raise _Malformed from None  # also EAGLE bigram pairs
    if len(tokens) != size * len(hashes):
        raise _Malformed
    extra = f.get("extra_keys")
    extra_keys: tuple[Any, ...] | None = None
    if isinstance(extra, list) and len(extra) == len(hashes) and any(e is not None for e in extra):
        extra_keys = tuple(_freeze(e) for e in extra)
    return Stored(
        engine_hashes=hashes,
        parent=parent,
        token_ids=tuple(tokens),
        block_size=size,
        lora_id=_opt_int(f.get("lora_id")),
        lora_name=_opt_str(f.get("lora_name")) or None,
        medium=_opt_str(f.get("medium")),
        cache_salt=_opt_str(f.get("cache_salt")) or None,
        extra_keys=extra_keys,
        group_idx=_opt_int(f.get("group_idx")),
    )


def _hash(v: Any) -> EngineHash:
    if isinstance(v, bool):
        raise _Malformed
    if isinstance(v, int):
        return v
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    raise _Malformed


def _hashes(v: Any) -> tuple[EngineHash, ...]:
    if not isinstance(v, list):
        raise _Malformed
    try:
        return tuple(msgspec.convert(v, _INT_HASHES))  # the usual case: 64-bit ints, checked in C
    except msgspec.ValidationError:
        return tuple(_hash(h) for h in v)  # bytes digests, or something malformed


def _opt_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _opt_str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _freeze(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted(((_freeze(k), _freeze(x)) for k, x in v.items()), key=repr))
    return v


# -- hash mapping ----------------------------------------------------------------


def event_identity(
    namespace: str = "",
    model: str = "",
    *,
    lora_name: str | None = None,
    lora_id: int | None = None,
    cache_salt: str | None = None,
) -> KvIdentity:
    """The identity an engine event's blocks are hashed under, from its own fields (see the module docstring;
    `HashMapper` also reads vLLM's extra keys and a parent's salt)."""
    adapter = lora_name or (f"lora_id={lora_id}" if lora_id is not None else "")
    return KvIdentity(namespace, model, adapter, cache_salt or "")


@dataclass(frozen=True, slots=True)
class MapResult:
    """What an event changes in the directory: our hashes to publish and to remove."""

    publish: tuple[int, ...] = ()
    remove: tuple[int, ...] = ()
    missing_parent: bool = False
    unsupported: str | None = None  # why the event could not be mapped


_Holder = tuple[int | None, str | None]  # (group_idx, medium)
_Entry = tuple[tuple[int, ...], tuple[_Holder, ...], str | None, str]
"""(ours, holders, medium, cache salt) of one engine block: the salt its chain was hashed under, which a
child event inherits. Plain tuples of ints and strings, so the garbage collector stops tracking them: with
a million entries, objects it tracked (a set each) made its full collections the adapter's largest cost."""


@dataclass(slots=True)
class MapperStats:
    stored_blocks: int = 0  # engine blocks mapped
    removed_blocks: int = 0  # engine blocks removed
    missing_parents: int = 0
    unsupported: int = 0
    unknown_removals: int = 0
    evicted: int = 0  # engine hashes dropped by the LRU bound
    unmapped_keys: int = 0  # extra keys folded in as raw keys (their blocks are misses)


class HashMapper:
    """Engine hash -> our sequence hashes for one engine, LRU-bounded. Not thread-safe.

    `namespace` and `model` are the identity's (docs/protocol.md §1.1) for every block; the adapter and the
    cache salt come from each event."""

    def __init__(self, block_size: int, namespace: str = "", max_entries: int = 1 << 20, *, model: str = "") -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.block_size = block_size
        self.namespace = namespace
        self.model = model
        self.max_entries = max_entries
        self.stats = MapperStats()
        self._map: OrderedDict[EngineHash, _Entry] = OrderedDict()
        self._refs: dict[int, int] = {}
        self._seeds: dict[tuple[str, str], tuple[str, int]] = {}  # (adapter, salt) -> (identity key, seed)

    _SEEDS_MAX = 4096  # distinct (adapter, salt) pairs remembered: salts can be per user

    def _seed(self, ident: KvIdentity) -> tuple[str, int]:
        """The identity's key and seed, remembered: its key is a JSON array once a model is set, and making it
        cost more than hashing a block."""
        got = self._seeds.get((ident.adapter, ident.cache_salt))
        if got is None:
            if len(self._seeds) >= self._SEEDS_MAX:
                self._seeds.clear()
            key = ident.key
            got = self._seeds[(ident.adapter, ident.cache_salt)] = (key, seed_for(key))
        return got

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, engine_hash: object) -> bool:
        return engine_hash in self._map

    def ours(self, engine_hash: EngineHash) -> tuple[int, ...] | None:
        """Our hashes for an engine hash (no LRU touch), or None."""
        e = self._map.get(engine_hash)
        return e[0] if e is not None else None

    def reset(self) -> None:
        """Forget everything (engine cleared, restarted, or a resync); counters stay."""
        self._map.clear()
        self._refs.clear()

    def snapshot(self) -> dict[int, str | None]:
        """Every hash of ours that some engine block holds -> a medium: what to republish under a new epoch."""
        out: dict[int, str | None] = {}
        for ours, _, medium, _ in self._map.values():
            for h in ours:
                out.setdefault(h, medium)
        return out

    def apply(self, ev: Event) -> MapResult:
        if isinstance(ev, Stored):
            return self.store(ev)
        if isinstance(ev, Removed):
            return self.remove(ev)
        removed = tuple(self._refs)
        self.reset()
        return MapResult(remove=removed)

    def identity(self, ev: Stored, parent_salt: str = "") -> tuple[KvIdentity, dict[int, bytes] | None]:
        """The identity `ev`'s blocks are hashed under, and the extra-key bytes of each of our blocks in it
        that has some (block index within the event -> bytes), from its fields and vLLM's extra keys."""
        k = ev.block_size // self.block_size
        adapter = ev.lora_name or ""
        salt = ev.cache_salt or ""
        if ev.extra_keys is None:
            if not adapter and ev.lora_id is not None:
                adapter = f"lora_id={ev.lora_id}"
            return KvIdentity(self.namespace, self.model, adapter, salt or parent_salt), None
        keys = _ExtraKeys(ev, k, self.block_size)
        if not adapter:
            adapter = keys.lora or (f"lora_id={ev.lora_id}" if ev.lora_id is not None else "")
        elif keys.lora and keys.lora != adapter:
            keys.unmappable(0, ("lora", keys.lora))
        if not salt:
            salt = keys.salt
        elif keys.salt and keys.salt != salt:
            keys.unmappable(0, ("cache_salt", keys.salt))
        self.stats.unmapped_keys += keys.raw_count
        return KvIdentity(self.namespace, self.model, adapter, salt or parent_salt), keys.blocks()

    def store(self, ev: Stored) -> MapResult:
        n = len(ev.engine_hashes)
        if n == 0:
            return MapResult()
        eb, ours_b = ev.block_size, self.block_size
        if len(ev.token_ids) != eb * n:
            self.stats.unsupported += 1
            return MapResult(unsupported=f"{len(ev.token_ids)} tokens for {n} blocks of {eb}")
        if eb % ours_b:
            self.stats.unsupported += 1
            return MapResult(unsupported=f"engine block size {eb} is not a multiple of {ours_b}")
        k = eb // ours_b
        prev: int | None = None
        parent_salt = ""
        if ev.parent is not None:
            parent = self._map.get(ev.parent)
            if parent is None:
                self.stats.missing_parents += 1
                return MapResult(missing_parent=True)
            self._map.move_to_end(ev.parent)
            prev, parent_salt = parent[0][-1], parent[3]
        ident, extra = self.identity(ev, parent_salt)
        try:  # array() packs the tuple in C; numpy's own conversion of a tuple is slower
            tokens = np.frombuffer(array.array(_U32, ev.token_ids), dtype=np.uint32)
        except (OverflowError, TypeError):
            self.stats.unsupported += 1
            return MapResult(unsupported="token ids are not unsigned 32-bit integers")
        # kvproto.hashing.identity_hashes(tokens, ident, ours_b, extra, prev), with the seed remembered
        key, seed = self._seed(ident)
        local = local_hashes(tokens, ours_b, key)
        if extra:
            local = [mix_extra(h, extra[i], seed) if i in extra else h for i, h in enumerate(local)]
        seq = chain_hashes(local, seed, prev)
        if k == 1:  # the usual case: one block of ours per engine block
            groups: Iterable[tuple[int, ...]] = ((h,) for h in seq)
        else:
            groups = (tuple(seq[i * k : (i + 1) * k]) for i in range(n))
        salt = ident.cache_salt
        holder = (ev.group_idx, ev.medium)
        holders = (holder,)
        publish: list[int] = []
        remove: list[int] = []
        entries, refs = self._map, self._refs
        for eh, ours in zip(ev.engine_hashes, groups):
            if eh in entries:
                self._put(eh, ours, holder, ev.medium, salt, publish, remove)
                continue
            # A new engine block (nearly every store): _put's work without the checks that cannot apply.
            entries[eh] = (ours, holders, ev.medium, salt)
            for h in ours:
                c = refs.get(h, 0)
                refs[h] = c + 1
                if c == 0:
                    publish.append(h)
                    if remove and h in remove:
                        remove.remove(h)
        self.stats.stored_blocks += n
        while len(self._map) > self.max_entries:
            _, old = self._map.popitem(last=False)
            self.stats.evicted += 1
            self._release(old[0], remove)
        return MapResult(publish=tuple(publish), remove=tuple(remove))

    def remove(self, ev: Removed) -> MapResult:
        remove: list[int] = []
        holder = (ev.group_idx, ev.medium)
        for eh in ev.engine_hashes:
            e = self._map.get(eh)
            if e is None:
                self.stats.unknown_removals += 1
                continue
            ours, holders, medium, salt = e
            if holder in holders:
                rest = tuple(x for x in holders if x != holder)
            elif len(holders) == 1:
                rest = ()  # one holder, labelled differently (an engine version mismatch): it is that one
            else:
                self.stats.unknown_removals += 1
                continue
            if rest:
                self._map[eh] = (ours, rest, medium, salt)  # keeps its place in the LRU
                continue
            del self._map[eh]
            self._release(ours, remove)
            self.stats.removed_blocks += 1
        return MapResult(remove=tuple(remove))

    def _put(
        self,
        eh: EngineHash,
        ours: tuple[int, ...],
        holder: _Holder,
        medium: str | None,
        salt: str,
        publish: list[int],
        remove: list[int],
    ) -> None:
        e = self._map.get(eh)
        if e is not None:
            self._map.move_to_end(eh)
            if e[0] == ours:
                if holder not in e[1]:
                    self._map[eh] = (ours, (*e[1], holder), e[2], e[3])
                return
            self._release(e[0], remove)  # the engine reused a hash for other content: trust the newest
            del self._map[eh]
        self._map[eh] = (ours, (holder,), medium, salt)
        for h in ours:
            c = self._refs.get(h, 0)
            self._refs[h] = c + 1
            if c == 0:
                publish.append(h)
                if h in remove:
                    remove.remove(h)

    def _release(self, ours: Iterable[int], remove: list[int]) -> None:
        for h in ours:
            c = self._refs.get(h, 0) - 1
            if c <= 0:
                self._refs.pop(h, None)
                remove.append(h)
            else:
                self._refs[h] = c


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def raw_key(key: Any) -> str:
    """The extra key of an engine key nothing here can map: no lookup ever names it, so its block is a miss."""
    try:
        return "raw:" + msgspec.msgpack.encode(key).hex()
    except (TypeError, ValueError, OverflowError):
        return "raw:" + repr(key).encode("utf-8", "backslashreplace").hex()


class _ExtraKeys:
    """One event's vLLM extra keys, sorted out (see the module docstring): the adapter and salt they name,
    and per block of ours the keys to fold in (`mm:ID:OFFSET`, then raw keys)."""

    def __init__(self, ev: Stored, k: int, block_size: int) -> None:
        self.k, self.block_size, self.engine_block = k, block_size, ev.block_size
        self.lora = ""
        self.salt = ""
        self.raw_count = 0
        assert ev.extra_keys is not None
        n = len(ev.engine_hashes)
        self._mm: list[list[tuple[int, str]]] = [[] for _ in range(n)]
        self._raw: list[list[str]] = [[] for _ in range(n)]
        for i, block in enumerate(ev.extra_keys):
            if block is None:
                continue
            for key in block if isinstance(block, tuple) else (block,):
                self._sort(i, key, ev)

    def _sort(self, i: int, key: Any, ev: Stored) -> None:
        if isinstance(key, tuple) and key:
            kind = key[0]
            if kind == "lora" and len(key) == 3 and isinstance(key[1], str) and key[1]:
                self._named("lora", key[1], i, key)
            elif kind == "cache_salt" and len(key) == 2 and isinstance(key[1], str) and key[1]:
                self._named("cache_salt", key[1], i, key)
            elif kind == "mm" and len(key) == 3 and isinstance(key[1], str) and key[1] and _is_int(key[2]):
                self._input(i, key[1], key[2], key)
            elif len(key) == 2 and isinstance(kind, str) and kind and _is_int(key[1]):  # older vLLM: (identifier, offset)
                self._input(i, kind, key[1], key)
            else:
                self.unmappable(i, key)
        elif isinstance(key, str) and key and key == ev.lora_name:  # older vLLM: the LoRA name
            self._named("lora", key, i, key)
        elif isinstance(key, str) and key and i == 0 and ev.parent is None:  # older vLLM: the salt, first block only
            self._named("cache_salt", key, i, key)
        else:
            self.unmappable(i, key)

    def _named(self, what: str, name: str, i: int, key: Any) -> None:
        have = self.lora if what == "lora" else self.salt
        if have and have != name:
            self.unmappable(i, key)  # two adapters or salts in one event: nothing matches it
        elif what == "lora":
            self.lora = name
        else:
            self.salt = name

    def _input(self, i: int, ident: str, offset: int, key: Any) -> None:
        if offset >= self.engine_block:
            self.unmappable(i, key)  # an input after the block is not in it: vLLM never sends this
        else:
            self._mm[i].append((offset, ident))

    def unmappable(self, i: int, key: Any) -> None:
        self.raw_count += 1
        self._raw[i].append(raw_key(key))

    def blocks(self) -> dict[int, bytes] | None:
        """Block index (ours, within the event) -> its extra-key bytes, for the blocks that have some: the
        `mm:ID:OFFSET` keys in the order of their inputs' offsets (as `multimodal_extra_keys` gives them),
        then the raw ones."""
        k, bs, eb = self.k, self.block_size, self.engine_block
        out: dict[int, bytes] = {}
        for i, (mm, raw) in enumerate(zip(self._mm, self._raw)):
            if not mm and not raw:
                continue
            named: list[list[str]] = [[] for _ in range(k)]
            unnamed: list[list[str]] = [[] for _ in range(k)]
            unnamed[0].extend(raw)  # the rest of the engine block chains from its first block of ours
            for offset, ident in sorted(mm):
                first = max(0, offset // bs)  # the block of ours the input starts in (0: it started before)
                # Covered further on? Only known when the next engine block of this event still has it.
                goes_on = i + 1 < len(self._mm) and (offset - eb, ident) in self._mm[i + 1]
                for j in range(first, k):
                    rel = offset - j * bs
                    if j == first or goes_on:
                        named[j].append(f"mm:{ident}:{rel}")
                    else:
                        unnamed[j].append(raw_key(("mm-extent", ident, rel)))  # its length is not sent: a miss
            for j in range(k):
                if named[j] or unnamed[j]:
                    out[i * k + j] = extra_key_bytes(named[j] + unnamed[j])
        return out or None
