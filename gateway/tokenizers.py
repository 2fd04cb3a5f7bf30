"""A completion's prompt as token ids, made as the engine behind the gateway will make them.

The gateway hashes the tokens the engine will hash, so it must tokenize as the
engine does: with the served model's own tokenizer files and chat template read
here (`ModelFilesTokenizer`, gateway.model_tokenizer), with a tokenizer given
by `--tokenizer` and the worker stub's chat template (`LocalTokenizer`: the bytes
tokenizer or a tokenizer.json, what worker stubs run), or by asking an engine's
own `/tokenize` (`EngineTokenizer`: vLLM's tokenizer and template, exactly, at
the cost of a round trip per request). `GatewayTokenizer` chooses per model and
request: `--tokenizer auto` (the default) reads each model's files where this
machine has them and asks the engine otherwise; whatever is chosen, a model whose
engines' /tokenize disagreed with the gateway's tokens (gateway.tokenizer_parity)
and a request the gateway cannot render exactly are asked of the engine. The routes
call it through `Tokenizer` and never ask which.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from gateway.engine_registry import EngineRegistry, EngineState
from gateway.errors import GatewayError
from gateway.model_tokenizer import CHAT_FIELDS_NOT_RENDERED, TOKENIZER_FILE, ModelTokenizer, NotRendered, find_model_dir
from kvproto import tokenizer as text_tokenizers
from kvproto.openai_api import ChatMessage, ChatRequest, CompletionRequest, chat_prompt, check_prompt_tokens, encode_checked

log = logging.getLogger("kvdir.gateway")

TOKENIZE_TIMEOUT_S = 5.0
MODELS_KEPT = 64  # models whose tokenizer (or the lack of one) is remembered; clients name models


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A chat request's messages, parsed (for the stub's chat template) and as the client sent them (what the
    model's template and an engine's /tokenize are given), and the request's other fields (`options`: those that
    change the rendering, such as tools, are passed on to /tokenize)."""

    messages: list[ChatMessage]
    sent: list[Any]
    options: Mapping[str, Any] = field(default_factory=dict)

    def tokenize_body(self, model: str) -> dict[str, Any]:
        """The /tokenize request (vLLM's API) for these messages, with the fields that change their rendering."""
        extra = {k: self.options[k] for k in (*CHAT_FIELDS_NOT_RENDERED, "add_generation_prompt") if k in self.options}
        return {"model": model, "messages": self.sent, **extra}


class Tokenizer(Protocol):
    """A prompt (a completion's text or a chat's messages) -> the token ids the engine serving `model` makes of it."""

    async def encode(self, model: str, prompt: str | ChatPrompt, limit: int, salt: str = "") -> list[int]:
        """The prompt's tokens; an OpenAIError where it is known to be over `limit` tokens before tokenizing it, or
        where the engine refused it. `salt` is the request's cache salt: work remembered from earlier prompts is
        reused only for prompts of the same salt (kvproto.tokenizer.Tokenizer)."""
        ...


class LocalTokenizer:
    """A tokenizer given by `--tokenizer` (kvproto.tokenizer: bytes or a tokenizer.json) with the worker stub's
    chat template and no special tokens: what worker stubs run.

    Tokenized as the worker stub tokenizes (kvproto.openai_api.encode_checked): a text with more characters
    than `limit` tokens could stand for is refused before it is tokenized, so a huge prompt costs no tokenizing.
    """

    def __init__(self, tokenizer: text_tokenizers.Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.name = tokenizer.name

    async def encode(self, model: str, prompt: str | ChatPrompt, limit: int, salt: str = "") -> list[int]:
        text, param = (prompt, "prompt") if isinstance(prompt, str) else (chat_prompt(prompt.messages), "messages")
        return encode_checked(self.tokenizer, text, limit, param, salt)


class ModelFilesTokenizer:
    """A model's own tokenizer files and chat template (gateway.model_tokenizer), as vLLM uses them; a request it
    cannot render exactly raises NotRendered."""

    def __init__(self, model: ModelTokenizer) -> None:
        self.model = model
        self.name = model.name

    async def encode(self, model: str, prompt: str | ChatPrompt, limit: int, salt: str = "") -> list[int]:
        if isinstance(prompt, str):
            return self.model.encode_prompt(prompt, salt)
        return self.model.encode_chat({**prompt.options, "messages": prompt.sent}, salt)


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
        payload = {"model": model, "prompt": prompt} if isinstance(prompt, str) else prompt.tokenize_body(model)
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

    async def ask(self, e: EngineState, model: str, prompt: str | ChatPrompt) -> list[int]:
        """`prompt`'s tokens from engine `e` itself (the parity probe); httpx's errors, or ValueError for an answer
        that is not a token list."""
        payload = {"model": model, "prompt": prompt} if isinstance(prompt, str) else prompt.tokenize_body(model)
        r = await self.http.post(e.origin.url("/tokenize"), json=payload, timeout=self.timeout_s)
        if r.status_code != 200:
            raise ValueError(f"/tokenize answered {r.status_code}: {r.text[:200]}")
        tokens = r.json().get("tokens")
        if not isinstance(tokens, list):
            raise ValueError("/tokenize answered no token list")
        return [int(t) for t in tokens]


Local = LocalTokenizer | ModelFilesTokenizer


class GatewayTokenizer:
    """The gateway's `Tokenizer`: per model, its own files (`--tokenizer auto`), a tokenizer given by
    `--tokenizer`, or the engine; and the engine wherever the gateway's tokens are known to differ from it.

    `spec` is `--tokenizer`: "auto" (each model's files where this machine has them: gateway.model_tokenizer's
    `find_model_dir`, with the engines' /v1/models "root" for the model; else the engine), "engine", "bytes", a
    tokenizer.json (with the stub's template) or a model directory (its files and template for every model).
    Files are loaded in a thread, once per model and place. Event loop only.
    """

    def __init__(
        self, spec: str, registry: EngineRegistry, http: httpx.AsyncClient, fixed: Local | None, prefix_cache_entries: int = 0
    ) -> None:
        """`fixed`: `fixed_tokenizer(spec)`, made before the gateway starts (a bad `--tokenizer` fails then)."""
        self.spec = spec
        self.registry = registry
        self.engine = EngineTokenizer(registry, http)
        self.cache_entries = prefix_cache_entries
        self.fixed = fixed
        self._models: OrderedDict[str, tuple[Path | None, Local | None]] = OrderedDict()  # auto: model -> (dir, tokenizer)
        self.disagreeing: dict[str, set[str]] = {}  # model -> engines whose /tokenize differed (gateway.tokenizer_parity)

    async def local(self, model: str) -> Local | None:
        """The gateway's own tokenizer for `model`, None where it asks the engine (`--tokenizer engine`, or no
        files found for it). With "auto", the model's directory is looked for again at every call (cheap: a few
        stat calls) so that a root an engine names later is found; its files are loaded once per directory."""
        if self.spec != "auto":
            return self.fixed
        base = self.registry.base_of(model)
        folder = await asyncio.to_thread(self._find, model, base)
        known = self._models.get(model)
        if known is not None and known[0] == folder:
            self._models.move_to_end(model)
            return known[1]
        tok = None
        if folder is not None:
            try:
                tok = ModelFilesTokenizer(await asyncio.to_thread(ModelTokenizer, folder, self.cache_entries))
                log.info("model %s: tokenizer and chat template from %s", model, folder)
            except Exception as exc:  # a broken file, whatever the library raises: the engine is asked
                log.warning("model %s: the tokenizer files in %s did not load (%s): asking the engines", model, folder, exc)
        elif known is None:
            log.info("model %s: no tokenizer files here (model name, engine root, HF cache): asking the engines", model)
        self._models[model] = (folder, tok)
        while len(self._models) > MODELS_KEPT:
            self._models.popitem(last=False)
        return tok

    def _find(self, model: str, base: str | None) -> Path | None:
        for name in (model, base):
            if name:
                found = find_model_dir(name, self.registry.model_root(name))
                if found is not None:
                    return found
        return None

    def known_local(self, model: str) -> Local | None:
        """The tokenizer `local` last found for `model`, without looking again (the request path)."""
        if self.spec != "auto":
            return self.fixed
        known = self._models.get(model)
        return known[1] if known is not None else None

    async def encode(self, model: str, prompt: str | ChatPrompt, limit: int, salt: str = "") -> list[int]:
        local = self.known_local(model) if self.spec != "auto" or model in self._models else await self.local(model)
        if local is None or self.disagreeing.get(model):
            return await self.engine.encode(model, prompt, limit, salt)
        try:
            return await local.encode(model, prompt, limit, salt)
        except NotRendered:
            return await self.engine.encode(model, prompt, limit, salt)


def fixed_tokenizer(spec: str, prefix_cache_entries: int = 0) -> Local | None:
    """The tokenizer `--tokenizer` names for every model: None for "auto" and "engine"; a model directory's files;
    else kvproto.tokenizer's (bytes, a tokenizer.json). ValueError for anything else."""
    if spec in ("auto", "engine"):
        return None
    if Path(spec).is_dir():
        if not (Path(spec) / TOKENIZER_FILE).is_file():
            raise ValueError(f"tokenizer {spec!r}: the directory has no {TOKENIZER_FILE}")
        return ModelFilesTokenizer(ModelTokenizer(spec, prefix_cache_entries))
    try:
        return LocalTokenizer(text_tokenizers.load_tokenizer(spec, prefix_cache_entries))
    except ValueError as exc:
        raise ValueError(f"{exc}, a model directory, 'auto' or 'engine'") from exc


async def prompt_tokens(
    tokenizer: Tokenizer, raw: dict[str, Any], body: CompletionRequest | ChatRequest, limit: Callable[[], int]
) -> list[int]:
    """The request's prompt tokens (a token-array prompt as given), refused (400) over `limit()` tokens.

    `limit` is read as each check is made: the engines' largest context may be
    learned while an engine tokenizes.
    """
    salt = body.cache_salt or ""
    if isinstance(body, ChatRequest):
        tokens = await tokenizer.encode(body.model, ChatPrompt(body.messages, raw["messages"], raw), limit(), salt)
    elif isinstance(body.prompt, str):
        tokens = await tokenizer.encode(body.model, body.prompt, limit(), salt)
    else:
        tokens = list(body.prompt)
    check_prompt_tokens(len(tokens), limit(), "messages" if isinstance(body, ChatRequest) else "prompt")
    return tokens
