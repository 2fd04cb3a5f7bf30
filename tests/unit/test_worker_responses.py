"""The worker's OpenAI answer shapes, without an app: the gateway and clients read these field names."""

from __future__ import annotations

import json

from worker_stub.responses import SSE_DONE, Completion, decode, kvdir_extension, sse_event, usage
from worker_stub.stub_engine import RequestStats

STATS = RequestStats(
    prompt_tokens=40,
    local_cached_tokens=16,
    host_cached_tokens=4,
    host_load_s=0.03125,
    pulled_tokens=8,
    completion_tokens=3,
    queue_s=0.5,
    pull_s=0.25,
    pull_transfer_s=0.125,
    pull_bytes=4096,
    pull_rank_s=[0.125, 0.0625],
    prefill_s=1.0,
    decode_s=2.0,
    pull_failures=["slot 7: digest mismatch"],
)


def test_usage_counts_local_hits_and_pulled_blocks_as_cached() -> None:
    assert usage(STATS) == {
        "prompt_tokens": 40,
        "completion_tokens": 3,
        "total_tokens": 43,
        "prompt_tokens_details": {"cached_tokens": 24},
    }


def test_the_kvdir_extension_names_the_node_and_where_the_time_went() -> None:
    assert kvdir_extension("worker-9", STATS, 1.75) == {
        "node_id": "worker-9",
        "local_cached_tokens": 16,
        "host_cached_tokens": 4,
        "host_load_s": 0.03125,
        "pulled_tokens": 8,
        "queue_s": 0.5,
        "pull_s": 0.25,
        "pull_transfer_s": 0.125,
        "pull_bytes": 4096,
        "pull_rank_s": [0.125, 0.0625],
        "prefill_s": 1.0,
        "decode_s": 2.0,
        "ttft_s": 1.75,
        "pull_failures": ["slot 7: digest mismatch"],
    }


def test_ids_are_prefixed_by_kind_and_unique() -> None:
    chat = Completion.new("m", chat=True, stream=False)
    text = Completion.new("m", chat=False, stream=False)
    assert chat.id.startswith("chatcmpl-") and len(chat.id) == len("chatcmpl-") + 24
    assert text.id.startswith("cmpl-") and len(text.id) == len("cmpl-") + 24
    assert Completion.new("m", chat=False, stream=False).id != text.id
    assert isinstance(text.created, int) and text.created > 0


def test_a_text_completion_body() -> None:
    c = Completion("cmpl-1", 100, "m", chat=False, stream=False)
    assert c.body("the", {"u": 1}, {"k": 2}) == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 100,
        "model": "m",
        "choices": [{"index": 0, "text": "the", "logprobs": None, "finish_reason": "length"}],
        "usage": {"u": 1},
        "kvdir": {"k": 2},
    }


def test_a_chat_completion_body_holds_a_message() -> None:
    c = Completion("chatcmpl-1", 100, "m", chat=True, stream=False)
    body = c.body("hi", {}, {})
    assert body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "length"}]


def test_chat_chunks_hold_deltas_and_the_last_one_the_usage() -> None:
    c = Completion("chatcmpl-1", 100, "m", chat=True, stream=True)
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 100, "model": "m"}
    assert c.chunk("t") == {
        **base,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": "t"}, "finish_reason": None}],
    }
    assert c.last_chunk({"u": 1}, {"k": 2}) == {
        **base,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": "length"}],
        "usage": {"u": 1},
        "kvdir": {"k": 2},
    }


def test_text_chunks_keep_the_text_completion_object() -> None:
    c = Completion("cmpl-1", 100, "m", chat=False, stream=True)
    assert c.chunk("t") == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 100,
        "model": "m",
        "choices": [{"index": 0, "text": "t", "logprobs": None, "finish_reason": None}],
    }
    assert c.last_chunk({}, {})["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]


def test_sse_framing() -> None:
    event = sse_event({"a": "é"})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[len(b"data: ") : -2]) == {"a": "é"}
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_a_token_ending_mid_character_is_replaced_not_refused() -> None:
    assert decode("é".encode()[:1]) == "\ufffd"
    assert decode(b"ok") == "ok"
