"""The worker stub's host tier against a real one-replica directory (issue #32, docs/protocol.md §2.3): a prefix the
device pool evicts lives on in the host tier, published with medium host; the engine serves it from there (a
modeled host-to-device copy), a peer pulls it from there, and it leaves the directory once evicted from the host
tier too; a peer's read of a host slot reused meanwhile fails the content check and is recomputed."""

from __future__ import annotations

from typing import Any

import httpx

from kvproto import media
from tests.support.wait import wait_for

MODEL = "kvdir-stub"
PROMPT = "Tiers: device, then host, then gone. " * 4  # 148 bytes: 9 full blocks of 16 byte tokens
FULL = 9 * 16
# --capacity-blocks 10 (the prompt, one block spare), --host-blocks 20.
ARGS = ("--transfer", "tcp", "--capacity-blocks", "10", "--host-blocks", "20")


def _complete(url: str, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _holder(dir_url: str, node_id: str, prompt: str = PROMPT) -> dict[str, Any] | None:
    body = {"tokens": list(prompt.encode()), "model": MODEL, "with_slots": True}
    holders = httpx.post(dir_url + "/v1/lookup", json=body, timeout=5).json()["holders"]
    return next((h for h in holders if h["node_id"] == node_id), None)


def _media_of(holder: dict[str, Any] | None) -> set[str]:
    return {media.medium_name(loc) for loc in holder["slots"]} if holder else set()


def _evict(url: str, n: int) -> None:
    """Serve `n` distinct 160-byte prompts (10 blocks each): each evicts every device block the last one left."""
    for i in range(n):
        _complete(url, f"{i:04d}" * 40)


def _on(dir_url: str, node: str, where: str, prompt: str = PROMPT) -> dict[str, Any]:
    return wait_for(
        lambda: h if (h := _holder(dir_url, node, prompt)) and h["matched_blocks"] == 9 and _media_of(h) == {where} else None,
        what=f"{node} listed as holding the prompt on {where}",
    )


def test_an_evicted_prefix_is_served_and_pulled_from_the_host_tier_then_gone(file_directory, make_workers) -> None:
    c = file_directory
    w = make_workers(c, 2, ARGS)
    d = c.replica_urls[0]
    regions = httpx.get(f"{d}/v1/nodes/worker-1", timeout=5).json()["regions"]
    assert sorted((r["medium"] or "device", r["length"] // r["block_bytes"]) for r in regions) == [("device", 10), ("host", 20)]
    _complete(w.urls[0], PROMPT)
    _on(d, "worker-1", "device")
    _evict(w.urls[0], 1)
    host = _on(d, "worker-1", "host")  # the same hashes, moved: their locations now name the host tier

    # A peer pulls the prefix from the host tier: every block's bytes check out.
    pulled = _complete(
        w.urls[1], PROMPT, kvdir_pull={"source_node": "worker-1", "source_epoch": host["epoch"], "slots": host["slots"]}
    )
    assert (pulled["kvdir"]["pulled_tokens"], pulled["kvdir"]["pull_failures"]) == (FULL, [])

    # The holder serves it from its host tier: cached, at the modeled cost of the copy, and back on its device.
    again = _complete(w.urls[0], PROMPT)
    k = again["kvdir"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == FULL
    assert (k["local_cached_tokens"], k["host_cached_tokens"], k["pulled_tokens"]) == (FULL, FULL, 0) and k["host_load_s"] > 0
    _on(d, "worker-1", "device")
    metrics = httpx.get(w.urls[0] + "/metrics", timeout=5).text
    assert 'kvdir_worker_cached_tokens_total{source="host"} 144.0' in metrics and "kvdir_worker_host_loads_total 9.0" in metrics

    # Evicted from the device (to the host), then from the host tier by three more prompts: gone from the node.
    _evict(w.urls[0], 1)
    _on(d, "worker-1", "host")
    _evict(w.urls[0], 3)
    wait_for(lambda: _holder(d, "worker-1") is None, what="the prompt gone from worker-1's entries")


def test_a_peers_read_of_a_host_slot_reused_meanwhile_is_recomputed(file_directory, make_workers) -> None:
    c = file_directory
    w = make_workers(c, 2, ARGS)
    d = c.replica_urls[0]
    _complete(w.urls[0], PROMPT)
    _evict(w.urls[0], 1)
    stale = _on(d, "worker-1", "host")
    # Three more prompts push the prompt's blocks out of the host tier; its slots there now hold others' bytes.
    _evict(w.urls[0], 3)
    wait_for(lambda: _holder(d, "worker-1") is None, what="the prompt gone from worker-1's entries")
    plan = {"source_node": "worker-1", "source_epoch": stale["epoch"], "slots": stale["slots"]}
    out = _complete(w.urls[1], PROMPT, kvdir_pull=plan)
    assert out["kvdir"]["pulled_tokens"] == 0 and out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert out["kvdir"]["pull_failures"] == ["9 blocks failed verification (slot reused on the source?)"]
    # A location in no medium (top bits 3) is refused, not a server error: nothing read, the prompt computed.
    bad = {**plan, "slots": [3 << media.SHIFT] * 9}
    out = _complete(w.urls[1], "?" + PROMPT, kvdir_pull=bad)  # blocks worker-2 does not hold
    assert out["kvdir"]["pull_failures"] == [f"location {3 << media.SHIFT} lies in no medium (docs/protocol.md §2.3)"]


def test_the_gateway_prices_a_host_hit_as_a_copy_to_the_device(file_directory, make_workers, make_gateway) -> None:
    """worker-1 holds the prompt in its host tier only. At the default copy rate the gateway sends the prompt
    there (microseconds of copy against recomputing it elsewhere or pulling it), and the engine serves it from
    there; told the copy crawls (--host-copy-gbps 1e-9), a gateway has worker-2 pull it from worker-1's host
    tier instead. That gateway's prefill rate is slow (100 tokens/s: 1.5 s to recompute the prompt), so the pull
    wins at whatever bandwidth worker-2's probe measured on these loaded cores (pricing a pull at a measured
    figure was seen to make recomputing at the default rate, 15 ms, cheaper)."""
    c = file_directory
    w = make_workers(c, 2, ARGS)
    d = c.replica_urls[0]
    _complete(w.urls[0], PROMPT)
    _evict(w.urls[0], 1)
    _on(d, "worker-1", "host")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    g = make_gateway(c, 2)
    r = httpx.post(g.url + "/v1/completions", json=body, timeout=60)
    assert (r.status_code, r.headers["x-kvdir-node"], r.headers["x-kvdir-decision"]) == (200, "worker-1", "affinity"), r.text
    assert (
        int(r.headers["x-kvdir-predicted-cached-tokens"]) == r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == FULL
    )
    assert r.json()["kvdir"]["host_cached_tokens"] == FULL

    _evict(w.urls[0], 1)
    _on(d, "worker-1", "host")
    crawl = make_gateway(c, 2, ("--host-copy-gbps", "1e-9", "--prefill-tokens-per-s", "100"))
    r = httpx.post(crawl.url + "/v1/completions", json=body, timeout=60)
    assert (r.status_code, r.headers["x-kvdir-node"], r.headers["x-kvdir-decision"]) == (200, "worker-2", "pull"), r.text
    assert r.json()["kvdir"]["pulled_tokens"] == FULL  # read from worker-1's host tier
