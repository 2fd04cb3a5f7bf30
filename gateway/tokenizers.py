"""A completion's prompt as token ids, made as the engine behind the gateway will make them.

The gateway hashes the tokens the engine will hash, so it must tokenize as the
engine does: with the same tokenizer loaded here (`LocalTokenizer`, the bytes
tokenizer or a tokenizer.json), or by asking an engine's own `/tokenize`
(`EngineTokenizer`, `--tokenizer engine`: vLLM's tokenizer and chat template,
exactly). `--tokenizer` picks one for the gateway's lifetime; the routes call it
through `Tokenizer` and never ask which.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from gateway.engine_registry import EngineRegistry
from gateway.errors import GatewayError
from kvproto import tokenizer as text_tokenizers
from kvproto.openai_api import ChatMessage, ChatRequest, CompletionRequest, chat_prompt, check_prompt_chars, check_prompt_tokens

TOKENIZE_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A chat request's messages, parsed (for the gateway's chat template) and as the client sent them (what an
    engine's /tokenize is given, for its own template)."""

    messages: list[ChatMessage]
    sent: list[Any]


class Tokenizer(Protocol):
    """A prompt (a completion's text or a chat's messages) -> the token ids the engine serving `model` makes of it."""

    async def encode(self, model: str, prompt: str | ChatPrompt, limit: int, salt: str = "") -> list[int]:
        """The prompt's tokens; an OpenAIError where it is known to be over `limit` tokens before tokenizing it, or
        where the engine refused it. `salt` is the request's cache salt: work remembered from earlier prompts is
        reused only for prompts of the same salt (kvproto.tokenizer.Tokenizer)."""
        ...


class LocalTokenizer:
    """The engines' tokenizer, loaded in the gateway (kvproto.tokenizer) with the stub's chat template.

    A text with more characters than `limit` tokens could stand for is refused
    before it is tokenized (kvproto.openai_api.check_prompt_chars), so a huge
    prompt costs no tokenizing.
    """

    def __init__(self, tokenizer: text_tokenizers.Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.chars_per_token = text_tokenizers.max_chars_per_token(tokenizer)

    async def encode(self, model: str, prompt: str | ChatPrompt, limit: int, salt: str = "") -> list[int]:
        text, param = (prompt, "prompt") if isinstance(prompt, str) else (chat_prompt(prompt.messages), "messages")
        check_prompt_chars(text, limit, self.chars_per_token, param)
        return self.tokenizer.encode(text, salt)


def engine_error(response: httpx.Response) -> GatewayError:
    """An engine's refusal to tokenize, as the gateway answers it: the engine's status (502 for its 5xx) and, from
    an OpenAI-shaped error body (a prompt over the engine's limit, ...), its message, code and param."""
    try:
        err = response.json()["error"]
        message, code, param = str(err["message"]), err.get("code"), err.get("param")
    except (ValueError, KeyError, TypeError):
        message, code, param = response.text, None, None
    return GatewayError(
        response.status_code if response.status_code < 500 else 502,
        f"the engine could not tokenize: {message[:300]}",
        code=code if isinstance(code, str) else None,
        param=param if isinstance(param, str) else None,
    )


class EngineTokenizer:
    """An engine's own /tokenize (vLLM's API), asked of the least busy healthy engine serving the model.

    An engine that cannot be reached is marked unhealthy and the next one is
    asked; an engine's answer other than 200 is the request's (`engine_error`);
    503 `no_engine` when no engine is left to ask. `limit` is the engine's to
    check: it refuses a prompt over its own context. `salt` is not needed: the
    gateway remembers nothing of what engines tokenized.
    """

    def __init__(self, registry: EngineRegistry, http: httpx.AsyncClient, timeout_s: float = TOKENIZE_TIMEOUT_S) -> None:
        self.registry = registry
        self.http = http
        self.timeout_s = timeout_s

    async def encode(self, model: str, prompt: str | ChatPrompt, limit: int, salt: str = "") -> list[int]:
        payload = {"model": model, "prompt": prompt} if isinstance(prompt, str) else {"model": model, "messages": prompt.sent}
        for e in sorted(self.registry.serving(model), key=lambda e: e.inflight):
            if not e.healthy:
                continue
            try:
                r = await self.http.post(e.origin.url("/tokenize"), json=payload, timeout=self.timeout_s)
            except httpx.TransportError:
                self.registry.mark_unhealthy(e.node_id)
                continue
            if r.status_code == 200:
                return [int(t) for t in r.json()["tokens"]]
            raise engine_error(r)
        raise GatewayError(503, "no engine is available to tokenize", "service_unavailable", "no_engine")


async def prompt_tokens(
    tokenizer: Tokenizer, raw: dict[str, Any], body: CompletionRequest | ChatRequest, limit: Callable[[], int]
) -> list[int]:
    """The request's prompt tokens (a token-array prompt as given), refused (400) over `limit()` tokens.

    `limit` is read as each check is made: the engines' largest context may be
    learned while an engine tokenizes.
    """
    salt = body.cache_salt or ""
    if isinstance(body, ChatRequest):
        tokens = await tokenizer.encode(body.model, ChatPrompt(body.messages, raw["messages"]), limit(), salt)
    elif isinstance(body.prompt, str):
        tokens = await tokenizer.encode(body.model, body.prompt, limit(), salt)
    else:
        tokens = list(body.prompt)
    check_prompt_tokens(len(tokens), limit(), "messages" if isinstance(body, ChatRequest) else "prompt")
    return tokens
