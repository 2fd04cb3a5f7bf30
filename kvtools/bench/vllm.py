"""`kvdir bench vllm`: TTFT of a prefix pulled from a peer vs recomputed vs served from the local cache, on two
real `vllm serve` engines with the kvdir connector (vLLM's CPU build, tiny model), and the pull bandwidth vs
raw Mooncake reads of the same pages.

Per prefix size (256, 1024, 2048 tokens; 8, 32, 64 blocks of 32) engine A serves the prefix once, so the
directory holds its slots; then, per round, engine B serves the same request (the prefix plus an 8-token tail
new each round) three ways, each timed to its first streamed token: **pulled** (B's cache reset, the plan of
A's slots in `kv_transfer_params`), **local** (at once again: B now holds the prefix), **recomputed** (B's
cache reset, no plan). Every pulled request must load every block of the prefix with no failure (the
connector's counters) and report the prefix as cached; otherwise the bench stops. Then the stall case: plain
requests' TTFT on B alone, and while one request on B pulls the longest prefix from A frozen with SIGSTOP (a
source that hangs mid-pull: the read waits out the transfer timeout, then the request recomputes); and the
slow-source case: plain requests' TTFT on B while requests on B pull the longest prefix from A over a slow link
(A's transfer ports shaped to 20 MB/s by the kernel, kvtools.faults.slow_link: root only), reads that go on and
land. `--model-size bench` runs both engines on the ~32M-parameter model (8 layers: four times the KV bytes per
token, and a prefill that costs what a pull should save) instead of the tiny one.
The connector times its reads (tags, pages, tags); the raw figure is one batched Mooncake read of the same
pages of A by this process. With `--tp N` both engines run N tensor-parallel ranks (a worker process each):
each rank reads its share of the pages from A's same rank, all at once; the connector times each rank's
reads, and the raw figure is rank 0's pages read alone. The model has two KV heads, so TP 1 and TP 2 move the
same bytes per prefix (one head per rank at TP 2). Engines and the directory are started and stopped here; the vLLM venv is
`$KVDIR_VLLM_VENV` or the checkout's `.venv-vllm` (`make vllm-install`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from adapters.vllm_plan import KvLayout, LayerRegion, page_pieces
from kvdir.local_cluster import Cluster, Gateway, free_ports
from kvdir.progress import clocked, stderr_meter
from kvproto.hashing import KvIdentity, identity_hashes
from kvproto.schemas import RegionInfo
from kvtools.bench.report import emit, header, say
from kvtools.faults import slow_link
from kvtools.plots import ttft_by_prefix
from kvtools.replay.calibration import EngineCalibration
from kvtools.replay.live import live_replay
from kvtools.replay.sim import SimParams, simulate
from kvtools.replay.trace import multi_turn
from kvtools.vllm_launcher import BLOCK, MODEL, VllmEngine, make_tiny_model, running, vllm_venv
from kvtransfer.backends import create_engine

SIZES = (256, 1024, 2048)
TAIL = 8
SLOW_LINK_BYTES_PER_S = 20e6
"""The slow-source case's link: a congested or distant source."""
PLAIN_TOKENS = 32
"""The slow-source case's plain requests: short enough that several run wholly beside one read."""
PULLED = "kvdir_connector_pulled_blocks_total"
FAILED = "kvdir_connector_pull_failed_blocks_total"
READ_BYTES = "kvdir_connector_pull_page_bytes_total"
READ_S = "kvdir_connector_pull_read_seconds_total"
RANK_READ_S = 'kvdir_connector_pull_rank_read_seconds_total{{rank="{}"}}'
IN_FLIGHT = "kvdir_connector_pulls_in_flight"
KV_HEADS = 2
MODEL_KIND = f"tiny random Llama (2 layers, {KV_HEADS} KV heads, head_dim 64, bf16)"
BENCH_MODEL_KIND = f"~32M-parameter random Llama (8 layers, hidden 512, {KV_HEADS} KV heads, head_dim 64, bf16)"


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
    """Plain requests' TTFT on B alone, then while one request on B pulls the longest prefix from A frozen
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


def _beside(b: VllmEngine, prompt: list[int], plain: Callable[[], list[int]], **extra: Any) -> tuple[float, int, list[float]]:
    """One request for `prompt` on `b` (`extra`: its plan) and, while it waits for its first token, plain requests one
    after another: its (TTFT, cached tokens) and the TTFTs of the plain requests sent before its first token."""
    beside: list[tuple[float, float]] = []  # each plain request's (sent, TTFT), perf_counter seconds
    with ThreadPoolExecutor(1) as pool:
        sent = time.perf_counter()
        big = pool.submit(ttft, b, prompt, **extra)
        while not big.done():
            t0 = time.perf_counter()
            beside.append((t0, ttft(b, plain())[0]))
        t, cached = big.result()
    return t, cached, [x for start, x in beside if start < sent + t]


def bench_slow_source(
    directory: str, a: VllmEngine, b: VllmEngine, samples: int, rng: np.random.Generator, vocab: tuple[int, int]
) -> dict[str, Any]:
    """Plain `PLAIN_TOKENS`-token requests' TTFT on B beside a request for the longest prefix that B pulls from A
    over a slow link (A's transfer ports shaped to `SLOW_LINK_BYTES_PER_S`: the read goes on for as long as the
    link takes, and lands), against the same beside the same request served from B's own cache: the pull's wait
    and read are the difference. Beside means sent before that request's first token, one after another from
    when it was sent; `samples` of each. Every pull must land whole; alone (no request beside) for reference."""
    n = SIZES[-1]
    prefix = [int(x) for x in rng.integers(*vocab, n)]
    holder = _held(directory, a, prefix)
    plan = {"kvdir_pull": {"source_node": a.name, "source_epoch": holder["epoch"], "slots": holder["slots"]}}

    def plain() -> list[int]:
        return [int(x) for x in rng.integers(*vocab, PLAIN_TOKENS)]

    def prompt() -> list[int]:
        return [*prefix, *(int(x) for x in rng.integers(*vocab, TAIL))]

    alone = [ttft(b, plain())[0] for _ in range(samples)]
    hit: list[float] = []
    pulled: list[float] = []
    pulls: list[float] = []
    read_s = read_bytes = 0.0
    with a.slow_link(SLOW_LINK_BYTES_PER_S):
        while len(pulled) < samples and len(pulls) < 4 * samples:
            b.reset_cache()
            before = _counters(b)
            t, cached, during = _beside(b, prompt(), plain, kv_transfer_params=plan)
            after = _counters(b)
            if after[PULLED] - before[PULLED] != n // BLOCK or after[FAILED] > before[FAILED] or cached < n:
                raise RuntimeError(f"a pull over the slow link did not land whole: {cached} of {n} tokens cached")
            pulls.append(t)
            pulled += during
            read_s += after[READ_S] - before[READ_S]
            read_bytes += after[READ_BYTES] - before[READ_BYTES]
            while len(hit) < len(pulled):  # B holds the prefix now: the same request, no pull
                t, cached, during = _beside(b, prompt(), plain)
                if cached < n:
                    raise RuntimeError(f"a local hit of the pulled prefix: only {cached} of {n} tokens cached")
                hit += during
    if len(pulled) < samples:
        raise RuntimeError(f"only {len(pulled)} plain requests ran beside {len(pulls)} pulls")
    med = statistics.median
    return {
        "slow_link_bytes_per_s": SLOW_LINK_BYTES_PER_S,
        "slow_pull_read_mb_s": read_bytes / read_s / 1e6,
        "slow_pull_read_ms": read_s / len(pulls) * 1e3,
        "slow_pulling_request_ttft_ms": med(pulls) * 1e3,
        "slow_pulls": len(pulls),
        "slow_plain_tokens": PLAIN_TOKENS,
        "slow_plain_alone_ttft_ms": med(alone) * 1e3,
        "slow_plain_beside_local_hit_ttft_ms": med(hit) * 1e3,
        "slow_plain_beside_pull_ttft_ms": med(pulled) * 1e3,
        "slow_plain_beside_pull_max_ttft_ms": max(pulled) * 1e3,
        "slow_plain_beside_pull_samples": len(pulled),
        "slow_beside_pull_vs_local_hit": med(pulled) / med(hit),
        "slow_beside_pull_vs_alone": med(pulled) / med(alone),
    }


@dataclass(frozen=True)
class BenchEngines:
    """What `bench_engines` started: the directory's first replica, the engines in spec order, the model's vocabulary
    range (ids 0-2 are special tokens)."""

    directory: str
    engines: list[VllmEngine]
    vocab: tuple[int, int]
    model: Path
    tmp: Path


@contextlib.contextmanager
def bench_engines(label: str, venv: Path, specs: Sequence[dict[str, Any]], size: str = "tiny") -> Iterator[BenchEngines]:
    """The tiny model (two KV heads; `size` "bench": the ~32M one), a 3-replica directory and one `vllm serve` per
    spec (`name` and the other `VllmEngine` keyword arguments), started and ready; all stopped on exit. Their logs
    stay in a temporary directory, removed unless something failed."""
    tmp = tempfile.mkdtemp(prefix="kvdir-bench-vllm-")
    ok = False
    try:
        say("making the tiny model...")
        model = make_tiny_model(venv, Path(tmp) / MODEL, kv_heads=KV_HEADS, size=size)
        vocab = (3, json.loads((model / "config.json").read_text())["vocab_size"])
        ports = free_ports(6)
        cluster = Cluster(Path(tmp), ports[:3], ports[3:], log_level="warning")
        try:
            cluster.start()
            cluster.wait_ready(60)
            engines = [VllmEngine(kw.pop("name"), venv, model, cluster.replica_urls, Path(tmp), **kw) for kw in map(dict, specs)]
            say(f"starting {len(engines)} vllm engines (about 30 s each on two cores)...")
            with running(engines):
                yield BenchEngines(cluster.replica_urls[0], engines, vocab, model, Path(tmp))
        finally:
            cluster.stop()
        ok = True
    finally:
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            say(f"{label}: the engines' and replicas' logs are kept in {tmp}")


def main(
    *,
    as_json: bool,
    quick: bool,
    plot: str | None = None,
    tp: int = 1,
    case: str = "pulls",
    calibration_out: str | None = None,
    replay_live: bool = False,
    calibrate_alike: bool = False,
    model_size: str = "tiny",
) -> int:
    """The bench, both engines at `tp` tensor-parallel ranks on the `model_size` model; with `plot`, also
    vllm_ttft.png there (TTFT by path and prefix size). `case` "calibration": `calibration_main` instead."""
    results: dict[str, Any] = header(quick)
    try:
        venv = vllm_venv()
    except FileNotFoundError as exc:
        say(f"kvdir bench vllm: {exc}")
        return 2
    if case == "calibration":
        return calibration_main(results, venv, as_json, quick, calibration_out, replay_live, calibrate_alike)
    if calibration_out or replay_live or calibrate_alike:
        say("kvdir bench vllm: --calibration-out, --replay-live and --calibrate-alike belong to --case calibration")
        return 2
    if (shaping := slow_link.available()) is not None:
        say(f"kvdir bench vllm: the slow-source case cannot shape a link here: {shaping}")
        return 2
    rounds = 2 if quick else 5
    results.update(model=BENCH_MODEL_KIND if model_size == "bench" else MODEL_KIND, block_size=BLOCK, rounds=rounds, tp=tp)
    ttfts: dict[int, dict[str, list[float]]] = {}
    specs = [{"name": name, "tp": tp} for name in ("bench-a", "bench-b")]
    with bench_engines("kvdir bench vllm", venv, specs, size=model_size) as run:
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
        say(f"plain TTFT on B alone and while pulls over a {SLOW_LINK_BYTES_PER_S / 1e6:.0f} MB/s link run there...")
        results.update(bench_slow_source(run.directory, a, b, rounds * 4, rng, vocab))
    emit(results, as_json)
    if plot:
        ttft_by_prefix(
            Path(plot) / "vllm_ttft.png",
            ttfts,
            title=f"vLLM CPU, {model_size} model, TP {tp}: TTFT on engine B by path\n(bars: medians of {rounds} rounds; dots: each round)",
        )
        say(f"wrote vllm_ttft.png into {plot}")
    return 0


# -- the calibration case: the engine's speed under load, for the replay's simulated engines (kvtools.replay.calibration)

CAL_RUNNING = (1, 2, 4, 8)  # uncached prompts prefilled at once
CAL_LENGTHS = (256, 1024)  # their lengths, tokens
CAL_BATCH = (1, 2, 4, 8)  # requests decoding at once
CAL_DECODE_TOKENS = 32
CAL_BESIDE = (4, 1792)  # requests decoding, and the uncached prompt prefilled beside them (tokens)


@dataclass
class _Stream:
    """One streamed completion: when it was sent and when each token chunk came (perf_counter seconds)."""

    sent: float = 0.0
    tokens: list[float] | None = None

    @property
    def first_s(self) -> float:
        """Seconds from sending to the first token."""
        if not self.tokens:
            raise RuntimeError("a calibration request streamed no token")
        return self.tokens[0] - self.sent


def _streamed(engine: VllmEngine, prompt: list[int], max_tokens: int, out: _Stream, start: threading.Barrier) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    times: list[float] = []
    out.tokens = times
    start.wait(60)
    out.sent = time.perf_counter()
    with httpx.stream("POST", engine.url + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:]).get("choices"):
                times.append(time.perf_counter())


def _together(
    engine: VllmEngine, prompts: Sequence[list[int]], max_tokens: int, mirrors: Sequence[VllmEngine] = ()
) -> list[_Stream]:
    """The prompts sent at once to `engine`, and the same to each of `mirrors` (a barrier releases all the threads
    together); the token times of `engine`'s."""
    jobs = [(e, p, _Stream()) for e in (engine, *mirrors) for p in prompts]
    start = threading.Barrier(len(jobs))
    with ThreadPoolExecutor(len(jobs)) as pool:
        for f in [pool.submit(_streamed, e, p, max_tokens, o, start) for e, p, o in jobs]:
            f.result()
    return [o for _, _, o in jobs[: len(prompts)]]


def calibrate(
    engine: VllmEngine, rounds: int, rng: np.random.Generator, vocab: tuple[int, int], mirrors: Sequence[VllmEngine] = ()
) -> EngineCalibration:
    """Measure `engine` (the `mirrors` given the same load at the same time: engines that share the machine's
    cores slow each other): its overhead (TTFT of a prompt it holds), its aggregate prefill rate with N uncached
    prompts at once (N x length / (the last one's TTFT - overhead), over `CAL_LENGTHS`), its time per output token
    with K requests decoding, and how much longer that is while an uncached prompt prefills beside them (alone)."""
    med = statistics.median

    def fresh(n: int) -> list[int]:
        return [int(x) for x in rng.integers(*vocab, n)]

    held = fresh(CAL_LENGTHS[0])
    for e in (engine, *mirrors):
        e.complete(held, max_tokens=1)
    overhead = med(_together(engine, [held], 1, mirrors)[0].first_s for _ in range(rounds * 2))
    rates = []
    for n in CAL_RUNNING:
        tokens = seconds = 0.0
        for length in CAL_LENGTHS:
            last = med(
                max(s.first_s for s in _together(engine, [fresh(length) for _ in range(n)], 1, mirrors)) for _ in range(rounds)
            )
            tokens += n * length
            seconds += max(last - overhead, 1e-3)
        rates.append(tokens / seconds)
    per_token = []
    for k in CAL_BATCH:
        gaps = []
        for _ in range(rounds):
            for s in _together(engine, [fresh(64) for _ in range(k)], CAL_DECODE_TOKENS, mirrors):
                assert s.tokens is not None and len(s.tokens) > 1
                gaps.append((s.tokens[-1] - s.tokens[0]) / (len(s.tokens) - 1))
        per_token.append(med(gaps))
    slowdowns = [_beside_prefill(engine, fresh) for _ in range(rounds)]
    return EngineCalibration(
        CAL_RUNNING,
        tuple(rates),
        overhead,
        CAL_BATCH,
        tuple(per_token),
        max(1.0, med(slowdowns)),
        {
            "engine": "vllm serve (CPU build), OMP_NUM_THREADS=1",
            "model": BENCH_MODEL_KIND,
            "block_size": BLOCK,
            "rounds": rounds,
            "engines_loaded_alike": len(mirrors),
        },
    )


def _beside_prefill(engine: VllmEngine, fresh: Callable[[int], list[int]]) -> float:
    """`CAL_BESIDE[0]` requests decode; once each has 4 tokens, a `CAL_BESIDE[1]`-token uncached prompt is sent:
    their mean gap between tokens while it prefills, over their mean gap when not."""
    k, length = CAL_BESIDE
    outs = [_Stream() for _ in range(k + 1)]
    start = threading.Barrier(k)
    tokens = CAL_DECODE_TOKENS * 2
    with ThreadPoolExecutor(k + 1) as pool:
        decoding = [pool.submit(_streamed, engine, fresh(64), tokens, o, start) for o in outs[:k]]
        deadline = time.monotonic() + 60
        while any(o.tokens is None or len(o.tokens) < 4 for o in outs[:k]):
            if time.monotonic() > deadline:
                raise RuntimeError("the decoding requests produced no tokens within 60 s")
            time.sleep(0.005)
        prefill = pool.submit(_streamed, engine, fresh(length), 1, outs[k], threading.Barrier(1))
        for f in [*decoding, prefill]:
            f.result()
    p = outs[k]
    assert p.tokens
    lo, hi = p.sent, p.tokens[0]
    during: list[float] = []
    other: list[float] = []
    for o in outs[:k]:
        assert o.tokens is not None
        for a, b in itertools.pairwise(o.tokens):
            (during if b > lo and a < hi else other).append(b - a)
    if not during or not other:
        return 1.0
    return float(statistics.mean(during) / statistics.mean(other))


# -- the replay against a live run of the same requests (its targets: hit rate within 3 points, TTFT p50 within 15%)

LIVE_WORKLOAD: dict[
    str, Any
] = {  # multi-turn chats (kvtools.replay.trace.multi_turn), sized for two CPU engines and 4,096-token prompts
    "sessions": 24,
    "rounds": 4,
    "system_tokens": 512,
    "first_turn_tokens": 1024,
    "turn_tokens": 256,
    "output_tokens": 16,
    "think_s": 4.0,
    "session_rate": 1.5,
}
STAY_MARGIN = (0.1, 0.25)  # the gateway's --stay-margin-ms / --stay-margin-ratio defaults, as seconds / fraction
LEARN_WINDOW = 64  # the gateway's --ttft-learn-window default
LINK_GBPS = 0.04  # Mooncake over TCP on two shared cores (kvtools.bench.routers says so too)


def replay_against_live(
    run: BenchEngines, model: Path, tmp: Path, cal: EngineCalibration, num_blocks: int, quick: bool
) -> dict[str, Any]:
    """The multi-turn slice live through kvdir's gateway in front of the two engines, then simulated on the same
    cluster by the replay with and without `cal` (the gateway's stay margins and TTFT learning in both; its prefill
    and decode priors, and the static engines, at the calibrated idle rates): hit rate and TTFT p50/p90 of each."""
    workload = {**LIVE_WORKLOAD, **({"sessions": 8} if quick else {})}
    requests = multi_turn(seed=44, block_tokens=BLOCK, **workload)
    prefill = round(cal.prefill_tokens_per_s[0])
    decode = round(1.0 / cal.decode_token_s[0], 1)
    priors = ("--prefill-tokens-per-s", str(prefill), "--decode-tokens-per-s", str(decode), "--link-gbps", str(LINK_GBPS))
    args = ("--tokenizer", str(model / "tokenizer.json"), *priors)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    for e in run.engines:
        e.reset_cache()
    g = Gateway(tmp, free_ports(1)[0], [run.directory], extra_args=args)
    try:
        g.wait_ready(120, engines=len(run.engines))
        say(f"live: {len(requests)} requests ({workload['sessions']} chats) through kvdir's gateway...")
        live = live_replay(g.url, requests, block_tokens=BLOCK, max_output=16, model=MODEL, stream=True, vocab=vocab)
    finally:
        g.stop()
    if live["failed"]:
        raise RuntimeError(f"live replay: {live['failed']} of {live['requests']} requests failed (see {g.log_path})")
    base = SimParams(
        nodes=len(run.engines),
        capacity_blocks=num_blocks,
        block_tokens=BLOCK,
        prefill_tokens_per_s=prefill,
        decode_tokens_per_s=decode,
        block_bytes=_block_bytes(model),
        link_bytes_per_s=LINK_GBPS * 1e9,
        ttft_learn_window=LEARN_WINDOW,
        policy_options={"kvdir": {"stay_margin_s": STAY_MARGIN[0], "stay_margin_ratio": STAY_MARGIN[1]}},
    )
    out: dict[str, Any] = {
        "replay_requests": len(requests),
        "live_hit_pct": 100 * live["hit_rate"],
        "live_ttft_p50_ms": live["ttft_p50_s"] * 1e3,
        "live_ttft_p90_ms": live["ttft_p90_s"] * 1e3,
        "live_decisions": live["decisions"],
    }
    for name, params in (("uncalibrated", base), ("calibrated", replace(base, calibration=cal))):
        sim = simulate(requests, "kvdir", params)
        out[f"{name}_hit_pct"] = 100 * sim["hit_rate"]
        out[f"{name}_ttft_p50_ms"] = sim["ttft_p50_s"] * 1e3
        out[f"{name}_ttft_p90_ms"] = sim["ttft_p90_s"] * 1e3
        out[f"{name}_hit_minus_live_points"] = out[f"{name}_hit_pct"] - out["live_hit_pct"]
        out[f"{name}_ttft_p50_vs_live"] = sim["ttft_p50_s"] / live["ttft_p50_s"]
        out[f"{name}_decisions"] = sim["reasons"]
    return out


def _block_bytes(model: Path) -> int:
    """KV bytes of one block of the model (bf16 K and V of every layer), as the engines register them."""
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return int(BLOCK * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2 * 2)


CAL_BLOCKS = 1024  # each calibration engine's KV blocks of 32 tokens: 8 prompts of 1,024 tokens at once fit twice


def calibration_main(
    results: dict[str, Any], venv: Path, as_json: bool, quick: bool, out: str | None, replay_live: bool, alike: bool
) -> int:
    """The calibration case on two engines of the ~32M model: engine A measured (`calibrate`; with `alike`, engine B
    loaded alike meanwhile), the figures printed and written to `out`; with `replay_live`, the replay against a live
    run on both (`replay_against_live`)."""
    rounds = 2 if quick else 3
    specs = [{"name": name, "num_blocks": CAL_BLOCKS} for name in ("cal-a", "cal-b")]
    with bench_engines("kvdir bench vllm", venv, specs, size="bench") as run:
        a = run.engines[0]
        rng = np.random.default_rng(44)
        for e in run.engines:
            e.complete([int(x) for x in rng.integers(*run.vocab, 40)], max_tokens=1)
        say(f"calibrating {a.name}{' (its peer loaded alike)' if alike else ''}: prefill by running prefills, decode...")
        cal = calibrate(a, rounds, rng, run.vocab, run.engines[1:] if alike else ())
        cal = replace(cal, source={**cal.source, "machine": results["machine"], "date": results["date"]})
        results.update(model=BENCH_MODEL_KIND, block_size=BLOCK, rounds=rounds)
        results["calibration_overhead_ms"] = cal.overhead_s * 1e3
        for n, r in zip(cal.prefill_running, cal.prefill_tokens_per_s, strict=True):
            results[f"calibration_prefill_tok_s_{n}_running"] = r
        for k, t in zip(cal.decode_batch, cal.decode_token_s, strict=True):
            results[f"calibration_decode_ms_per_token_{k}_decoding"] = t * 1e3
        results["calibration_decode_slowdown_beside_prefill"] = cal.prefill_slowdown
        if out:
            cal.dump(out)
            say(f"wrote {out}")
        if replay_live:
            results.update(replay_against_live(run, run.model, run.tmp, cal, CAL_BLOCKS, quick))
    emit(results, as_json)
    return 0
