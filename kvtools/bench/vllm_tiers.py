"""`kvdir bench vllm-tiers`: TTFT of a prefix vLLM evicted, served from the kvdir connector's host tier, against a
device hit and against recomputing it, on a real `vllm serve` (vLLM's CPU build, the tiny model).

Engine A has a small device cache (160 blocks of 32 tokens, `--max-model-len 2048`) and a 512-block host tier
(`host_blocks`); engine B has no host tier and only checks outputs. Per prefix size (1,024 and 1,792 tokens) and
round, with a new random prefix each round: A serves it once (its blocks are saved to the host tier as they
complete); **device**: A serves it again with a new 8-token tail (vLLM's own prefix cache); three filler prompts
of 60 blocks then evict it from A's device, and the directory lists it in A's host tier; **host**: A serves it
with another tail, the connector loading the prefix back (every block counted by
`kvdir_connector_host_loaded_blocks_total`, none failing, the prefix reported cached); **recomputed**: A serves a
fresh random prompt of the same size. The host-served request's first token must equal B's for the same prompt
with B's cache reset (greedy). TTFTs are to the first streamed token; medians of the rounds.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import httpx
import numpy as np

from kvproto import media
from kvproto.hashing import KvIdentity, identity_hashes
from kvtools.bench.report import emit, header, say
from kvtools.bench.vllm import MODEL_KIND, TAIL, bench_engines, ttft
from kvtools.vllm_launcher import BLOCK, MODEL, VllmEngine, vllm_venv

SIZES = (1024, 1792)
DEVICE_BLOCKS = 160
HOST_BLOCKS = 512
FILLER_BLOCKS = 60
LOADED = "kvdir_connector_host_loaded_blocks_total"
LOAD_FAILED = "kvdir_connector_host_load_failed_blocks_total"


def _in_host_tier(directory: str, prefix: list[int], node_id: str) -> None:
    """Wait until the directory lists every block of `prefix` in the node's host tier."""
    hashes = identity_hashes(prefix, KvIdentity(model=MODEL), BLOCK)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = httpx.post(directory + "/v1/lookup", json={"hashes": hashes, "with_slots": True}, timeout=5)
        if r.status_code == 200:
            h = next((h for h in r.json()["holders"] if h["node_id"] == node_id), None)
            if h and h["matched_blocks"] == len(hashes) and all(loc >> media.SHIFT == media.HOST for loc in h["slots"]):
                return
        time.sleep(0.05)
    raise RuntimeError(f"the directory never listed the {len(hashes)}-block prefix in {node_id}'s host tier")


def _with_tail(prefix: list[int], rng: np.random.Generator, vocab: tuple[int, int]) -> list[int]:
    return [*prefix, *(int(x) for x in rng.integers(*vocab, TAIL))]


def _first_token(engine: VllmEngine, prompt: list[int]) -> str:
    text: str = engine.complete(prompt, max_tokens=1)["choices"][0]["text"]
    return text


def bench_size(
    directory: str, a: VllmEngine, b: VllmEngine, n: int, rounds: int, rng: np.random.Generator, vocab: tuple[int, int]
) -> dict[str, Any]:
    blocks = n // BLOCK
    paths: dict[str, list[float]] = {"device": [], "host": [], "recomputed": []}
    for _ in range(rounds):
        prefix = [int(x) for x in rng.integers(*vocab, n)]
        a.complete(_with_tail(prefix, rng, vocab), max_tokens=1)
        t, cached = ttft(a, _with_tail(prefix, rng, vocab))
        if cached < n:
            raise RuntimeError(f"{n}-token device hit: only {cached} tokens cached")
        paths["device"].append(t)
        for _ in range(3):
            a.complete([int(x) for x in rng.integers(*vocab, FILLER_BLOCKS * BLOCK)], max_tokens=1)
        _in_host_tier(directory, prefix, a.name)
        again = _with_tail(prefix, rng, vocab)
        before = (a.metric(LOADED), a.metric(LOAD_FAILED))
        t, cached = ttft(a, again)
        got, bad = a.metric(LOADED) - before[0], a.metric(LOAD_FAILED) - before[1]
        if got != blocks or bad or cached < n:
            raise RuntimeError(f"{n}-token host hit: {got:.0f} of {blocks} blocks loaded, {bad:.0f} failed, {cached} cached")
        paths["host"].append(t)
        b.reset_cache()
        if _first_token(a, again) != _first_token(b, again):
            raise RuntimeError(f"{n}-token host hit: the output differs from recomputing it")
        t, cached = ttft(a, [int(x) for x in rng.integers(*vocab, n + TAIL)])
        if cached:
            raise RuntimeError(f"{n}-token recompute: {cached} tokens cached")
        paths["recomputed"].append(t)
    med = statistics.median
    out = {f"p{n}_{path}_ttft_ms": med(ts) * 1e3 for path, ts in paths.items()}
    out[f"p{n}_host_vs_recomputed"] = med(paths["host"]) / med(paths["recomputed"])
    out[f"p{n}_host_vs_device"] = med(paths["host"]) / med(paths["device"])
    return out


def main(*, as_json: bool, quick: bool) -> int:
    results: dict[str, Any] = header(quick)
    try:
        venv = vllm_venv()
    except FileNotFoundError as exc:
        say(f"kvdir bench vllm-tiers: {exc}")
        return 2
    rounds = 2 if quick else 5
    results.update(
        model=MODEL_KIND,
        block_size=BLOCK,
        device_blocks=DEVICE_BLOCKS,
        host_blocks=HOST_BLOCKS,
        rounds=rounds,
    )
    specs: list[dict[str, Any]] = [
        {
            "name": "tiers-a",
            "num_blocks": DEVICE_BLOCKS,
            "connector": {"host_blocks": HOST_BLOCKS},
            "extra_args": ("--max-model-len", "2048"),
        },
        {"name": "tiers-b"},
    ]
    with bench_engines("kvdir bench vllm-tiers", venv, specs) as run:
        a, b = run.engines
        rng = np.random.default_rng(32)
        for e in run.engines:  # first requests are set-up costs
            e.complete([int(x) for x in rng.integers(*run.vocab, 40)], max_tokens=1)
        for n in SIZES:
            say(f"{n}-token prefix: device hit, host-tier hit and recompute, {rounds} rounds...")
            results.update(bench_size(run.directory, a, b, n, rounds, rng, run.vocab))
    emit(results, as_json)
    return 0
