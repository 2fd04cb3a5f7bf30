"""The gateway in front of real workers and a real directory: affinity, pulls, fallback, retries, errors."""

from __future__ import annotations

import json
import socketserver
import subprocess
import sys
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx

from kvdir.local_cluster import Gateway, free_ports
from tests.support.wait import wait_for

MODEL = "kvdir-stub"
SYSTEM = "You are the assistant of a very long shared system prompt about KV caches. " * 8


def _chat(url: str, messages: list[dict], **extra) -> httpx.Response:
    r = httpx.post(
        url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 4, **extra}, timeout=60
    )
    assert r.status_code == 200, r.text
    return r


def test_multi_turn_chat_sticks_to_the_node_holding_its_history(file_directory, make_workers, make_gateway) -> None:
    c = file_directory
    make_workers(c, 3)
    g = make_gateway(c, 3)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    first = _chat(g.url, messages)
    node = first.headers["x-kvdir-node"]
    assert first.headers["x-kvdir-decision"] == "balance"
    messages += [
        {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "second question"},
    ]
    # Publishing is asynchronous: wait until the directory lists turn 1's blocks, as a user's think time would.
    n_blocks = first.json()["usage"]["prompt_tokens"] // 16
    wait_for(
        lambda: httpx.post(
            c.replica_urls[0] + "/v1/lookup",
            json={
                "tokens": list(("<|system|>\n" + SYSTEM + "\n<|user|>\nfirst question\n<|assistant|>\n").encode()),
                "model": MODEL,
            },
        ).json()["holders"],
        what="turn 1 published",
    )
    second = _chat(g.url, messages)
    assert second.headers["x-kvdir-node"] == node
    assert second.headers["x-kvdir-decision"] == "affinity"
    predicted = int(second.headers["x-kvdir-predicted-cached-tokens"])
    reported = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert predicted == reported >= (n_blocks - 1) * 16
    metrics = httpx.get(g.url + "/metrics").text
    assert 'kvdir_gateway_decisions_total{reason="affinity"} 1.0' in metrics
    assert "kvdir_gateway_reported_cached_tokens_total" in metrics
    assert "kvdir_gateway_tokenize_seconds_count 2.0" in metrics  # both turns, timed apart from routing
    page = httpx.get(g.url + "/").text
    assert "kvdir gateway" in page and node in page


def test_hot_prefix_at_high_concurrency_spreads_by_pulls(file_directory, make_workers, make_gateway) -> None:
    c = file_directory
    # Slow prefill (1,000 tokens/s at time scale 1): recomputing the ~2,000-token prompt costs ~2 s, pulling it ~ms.
    make_workers(c, 3, ("--time-scale", "1", "--prefill-tokens-per-s", "1000", "--transfer", "tcp"))
    g = make_gateway(c, 3, ("--prefill-tokens-per-s", "1000", "--max-running", "1"))
    prompt = SYSTEM * 3
    first = httpx.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}, timeout=60)
    holder = first.headers["x-kvdir-node"]
    wait_for(
        lambda: httpx.post(c.replica_urls[0] + "/v1/lookup", json={"tokens": list(prompt.encode()), "model": MODEL}).json()[
            "holders"
        ],
        what="the prompt published",
    )
    # Six users send the hot prompt at once; each decodes 40 tokens (0.5 s), so the holder stays busy.
    results: list[httpx.Response] = []

    def user(i: int) -> None:
        results.append(
            httpx.post(
                g.url + "/v1/completions", json={"model": MODEL, "prompt": prompt + f" user {i}", "max_tokens": 40}, timeout=60
            )
        )

    threads = [threading.Thread(target=user, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.status_code == 200 for r in results)
    nodes = {r.headers["x-kvdir-node"] for r in results}
    decisions = [r.headers["x-kvdir-decision"] for r in results]
    assert len(nodes) >= 2, decisions  # not all queued on the holder
    assert "pull" in decisions, decisions
    # A request sent to pull may find the blocks already there (an earlier pull landed first): either way
    # nothing is recomputed from scratch, and every answer reports most of the prompt as cached.
    assert any(r.json()["kvdir"]["pulled_tokens"] > 0 for r in results)
    summary = [
        (r.headers["x-kvdir-node"], r.headers["x-kvdir-decision"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        for r in results
    ]
    assert all(cached >= len(prompt) - 32 for _, _, cached in summary), (holder, summary)


def test_directory_down_routes_by_load_and_never_fails(make_cluster, make_workers, make_gateway) -> None:
    c = make_cluster(1)  # all of the directory down: its one replica is as good as three
    make_workers(c, 2)
    g = make_gateway(c, 2, ("--mirror-stale-lag-s", "1"))
    wait_for(lambda: "kvdir_gateway_mirror_lag_seconds 0." in httpx.get(g.url + "/metrics").text, what="a fresh mirror")
    c.kill(0)
    # Once REST fails, the gateway's mirror still answers lookups until it is --mirror-stale-lag-s behind
    # (tests/integration/test_gateway_mirror.py); past that, the request is routed by load.
    wait_for(lambda: _mirror_lag(g.url) > 1, what="the mirror past its stale bound")
    r = httpx.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": SYSTEM, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
    assert r.headers["x-kvdir-decision"] == "fallback"
    wait_for(lambda: "directory_up 0.0" in httpx.get(g.url + "/metrics").text, what="the gateway to notice")
    failures = [
        line
        for line in httpx.get(g.url + "/metrics").text.splitlines()
        if line.startswith("kvdir_gateway_lookup_failures_total{")
    ]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in failures) >= 1, failures


def _mirror_lag(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("kvdir_gateway_mirror_lag_seconds "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no kvdir_gateway_mirror_lag_seconds")


def test_unreachable_engine_is_retried_on_the_next(file_directory, make_workers, make_gateway) -> None:
    c = file_directory
    make_workers(c, 1)
    dead = f"http://127.0.0.1:{free_ports(1)[0]}"
    g = make_gateway(c, 2, ("--engine", dead, "--policy", "round_robin"))
    nodes = set()
    for _ in range(4):  # round robin would hit the dead static engine; each request still succeeds
        r = httpx.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": "hello there", "max_tokens": 1}, timeout=60)
        assert r.status_code == 200, r.text
        nodes.add(r.headers["x-kvdir-node"])
    assert nodes == {"worker-1"}
    assert 'kvdir_gateway_upstream_errors_total{kind="connect"} 1.0' in httpx.get(g.url + "/metrics").text


class _FailingEngine(socketserver.ThreadingTCPServer):
    """An engine on 127.0.0.1 that fails after taking a request: `close` in the prompt closes the connection
    without an answer, `break` starts a stream and closes it after one event; anything else gets a 404."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _FailingHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _FailingHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            line = self.rfile.readline()
            if not line:
                return
            head += line
        length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")), 0)
        body = self.rfile.read(length)
        if b"close" in body:
            return  # the connection closes with no answer
        if b"break" in body:
            self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            event = b"data: first\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.flush()
            return  # closed mid-stream, no last chunk
        self.wfile.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")


def test_an_engine_that_fails_after_taking_the_request_gets_a_502_or_a_short_stream(file_directory, make_gateway) -> None:
    """Once the request was sent the engine may have run it: no retry elsewhere, a 502 (or, mid-stream, a stream that
    ends short), and the gateway goes on serving."""
    c = file_directory
    engine = _FailingEngine()
    try:
        g = make_gateway(c, 1, ("--engine", engine.url))
        r = httpx.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": "close", "max_tokens": 1}, timeout=60)
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "engine_failed", r.text
        with httpx.stream(
            "POST",
            g.url + "/v1/completions",
            json={"model": MODEL, "prompt": "break", "max_tokens": 4, "stream": True},
            timeout=60,
        ) as s:
            assert s.status_code == 200
            assert b"".join(s.iter_raw()) == b"data: first\n\n"
        r = httpx.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": "other", "max_tokens": 1}, timeout=60)
        assert r.status_code == 404, r.text  # an engine's error status is relayed as is
        metrics = httpx.get(g.url + "/metrics").text
        assert 'kvdir_gateway_upstream_errors_total{kind="error"} 1.0' in metrics, metrics
        assert 'kvdir_gateway_upstream_errors_total{kind="stream"} 1.0' in metrics, metrics
    finally:
        engine.shutdown()
        engine.server_close()


def test_streaming_passthrough_models_and_errors(file_directory, make_workers, make_gateway) -> None:
    c = file_directory
    make_workers(c, 2)
    g = make_gateway(c, 2)
    with httpx.stream(
        "POST", g.url + "/v1/completions", json={"model": MODEL, "prompt": SYSTEM, "max_tokens": 6, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-kvdir-node"].startswith("worker-")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 6
    assert [m["id"] for m in httpx.get(g.url + "/v1/models").json()["data"]] == [MODEL]
    cases = [
        (b"{oops", 400),
        (b"[1,2]", 400),
        (json.dumps({"prompt": "x"}).encode(), 400),
        (json.dumps({"model": MODEL, "prompt": 3}).encode(), 400),
        (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": -1}).encode(), 400),
    ]
    for body, status in cases:
        r = httpx.post(g.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        assert r.json()["error"]["message"]
    r = httpx.post(g.url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400
    r = httpx.post(g.url + "/v1/completions", json={"model": "unknown-model", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"  # the gateway's own: no engine serves it
    r = httpx.post(g.url + "/v1/completions", content=b"x" * (65 << 20), headers={"content-type": "application/json"})
    assert r.status_code == 413


def _conversations(g: Gateway, c, n: int) -> list[bool]:
    """n two-turn conversations; for each, did turn 2 land where turn 1 was served?"""
    same = []
    for k in range(n):
        messages = [{"role": "system", "content": f"Conversation {k}: " + SYSTEM}, {"role": "user", "content": "turn one"}]
        first = _chat(g.url, messages)
        text = f"<|system|>\nConversation {k}: {SYSTEM}\n<|user|>\nturn one\n<|assistant|>\n"
        wait_for(
            lambda: httpx.post(c.replica_urls[0] + "/v1/lookup", json={"tokens": list(text.encode()), "model": MODEL}).json()[
                "holders"
            ],
            what="turn 1 published",
        )
        messages += [
            {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": "turn two"},
        ]
        second = _chat(g.url, messages)
        same.append(second.headers["x-kvdir-node"] == first.headers["x-kvdir-node"])
    return same


def test_round_robin_mostly_misses_what_kvdir_hits(file_directory, make_workers, make_gateway) -> None:
    c = file_directory
    make_workers(c, 3)
    kv = make_gateway(c, 3)
    rr = make_gateway(c, 3, ("--policy", "round_robin"))
    assert all(_conversations(kv, c, 4))
    assert sum(_conversations(rr, c, 4)) <= 1


def test_killed_engine_is_avoided_and_no_request_fails(file_directory, make_workers, make_gateway) -> None:
    c = file_directory
    w = make_workers(c, 3)
    g = make_gateway(c, 3, ("--policy", "round_robin"))
    w.kill(1)  # SIGKILL: still listed by the directory until its lease lapses
    served = [
        httpx.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": f"request {i}", "max_tokens": 1}, timeout=60)
        for i in range(9)
    ]
    assert all(r.status_code == 200 for r in served)
    assert "worker-2" not in {r.headers["x-kvdir-node"] for r in served}


def _running(worker_url: str) -> float:
    """The worker's `kvdir_worker_running` gauge: requests its engine is still decoding."""
    for line in httpx.get(worker_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvdir_worker_running "):
            return float(line.split()[1])
    raise AssertionError("kvdir_worker_running not exported")


def test_streaming_arrives_incrementally(file_directory, make_workers, make_gateway) -> None:
    """The first chunk reaches the client while the engine is still decoding the request (observed on the
    engine's own gauge), so the gateway forwards chunks as they come rather than buffering the response:
    a buffered stream could only start after the engine's generator had finished and left `running` at 0."""
    c = file_directory
    w = make_workers(c, 1, ("--time-scale", "1", "--decode-tokens-per-s", "40"))
    g = make_gateway(c, 1)
    tokens = 40  # ~1 s of decoding after the first chunk: the window in which the gauge is read
    assert _running(w.urls[0]) == 0
    chunks = 0
    running_at_first_chunk = None
    with httpx.stream(
        "POST", g.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": tokens, "stream": True}, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks += 1
                if chunks == 1:
                    running_at_first_chunk = _running(w.urls[0])
    assert chunks >= tokens
    assert running_at_first_chunk == 1
    wait_for(lambda: _running(w.urls[0]) == 0, what="the engine to finish the streamed request")


def test_official_openai_client_works(file_directory, make_workers, make_gateway) -> None:
    c = file_directory
    make_workers(c, 1)
    g = make_gateway(c, 1)
    code = f"""
import openai
client = openai.OpenAI(base_url="{g.url}/v1", api_key="unused")
c = client.completions.create(model="{MODEL}", prompt="Hello", max_tokens=3)
assert c.choices[0].text and c.usage.prompt_tokens == 5, c
ch = client.chat.completions.create(model="{MODEL}", messages=[{{"role": "user", "content": "Hi"}}], max_tokens=3)
assert ch.choices[0].message.role == "assistant" and ch.choices[0].message.content, ch
parts = [e.choices[0].delta.content or "" for e in client.chat.completions.create(
    model="{MODEL}", messages=[{{"role": "user", "content": "Hi"}}], max_tokens=4, stream=True) if e.choices]
assert len("".join(parts)) == 4, parts
print([m.id for m in client.models.list()])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert MODEL in out.stdout


def test_engine_tokenizer_gives_the_same_routing(file_directory, make_workers, make_gateway) -> None:
    c = file_directory
    make_workers(c, 2)
    g = make_gateway(c, 2, ("--tokenizer", "engine"))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "tokenized by the engine"}]
    first = _chat(g.url, messages)
    text = f"<|system|>\n{SYSTEM}\n<|user|>\ntokenized by the engine\n<|assistant|>\n"
    wait_for(
        lambda: httpx.post(c.replica_urls[0] + "/v1/lookup", json={"tokens": list(text.encode()), "model": MODEL}).json()[
            "holders"
        ],
        what="the first request published",
    )
    again = _chat(g.url, messages)
    assert again.headers["x-kvdir-node"] == first.headers["x-kvdir-node"]
    assert again.headers["x-kvdir-decision"] == "affinity"
    assert (
        int(again.headers["x-kvdir-predicted-cached-tokens"])
        == again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        > 0
    )


def test_burst_on_an_uncached_prefix_computes_it_once_per_node(file_directory, make_workers, make_gateway) -> None:
    """24 requests sharing a 3,000-token prefix nobody holds, all at once: the gateway knows where it sent the
    prefix to be computed (gateway.inflight), so followers queue behind that prefill (decision `inflight`) instead
    of computing it again, and each node computes it at most once."""
    c = file_directory
    make_workers(c, 2, ("--time-scale", "1", "--transfer", "tcp"))  # 3,000 tokens at 10,000 tokens/s: 0.3 s of prefill
    g = make_gateway(c, 2)
    prefix = ("kv cache routing prefix burst " * 200)[:3000]

    def user(i: int) -> tuple[str, str, int, int]:
        r = httpx.post(
            g.url + "/v1/completions", json={"model": MODEL, "prompt": prefix + f" user {i}", "max_tokens": 2}, timeout=60
        )
        assert r.status_code == 200, r.text
        h = r.headers
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        return h["x-kvdir-node"], h["x-kvdir-decision"], int(h["x-kvdir-predicted-cached-tokens"]), cached

    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(user, range(24)))
    computed = Counter(node for node, _, _, cached in results if cached < len(prefix) - 16)
    decisions = Counter(d for _, d, _, _ in results)
    assert max(computed.values()) == 1, (computed, results)  # at most once per node (and at least once somewhere)
    assert decisions["inflight"] >= 24 - 2 - decisions["affinity"] - decisions["pull"], decisions
    assert all(pred == cached for _, d, pred, cached in results if d == "inflight"), results
