"""A gateway started with neither --block-size nor --tokenizer in front of the session's two vLLM engines (issue
#44): it hashes at the engines' registered block size (32, not its default 16), tokenizes chats with the tiny
model's own files (found through the engines' /v1/models root: the engines serve it as `tiny`), its parity
probe reports a match with both engines, and turn 2 of a chat is served from the cache turn 1 left."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvdir.local_cluster import Cluster, Gateway, free_ports
from kvproto.hashing import KvIdentity, identity_hashes
from tests.support.wait import wait_for
from tests.vllm.conftest import BLOCK, MODEL, Engine

SYSTEM = "a support assistant of a hardware store answers briefly and cites the aisle for screws nails hinges " * 6


@pytest.fixture(scope="module")
def bare_gateway(directory: Cluster, engines: dict[str, Engine], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = Gateway(
        tmp_path_factory.mktemp("gateway-defaults"),
        free_ports(1)[0],
        directory.replica_urls,
        log_level="info",
        tokenizer=None,  # no --tokenizer: the default, auto
        extra_args=("--lookup-timeout-s", "5"),  # a lookup may be slow on two busy cores; nothing else is tuned
    )
    try:
        g.wait_ready(60, engines=2)
        yield g
    finally:
        g.stop()


def _chat(gateway: Gateway, messages: list[dict[str, str]]) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
    r = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def test_a_gateway_with_no_tuning_matches_the_engines_and_serves_turn_2_from_cache(
    engines: dict[str, Engine], directory: Cluster, bare_gateway: Gateway
) -> None:
    g = bare_gateway

    # Compared with its own files: a match. Until an engine's /v1/models has named the model's root the gateway
    # has no files for it and reports that it asks the engine; found, the model is probed again (tokenizer_parity.py).
    def matched() -> list[dict[str, Any]] | None:
        listed = httpx.get(g.url + "/v1/status").json()["engines"]
        return listed if [e["tokenizer_parity"] for e in listed] == ["match", "match"] else None

    probed: list[dict[str, Any]] = wait_for(matched, what="both engines probed, each a match", timeout=60)
    health = httpx.get(g.url + "/health").json()
    assert (health["tokenizer"], health["tokenizer_mismatch"], health["block_size_mismatch"]) == ("auto", [], [])
    assert {e["block_size"] for e in probed} == {BLOCK}
    assert "model tiny: tokenizer and chat template from " in g.log_path.read_text()

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "where are the hinges?"}]
    first = _chat(g, messages)
    node = first.headers["x-kvdir-node"]
    # Wait until the directory holds turn 1's blocks on its engine (publishing is asynchronous; a user thinks).
    tokens = httpx.post(engines[node].url + "/tokenize", json={"model": MODEL, "messages": messages}, timeout=30).json()["tokens"]
    hashes = identity_hashes(tokens, KvIdentity(model=MODEL), BLOCK)
    assert len(hashes) >= 4
    lookup = directory.replica_urls[0] + "/v1/lookup"

    def held() -> bool:
        holders = httpx.post(lookup, json={"hashes": hashes}, timeout=5).json()["holders"]
        return any(h["node_id"] == node and h["matched_blocks"] == len(hashes) for h in holders)

    wait_for(held, what="turn 1's blocks in the directory", timeout=30)
    messages += [
        {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "and the paint?"},
    ]
    second = _chat(g, messages)
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert second.headers["x-kvdir-node"] == node, second.headers
    # To its history's engine: as the directory lists it (affinity) or as the gateway itself sent it there (inflight).
    assert second.headers["x-kvdir-decision"] in ("affinity", "inflight"), second.headers
    assert cached >= len(hashes) * BLOCK  # the engine served turn 1's blocks from its cache
    assert int(second.headers["x-kvdir-predicted-cached-tokens"]) == cached
