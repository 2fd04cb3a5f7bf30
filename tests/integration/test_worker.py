"""Worker stubs against a real directory (three replicas where a test reads from followers or takes the
directory down, else one): reuse, pulls through a real transfer engine, publishing through outages and
restarts, and OpenAI-style errors."""

from __future__ import annotations

import json

import httpx
import pytest

from kvproto.hashing import block_hashes
from kvproto.schemas import PULL_GBPS_LABEL
from tests.support.wait import wait_for

MODEL = "kvdir-stub"
PROMPT = "You are a careful assistant. Keep answers short and cite the cache. " * 6  # 408 bytes: 25 full blocks


def _complete(url: str, prompt: str | list[int], **extra) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _holders(dir_url: str, prompt: str, **extra) -> dict[str, int]:
    r = httpx.post(dir_url + "/v1/lookup", json={"tokens": list(prompt.encode()), "model": MODEL, **extra}).json()
    return {h["node_id"]: h["matched_blocks"] for h in r["holders"]}


def _load(dir_url: str, node_id: str) -> dict[str, float]:
    return httpx.get(f"{dir_url}/v1/nodes/{node_id}").json()["load"]


def test_second_request_reuses_the_prefix(file_directory, make_workers) -> None:
    c = file_directory
    w = make_workers(c, 1)
    first = _complete(w.urls[0], PROMPT)
    second = _complete(w.urls[0], PROMPT + " And one more question?")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 25 * 16  # every full block of the first prompt
    assert second["kvdir"]["prefill_s"] < first["kvdir"]["prefill_s"]
    assert first["choices"][0]["text"] and first["usage"]["completion_tokens"] == 4
    # Publishing is asynchronous; the blocks reach every replica.
    for url in c.replica_urls:
        wait_for(lambda: _holders(url, PROMPT) == {"worker-1": 25}, what=f"worker-1's blocks on {url}")


@pytest.mark.parametrize("transfer", ["mooncake", "tcp"])
def test_peer_pulls_a_prefix_as_verified_bytes(file_directory, make_workers, transfer) -> None:
    c = file_directory
    w = make_workers(c, 2, ("--transfer", transfer, "--tp", "2", "--pull-probe-blocks", "0"))
    _complete(w.urls[0], PROMPT)
    wait_for(lambda: _holders(c.replica_urls[0], PROMPT) == {"worker-1": 25}, what="worker-1's blocks")
    res = httpx.post(
        c.replica_urls[0] + "/v1/lookup", json={"tokens": list(PROMPT.encode()), "model": MODEL, "with_slots": True}
    ).json()
    holder = res["holders"][0]
    plan = {"source_node": holder["node_id"], "source_epoch": holder["epoch"], "slots": holder["slots"]}
    pulled = _complete(w.urls[1], PROMPT, kvdir_pull=plan)
    assert pulled["kvdir"]["pulled_tokens"] == 25 * 16, pulled["kvdir"]
    assert pulled["kvdir"]["pull_failures"] == []
    assert pulled["usage"]["prompt_tokens_details"]["cached_tokens"] == 25 * 16
    wait_for(lambda: _holders(c.replica_urls[0], PROMPT) == {"worker-1": 25, "worker-2": 25}, what="both holders listed")
    metrics = httpx.get(w.urls[1] + "/metrics").text
    assert "kvdir_worker_pulled_blocks_total 25.0" in metrics
    # The puller's heartbeats report the bandwidth of that read (its only one) for the gateway to price pulls with.
    measured = pulled["kvdir"]["pull_bytes"] / pulled["kvdir"]["pull_transfer_s"] / 1e9
    wait_for(lambda: PULL_GBPS_LABEL in _load(c.replica_urls[0], "worker-2"), what="worker-2's pull_gbps")
    assert _load(c.replica_urls[0], "worker-2")[PULL_GBPS_LABEL] == pytest.approx(measured)
    assert PULL_GBPS_LABEL not in _load(c.replica_urls[0], "worker-1")  # it never pulled


@pytest.mark.parametrize("transfer", ["mooncake", "tcp"])
def test_engines_measure_their_pull_bandwidth_before_any_pull(file_directory, make_workers, transfer) -> None:
    """The first pull priced right: each engine reads a probe of its peer's KV memory, so its heartbeats report a
    bandwidth before the gateway plans a pull to it; nothing of the probe counts as a pull or lands in a pool."""
    c = file_directory
    w = make_workers(c, 2, ("--transfer", transfer, "--tp", "2", "--pull-probe-blocks", "8"))
    for node_id in ("worker-1", "worker-2"):
        wait_for(lambda: PULL_GBPS_LABEL in _load(c.replica_urls[0], node_id), what=f"{node_id}'s pull_gbps")
        assert _load(c.replica_urls[0], node_id)[PULL_GBPS_LABEL] > 0
    for url in w.urls:
        metrics = httpx.get(url + "/metrics").text
        assert "kvdir_worker_pulled_blocks_total 0.0" in metrics and "kvdir_worker_pull_errors_total 0.0" in metrics
        assert 'kvdir_worker_task_failures_total{task="pull_probe"} 0.0' in metrics


def test_stale_or_wrong_pull_falls_back_to_recompute(file_directory, make_workers) -> None:
    c = file_directory
    w = make_workers(c, 2, ("--transfer", "tcp"))
    _complete(w.urls[0], PROMPT)
    wait_for(lambda: _holders(c.replica_urls[0], PROMPT) == {"worker-1": 25}, what="worker-1's blocks")
    res = httpx.post(
        c.replica_urls[0] + "/v1/lookup", json={"tokens": list(PROMPT.encode()), "model": MODEL, "with_slots": True}
    ).json()
    holder = res["holders"][0]
    # The slots of other blocks (as if the source reused them): every block fails verification.
    shifted = holder["slots"][1:] + holder["slots"][:1]
    wrong = _complete(
        w.urls[1], PROMPT, kvdir_pull={"source_node": "worker-1", "source_epoch": holder["epoch"], "slots": shifted}
    )
    assert wrong["kvdir"]["pulled_tokens"] == 0
    assert wrong["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert "verification" in " ".join(wrong["kvdir"]["pull_failures"])
    assert "kvdir_worker_pull_failed_blocks_total 25.0" in httpx.get(w.urls[1] + "/metrics").text
    # A plan naming an epoch the source does not have is not followed.
    other = "Another prompt that only worker-1 has computed so far, long enough. " * 6
    _complete(w.urls[0], other)
    wait_for(lambda: _holders(c.replica_urls[0], other) == {"worker-1": 25}, what="worker-1's second prompt")
    slots = httpx.post(
        c.replica_urls[0] + "/v1/lookup", json={"tokens": list(other.encode()), "model": MODEL, "with_slots": True}
    ).json()["holders"][0]["slots"]
    stale = _complete(
        w.urls[1], other, kvdir_pull={"source_node": "worker-1", "source_epoch": holder["epoch"] + 100, "slots": slots}
    )
    assert stale["kvdir"]["pulled_tokens"] == 0 and "not registered" in " ".join(stale["kvdir"]["pull_failures"])
    # The recomputed blocks are good: worker-2 now serves them from its own cache.
    again = _complete(w.urls[1], PROMPT)
    assert again["kvdir"]["local_cached_tokens"] == 25 * 16
    # A malformed plan (the wire type is kvproto.schemas.PullPlan) is a 400 naming it, never a 500.
    for bad in ({"source_node": "worker-1", "source_epoch": 0, "slots": []}, {"source_node": "worker-1", "slots": ["a"]}):
        r = httpx.post(w.urls[1] + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "kvdir_pull": bad}, timeout=60)
        assert r.status_code == 400 and "kvdir_pull" in r.json()["error"]["message"], r.text


def test_eviction_publishes_removals(file_directory, make_workers) -> None:
    c = file_directory
    w = make_workers(c, 1, ("--capacity-blocks", "30"))
    _complete(w.urls[0], PROMPT)
    wait_for(lambda: _holders(c.replica_urls[0], PROMPT) == {"worker-1": 25}, what="the first prompt's blocks")
    other = "A different conversation entirely, sharing nothing with the first. " * 6
    _complete(w.urls[0], other)  # needs 25 slots of 30: most of the first prompt is evicted (LRU, tail first)
    wait_for(lambda: _holders(c.replica_urls[0], other) == {"worker-1": 25}, what="the second prompt's blocks")
    wait_for(lambda: _holders(c.replica_urls[0], PROMPT).get("worker-1", 0) <= 5, what="removals of evicted blocks")
    node = httpx.get(c.replica_urls[0] + "/v1/nodes/worker-1").json()
    assert node["blocks"] <= 30


def test_worker_serves_while_the_directory_is_down_and_catches_up(make_cluster, make_workers) -> None:
    c = make_cluster(1)  # all of the directory down: its one replica is as good as three
    w = make_workers(c, 1)
    c.kill(0)
    answer = _complete(w.urls[0], PROMPT)  # the request never waits for the directory
    assert answer["usage"]["prompt_tokens"] == len(PROMPT)
    c.start()
    c.wait_ready(60)
    wait_for(lambda: _holders(c.replica_urls[0], PROMPT) == {"worker-1": 25}, timeout=30, what="blocks published after recovery")


def test_worker_restart_gets_a_new_epoch_and_old_entries_vanish(file_directory, make_workers) -> None:
    c = file_directory
    w = make_workers(c, 1)
    _complete(w.urls[0], PROMPT)
    wait_for(lambda: _holders(c.replica_urls[0], PROMPT) == {"worker-1": 25}, what="first incarnation's blocks")
    old_epoch = httpx.get(w.urls[0] + "/health").json()["epoch"]
    w.kill(0)  # SIGKILL: no deregistration; its pool is gone
    w.start_worker(0)
    new_epoch = w.wait_ready(60)[0]
    assert new_epoch > old_epoch
    res = httpx.post(
        c.replica_urls[0] + "/v1/lookup?consistency=linearizable", json={"tokens": list(PROMPT.encode()), "model": MODEL}
    ).json()
    assert res["holders"] == []  # the old epoch's entries went with the re-registration
    _complete(w.urls[0], PROMPT)
    wait_for(
        lambda: (
            httpx.post(c.replica_urls[0] + "/v1/lookup", json={"tokens": list(PROMPT.encode()), "model": MODEL}).json()["holders"]
            == [{"node_id": "worker-1", "epoch": new_epoch, "matched_blocks": 25}]
        ),
        what="the new epoch's blocks",
    )


def test_openai_api_shapes_streaming_and_errors(file_directory, make_workers) -> None:
    c = file_directory
    w = make_workers(c, 1, ("--max-model-len", "1000"))
    url = w.urls[0]
    models = httpx.get(url + "/v1/models").json()
    assert models["data"][0]["id"] == MODEL
    chat = httpx.post(
        url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    ).json()
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    with httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        json={"model": MODEL, "stream": True, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(ch["choices"][0]["delta"]["content"] for ch in chunks) and chunks[-1]["usage"]["completion_tokens"] == 5
    ids = list(range(40))
    tok = _complete(url, ids)
    assert tok["usage"]["prompt_tokens"] == 40
    assert httpx.post(url + "/tokenize", json={"prompt": "héllo"}).json()["count"] == 6
    bad = [
        (httpx.post(url + "/v1/completions", content=b"{nope", headers={"content-type": "application/json"}), 400),
        (httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": 5}), 400),
        (httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": "many"}), 400),
        (httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [-1]}), 400),
        (httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 999, "max_tokens": 10}), 400),
        (httpx.post(url + "/v1/completions", json={"model": "other", "prompt": "x"}), 404),
        (httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": []}), 400),
        (httpx.post(url + "/v1/completions", json={"prompt": "x"}), 400),
    ]
    for r, status in bad:
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["message"] and err["type"]
    assert (
        httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 999, "max_tokens": 10}).json()["error"]["code"]
        == "context_length_exceeded"
    )
    assert block_hashes(list(PROMPT.encode()))  # the gateway hashes exactly what the worker caches


def test_directory_rebuilds_from_workers_after_losing_all_state(make_cluster, make_workers) -> None:
    """Every replica loses its data dir at once (the worst case): the workers' next heartbeat
    gets a 409, they register again and republish what they hold, and lookups find it again (one replica: what a
    3-replica cluster restarted whole recovers is test_replication's)."""
    import shutil

    c = make_cluster(1)
    w = make_workers(c, 1)
    _complete(w.urls[0], PROMPT)
    wait_for(lambda: _holders(c.replica_urls[0], PROMPT) == {"worker-1": 25}, what="blocks published")
    old_epoch = httpx.get(w.urls[0] + "/health").json()["epoch"]
    c.kill(0)
    shutil.rmtree(c.data_dir / "replica1")
    c.start()
    c.wait_ready(60)
    wait_for(lambda: _holders(c.replica_urls[0], PROMPT) == {"worker-1": 25}, timeout=30, what="blocks republished")
    assert httpx.get(w.urls[0] + "/health").json()["epoch"] >= 1
    assert old_epoch >= 1
