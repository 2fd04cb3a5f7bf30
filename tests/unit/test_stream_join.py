"""A non-streamed request's answer rebuilt from its stream's chunks (gateway.stream_join)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.stream_join import StreamError, events, join, streamable, streamed_body


def sse(*payloads: Any) -> bytes:
    return b"".join(b"data: " + json.dumps(p).encode() + b"\n\n" for p in payloads) + b"data: [DONE]\n\n"


HEAD = {"id": "chatcmpl-1", "created": 7, "model": "m", "system_fingerprint": None}
USAGE = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 8}}


def test_chat_chunks_join_into_one_message_with_the_final_usage() -> None:
    body = sse(
        {**HEAD, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {
            **HEAD,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}],
        },
        {**HEAD, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]},
        {
            **HEAD,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "length", "stop_reason": None}],
        },
        {**HEAD, "object": "chat.completion.chunk", "choices": [], "usage": USAGE, "kvdir": {"node_id": "a"}},
    )
    answer = join(body, chat=True)
    assert answer == {
        **HEAD,
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello", "reasoning_content": "hm"},
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
        "usage": USAGE,
        "kvdir": {"node_id": "a"},
    }


def test_completion_chunks_join_into_one_text() -> None:
    head = {"id": "cmpl-1", "created": 7, "model": "m"}
    body = sse(
        {**head, "object": "text_completion", "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}]},
        {**head, "object": "text_completion", "choices": [{"index": 0, "text": "b", "finish_reason": "stop", "stop_reason": 2}]},
        {**head, "object": "text_completion", "choices": [], "usage": USAGE},
    )
    answer = join(body, chat=False)
    assert answer["object"] == "text_completion" and answer["usage"] == USAGE
    assert answer["choices"] == [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": "stop", "stop_reason": 2}]


@pytest.mark.parametrize(
    ("event", "status"),
    [
        ({"error": {"message": "too long", "type": "BadRequestError", "param": None, "code": 400}}, 400),
        ({"object": "error", "message": "boom", "type": "InternalServerError", "code": 500}, 502),
    ],
)
def test_an_error_event_is_answered_as_an_error(event: dict[str, Any], status: int) -> None:
    with pytest.raises(StreamError) as err:
        join(sse({**HEAD, "choices": [{"index": 0, "delta": {"content": "x"}}]}, event), chat=True)
    assert err.value.status == status and err.value.body["error"]["message"] in ("too long", "boom")


def test_a_stream_without_chunks_is_a_bad_gateway() -> None:
    with pytest.raises(StreamError) as err:
        join(b"data: [DONE]\n\n", chat=True)
    assert err.value.status == 502


@pytest.mark.parametrize(
    ("extra", "ok"),
    [
        ({}, True),
        ({"n": 1, "temperature": 0.5, "max_tokens": 9, "stop": ["x"]}, True),
        ({"stream": True}, False),
        ({"n": 2}, False),
        ({"logprobs": True}, False),
        ({"logprobs": 2}, False),
        ({"echo": True}, False),
        ({"tools": [{"type": "function"}]}, False),
        ({"stream_options": {"include_usage": True}}, False),
        ({"best_of": 3}, False),
    ],
)
def test_only_requests_whose_answer_the_join_rebuilds_are_streamed(extra: dict[str, Any], ok: bool) -> None:
    assert streamable({"model": "m", "prompt": "p", **extra}) is ok


def test_the_streamed_body_asks_for_the_usage_chunk() -> None:
    raw = {"model": "m", "prompt": "p"}
    assert streamed_body(raw) == {"model": "m", "prompt": "p", "stream": True, "stream_options": {"include_usage": True}}
    assert raw == {"model": "m", "prompt": "p"}


def test_events_skip_what_is_not_one_json_object_and_keep_the_rest_in_order() -> None:
    """The events decode as one array; one that is not JSON, holds two values, or is no object is left out alone, as
    a per-event decode did; values msgspec refuses but Python's json reads (NaN, huge ints) are still read."""
    good = [{"i": 0}, {"i": 1, "x": None}]
    assert events(sse(*good) + b": a comment\n\ndata:\n\n") == good
    cases = [b"data: {not json}\n\n", b'data: {"a": 1}, {"b": 2}\n\n', b"data: [1, 2]\n\n", b"data: 7\n\n"]
    for bad in cases:
        assert events(b'data: {"i": 0}\n\n' + bad + b'data: {"i": 1, "x": null}\n\n') == good, bad
    assert events(b'data: {"v": NaN, "n": 123456789012345678901234567890}\n\n') == [
        {"v": pytest.approx(float("nan"), nan_ok=True), "n": 123456789012345678901234567890}
    ]
