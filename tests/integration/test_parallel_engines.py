"""Tensor- and data-parallel worker stubs against a real directory (one replica; three where a test reads from
followers) and gateway (docs/protocol.md §2.2, docs/engines.md): a TP node registers one region and transfer engine
per rank under one epoch and pulls rank to rank; a restart invalidates its entries on every rank; TP sizes that
differ never pull; DP ranks behind one API are separate holders and candidates, and the gateway's request reaches
the rank it planned for."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

from kvproto.schemas import DP_RANK_HEADER
from tests.support.wait import wait_for

MODEL = "kvdir-stub"
PROMPT = "You are a careful assistant. Keep answers short and cite the cache. " * 6  # 408 bytes: 25 full blocks
FULL = 25 * 16


def _complete(url: str, prompt: str, headers: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra}
    r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _lookup(dir_url: str, prompt: str = PROMPT) -> dict[str, dict[str, Any]]:
    body = {"tokens": list(prompt.encode()), "model": MODEL, "with_slots": True}
    return {h["node_id"]: h for h in httpx.post(dir_url + "/v1/lookup", json=body, timeout=5).json()["holders"]}


def _node(dir_url: str, node_id: str) -> dict[str, Any]:
    out: dict[str, Any] = httpx.get(f"{dir_url}/v1/nodes/{node_id}", timeout=5).json()
    return out


def _plan(holder: dict[str, Any]) -> dict[str, Any]:
    return {"source_node": holder["node_id"], "source_epoch": holder["epoch"], "slots": holder["slots"]}


def _served_on(dir_url: str, url: str, node_id: str) -> dict[str, Any]:
    _complete(url, PROMPT)
    return wait_for(
        lambda: h if (h := _lookup(dir_url).get(node_id)) and h["matched_blocks"] == 25 else None,
        what=f"{node_id}'s blocks in the directory",
    )


@pytest.mark.parametrize("transfer", ["mooncake", "tcp"])
def test_a_tp4_node_pulls_from_a_tp4_node_rank_to_rank(file_directory, make_workers, transfer: str) -> None:
    c = file_directory
    w = make_workers(c, 2, ("--transfer", transfer, "--tp", "4"))
    node = _node(c.replica_urls[0], "worker-1")
    sessions = [node["transfer_url"], *(r["transfer_url"] for r in sorted(node["regions"], key=lambda r: r["rank"])[1:])]
    assert [r["rank"] for r in node["regions"]] == [0, 1, 2, 3] and len(set(sessions)) == 4  # one engine per rank
    holder = _served_on(c.replica_urls[0], w.urls[0], "worker-1")
    pulled = _complete(w.urls[1], PROMPT, kvdir_pull=_plan(holder))["kvdir"]
    # Every block verified on every rank (the content is a function of hash and rank: a rank read from another
    # rank's memory fails), four reads at once, 4 x 25 blocks of 16 KiB.
    assert (pulled["pulled_tokens"], pulled["pull_failures"]) == (FULL, [])
    assert len(pulled["pull_rank_s"]) == 4 and pulled["pull_bytes"] == 4 * 25 * 16384
    # One entry per block for the whole node, the same slot on every rank (mirrored): a TP node costs the
    # directory what a TP 1 node does.
    puller = wait_for(lambda: _lookup(c.replica_urls[0]).get("worker-2"), what="worker-2's blocks listed")
    assert puller["matched_blocks"] == 25 and len(puller["slots"]) == 25


def test_a_restarted_tp_node_has_a_new_epoch_and_none_of_its_old_entries(file_directory, make_workers) -> None:
    """Its memory on every rank is new: nothing published under the old epoch is handed out, and a plan naming
    the old epoch is recomputed on every rank."""
    c = file_directory
    w = make_workers(c, 2, ("--transfer", "tcp", "--tp", "4"))
    old = _served_on(c.replica_urls[0], w.urls[0], "worker-1")
    w.kill(0)
    w.start_worker(0)
    wait_for(lambda: _node(c.replica_urls[0], "worker-1").get("epoch") not in (None, old["epoch"]), what="a new epoch")
    assert "worker-1" not in _lookup(c.replica_urls[0])  # the old epoch's entries went with the re-registration
    w.wait_ready(60)
    out = _complete(w.urls[1], PROMPT, kvdir_pull=_plan(old))["kvdir"]
    assert out["pulled_tokens"] == 0 and "not registered" in out["pull_failures"][0]


def test_holder_and_puller_of_different_tp_sizes_never_pull(file_directory, make_workers) -> None:
    """Even with equal fingerprints (forced here): rank r's pages of a TP 4 node hold another share of the heads
    than a TP 2 node's rank r."""
    c = file_directory
    w = make_workers(c, 2, ("--transfer", "tcp", "--fingerprint", "same", "--tp", "4"))
    w.kill(1)
    w.start_worker(1, "--tp", "2")
    w.wait_ready(60)
    holder = _served_on(c.replica_urls[0], w.urls[0], "worker-1")
    out = _complete(w.urls[1], PROMPT, kvdir_pull=_plan(holder))["kvdir"]
    assert out["pulled_tokens"] == 0
    assert out["pull_failures"] == ["source worker-1 has 4 TP ranks, this engine 2: its KV heads are sliced otherwise"]
    assert "kvdir_worker_pull_refused_total 1.0" in httpx.get(w.urls[1] + "/metrics", timeout=5).text


def test_a_plan_past_one_ranks_memory_is_recomputed_on_every_rank(file_directory, make_workers) -> None:
    """A holder whose rank 1 registered room for 8 blocks (rank 0: all of them) and a plan for 25: no rank reads
    anything (a partial load would leave the ranks unequal), the pull is counted as failed and the prompt is
    computed; the output names the rank."""
    c = file_directory
    w = make_workers(c, 2, ("--transfer", "tcp", "--tp", "2"))
    real = _served_on(c.replica_urls[0], w.urls[0], "worker-1")
    node = _node(c.replica_urls[0], "worker-1")
    regions = [{k: v for k, v in r.items() if v is not None} for r in node["regions"]]
    for r in regions:
        if r["rank"] == 1:
            r["length"] = 8 * r["block_bytes"]
    body = {
        "node_id": "short-rank",
        "api_url": "http://127.0.0.1:9",
        "transfer_url": node["transfer_url"],
        "regions": regions,
        "fingerprint": node["fingerprint"],
        "models": node["models"],
    }
    reg = httpx.post(c.replica_urls[0] + "/v1/nodes", json=body, timeout=10)
    assert reg.status_code == 200, reg.text
    plan = {"source_node": "short-rank", "source_epoch": reg.json()["epoch"], "slots": real["slots"]}
    assert "kvdir_worker_pull_errors_total 0.0" in httpx.get(w.urls[1] + "/metrics", timeout=5).text
    out = _complete(w.urls[1], PROMPT, kvdir_pull=plan)["kvdir"]
    assert (out["pulled_tokens"], out["pull_bytes"], len(out["pull_failures"])) == (0, 0, 1)
    assert re.fullmatch(r"slot \d+ is outside rank 1's 8 device slots on short-rank", out["pull_failures"][0])
    assert "kvdir_worker_pull_errors_total 1.0" in httpx.get(w.urls[1] + "/metrics", timeout=5).text


def test_dp_ranks_are_holders_of_their_own_and_the_header_picks_one(file_directory, make_workers) -> None:
    c = file_directory
    w = make_workers(c, 1, ("--transfer", "tcp", "--dp", "2"))
    nodes = {n["node_id"]: n for n in httpx.get(c.replica_urls[0] + "/v1/nodes", timeout=5).json()["nodes"]}
    assert {k: (n["dp_rank"], n["api_url"]) for k, n in nodes.items()} == {
        "worker-1-dp0": (0, w.urls[0]),
        "worker-1-dp1": (1, w.urls[0]),
    }
    out = _complete(w.urls[0], PROMPT, headers={DP_RANK_HEADER: "1"})
    assert out["kvdir"]["node_id"] == "worker-1-dp1"
    wait_for(lambda: set(_lookup(c.replica_urls[0])) == {"worker-1-dp1"}, what="rank 1 alone holding the prompt")
    again = _complete(w.urls[0], PROMPT, headers={DP_RANK_HEADER: "0"})  # rank 0 has its own cache: computed
    assert (again["kvdir"]["node_id"], again["usage"]["prompt_tokens_details"]["cached_tokens"]) == ("worker-1-dp0", 0)
    r = httpx.post(w.urls[0] + "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers={DP_RANK_HEADER: "2"})
    assert r.status_code == 400 and "ranks 0..1" in r.json()["error"]["message"]


def test_the_gateway_routes_to_the_dp_rank_holding_the_prefix(file_directory, make_workers, make_gateway) -> None:
    """Two DP ranks behind one API server are two candidates; the request the gateway plans for rank 1 (the
    holder) is served by rank 1, which reports its cached prefix."""
    c = file_directory
    w = make_workers(c, 1, ("--transfer", "tcp", "--dp", "2"))
    g = make_gateway(c, 2)
    _complete(w.urls[0], PROMPT, headers={DP_RANK_HEADER: "1"})
    wait_for(lambda: set(_lookup(c.replica_urls[0])) == {"worker-1-dp1"}, what="rank 1 holding the prompt")
    r = httpx.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-kvdir-node"] == "worker-1-dp1" and r.json()["kvdir"]["node_id"] == "worker-1-dp1"
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == FULL
    status = {e["node_id"] for e in httpx.get(g.url + "/v1/status", timeout=5).json()["engines"]}
    assert status == {"worker-1-dp0", "worker-1-dp1"}
