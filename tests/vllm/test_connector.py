"""The kvdir connector in real vLLM engines: published slots, pulls through the gateway, stale plans, dead holders.

Tests share two engines (session fixtures) and run in file order; the last ones kill and restart engine A.
Greedy decoding (temperature 0) makes outputs comparable: a pulled prefix must give exactly the output of
the same request recomputed on the same engine after `/reset_prefix_cache`.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import httpx
import numpy as np

from kvdir.local_cluster import Cluster, Gateway
from kvproto.hashing import KvIdentity, identity_hashes
from kvtransfer.backends import create_engine
from tests.support.wait import wait_for
from tests.vllm.conftest import BLOCK, MODEL, PROMPT, Engine

PULL = "kvdir_connector_pulled_blocks_total"
FAILED = "kvdir_connector_pull_failed_blocks_total"
REFUSED = 'kvdir_connector_plans_total{outcome="refused"}'


def _tokens(engine: Engine, prompt: str = PROMPT) -> list[int]:
    return engine.tokenize(prompt)


def _node(directory: Cluster, node_id: str) -> dict[str, Any] | None:
    nodes = httpx.get(directory.replica_urls[0] + "/v1/nodes", timeout=5).json()["nodes"]
    return next((n for n in nodes if n["node_id"] == node_id), None)


def _holder(directory: Cluster, hashes: list[int], node_id: str) -> dict[str, Any] | None:
    r = httpx.post(directory.replica_urls[0] + "/v1/lookup", json={"hashes": hashes, "with_slots": True}, timeout=5)
    return next((h for h in r.json()["holders"] if h["node_id"] == node_id), None)


def _served(engine: Engine, directory: Cluster, prompt: str = PROMPT) -> tuple[list[int], dict[str, Any]]:
    """Serve `prompt` on `engine`; wait until the directory holds every full block of it there."""
    out = engine.complete(prompt)
    hashes = identity_hashes(_tokens(engine, prompt), KvIdentity(model=MODEL), BLOCK)
    assert out["usage"]["prompt_tokens"] // BLOCK == len(hashes)
    # The holder entry the wait saw (a second lookup could meet an election on two busy cores: a 503).
    holder: dict[str, Any] = wait_for(
        lambda: h if (h := _holder(directory, hashes, engine.name)) is not None and h["matched_blocks"] == len(hashes) else None,
        what=f"{engine.name}'s blocks of the prompt in the directory",
        timeout=30,
    )
    return hashes, holder


def _plan(holder: dict[str, Any], slots: list[int] | None = None, epoch: int | None = None) -> dict[str, Any]:
    return {
        "kvdir_pull": {
            "source_node": holder["node_id"],
            "source_epoch": holder["epoch"] if epoch is None else epoch,
            "slots": holder["slots"] if slots is None else slots,
        }
    }


def _recomputed(engine: Engine, prompt: str = PROMPT) -> dict[str, Any]:
    engine.reset_cache()
    out = engine.complete(prompt)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    return out


def test_the_directory_holds_the_engines_real_block_ids(engines: dict[str, Engine], directory: Cluster) -> None:
    a = engines["vllm-a"]
    hashes, holder = _served(a, directory)
    node = _node(directory, "vllm-a")
    assert node is not None and node["transfer_url"] and node["block_size"] == BLOCK
    # Exactly the prompt's full blocks, each at a distinct slot inside the engine's pool.
    assert holder["matched_blocks"] == len(hashes) and len(set(holder["slots"])) == len(hashes)
    assert all(0 < s < node["capacity_blocks"] for s in holder["slots"])  # vLLM's block 0 is its null block
    # The connector's own record of each block: the tag it keeps beside the KV pages, read from A's memory.
    tags_region = next(r for r in node["regions"] if r["rkey"] == "kvdir-tags")
    te = create_engine("mooncake", "127.0.0.1")
    try:
        buf = np.zeros((len(hashes), 2), dtype="<u8")
        te.register(buf.ctypes.data, buf.nbytes)
        te.read(
            node["transfer_url"],
            [buf.ctypes.data + 16 * i for i in range(len(hashes))],
            [tags_region["base_addr"] + 16 * s for s in holder["slots"]],
            [16] * len(hashes),
        )
    finally:
        te.close()
    assert [int(h) for h in buf[:, 0]] == hashes


def _vllm_counter(engine: Engine, name: str) -> float:
    """A counter of vLLM's own /metrics (the API server's), summed over its series."""
    text = httpx.get(engine.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + " ", name + "{")))


def test_a_pulled_prefix_gives_the_recomputed_output(engines: dict[str, Engine], directory: Cluster) -> None:
    """B's first request is this pull, on purpose: a crash reported on the CPU build ("Illegal instruction" at a
    fresh engine's first connector load) would fail here, not be retried away.

    The counters are exact: the worker reports a load's outcome with the step that ran it, and the scheduler
    adds it to the counters before that step's output (let alone the request's last token) goes out."""
    a, b = engines["vllm-a"], engines["vllm-b"]
    hashes, holder = _served(a, directory)
    assert b.metric(PULL) == 0 and b.metric("kvdir_connector_published_blocks_total") == 0  # B has served nothing yet
    out = b.complete(PROMPT, kv_transfer_params=_plan(holder))
    n_tokens = out["usage"]["prompt_tokens"]
    pullable = min(len(hashes), (n_tokens - 1) // BLOCK)
    # A failed read is recomputed (correct output, see the stale-plan test) but is not a pull: the connector logs why.
    assert b.metric(FAILED) == 0, b.log_lines("pull of")
    assert b.metric(PULL) == pullable, (out["usage"], b.log_lines("pull of"))
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= pullable * BLOCK
    expected = _recomputed(b)
    assert out["choices"][0]["text"] == expected["choices"][0]["text"]
    # vLLM's own /metrics shows the pull too (build_prom_metrics, fed by the stats vLLM gathers each step).
    wait_for(lambda: _vllm_counter(b, "vllm:kvdir_pulled_blocks_total") == pullable, what="vLLM's kvdir_pulled_blocks")
    assert _vllm_counter(b, "vllm:kvdir_pull_failed_blocks_total") == 0 and _vllm_counter(b, "vllm:kvdir_pulls_total") >= 1
    assert _vllm_counter(b, "vllm:kvdir_pull_read_bytes_total") > 0
    # B holds the first blocks itself: it pulls only the rest.
    local = 3
    b.reset_cache()
    b.complete(_tokens(b)[: local * BLOCK + 1], max_tokens=1)
    pulled = b.metric(PULL)
    out = b.complete(PROMPT, kv_transfer_params=_plan(holder))
    assert (b.metric(PULL) - pulled, b.metric(FAILED)) == (pullable - local, 0), b.log_lines("pull of")
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= pullable * BLOCK
    assert out["choices"][0]["text"] == expected["choices"][0]["text"]


def test_a_stale_plan_is_recomputed_and_counted(engines: dict[str, Engine], directory: Cluster) -> None:
    a, b = engines["vllm-a"], engines["vllm-b"]
    hashes, holder = _served(a, directory)
    expected = _recomputed(b)
    pullable = min(len(hashes), (expected["usage"]["prompt_tokens"] - 1) // BLOCK)
    failed, refused = b.metric(FAILED), b.metric(REFUSED)
    # A wrong slot (every block shifted by one): read, found stale, recomputed; the output unchanged.
    b.reset_cache()
    out = b.complete(PROMPT, kv_transfer_params=_plan(holder, slots=[s + 1 for s in holder["slots"]]))
    assert out["choices"][0]["text"] == expected["choices"][0]["text"]
    assert b.metric(FAILED) - failed == pullable
    # A wrong epoch: refused before vLLM counts a token as loaded, so the usage says nothing was cached.
    b.reset_cache()
    out = b.complete(PROMPT, kv_transfer_params=_plan(holder, epoch=holder["epoch"] + 1))
    assert out["choices"][0]["text"] == expected["choices"][0]["text"]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert (b.metric(FAILED) - failed, b.metric(REFUSED) - refused) == (pullable, 1)
    # A evicts and reuses its blocks between plan and read: reset, then fill its whole pool with other prompts.
    a.reset_cache()
    for i in range(10):
        a.complete(f"{i} other words to fill the pool of blocks with something else entirely " * 30, max_tokens=1)
    failed = b.metric(FAILED)
    b.reset_cache()
    out = b.complete(PROMPT, kv_transfer_params=_plan(holder))
    assert out["choices"][0]["text"] == expected["choices"][0]["text"]
    assert b.metric(FAILED) > failed
    # And the directory forgot A's evicted blocks (the connector's pool scan).
    wait_for(lambda: _holder(directory, hashes, "vllm-a") is None, what="A's evicted blocks removed", timeout=30)


def _gateway_running(gateway: Gateway, node_id: str) -> int | None:
    """The engine's running requests as the gateway last read them (`GET /v1/status`), None if it lists no such engine."""
    e = _gateway_engine(gateway, node_id)
    return None if e is None else int(e["running"])


def _gateway_engine(gateway: Gateway, node_id: str) -> dict[str, Any] | None:
    engines = httpx.get(gateway.url + "/v1/status", timeout=5).json()["engines"]
    return next((e for e in engines if e["node_id"] == node_id), None)


def wait_gateway_sees_running(gateway: Gateway, node_id: str, n: int, timeout: float = 30) -> None:
    """Until the gateway's status shows `node_id` running at least `n`; a timeout says what it showed last (where
    the figure came from and how old it was) and what the gateway logged of that engine's load reads."""
    last: list[dict[str, Any] | None] = [None]

    def seen() -> bool:
        last[0] = e = _gateway_engine(gateway, node_id)
        return e is not None and e["running"] >= n

    try:
        wait_for(seen, what=f"the gateway to see {node_id} running {n}", timeout=timeout)
    except AssertionError as exc:
        e = last[0] or {}
        shown = {k: e.get(k) for k in ("running", "waiting", "inflight", "load_source", "load_age_s", "alive")}
        lines = gateway.log_path.read_text(errors="replace").splitlines()
        reads = [x for x in lines if f"engine {node_id}" in x and "load" in x][-5:]
        raise AssertionError(f"{exc}; the status showed {shown}; its load reads: {reads}") from None


BUSY_STREAMS = 2
"""Streams of 3,000 tokens each that keep a holder busy while a test waits for the gateway to see it running 2:
about 10 s of decode here (vLLM decoded ~600 tokens/s over the two), and 6,080 tokens of the KV cache's 8,192, so
that the prefix a pull plan names stays cached (four streams overflowed it: the prefix was evicted, the pull found
its slots reused and recomputed). Seeing them in time rests on the gateway being scheduled: the test engines run
niced (conftest.ENGINE_NICE)."""


def keep_busy(streams: ExitStack, http: httpx.Client, engine: Engine) -> None:
    """Open `BUSY_STREAMS` streams of 3,000 tokens (ignoring EOS) on `engine`, closed (vLLM aborts them) with
    `streams`."""
    busy = {"model": MODEL, "prompt": "keep busy " * 20, "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
    for _ in range(BUSY_STREAMS):
        assert streams.enter_context(http.stream("POST", engine.url + "/v1/completions", json=busy)).status_code == 200


def _decisions(gateway: Gateway) -> str:
    """The gateway's last routing decisions with their TTFT formulas, and what it logged about lookups and engines."""
    lines = gateway.log_path.read_text(errors="replace").splitlines()
    keep = [x for x in lines if "kvdir.gateway" in x]
    return "\n".join(keep[-15:])


def test_the_gateway_plans_a_pull_from_a_busy_holder(engines: dict[str, Engine], directory: Cluster, gateway: Gateway) -> None:
    """Decided by the gateway's TTFT model, not by timing: with its --max-running 1 and --decode-tokens-per-s 8,
    each request running on A adds 1 s to A's estimate, against ~2 ms for B to pull the prefix (its
    --link-gbps); both compute the same last partial block. The test waits until the gateway itself sees A's
    requests running (the load it reads from the directory), and they cannot all end meanwhile (`keep_busy`), until
    the test closes them (vLLM aborts a stream whose client left)."""
    a, b = engines["vllm-a"], engines["vllm-b"]
    hashes, _ = _served(a, directory)
    expected = _recomputed(b)
    b.reset_cache()
    wait_for(lambda: _holder(directory, hashes, "vllm-b") is None, what="B's reset blocks gone from the directory", timeout=30)
    with ExitStack() as streams, httpx.Client(timeout=180) as http:
        keep_busy(streams, http, a)
        wait_gateway_sees_running(gateway, "vllm-a", 2)
        r = http.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    wait_for(lambda: (n := _node(directory, "vllm-a")) is not None and n["load"].get("running") == 0, what="A idle", timeout=60)
    assert r.status_code == 200, r.text
    assert (r.headers["x-kvdir-node"], r.headers["x-kvdir-decision"]) == ("vllm-b", "pull"), _decisions(gateway)
    out = r.json()
    pullable = min(len(hashes), (out["usage"]["prompt_tokens"] - 1) // BLOCK)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= pullable * BLOCK
    assert out["choices"][0]["text"] == expected["choices"][0]["text"]


def test_a_dead_holder_means_recompute_and_its_entries_go(engines: dict[str, Engine], directory: Cluster) -> None:
    a, b = engines["vllm-a"], engines["vllm-b"]
    hashes, holder = _served(a, directory)
    expected = _recomputed(b)
    a.stop(sig=9)
    b.reset_cache()
    out = b.complete(PROMPT, kv_transfer_params=_plan(holder))
    assert out["choices"][0]["text"] == expected["choices"][0]["text"]
    wait_for(lambda: _holder(directory, hashes, "vllm-a") is None, what="the dead holder's entries expired", timeout=15)
    # Restarted: a new epoch; the old plan is never served from the new incarnation's memory.
    a.start()
    a.wait_ready()
    wait_for(lambda: (n := _node(directory, "vllm-a")) is not None and n["alive"], what="A registered again", timeout=60)
    node = _node(directory, "vllm-a")
    assert node is not None and node["epoch"] != holder["epoch"]
    _, again = _served(a, directory)
    assert again["epoch"] == node["epoch"]
    refused = b.metric(REFUSED)
    b.reset_cache()
    out = b.complete(PROMPT, kv_transfer_params=_plan(holder))
    assert out["choices"][0]["text"] == expected["choices"][0]["text"]
    assert b.metric(REFUSED) == refused + 1  # the old epoch is not A's any more: refused before any read
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
