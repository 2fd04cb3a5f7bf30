"""What the gateway makes of a client's completion request before routing it: its checked body and its KV identity.

The body is parsed by kvproto.openai_api (the shapes and size checks the
worker stub shares) and stripped of any pull plan the client put in it: only
the gateway writes pull plans, and an engine that can pull would otherwise read
a client's plan as an order to copy another engine's KV memory.
"""

from __future__ import annotations

from typing import Any, TypeVar

from gateway.engine_registry import EngineRegistry
from gateway.errors import GatewayError
from gateway.proxy import KvRequest
from kvproto.hashing import KvIdentity
from kvproto.openai_api import ChatMessage, ChatRequest, CompletionRequest, check_sizes, parse_request
from kvproto.schemas import KV_TRANSFER_PARAMS_FIELD, PULL_PLAN_FIELD

_Request = TypeVar("_Request", bound=CompletionRequest | ChatRequest)


def without_pull_plans(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` without a `kvdir_pull`, at the top level or inside `kv_transfer_params` (the rest of those is kept);
    `raw` itself is left as it is."""
    out = {k: v for k, v in raw.items() if k != PULL_PLAN_FIELD}
    params = out.get(KV_TRANSFER_PARAMS_FIELD)
    if isinstance(params, dict):
        out[KV_TRANSFER_PARAMS_FIELD] = {k: v for k, v in params.items() if k != PULL_PLAN_FIELD}
    return out


def parse(body: bytes, model: type[_Request], max_messages: int, max_prompt_tokens: int) -> tuple[dict[str, Any], _Request]:
    """The body to forward (without pull plans) and its parsed `model`; OpenAIError 400 for a bad or oversized one.

    The raw sizes (a token array's length, the message count) are checked
    before anything is parsed or validated.
    """
    check_sizes(body, model is ChatRequest, max_messages, max_prompt_tokens)
    raw, parsed = parse_request(body, model)
    return without_pull_plans(raw), parsed


def unhashable(raw: dict[str, Any], messages: list[ChatMessage] | None = None) -> str | None:
    """Why the gateway cannot hash this prompt as the engine will (None: it can).

    An engine's block hashes cover the multimodal inputs a block holds (docs/protocol.md §1.1), which the
    gateway does not expand: such a prompt is routed by load, never looked up nor given a pull plan.
    """
    if raw.get("prompt_embeds") is not None:
        return "the prompt is given as embeddings"
    for m in messages or ():
        if isinstance(m.content, list) and any(isinstance(p, dict) and p.get("type", "text") != "text" for p in m.content):
            return "a message has non-text content parts (images, audio, ...)"
    return None


def kv_request(registry: EngineRegistry, namespace: str, raw: dict[str, Any], body: CompletionRequest | ChatRequest) -> KvRequest:
    """The request's model and KV identity (docs/protocol.md §1.1); 404 `model_not_found` when engines are known and
    none serves its model (checked before the prompt is tokenized)."""
    if registry.engines and not registry.serving(body.model):
        raise GatewayError(
            404,
            f"The model `{body.model}` does not exist: no engine serves it (GET /v1/models lists what is served)",
            code="model_not_found",
            param="model",
        )
    base = registry.base_of(body.model)
    identity = KvIdentity(
        namespace,
        model=base if base is not None else body.model,
        adapter=body.model if base is not None else "",
        cache_salt=body.cache_salt or "",
    )
    messages = body.messages if isinstance(body, ChatRequest) else None
    return KvRequest(body.model, identity, unhashable(raw, messages), body.completion_tokens())
