"""`kvdir bench vllm`: TTFT of a prefix pulled from a peer vs recomputed vs served from the local cache, on two
real `vllm serve` engines with the kvdir connector (vLLM's CPU build, tiny model), and the pull bandwidth vs
raw Mooncake reads of the same pages.

Per prefix size (256, 1024, 1792 tokens; 8, 32, 56 blocks of 32) engine A serves the prefix once, so the
directory holds its slots; then, per round, engine B serves the same request (the prefix plus an 8-token tail
new each round) three ways, each timed to its first streamed token: **pulled** (B's cache reset, the plan of
A's slots in `kv_transfer_params`), **local** (at once again: B now holds the prefix), **recomputed** (B's
cache reset, no plan). Every pulled request must load every block of the prefix with no failure (the
connector's counters) and report the prefix as cached; otherwise the bench stops. Then the stall case: plain
requests' TTFT on B alone, and while one request on B pulls the longest prefix from A frozen with SIGSTOP (a
source that hangs mid-pull: the read waits out the transfer timeout, then the request recomputes).
The connector times its reads (tags, pages, tags); the raw figure is one batched Mooncake read of the same
pages of A by this process. With `--tp N` both engines run N tensor-parallel ranks (a worker process each):
each rank reads its share of the pages from A's same rank, all at once; the connector times each rank's
reads, and the raw figure is rank 0's pages read alone. The model has two KV heads, so TP 1 and TP 2 move the
same bytes per prefix (one head per rank at TP 2). Engines and the directory are started and stopped here; the vLLM venv is
`$KVDIR_VLLM_VENV` or the checkout's `.venv-vllm` (`make vllm-install`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from adapters.vllm_plan import KvLayout, LayerRegion, page_pieces
from kvdir.local_cluster import Cluster, free_ports
from kvdir.progress import clocked, stderr_meter
from kvproto.hashing import KvIdentity, identity_hashes
from kvproto.schemas import RegionInfo
from kvtools.bench.report import emit, header, say
from kvtools.plots import ttft_by_prefix
from kvtools.vllm_launcher import BLOCK, MODEL, VllmEngine, make_tiny_model, running, vllm_venv
from kvtransfer.backends import create_engine

SIZES = (256, 1024, 1792)
TAIL = 8
PULLED = "kvdir_connector_pulled_blocks_total"
FAILED = "kvdir_connector_pull_failed_blocks_total"
READ_BYTES = "kvdir_connector_pull_page_bytes_total"
READ_S = "kvdir_connector_pull_read_seconds_total"
RANK_READ_S = 'kvdir_connector_pull_rank_read_seconds_total{{rank="{}"}}'
IN_FLIGHT = "kvdir_connector_pulls_in_flight"
KV_HEADS = 2
MODEL_KIND = f"tiny random Llama (2 layers, {KV_HEADS} KV heads, head_dim 64, bf16)"


def ttft(engine: VllmEngine, prompt: str | list[int], **extra: Any) -> tuple[float, int]:
    """(seconds to the first streamed token, cached prompt tokens the engine reported) of a 1-token completion."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    first: float | None = None
    usage: dict[str, Any] = {}
    t0 = time.perf_counter()
    with httpx.stream("POST", engine.url + "/v1/completions", json=body, timeout=180) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    if first is None or not usage:
        raise RuntimeError(f"{engine.name} streamed no token or no usage")
    return first, int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _holder(directory: str, hashes: list[int], node_id: str) -> dict[str, Any] | None:
    """The node's holder entry; None also while the replica answers 503 (an election on busy cores)."""
    r = httpx.post(directory + "/v1/lookup", json={"hashes": hashes, "with_slots": True}, timeout=5)
    if r.status_code == 503:
        return None
    r.raise_for_status()
    return next((h for h in r.json()["holders"] if h["node_id"] == node_id), None)


def _held(directory: str, engine: VllmEngine, prefix: list[int]) -> dict[str, Any]:
    """Serve the prefix (plus a tail) on `engine`; its holder entry once the directory lists every block."""
    engine.complete([*prefix, 1, 1], max_tokens=1)
    hashes = identity_hashes(prefix, KvIdentity(model=MODEL), BLOCK)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        h = _holder(directory, hashes, engine.name)
        if h is not None and h["matched_blocks"] == len(hashes):
            return h
        time.sleep(0.05)
    raise RuntimeError(f"{engine.name}'s {len(hashes)} blocks never all reached the directory")


def _counters(engine: VllmEngine) -> dict[str, float]:
    names = (PULLED, FAILED, READ_BYTES, READ_S, *(RANK_READ_S.format(r) for r in range(engine.tp)))
    return {k: engine.metric(k) for k in names}


def _pages_of(directory: str, holder: dict[str, Any]) -> tuple[str, KvLayout]:
    """The holder's transfer session and KV layout, as registered."""
    nodes = httpx.get(directory + "/v1/nodes", timeout=5).json()["nodes"]
    node = next(n for n in nodes if n["node_id"] == holder["node_id"])
    return node["transfer_url"], KvLayout.from_regions([RegionInfo(**r) for r in node["regions"]])


def raw_reads(session: str, layout: KvLayout, slots: list[int], repeats: int) -> tuple[list[float], int]:
    """Seconds of `repeats` batched Mooncake reads of every layer's page of `slots`, in the connector's pieces
    (runs of consecutive slots coalesced), and the number of pieces."""
    te = create_engine("mooncake", "127.0.0.1")
    try:
        n = len(slots)
        buf = np.zeros(sum(r.page_bytes for r in layout.layers) * n, dtype=np.uint8)
        te.register(buf.ctypes.data, buf.nbytes)
        base, layers = buf.ctypes.data, []
        for r in layout.layers:  # here, blocks 0..n-1 of each layer, one layer after the other
            layers.append(LayerRegion(base, r.page_bytes, n))
            base += r.page_bytes * n
        pieces = page_pieces(KvLayout(tuple(layers), 0), layout, list(range(n)), slots)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            te.read(session, *pieces)
            times.append(time.perf_counter() - t0)
        return times, len(pieces[0])
    finally:
        te.close()


def bench_size(
    directory: str,
    a: VllmEngine,
    b: VllmEngine,
    n: int,
    rounds: int,
    rng: np.random.Generator,
    vocab: tuple[int, int],
    progress: Callable[[float], None] | None = None,
) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """Medians over `rounds` of the three TTFTs for an `n`-token prefix, the pull and the raw read bandwidth; and
    each round's TTFTs (seconds) by path, for the figures. `progress(rounds done)` after each round."""
    prefix = [int(x) for x in rng.integers(*vocab, n)]
    blocks = n // BLOCK
    holder = _held(directory, a, prefix)
    plan = {"kvdir_pull": {"source_node": a.name, "source_epoch": holder["epoch"], "slots": holder["slots"]}}
    pulled: list[float] = []
    local: list[float] = []
    recomputed: list[float] = []
    bandwidth, read_s = [], []
    rank_read_s: list[list[float]] = [[] for _ in range(b.tp)]
    for done in range(1, rounds + 1):
        prompt = [*prefix, *(int(x) for x in rng.integers(*vocab, TAIL))]
        b.reset_cache()
        before = _counters(b)
        t, cached = ttft(b, prompt, kv_transfer_params=plan)
        after = _counters(b)
        got, bad = after[PULLED] - before[PULLED], after[FAILED] - before[FAILED]
        if got != blocks or bad or cached < n:
            why = "; ".join(b.log_lines("pull of")[-3:])
            raise RuntimeError(f"{n}-token pull: {got:.0f} of {blocks} blocks loaded, {bad:.0f} failed, {cached} cached ({why})")
        pulled.append(t)
        read_s.append(after[READ_S] - before[READ_S])
        for r, times in enumerate(rank_read_s):
            key = RANK_READ_S.format(r)
            times.append(after[key] - before[key])
        bandwidth.append((after[READ_BYTES] - before[READ_BYTES]) / read_s[-1])
        t, cached = ttft(b, prompt)
        if cached < n:
            raise RuntimeError(f"{n}-token local hit: only {cached} tokens cached")
        local.append(t)
        b.reset_cache()
        t, cached = ttft(b, prompt)
        if cached:
            raise RuntimeError(f"{n}-token recompute: {cached} tokens cached after a reset")
        recomputed.append(t)
        if progress is not None:
            progress(done)
    session, layout = _pages_of(directory, holder)
    raw, pieces = raw_reads(session, layout, holder["slots"], max(5, rounds * 4))
    page_bytes = sum(r.page_bytes for r in layout.layers) * blocks  # rank 0's: what the raw read reads
    med = statistics.median
    out: dict[str, Any] = {
        f"p{n}_pulled_ttft_ms": med(pulled) * 1e3,
        f"p{n}_recomputed_ttft_ms": med(recomputed) * 1e3,
        f"p{n}_local_ttft_ms": med(local) * 1e3,
        f"p{n}_pulled_vs_recomputed": med(pulled) / med(recomputed),
        f"p{n}_pulled_vs_local": med(pulled) / med(local),
        f"p{n}_pull_bytes": page_bytes * b.tp,  # every rank's share (mirrored layouts: equal shares)
        f"p{n}_raw_read_pieces": pieces,
        f"p{n}_pull_read_ms": med(read_s) * 1e3,
        f"p{n}_raw_read_ms": med(raw) * 1e3,
        f"p{n}_pull_gbps": med(bandwidth) / 1e9,
        f"p{n}_raw_read_gbps": page_bytes / med(raw) / 1e9,  # one rank's pages
    }
    out[f"p{n}_pull_vs_raw"] = out[f"p{n}_pull_gbps"] / out[f"p{n}_raw_read_gbps"]
    if b.tp > 1:
        # Each rank's reads, against rank 0's pages read alone (raw_read_ms): overlapping ranks cost about one.
        out[f"p{n}_rank_read_ms"] = [round(med(t) * 1e3, 3) for t in rank_read_s]
    return out, {"pulled": pulled, "local": local, "recomputed": recomputed}


def bench_stall(
    directory: str, a: VllmEngine, b: VllmEngine, rounds: int, rng: np.random.Generator, vocab: tuple[int, int]
) -> dict[str, Any]:
    """Plain requests' TTFT on B alone, then while one request on B pulls a 1,792-token prefix from A frozen
    mid-pull (its read waits out the transfer timeout, then it recomputes): a pull must stall no other request."""
    prefix = [int(x) for x in rng.integers(*vocab, SIZES[-1])]
    holder = _held(directory, a, prefix)
    plan = {"kvdir_pull": {"source_node": a.name, "source_epoch": holder["epoch"], "slots": holder["slots"]}}

    def plain() -> list[int]:
        return [int(x) for x in rng.integers(*vocab, SIZES[0])]

    alone = [ttft(b, plain())[0] for _ in range(rounds)]
    b.reset_cache()
    with a.frozen(), ThreadPoolExecutor(1) as pool:
        t0 = time.perf_counter()
        pulling = pool.submit(ttft, b, [*prefix, 1, 1], kv_transfer_params=plan)
        deadline = time.monotonic() + 30
        while b.metric(IN_FLIGHT) < 1:
            if time.monotonic() > deadline or pulling.done():
                raise RuntimeError(f"the pull never started waiting ({pulling.done() and pulling.result()})")
            time.sleep(0.01)
        during = [ttft(b, plain())[0] for _ in range(rounds)]
        pulling.result(timeout=120)
        pull_s = time.perf_counter() - t0
    med = statistics.median
    return {
        "stall_plain_alone_ttft_ms": med(alone) * 1e3,
        "stall_plain_during_hung_pull_ttft_ms": med(during) * 1e3,
        "stall_plain_during_hung_pull_max_ttft_ms": max(during) * 1e3,
        "stall_during_vs_alone": med(during) / med(alone),
        "stall_pulling_request_ttft_ms": pull_s * 1e3,
    }


@dataclass(frozen=True)
class BenchEngines:
    """What `bench_engines` started: the directory's first replica, the engines in spec order, the model's vocabulary
    range (ids 0-2 are special tokens)."""

    directory: str
    engines: list[VllmEngine]
    vocab: tuple[int, int]


@contextlib.contextmanager
def bench_engines(label: str, venv: Path, specs: Sequence[dict[str, Any]]) -> Iterator[BenchEngines]:
    """The tiny model (two KV heads), a 3-replica directory and one `vllm serve` per spec (`name` and the other
    `VllmEngine` keyword arguments), started and ready; all stopped on exit. Their logs stay in a temporary
    directory, removed unless something failed."""
    tmp = tempfile.mkdtemp(prefix="kvdir-bench-vllm-")
    ok = False
    try:
        say("making the tiny model...")
        model = make_tiny_model(venv, Path(tmp) / MODEL, kv_heads=KV_HEADS)
        vocab = (3, json.loads((model / "config.json").read_text())["vocab_size"])
        ports = free_ports(6)
        cluster = Cluster(Path(tmp), ports[:3], ports[3:], log_level="warning")
        try:
            cluster.start()
            cluster.wait_ready(60)
            engines = [VllmEngine(kw.pop("name"), venv, model, cluster.replica_urls, Path(tmp), **kw) for kw in map(dict, specs)]
            say(f"starting {len(engines)} vllm engines (about 30 s each on two cores)...")
            with running(engines):
                yield BenchEngines(cluster.replica_urls[0], engines, vocab)
        finally:
            cluster.stop()
        ok = True
    finally:
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            say(f"{label}: the engines' and replicas' logs are kept in {tmp}")


def main(*, as_json: bool, quick: bool, plot: str | None = None, tp: int = 1) -> int:
    """The bench, both engines at `tp` tensor-parallel ranks; with `plot`, also vllm_ttft.png there (TTFT by path
    and prefix size)."""
    results: dict[str, Any] = header(quick)
    try:
        venv = vllm_venv()
    except FileNotFoundError as exc:
        say(f"kvdir bench vllm: {exc}")
        return 2
    rounds = 2 if quick else 5
    results.update(model=MODEL_KIND, block_size=BLOCK, rounds=rounds, tp=tp)
    ttfts: dict[int, dict[str, list[float]]] = {}
    specs = [{"name": name, "tp": tp} for name in ("bench-a", "bench-b")]
    with bench_engines("kvdir bench vllm", venv, specs) as run:
        a, b = run.engines
        vocab = run.vocab
        rng = np.random.default_rng(14)
        # Both engines' first requests, and B's first pull (its directory lookup, the transfer handshake), are
        # set-up costs, not what is measured.
        for e in run.engines:
            e.complete([int(x) for x in rng.integers(*vocab, 40)], max_tokens=1)
        bench_size(run.directory, a, b, 64, 1, rng, vocab)
        say(f"pulled, local and recomputed TTFT, {rounds} rounds per prefix size...")
        with stderr_meter("vllm TTFT", len(SIZES) * rounds, unit="rounds") as meter:
            for n in SIZES:
                meter.stage(f"{n}-token prefix", rounds, time.monotonic())
                figures, ttfts[n] = bench_size(run.directory, a, b, n, rounds, rng, vocab, clocked(meter))
                results.update(figures)
        say("plain TTFT on B alone and while a pull from a hung source runs there...")
        results.update(bench_stall(run.directory, a, b, rounds * 2, rng, vocab))
    emit(results, as_json)
    if plot:
        ttft_by_prefix(
            Path(plot) / "vllm_ttft.png",
            ttfts,
            title=f"vLLM CPU, tiny model, TP {tp}: TTFT on engine B by path\n(bars: medians of {rounds} rounds; dots: each round)",
        )
        say(f"wrote vllm_ttft.png into {plot}")
    return 0
