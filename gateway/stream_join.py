"""A non-streamed request sent to the engine as a stream, its chunks joined back into the answer the client asked for.

An engine answers a non-streamed request only once it has decoded all of it, so the gateway would see its
prefill end (and the engine's place in line free up, as far as routing knows) only at the very end: an
engine decoding long answers would look busy with prefill. Streamed from the engine, the first chunk marks the
first token as it does for streamed requests; the gateway buffers the rest and answers with one body.

Only requests whose answer is rebuilt exactly from OpenAI's chunks are sent so (`streamable`): one choice, no
logprobs, no echo, no tools; the others are forwarded as they came (their prefill then ends with the body, as
before). What the join keeps: the first chunk's top-level fields (id, created, model, ...), each choice's text
(or the message's string fields: content, reasoning_content, ...) concatenated in order, its last
finish_reason and stop_reason, and the last chunk's top-level extras (`usage`, the worker stub's `kvdir`).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

__all__ = ["StreamError", "join", "streamable", "streamed_body"]

# Fields that change the answer's shape beyond what a join of plain chunks rebuilds.
_UNJOINABLE = ("logprobs", "top_logprobs", "echo", "prompt_logprobs", "tools", "functions", "tool_choice", "stream_options")
_CHUNK_FIELDS = frozenset({"object", "choices", "usage"})
_DECODER = msgspec.json.Decoder()


class StreamError(ValueError):
    """The engine's stream carried an error event, or none that could be joined: `status` and `body` to answer."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(str(body))
        self.status = status
        self.body = body


def streamable(raw: dict[str, Any]) -> bool:
    """Whether a non-streamed request's answer can be rebuilt from the chunks of its stream."""
    if raw.get("stream") or raw.get("n") not in (None, 1) or raw.get("best_of") not in (None, 1):
        return False
    return not any(raw.get(k) for k in _UNJOINABLE)


def streamed_body(raw: dict[str, Any]) -> dict[str, Any]:
    """The body sent upstream instead: streamed, with the usage chunk the non-streamed answer carries."""
    return {**raw, "stream": True, "stream_options": {"include_usage": True}}


def events(content: bytes) -> list[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream, `[DONE]` and comments left out, and any that is not a JSON
    object. Decoded as one JSON array (msgspec: a 200-token answer's events in 0.2 ms, where one `json.loads` per
    event took 0.8); an event that breaks the array (not JSON, or more than one value) sends them one by one."""
    datas = [d for line in content.split(b"\n") if line.startswith(b"data:") and (d := line[5:].strip()) and d != b"[DONE]"]
    try:
        payloads = _DECODER.decode(b"[" + b",".join(datas) + b"]")
    except msgspec.DecodeError:
        payloads = None
    if payloads is None or len(payloads) != len(datas):
        payloads = [_loads(d) for d in datas]
    return [p for p in payloads if isinstance(p, dict)]


def _loads(data: bytes) -> object:
    try:
        return json.loads(data)
    except ValueError:
        return None


def _error(payload: dict[str, Any]) -> StreamError | None:
    """The error an event carries (vLLM streams `{"error": {...}}`, older servers `{"object": "error", ...}`)."""
    err = payload.get("error")
    if not isinstance(err, dict):
        if payload.get("object") != "error":
            return None
        err = payload
    code = err.get("code")
    status = code if isinstance(code, int) and 400 <= code < 500 else 502
    return StreamError(status, {"error": {k: err.get(k) for k in ("message", "type", "param", "code")}})


def join(content: bytes, chat: bool) -> dict[str, Any]:
    """The non-streamed answer the chunks in `content` (an SSE body) add up to; StreamError for an error event
    or a stream with no chunk."""
    chunks = events(content)
    for c in chunks:
        err = _error(c)
        if err is not None:
            raise err
    if not chunks:
        raise StreamError(502, {"error": {"message": "the engine's stream had no answer", "type": "upstream_error"}})
    first = chunks[0]
    answer: dict[str, Any] = {k: v for k, v in first.items() if k not in _CHUNK_FIELDS}
    answer["object"] = "chat.completion" if chat else "text_completion"
    choices: dict[int, dict[str, Any]] = {}
    for c in chunks:
        for ch in c.get("choices") or ():
            if not isinstance(ch, dict):
                continue
            i = ch.get("index", 0)
            choices[i] = _merge(choices.get(i), ch, chat)
        for k, v in c.items():
            if k not in _CHUNK_FIELDS and k not in first:
                answer[k] = v
        if c.get("usage") is not None:
            answer["usage"] = c["usage"]
    answer["choices"] = [choices[i] for i in sorted(choices)]
    return answer


def _merge(acc: dict[str, Any] | None, ch: dict[str, Any], chat: bool) -> dict[str, Any]:
    """A choice so far (`acc`) with the chunk's piece of it added."""
    if acc is None:
        acc = {"index": ch.get("index", 0)}
        if chat:
            acc["message"] = {"role": "assistant", "content": None}
        else:
            acc["text"] = ""
        acc["logprobs"] = None
        acc["finish_reason"] = None
    if chat:
        msg = acc["message"]
        for k, v in (ch.get("delta") or {}).items():
            if isinstance(v, str) and k != "role":
                msg[k] = (msg.get(k) or "") + v
            elif k == "role" and isinstance(v, str):
                msg["role"] = v
    else:
        acc["text"] += ch.get("text") or ""
    for k in ("finish_reason", "stop_reason"):
        if ch.get(k) is not None:
            acc[k] = ch[k]
    return acc
