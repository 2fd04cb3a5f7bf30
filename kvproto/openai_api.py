"""OpenAI's API as kvdir's OpenAI-compatible servers (the gateway and the worker stub) both speak it.

One definition of the request shapes, their parsing and limit checks, and the error body, so the
gateway and the engines behind it answer the same request the same way.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

OpenAI's SDKs and the tools built on them look for `error.message` and `error.code`, which
FastAPI's own `{"detail": "Not Found"}` for an unknown path or method lacks. `http_error`
answers routing's 404 and 405 in OpenAI's shape instead, naming the request and the routes
the server has. The routes parse bodies themselves (`parse_request`, after the size checks
on the raw bytes), so a bad request is one 400 with a message on both sides, never FastAPI's 422.

As OpenAI's API does, a message's `content` may be null only in an assistant message (one that
carries `tool_calls`), `max_tokens` and `max_completion_tokens` are at most `MAX_TOKENS`, and
unknown parameters (temperature, tools, ...) are accepted and left to the engine. A `model` is at most
as long as a registration may name one (kvproto.schemas.MODEL_NAME_MAX_LEN): a longer name is served by
no engine, and the gateway would otherwise hash and remember whatever a client sends. This module
imports only the web stack and kvproto, so both servers use it without importing each
other (docs/architecture.md, "Import layers").
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from starlette.exceptions import HTTPException

from kvproto.schemas import MODEL_NAME_MAX_LEN
from kvproto.tokenizer import Tokenizer, count_messages, max_chars_per_token, render_chat

_CODES = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}

MAX_TOKENS = 1 << 20
"""The most tokens a request may ask for: a bound on what a number in a request may make a server plan for,
above any context length served (each side also checks the context length it knows)."""
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions; the worker stub's for chat too

TokenId = Annotated[int, Field(strict=True, ge=0, le=2**32 - 1)]
Role = Literal["system", "user", "assistant", "tool", "developer"]


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: status, message and OpenAI's `type`, `code` and `param`."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def response(self) -> JSONResponse:
        """This error's body (error_response)."""
        return error_response(self.status, self.message, self.type, self.code, self.param)


class OpenAIRequest(BaseModel):
    """What both servers read of a completion request; everything else is accepted as is (the gateway forwards it)."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1, max_length=MODEL_NAME_MAX_LEN)
    stream: bool = False
    max_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)  # vLLM's: a KV identity of its own

    def completion_tokens(self) -> int:
        """The tokens to generate at most: `max_tokens`, else DEFAULT_MAX_TOKENS."""
        return self.max_tokens if self.max_tokens is not None else DEFAULT_MAX_TOKENS


class CompletionRequest(OpenAIRequest):
    prompt: str | list[TokenId]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, name, tool_call_id, ...
    role: Role
    content: str | list[dict[str, Any]] | None = ""

    @field_validator("content")
    @classmethod
    def _null_only_from_the_assistant(cls, content: object, info: ValidationInfo) -> object:
        """OpenAI's API takes a null content from the assistant only (its turn was tool calls); others must say something."""
        if content is None and info.data.get("role", "assistant") != "assistant":
            raise ValueError("content may be null only in an assistant message")
        return content


class ChatRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)  # OpenAI's newer name for max_tokens

    def completion_tokens(self) -> int:
        """`max_completion_tokens`, else `max_tokens`, else DEFAULT_MAX_TOKENS."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().completion_tokens()


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: exactly one of `prompt` or `messages` (checked by the route)."""

    model_config = ConfigDict(extra="allow")  # `model` and other vLLM fields are accepted
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


def chat_prompt(messages: Sequence[ChatMessage]) -> str:
    """The messages through the stub's chat template (kvproto.tokenizer.render_chat); a null content is no text."""
    return render_chat([{"role": m.role, "content": "" if m.content is None else m.content} for m in messages])


_Model = TypeVar("_Model", bound=BaseModel)
_VALIDATION_CODES = {"string_too_long": "string_above_max_length"}  # pydantic's error type -> OpenAI's code


def parse_request(body: bytes, model: type[_Model]) -> tuple[dict[str, Any], _Model]:
    """The JSON object of a request body and its validated `model`; OpenAIError 400 naming the first problem."""
    try:
        raw = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser's limit
        raise OpenAIError(400, "the request body is not valid JSON", code="invalid_json") from exc
    if not isinstance(raw, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    try:
        return raw, model.model_validate(raw)
    except ValidationError as exc:
        e = exc.errors()[0]
        loc = ".".join(str(x) for x in e["loc"])
        code = _VALIDATION_CODES.get(e["type"])
        raise OpenAIError(400, f"{loc or 'body'}: {e['msg']}", code=code, param=loc or None) from exc


def context_length_exceeded(limit: int, what: str, param: str | None = None) -> OpenAIError:
    """OpenAI's 400 for a request over the model's context: `what` says what the request has."""
    return OpenAIError(
        400, f"This model's maximum context length is {limit} tokens; {what}", code="context_length_exceeded", param=param
    )


def check_prompt_tokens(n: int, limit: int, param: str) -> None:
    """Refuse a prompt of `n` tokens over `limit`."""
    if n > limit:
        raise context_length_exceeded(limit, f"the prompt has {n}", param)


def check_prompt_chars(text: str, limit: int, chars_per_token: int | None, param: str) -> None:
    """Refuse a text provably over `limit` tokens (more characters than it could make) before tokenizing it."""
    if chars_per_token is not None and len(text) > limit * chars_per_token:
        raise context_length_exceeded(limit, f"the prompt has {len(text)} characters, which is more", param)


def encode_checked(tokenizer: Tokenizer, text: str, limit: int, param: str, salt: str = "") -> list[int]:
    """A prompt's tokens, the one way both servers tokenize what a client sent: refused before tokenizing where
    its characters prove it over `limit` tokens (a huge prompt costs nothing), and after where its tokens are."""
    check_prompt_chars(text, limit, max_chars_per_token(tokenizer), param)
    tokens = tokenizer.encode(text, salt)
    check_prompt_tokens(len(tokens), limit, param)
    return tokens


def check_context(n_prompt: int, max_tokens: int, max_model_len: int) -> None:
    """Refuse a prompt and completion that together do not fit in `max_model_len`."""
    if n_prompt + max_tokens > max_model_len:
        raise context_length_exceeded(max_model_len, f"the request has {n_prompt} prompt tokens and asks for {max_tokens} more")


@contextmanager
def _raw_body_errors() -> Iterator[None]:
    """msgspec's errors on a raw body, as OpenAI's 400s."""
    try:
        yield
    except msgspec.ValidationError as exc:
        raise OpenAIError(400, f"the request body is invalid: {exc}") from exc
    except (msgspec.DecodeError, RecursionError) as exc:
        raise OpenAIError(400, "the request body is not valid JSON", code="invalid_json") from exc


def message_count(body: bytes) -> int:
    """The chat messages in a raw body, counted before it is parsed (kvproto.tokenizer.count_messages); 400 if unreadable."""
    with _raw_body_errors():
        return count_messages(body)


class _PromptSize(msgspec.Struct):
    """What the size check reads of a completion body: the prompt as raw JSON (everything else is skipped unparsed)."""

    prompt: msgspec.Raw = msgspec.Raw()


_NUMBER_ARRAY_BYTES = b"0123456789,[] \t\r\n"


def check_sizes(body: bytes, chat: bool, max_messages: int, max_prompt_tokens: int) -> None:
    """Count a token-array prompt or the chat messages on the raw JSON, so no list of millions is built or validated.

    A token array's element count is one more than its commas (checked only on
    arrays of plain numbers, where that is exact); messages are counted by a
    parse that keeps only their roles and stops at the first message without
    one (a body of millions of bad messages would otherwise get millions of
    validation errors).
    """
    if chat:
        n = message_count(body)
        if n > max_messages:
            raise OpenAIError(
                400,
                f"'messages' has {n} messages; at most {max_messages} are accepted",
                code="array_above_max_length",
                param="messages",
            )
        return
    with _raw_body_errors():
        prompt = bytes(msgspec.json.decode(body, type=_PromptSize).prompt).strip()
    if prompt.startswith(b"[") and not prompt.translate(None, _NUMBER_ARRAY_BYTES):
        check_prompt_tokens(prompt.count(b",") + (1 if prompt.strip(b"[] \t\r\n") else 0), max_prompt_tokens, "prompt")


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """An OpenAPI `requestBody` for a route that reads the raw request (its schema inlined, no `$defs`).

    The routes parse bodies themselves (`parse_request`), so FastAPI cannot infer
    them; this tells clients and fuzzers what is expected.
    """
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


def error_response(
    status: int, message: str, type_: str = "invalid_request_error", code: str | None = None, param: str | None = None
) -> JSONResponse:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status)


async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    """For `app.exception_handler(OpenAIError)(openai_error)`: the error's body."""
    return exc.response()


def _routes(request: Request) -> str:
    """The app's documented routes, as `METHOD /path`, in the order they were declared."""
    return ", ".join(
        f"{'/'.join(sorted(r.methods or ()))} {r.path}"
        for r in request.app.routes
        if isinstance(r, APIRoute) and r.include_in_schema
    )


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's HTTP errors in OpenAI's shape: an unknown path (404) or method (405) says what exists.

    For `app.exception_handler(HTTPException)(http_error)`: routing raises it for both. Its
    headers (a 405's `Allow`) are kept.
    """
    status = exc.status_code
    what = f"{request.method} {request.url.path}"
    if status == 404:
        message = f"Invalid URL ({what}): no such route; this server has {_routes(request)}"
    elif status == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"Invalid method ({what}): {request.url.path} takes {allowed}; this server has {_routes(request)}"
    else:
        message = str(exc.detail)
    response = error_response(status, message, code=_CODES.get(status))
    response.headers.update(exc.headers or {})
    return response
