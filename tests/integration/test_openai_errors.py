"""Unknown paths and methods on a live gateway and worker stub: OpenAI-shaped errors that name the routes (issue #34)."""

from __future__ import annotations

import httpx

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


def test_unknown_paths_and_methods_are_openai_errors_naming_the_routes(make_cluster, make_workers, make_gateway) -> None:
    c = make_cluster(1)
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
