"""A live gateway and worker stub: OpenAI-shaped errors for unknown paths and methods that name the routes (issue #34),
and the same answer from both to the same bad request (issue #30)."""

from __future__ import annotations

import httpx

from kvproto.openai_api import MAX_TOKENS

MODEL = "kvdir-stub"
ROUTES = ("POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models")


def _openai_error(r: httpx.Response, status: int, code: str, *named: str) -> None:
    """An OpenAI error body, `{"error": {"message", "type", "param", "code"}}`, whose message names `named`."""
    assert r.status_code == status, (r.request.method, r.request.url, r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == code and body["error"]["type"] == "invalid_request_error", body
    for text in named:
        assert text in body["error"]["message"], (text, body)


def test_unknown_paths_and_methods_are_openai_errors_naming_the_routes(file_directory, make_workers, make_gateway) -> None:
    c = file_directory
    w = make_workers(c, 1)
    g = make_gateway(c, 1)
    for url in (g.url, w.urls[0]):
        for method in ("GET", "POST"):
            r = httpx.request(method, url + "/v1/nope", json={"model": MODEL}, timeout=5)
            _openai_error(r, 404, "not_found", f"{method} /v1/nope", *ROUTES)
        r = httpx.get(url + "/v1/completions", timeout=5)
        _openai_error(r, 405, "method_not_allowed", "GET /v1/completions", *ROUTES)
        assert r.headers["allow"] == "POST"
        _openai_error(httpx.delete(url + "/v1/models", timeout=5), 405, "method_not_allowed", "DELETE /v1/models")
    # The gateway still routes what it knows after all that.
    r = httpx.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": "still here", "max_tokens": 1}, timeout=30)
    assert r.status_code == 200 and r.headers["x-kvdir-node"] == w.node_ids[0], r.text


def test_the_gateway_and_the_worker_answer_a_bad_request_alike(file_directory, make_workers, make_gateway) -> None:
    """One definition of the request shapes (kvproto.openai_api, issue #30): the gateway refuses what the worker would,
    with the same body, itself (no engine sees it), and both take an assistant's tool-call turn with null content."""
    c = file_directory
    w = make_workers(c, 1)
    g = make_gateway(c, 1)
    hi = {"role": "user", "content": "hi"}
    bad = [
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": MAX_TOKENS + 1}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [hi], "max_completion_tokens": MAX_TOKENS + 1}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": None}]}),
        ("/v1/completions", {"model": "", "prompt": "x"}),
        ("/v1/completions", {"model": "m" * 200_000, "prompt": "x"}),  # longer than any registration may name
    ]
    for path, body in bad:
        gateway, worker = (httpx.post(url + path, json=body, timeout=30) for url in (g.url, w.urls[0]))
        assert "x-kvdir-node" not in gateway.headers, (body, gateway.text)  # the gateway's own answer, not relayed
        assert (gateway.status_code, gateway.json()) == (worker.status_code, worker.json()), (body, gateway.text, worker.text)
        _openai_error(worker, 400, worker.json()["error"]["code"], str(worker.json()["error"]["param"]))
    tool_turn = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]}
    chat = {"model": MODEL, "max_tokens": 2, "messages": [hi, tool_turn, {"role": "tool", "content": "42", "tool_call_id": "c1"}]}
    for url in (g.url, w.urls[0]):
        r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant", r.text


def test_a_model_name_longer_than_any_engine_may_register_is_refused_before_any_work(file_directory, make_gateway) -> None:
    """With no engine known, no model is unknown: the bound on the name is what keeps a client's unique long names
    from being hashed and remembered (a 400 `string_above_max_length` naming `model`, never a 503 after the work)."""
    c = file_directory
    g = make_gateway(c, 0)
    with httpx.Client(timeout=30) as client:
        for i in range(20):
            r = client.post(g.url + "/v1/completions", json={"model": f"{i}" + "m" * 200_000, "prompt": "hello"})
            _openai_error(r, 400, "string_above_max_length", "model", "256")
            assert r.json()["error"]["param"] == "model"
