"""The gateway's pure request pieces: pull-plan stripping, the KV identity checks, the /v1/models merge, the local
tokenizer's character pre-check and the mapping of an engine's refusal to tokenize (gateway.client_request,
gateway.models_list, gateway.tokenizers)."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator

import httpx
import pytest

from gateway.client_request import kv_request, parse, unhashable, without_pull_plans
from gateway.engine_registry import EngineRegistry, EngineState, parse_origin
from gateway.errors import GatewayError
from gateway.models_list import merge_models
from gateway.tokenizers import ChatPrompt, LocalTokenizer, engine_error, prompt_tokens
from kvproto.client import DirectoryClient
from kvproto.openai_api import ChatMessage, ChatRequest, CompletionRequest, OpenAIError, parse_request
from kvproto.tokenizer import ByteTokenizer

PLAN = {"source_node": "victim", "source_epoch": 1, "slots": [1, 2, 3]}


def test_pull_plans_are_dropped_at_the_top_level_and_in_the_transfer_params_only() -> None:
    params = {"remote_host": "10.0.0.9", "nested": {"kvdir_pull": "kept: not the plan's field"}}
    raw = {"model": "m", "prompt": "hi", "kvdir_pull": PLAN, "kv_transfer_params": {**params, "kvdir_pull": PLAN}}
    before = copy.deepcopy(raw)
    assert without_pull_plans(raw) == {"model": "m", "prompt": "hi", "kv_transfer_params": params}
    assert raw == before  # the client's object is left as it was
    assert without_pull_plans({"model": "m", "kv_transfer_params": "not an object"}) == {
        "model": "m",
        "kv_transfer_params": "not an object",
    }


def test_parse_returns_the_body_to_forward_and_checks_sizes_first() -> None:
    raw, body = parse(b'{"model": "m", "prompt": [1, 2], "kvdir_pull": {}}', CompletionRequest, 10, 8)
    assert raw == {"model": "m", "prompt": [1, 2]} and body.prompt == [1, 2]
    with pytest.raises(OpenAIError) as exc:
        parse(b'{"model": "m", "prompt": [1, 2, 3]}', CompletionRequest, 10, 2)
    assert (exc.value.status, exc.value.code, exc.value.param) == (400, "context_length_exceeded", "prompt")
    with pytest.raises(OpenAIError) as exc:
        parse(b'{"model": "m", "messages": [{"role": "user"}, {"role": "user"}]}', ChatRequest, 1, 100)
    assert (exc.value.status, exc.value.code) == (400, "array_above_max_length")


def test_unhashable_names_embeddings_and_non_text_parts() -> None:
    assert unhashable({"prompt": "x"}) is None
    assert unhashable({"prompt_embeds": "..."}) == "the prompt is given as embeddings"
    text = ChatMessage(role="user", content=[{"type": "text", "text": "hi"}])
    image = ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}])
    assert unhashable({}, [text]) is None
    assert unhashable({}, [text, image]) == "a message has non-text content parts (images, audio, ...)"


@pytest.fixture
def registry() -> Iterator[EngineRegistry]:
    """A registry nothing refreshes: its engines are set by the test."""
    http = httpx.AsyncClient()
    directory = DirectoryClient("http://127.0.0.1:1")
    yield EngineRegistry(directory, http, [], refresh_s=1.0, unhealthy_s=1.0)
    asyncio.run(directory.aclose())
    asyncio.run(http.aclose())


def test_kv_request_refuses_a_model_no_known_engine_serves_and_names_adapters_by_their_base(registry: EngineRegistry) -> None:
    _, unknown_engines = parse_request(b'{"model": "anything", "prompt": "x", "cache_salt": "s"}', CompletionRequest)
    kv = kv_request(registry, "ns", {}, unknown_engines)  # no engine known yet: nothing to refuse it for
    assert (kv.model, kv.identity.model, kv.identity.adapter, kv.identity.cache_salt, kv.unhashed) == (
        "anything",
        "anything",
        "",
        "s",
        None,
    )

    e = EngineState("e1", parse_origin("http://127.0.0.1:9"), models_known=True, listed_models=frozenset({"base", "lora"}))
    e.adapters = {"lora": "base"}
    registry.engines["e1"] = e
    with pytest.raises(GatewayError) as exc:
        kv_request(registry, "ns", {}, unknown_engines)
    assert (exc.value.status, exc.value.code, exc.value.param) == (404, "model_not_found", "model")
    _, lora = parse_request(b'{"model": "lora", "messages": [{"role": "user", "content": "x"}]}', ChatRequest)
    kv = kv_request(registry, "ns", {"prompt_embeds": "e"}, lora)
    assert (kv.identity.namespace, kv.identity.model, kv.identity.adapter) == ("ns", "base", "lora")
    assert kv.unhashed == "the prompt is given as embeddings"


def test_the_models_merge_keeps_each_id_once_first_listing_first() -> None:
    a = [{"id": "m", "owned_by": "a"}, {"object": "model"}]
    b = [{"id": "m", "owned_by": "b"}, {"id": "lora", "parent": "m"}, {"object": "other"}]
    assert merge_models([a, b]) == [{"id": "m", "owned_by": "a"}, {"object": "model"}, {"id": "lora", "parent": "m"}]
    assert merge_models([]) == []


def test_the_local_tokenizer_refuses_a_text_longer_than_the_limit_could_be_before_tokenizing() -> None:
    local = LocalTokenizer(ByteTokenizer())
    assert asyncio.run(local.encode("m", "abc", 3)) == [97, 98, 99]
    with pytest.raises(OpenAIError) as exc:
        asyncio.run(local.encode("m", "abcd", 3))
    assert (exc.value.status, exc.value.code, exc.value.param) == (400, "context_length_exceeded", "prompt")
    messages = [ChatMessage(role="user", content="hi")]
    assert asyncio.run(local.encode("m", ChatPrompt(messages, []), 100)) == list(b"<|user|>\nhi\n<|assistant|>\n")
    with pytest.raises(OpenAIError) as exc:
        asyncio.run(local.encode("m", ChatPrompt(messages, []), 10))
    assert exc.value.param == "messages"


def test_prompt_tokens_passes_token_arrays_through_and_checks_the_count_against_the_limit_as_it_is_then() -> None:
    local = LocalTokenizer(ByteTokenizer())
    _, arrays = parse_request(b'{"model": "m", "prompt": [5, 6, 7]}', CompletionRequest)
    assert asyncio.run(prompt_tokens(local, {}, arrays, lambda: 3)) == [5, 6, 7]
    _, text = parse_request(b'{"model": "m", "prompt": "abc"}', CompletionRequest)
    limits = iter([10, 2])  # the limit learned to be lower after tokenizing: the count is checked against that
    with pytest.raises(OpenAIError) as exc:
        asyncio.run(prompt_tokens(local, {}, text, lambda: next(limits)))
    assert (exc.value.code, exc.value.param) == ("context_length_exceeded", "prompt")
    raw, chat = parse_request(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', ChatRequest)
    with pytest.raises(OpenAIError) as exc:
        asyncio.run(prompt_tokens(local, raw, chat, iter([100, 5]).__next__))
    assert exc.value.param == "messages"


class _SaltRecorder(ByteTokenizer):
    """The bytes tokenizer, noting the salt of each text it is given."""

    def __init__(self) -> None:
        self.salts: list[str] = []

    def encode(self, text: str, salt: str = "") -> list[int]:
        self.salts.append(salt)
        return super().encode(text, salt)


def test_prompt_tokens_tokenizes_under_the_requests_cache_salt() -> None:
    """The tokenizer's cache is keyed by salt (kvproto.prefix_tokens): the request's salt must reach it."""
    recorder = _SaltRecorder()
    local = LocalTokenizer(recorder)
    for body in (
        b'{"model": "m", "prompt": "abc", "cache_salt": "alice"}',
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "bob"}',
        b'{"model": "m", "prompt": "abc"}',
    ):
        raw, parsed = parse_request(body, ChatRequest if b"messages" in body else CompletionRequest)
        asyncio.run(prompt_tokens(local, raw, parsed, lambda: 100))
    assert recorder.salts == ["alice", "bob", ""]


def test_an_engines_openai_error_keeps_its_status_code_and_param() -> None:
    body = {
        "error": {"message": "too long", "type": "invalid_request_error", "code": "context_length_exceeded", "param": "prompt"}
    }
    err = engine_error(httpx.Response(400, json=body))
    assert (err.status, err.message, err.code, err.param) == (
        400,
        "the engine could not tokenize: too long",
        "context_length_exceeded",
        "prompt",
    )
    assert err.type == "invalid_request_error"


def test_an_engines_other_refusals_are_its_text_and_its_5xx_a_502() -> None:
    err = engine_error(httpx.Response(503, text="x" * 1000))
    assert (err.status, err.message, err.code, err.param) == (502, "the engine could not tokenize: " + "x" * 300, None, None)
    odd = {"error": {"message": "no", "code": 7, "param": ["prompt"]}}  # not strings: not passed on
    err = engine_error(httpx.Response(422, json=odd))
    assert (err.status, err.message, err.code, err.param) == (422, "the engine could not tokenize: no", None, None)
    err = engine_error(httpx.Response(400, json=["not", "an", "object"]))
    assert err.status == 400 and err.message == 'the engine could not tokenize: ["not","an","object"]'


@pytest.mark.parametrize(
    ("body", "kind", "max_tokens"),
    [
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 500}', ChatRequest, 500),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 7, "max_tokens": 9}',
            ChatRequest,
            7,
        ),
        (b'{"model": "m", "prompt": "x", "max_tokens": 300}', CompletionRequest, 300),
        (b'{"model": "m", "prompt": "x"}', CompletionRequest, 16),  # OpenAI's default for completions
    ],
)
def test_the_decode_the_router_prices_is_what_the_request_may_generate(
    registry: EngineRegistry, body: bytes, kind: type[CompletionRequest] | type[ChatRequest], max_tokens: int
) -> None:
    _, parsed = parse_request(body, kind)
    assert kv_request(registry, "ns", {}, parsed).max_tokens == max_tokens
