"""A non-streamed request goes to vLLM as a stream (its first token ends its prefill in the gateway's count,
gateway.stream_join) and is answered as vLLM answers it unstreamed: the same text, usage and finish reason."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kvdir.local_cluster import Gateway
from tests.vllm.conftest import MODEL, Engine

SYSTEM = "a librarian answers questions about opening hours of the reading room and the map archive " * 5


def _strip(answer: dict[str, Any]) -> dict[str, Any]:
    """What must match: the choices' text or message (its role and content: vLLM's unstreamed message also lists
    the fields it left empty, refusal, annotations, tool_calls, ..., which the joined one leaves out), finish
    reason, the token counts."""
    usage = answer["usage"]

    def message(c: dict[str, Any]) -> dict[str, Any] | None:
        m = c.get("message")
        return None if m is None else {"role": m["role"], "content": m["content"]}

    return {
        "object": answer["object"],
        "choices": [
            {**{k: c.get(k) for k in ("index", "text", "finish_reason", "stop_reason")}, "message": message(c)}
            for c in answer["choices"]
        ],
        "usage": {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
    }


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hours?"}]}),
        ("/v1/completions", {"prompt": SYSTEM + " The reading room opens at"}),
    ],
)
def test_a_non_streamed_answer_through_the_gateway_is_vllm_s_own(
    gateway: Gateway, engines: dict[str, Engine], path: str, body: dict[str, Any]
) -> None:
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, **body}
    direct = httpx.post(engines["vllm-a"].url + path, json=body, timeout=120)
    assert direct.status_code == 200, direct.text
    before = {e["node_id"]: e["ttft_observed"] for e in httpx.get(gateway.url + "/v1/status", timeout=10).json()["engines"]}
    routed = httpx.post(gateway.url + path, json=body, timeout=120)
    assert routed.status_code == 200, routed.text
    assert routed.headers["content-type"].startswith("application/json")
    assert _strip(routed.json()) == _strip(direct.json())
    assert routed.json()["usage"]["prompt_tokens_details"] is not None  # the usage chunk's, cached tokens included
    node = routed.headers["x-kvdir-node"]
    after = {e["node_id"]: e["ttft_observed"] for e in httpx.get(gateway.url + "/v1/status", timeout=10).json()["engines"]}
    assert after[node] == before[node] + 1  # its first byte was observed: it came as a stream


def test_an_engine_error_in_a_joined_request_is_the_client_s_error(gateway: Gateway) -> None:
    """A request vLLM refuses (here: more tokens than its context) is answered with vLLM's 4xx, not a 502."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 10**7}
    r = httpx.post(gateway.url + "/v1/completions", json=body, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    assert "error" in r.json()
