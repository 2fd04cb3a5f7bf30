"""Several models, adapters and cache salts behind one gateway (issue #28), on real workers and a real directory.

Equal tokens under another model, adapter or cache salt are other KV: they never share a hash, so they never
hit each other's blocks; a request reaches only engines that serve its model; a pull is planned and accepted
only between engines of one KV fingerprint (docs/protocol.md §1.1, §2.1).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvdir.local_cluster import Cluster, Gateway, Workers, free_ports
from tests.support.wait import wait_for

PROMPT = "The same words, under two models, are two different caches of keys and values. " * 4
N_BLOCKS = len(PROMPT.encode()) // 16
# worker-1 and worker-2 serve alpha (and its adapter alpha-sql), worker-3 serves beta, worker-4 serves alpha's
# next revision under the same name: each its own KV fingerprint but for the first two.
ROLES = (
    ("--model", "alpha", "--adapters", "alpha-sql"),
    ("--model", "alpha", "--adapters", "alpha-sql"),
    ("--model", "beta"),
    ("--model", "alpha", "--adapters", "alpha-sql", "--model-revision", "r2"),
)


@dataclass
class Mixed:
    cluster: Cluster
    workers: Workers
    gateway: Gateway


@pytest.fixture
def mixed(file_directory, make_gateway, tmp_path: Path) -> Iterator[Mixed]:
    c = file_directory
    data = tmp_path / "mixed-workers"
    data.mkdir()
    w = Workers(
        data,
        free_ports(len(ROLES)),
        c.replica_urls,
        log_level="info",
        extra_args=("--time-scale", "0.05", "--heartbeat-interval-s", "0.3", "--transfer", "tcp"),
    )
    try:
        for i, role in enumerate(ROLES):
            w.start_worker(i, *role)
        w.wait_ready(60)
        yield Mixed(c, w, make_gateway(c, len(ROLES)))
    finally:
        w.stop()


def _complete(url: str, model: str, prompt: str = PROMPT, **extra: object) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def _cached(r: httpx.Response) -> int:
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def _decisions(gateway: str) -> float:
    """Requests the gateway routed (the sum of kvdir_gateway_decisions_total over its reasons)."""
    lines = httpx.get(gateway + "/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("kvdir_gateway_decisions_total{"))


def _holders(m: Mixed, **identity: str) -> dict[str, dict]:
    body = {"tokens": list(PROMPT.encode()), "with_slots": True, **identity}
    res = httpx.post(m.cluster.replica_urls[0] + "/v1/lookup", json=body, timeout=5).json()
    return {h["node_id"]: h for h in res["holders"]}


def test_requests_reach_only_the_engines_of_their_model(mixed: Mixed) -> None:
    g = mixed.gateway.url
    served = {"alpha": {"worker-1", "worker-2", "worker-4"}, "alpha-sql": {"worker-1", "worker-2", "worker-4"}}
    served["beta"] = {"worker-3"}
    wait_for(lambda: {m["id"] for m in httpx.get(g + "/v1/models").json()["data"]} == set(served), what="the union of models")
    for i in range(8):
        for model, nodes in served.items():
            r = _complete(g, model, f"request {i} for {model}: " + PROMPT)
            assert r.headers["x-kvdir-node"] in nodes, (model, r.headers)
            assert r.json()["model"] in (model, "alpha")  # the stub answers under its base model's name
    # A prompt with an image: the gateway cannot hash it as the engine does, so it routes by load, says so,
    # predicts nothing and plans no pull.
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    content = [{"type": "text", "text": PROMPT}, image]
    r = httpx.post(g + "/v1/chat/completions", json={"model": "beta", "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    assert r.headers["x-kvdir-decision"] == "unhashed" and r.headers["x-kvdir-predicted-cached-tokens"] == "0"
    # A model no engine serves: the gateway answers itself, OpenAI-shaped, and forwards nothing.
    before = _decisions(g)
    r = httpx.post(g + "/v1/completions", json={"model": "gamma", "prompt": PROMPT}, timeout=5)
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    r = httpx.post(g + "/v1/chat/completions", json={"model": "gamma", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert _decisions(g) == before == 8 * len(served) + 1


def test_equal_tokens_under_two_models_adapters_or_salts_never_share_blocks(mixed: Mixed) -> None:
    g, w = mixed.gateway.url, mixed.workers
    first = _complete(g, "alpha")
    holder = first.headers["x-kvdir-node"]
    wait_for(lambda: holder in _holders(mixed, model="alpha"), what="alpha's blocks")
    # The directory names the blocks by identity: beta, the adapter and a salt hold nothing of them.
    assert _holders(mixed, model="beta") == {} == _holders(mixed, model="alpha", adapter="alpha-sql")
    assert _holders(mixed, model="alpha", cache_salt="s1") == {}
    # beta through the gateway: no affinity to alpha's holder, nothing cached.
    r = _complete(g, "beta")
    assert r.headers["x-kvdir-node"] == "worker-3" and r.headers["x-kvdir-predicted-cached-tokens"] == "0"
    assert _cached(r) == 0
    # On alpha's holder itself: the adapter and a salted request compute the prompt again...
    url = w.urls[w.node_ids.index(holder)]
    assert _cached(_complete(url, "alpha-sql")) == 0
    assert _cached(_complete(url, "alpha", cache_salt="s1")) == 0
    assert _cached(_complete(url, "alpha", cache_salt="s2")) == 0
    # ...and each hits its own blocks the next time.
    assert _cached(_complete(url, "alpha-sql")) == N_BLOCKS * 16
    assert _cached(_complete(url, "alpha", cache_salt="s1")) == N_BLOCKS * 16
    assert _cached(_complete(url, "alpha")) == N_BLOCKS * 16
    # Through the gateway, a salted request follows its own salt's blocks only.
    wait_for(lambda: holder in _holders(mixed, model="alpha", cache_salt="s1"), what="the salted blocks")
    r = _complete(g, "alpha", cache_salt="s1")
    assert r.headers["x-kvdir-node"] == holder and r.headers["x-kvdir-decision"] == "affinity", r.headers
    r = _complete(g, "alpha", cache_salt="s3")
    assert r.headers["x-kvdir-predicted-cached-tokens"] == "0", r.headers


def test_a_pull_across_fingerprints_is_refused_and_recomputed(mixed: Mixed) -> None:
    w = mixed.workers
    _complete(w.urls[0], "alpha")
    wait_for(lambda: "worker-1" in _holders(mixed, model="alpha"), what="worker-1's blocks")
    src = _holders(mixed, model="alpha")["worker-1"]
    fingerprints = {
        n["node_id"]: n["fingerprint"] for n in httpx.get(mixed.cluster.replica_urls[0] + "/v1/nodes").json()["nodes"]
    }
    assert fingerprints["worker-1"] == fingerprints["worker-2"]
    assert len({fingerprints["worker-1"], fingerprints["worker-3"], fingerprints["worker-4"]}) == 3
    plan = {"source_node": "worker-1", "source_epoch": src["epoch"], "slots": src["slots"]}
    # Another model (beta) and the same name's next revision (worker-4): refused, whether the plan names the
    # source's fingerprint or not; the prompt is computed, and the refusal counted.
    for i, node in ((2, "worker-3"), (3, "worker-4")):
        for forged in (plan, {**plan, "fingerprint": fingerprints["worker-1"]}):
            model = "beta" if node == "worker-3" else "alpha"
            r = _complete(w.urls[i], model, kvdir_pull=forged, cache_salt=f"fresh-{len(forged)}")
            assert r.json()["kvdir"]["pulled_tokens"] == 0 and _cached(r) == 0, r.json()
            assert "fingerprint" in " ".join(r.json()["kvdir"]["pull_failures"])
        assert "kvdir_worker_pull_refused_total 2.0" in httpx.get(w.urls[i] + "/metrics").text
    # The same plan between equal fingerprints is followed: the control.
    r = _complete(w.urls[1], "alpha", kvdir_pull=plan)
    assert r.json()["kvdir"]["pulled_tokens"] == N_BLOCKS * 16 and r.json()["kvdir"]["pull_failures"] == [], r.json()
    # A plan naming a fingerprint that is not the puller's is refused even from a compatible source.
    r = _complete(w.urls[1], "alpha", kvdir_pull={**plan, "fingerprint": fingerprints["worker-3"]}, cache_salt="other")
    assert r.json()["kvdir"]["pulled_tokens"] == 0 and "fingerprint" in " ".join(r.json()["kvdir"]["pull_failures"])
