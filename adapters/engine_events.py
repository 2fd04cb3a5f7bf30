"""One engine KV event (docs/protocol.md §5): the decoded types, and either encoding of an event made one.

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

Never fatal: an event of an unknown type is counted and skipped; so is a
malformed one (wrong field types, token count not matching). Fields nobody
here knows are counted as *extra fields* and ignored. Events for cache groups
that are not full attention (``kv_cache_spec_kind``, e.g. sliding window) are
skipped: they say nothing about reusable prefixes.

What SGLang's events differ in
------------------------------
Read in sgl-project/sglang, python/sglang/srt/disaggregation/kv_events.py
(stored revisions 006d053f and 612d5790) and
python/sglang/srt/mem_cache/events.py (revision 06f643f4); its framing and
batches are `adapters.event_wire`'s:

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
  page's token count. Such a block is not a full block of ours: the hash
  mapper skips it (counted as unsupported), like a block of any size that is
  not a multiple of ours. SGLang's default page size is 1: run it with
  ``--page-size`` equal to (or a multiple of) our block size.
* ``token_ids`` may hold pairs (EAGLE bigram keys): malformed here, skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from kvproto.hashing import U32_MAX

EngineHash = int | bytes
"""An engine's block hash: opaque, compared for equality only."""

# Token ids and engine hashes are checked by msgspec in C (strict: a bool is not an int): a loop over
# a 64-block event's 1,024 tokens in Python cost more than everything else the adapter does with it.
_TOKENS = list[Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)]]
_INT_HASHES = list[int]


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
