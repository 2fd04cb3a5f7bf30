"""The gateway right in front of its engines with no tuning (issue #44): it hashes at the block size the engines
registered, not at its --block-size default, and its tokenizer parity probe reports, and routes around, a
tokenizer that differs from the engines' (/health, /metrics, the status JSON, the log)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.support.wait import wait_for

MODEL = "kvdir-stub"
SYSTEM = "You are the assistant of a very long shared system prompt about KV caches. " * 8


def _chat(url: str, messages: list[dict[str, str]]) -> httpx.Response:
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def _two_turns(gateway: str, leader: str) -> tuple[httpx.Response, httpx.Response]:
    """Turn 1 of a chat, then (once the directory lists its engine's blocks, as a user's think time would) turn 2."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    first = _chat(gateway, messages)
    node = first.headers["x-kvdir-node"]
    wait_for(
        lambda: any(n["node_id"] == node and n["blocks"] > 0 for n in httpx.get(leader + "/v1/nodes").json()["nodes"]),
        what="turn 1 published",
    )
    messages += [
        {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "second question"},
    ]
    return first, _chat(gateway, messages)


def _served_from_cache(first: httpx.Response, second: httpx.Response) -> int:
    """The cached tokens turn 2 was predicted and reported to have, asserting it stayed home and they agree."""
    assert second.headers["x-kvdir-node"] == first.headers["x-kvdir-node"]
    assert second.headers["x-kvdir-decision"] == "affinity"
    predicted = int(second.headers["x-kvdir-predicted-cached-tokens"])
    assert predicted == second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return predicted


def test_no_block_size_flag_and_the_gateway_still_matches_engines_of_another_block_size(
    file_directory: Any, make_workers: Any, make_gateway: Any
) -> None:
    """Engines registering 32-token blocks, a gateway left at its default (16): turn 2 is served from the
    cache its history left, in whole 32-token blocks, and nothing is reported mismatched."""
    c = file_directory
    make_workers(c, 2, ("--block-size", "32"))
    g = make_gateway(c, 2)
    health = wait_for(
        lambda: (h := httpx.get(g.url + "/health").json())["tokenizer_mismatch"] == [] and h, what="health answered"
    )
    assert health["block_size_mismatch"] == []
    first, second = _two_turns(g.url, c.wait_ready(10))
    cached = _served_from_cache(first, second)
    assert cached >= first.json()["usage"]["prompt_tokens"] - 32 and cached % 32 == 0
    engines = wait_for(
        lambda: [e for e in httpx.get(g.url + "/v1/status").json()["engines"] if e["tokenizer_parity"] == "match"],
        what="both engines probed",
    )
    assert {e["block_size"] for e in engines} == {32} and len(engines) == 2


def _tokenizer_file(folder: Path) -> Path:
    """A byte-level BPE tokenizer.json, trained here (no download): what the worker stubs run in this test."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([SYSTEM, "first question second question"] * 20, trainers.BpeTrainer(vocab_size=400))
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def test_a_tokenizer_mismatch_shows_in_health_metrics_status_and_log_and_hashing_follows_the_engines(
    file_directory: Any, make_workers: Any, make_gateway: Any, tmp_path: Path
) -> None:
    """Engines tokenizing with a BPE tokenizer, a gateway told `--tokenizer bytes`: the probe finds each engine's
    tokens differ from the gateway's and says so, and the gateway asks the engines to tokenize that model from
    then on, so turn 2 still finds its history."""
    c = file_directory
    make_workers(c, 2, ("--tokenizer", str(_tokenizer_file(tmp_path))))
    g = make_gateway(c, 2, ("--tokenizer", "bytes"))
    problems = wait_for(
        lambda: len(p := httpx.get(g.url + "/health").json()["tokenizer_mismatch"]) == 2 and p, what="both engines probed"
    )
    for p in problems:
        assert p["status"] == "mismatch" and p["model"] == MODEL, p
        assert p["detail"].startswith("chat: first differing token at 0 (gateway ") and "completion: " in p["detail"], p
    metrics = httpx.get(g.url + "/metrics").text
    assert 'kvdir_gateway_tokenizer_mismatches_total{status="mismatch"} 2.0' in metrics
    assert 'kvdir_gateway_tokenizer_parity_engines{status="mismatch"} 2.0' in metrics
    parity = {e["node_id"]: e["tokenizer_parity"] for e in httpx.get(g.url + "/v1/status").json()["engines"]}
    assert all(v.startswith("mismatch: chat: first differing token at 0") for v in parity.values()), parity
    assert "Block sizes and tokenizer parity" in httpx.get(g.url + "/").text
    warnings = [line for line in g.log_path.read_text().splitlines() if "tokenizer parity: engine" in line]
    assert len(warnings) == 2 and all("WARNING" in w and "tokenizes otherwise than the gateway" in w for w in warnings)
    first, second = _two_turns(g.url, c.wait_ready(10))
    assert _served_from_cache(first, second) > 0
