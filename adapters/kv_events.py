"""Engine KV events (docs/protocol.md §5): decoding and mapping engine block hashes to ours.

Pure code: no sockets, no clocks. `adapters.subscriber` feeds it ZMQ
frames and sends what it returns to the directory. The names live where their
part of the work is, and are all importable from here:

* `adapters.event_wire`: ZMQ messages and msgpack batches (vLLM's and SGLang's framing);
* `adapters.engine_events`: the decoded events, and either encoding of one event (positional or map,
  vLLM's or SGLang's fields);
* `adapters.hash_mapper`: engine block hashes -> our sequence hashes, under the KV identity;
* `adapters.extra_keys`: vLLM's per-block extra keys (adapter, salt, multimodal inputs).
"""

from __future__ import annotations

from adapters.engine_events import Cleared, DecodeStats, EngineHash, Event, Removed, Stored, decode_event
from adapters.event_wire import (
    END_SEQ,
    Batch,
    DecodeError,
    decode_message,
    decode_payload,
    decode_replay_reply,
    encode_seq,
    parse_seq,
)
from adapters.extra_keys import raw_key
from adapters.hash_mapper import HashMapper, MapperStats, MapResult, event_identity

__all__ = [
    "END_SEQ",
    "Batch",
    "Cleared",
    "DecodeError",
    "DecodeStats",
    "EngineHash",
    "Event",
    "HashMapper",
    "MapResult",
    "MapperStats",
    "Removed",
    "Stored",
    "decode_event",
    "decode_message",
    "decode_payload",
    "decode_replay_reply",
    "encode_seq",
    "event_identity",
    "parse_seq",
    "raw_key",
]
