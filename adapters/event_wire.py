"""Engine KV event messages (docs/protocol.md §5): ZMQ frames and msgpack batches; the events in a batch are
`adapters.engine_events`'.

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

SGLang copied vLLM's framing and its ``ZmqEventPublisher`` (PUB + optional
ROUTER replay, seq from 0, -1 end marker); its batch is positional, ``[ts,
events]``, with ``attn_dp_rank`` as the optional third element in newer
revisions (vLLM calls it ``data_parallel_rank``).

Never fatal: a message with the wrong frame count, a seq that is not 8
bytes or a payload that is not msgpack of a batch is a *garbage frame*
(counted, skipped).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from adapters.engine_events import DecodeStats, Event, decode_event

END_SEQ = -1
"""The seq of the replay socket's end-of-replay marker."""

_seq = struct.Struct(">q")


@dataclass(frozen=True, slots=True)
class Batch:
    """One ZMQ message: the events of one engine step, in order."""

    seq: int
    ts: float | None
    events: tuple[Event, ...]
    topic: bytes = b""
    dp_rank: int | None = None


class DecodeError(ValueError):
    """A message or payload that is not a KV event batch."""


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
