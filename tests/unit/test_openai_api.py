"""kvproto.openai_api: the OpenAI request shapes, parsing and limit checks the gateway and the worker stub share (issue #30)."""

from __future__ import annotations

import json

import pytest

from kvproto.openai_api import (
    MAX_TOKENS,
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    chat_prompt,
    check_context,
    check_prompt_chars,
    check_sizes,
    encode_checked,
    parse_request,
)
from kvproto.schemas import MODEL_NAME_MAX_LEN
from kvproto.tokenizer import ByteTokenizer

MODEL = "kvdir-stub"


def _body(**fields: object) -> bytes:
    return json.dumps({"model": MODEL, **fields}).encode()


def _refused(body: bytes, model: type[ChatRequest] | type[CompletionRequest]) -> dict[str, object]:
    """The OpenAI error body `parse_request` answers `body` with (it must refuse it, with a 400 and a message)."""
    with pytest.raises(OpenAIError) as exc:
        parse_request(body, model)
    payload = json.loads(exc.value.response().body)
    assert exc.value.status == 400 and set(payload) == {"error"}, payload
    error: dict[str, object] = payload["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["type"] == "invalid_request_error", error
    return error


def test_an_assistant_message_may_have_null_content_and_renders_as_no_text() -> None:
    tool_turn = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]}
    messages = [{"role": "user", "content": "weather?"}, tool_turn, {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    raw, chat = parse_request(_body(messages=messages), ChatRequest)
    assert raw["messages"][1] == tool_turn  # what the gateway forwards is the client's, untouched
    assert chat.messages[1].content is None and chat.messages[1].model_extra == {"tool_calls": tool_turn["tool_calls"]}
    assert chat_prompt(chat.messages) == "<|user|>\nweather?\n<|assistant|>\n\n<|tool|>\nsunny\n<|assistant|>\n"


@pytest.mark.parametrize("role", ["user", "system", "tool", "developer"])
def test_null_content_from_any_other_role_is_refused_naming_the_field(role: str) -> None:
    error = _refused(_body(messages=[{"role": role, "content": None}]), ChatRequest)
    assert error["param"] == "messages.0.content" and "null only in an assistant message" in str(error["message"]), error


def test_max_tokens_is_capped_on_both_request_kinds() -> None:
    assert parse_request(_body(prompt="x", max_tokens=MAX_TOKENS), CompletionRequest)[1].completion_tokens() == MAX_TOKENS
    error = _refused(_body(prompt="x", max_tokens=MAX_TOKENS + 1), CompletionRequest)
    assert error["param"] == "max_tokens" and str(MAX_TOKENS) in str(error["message"]), error
    chat = [{"role": "user", "content": "hi"}]
    for field in ("max_tokens", "max_completion_tokens"):
        error = _refused(_body(messages=chat, **{field: MAX_TOKENS + 1}), ChatRequest)
        assert error["param"] == field, error
        assert _refused(_body(messages=chat, **{field: -1}), ChatRequest)["param"] == field


def test_completion_tokens_prefers_max_completion_tokens_then_max_tokens_then_16() -> None:
    chat = [{"role": "user", "content": "hi"}]
    assert parse_request(_body(messages=chat), ChatRequest)[1].completion_tokens() == 16
    assert parse_request(_body(messages=chat, max_tokens=None), ChatRequest)[1].completion_tokens() == 16
    assert parse_request(_body(messages=chat, max_tokens=5), ChatRequest)[1].completion_tokens() == 5
    assert parse_request(_body(messages=chat, max_tokens=5, max_completion_tokens=7), ChatRequest)[1].completion_tokens() == 7
    assert parse_request(_body(prompt="x"), CompletionRequest)[1].completion_tokens() == 16


@pytest.mark.parametrize(
    ("body", "param", "code", "says"),
    [
        (b"{oops", None, "invalid_json", "not valid JSON"),
        (b"[1, 2]", None, None, "must be a JSON object"),
        (json.dumps({"prompt": "x"}).encode(), "model", None, "model: Field required"),
        (_body(model="", prompt="x"), "model", None, "model:"),
        (_body(prompt=3), "prompt.str", None, "prompt.str: Input should be a valid string"),  # the union's first member
        (_body(prompt="x", max_tokens="many"), "max_tokens", None, "max_tokens:"),
        (_body(model="m" * 257, prompt="x"), "model", "string_above_max_length", "at most 256 characters"),
        (_body(prompt="x", cache_salt="s" * 1025), "cache_salt", "string_above_max_length", "at most 1024 characters"),
    ],
)
def test_bad_shapes_are_one_openai_error_with_a_message(body: bytes, param: str | None, code: str | None, says: str) -> None:
    error = _refused(body, CompletionRequest)
    assert (error["param"], error["code"]) == (param, code) and says in str(error["message"]), error


def test_a_model_name_as_long_as_a_registration_may_list_is_taken() -> None:
    longest = "m" * MODEL_NAME_MAX_LEN
    assert parse_request(_body(model=longest, prompt="x"), CompletionRequest)[1].model == longest
    chat = _body(model=longest + "m", messages=[{"role": "user", "content": "hi"}])
    assert _refused(chat, ChatRequest)["code"] == "string_above_max_length"


def test_a_chat_without_messages_or_with_an_unknown_role_is_refused() -> None:
    assert _refused(_body(messages=[]), ChatRequest)["param"] == "messages"
    assert _refused(_body(messages=[{"role": "wizard", "content": "hi"}]), ChatRequest)["param"] == "messages.0.role"


def test_the_size_checks_read_the_raw_body() -> None:
    with pytest.raises(OpenAIError) as exc:
        check_sizes(_body(messages=[{"role": "user", "content": "hi"}] * 3), True, max_messages=2, max_prompt_tokens=100)
    assert (exc.value.code, exc.value.param) == ("array_above_max_length", "messages")
    check_sizes(_body(prompt=[1] * 100), False, max_messages=2, max_prompt_tokens=100)
    with pytest.raises(OpenAIError) as exc:
        check_sizes(_body(prompt=[1] * 101), False, max_messages=2, max_prompt_tokens=100)
    assert (exc.value.code, exc.value.param) == ("context_length_exceeded", "prompt") and "has 101" in exc.value.message
    with pytest.raises(OpenAIError) as exc:
        check_sizes(b"{oops", False, max_messages=2, max_prompt_tokens=100)
    assert exc.value.code == "invalid_json"


def test_the_context_checks() -> None:
    check_prompt_chars("x" * 10, 10, 1, "prompt")
    check_prompt_chars("x" * 11, 10, None, "prompt")  # unknown characters per token: left to the token count
    with pytest.raises(OpenAIError) as exc:
        check_prompt_chars("x" * 11, 10, 1, "prompt")
    assert exc.value.code == "context_length_exceeded" and "11 characters" in exc.value.message
    check_context(6, 4, 10)
    with pytest.raises(OpenAIError) as exc:
        check_context(6, 5, 10)
    assert exc.value.code == "context_length_exceeded" and "6 prompt tokens and asks for 5 more" in exc.value.message


class _Counting(ByteTokenizer):
    """The bytes tokenizer, counting the texts it was asked to tokenize."""

    calls = 0

    def encode(self, text: str, salt: str = "") -> list[int]:
        self.calls += 1
        return super().encode(text, salt)


def test_both_servers_refuse_a_prompt_over_the_limit_the_same_way_and_a_huge_one_untokenized() -> None:
    tok = _Counting()
    assert encode_checked(tok, "abcd", 4, "prompt") == list(b"abcd") and tok.calls == 1
    with pytest.raises(OpenAIError) as caught:
        encode_checked(tok, "x" * 10_000_000, 4, "messages")
    assert tok.calls == 1  # refused by its characters, never tokenized
    assert (caught.value.status, caught.value.code, caught.value.param) == (400, "context_length_exceeded", "messages")
    assert "10000000 characters" in caught.value.message
