"""`kvdir bench routers`: kvdir's gateway against the real peers' routers, live, on the same engines.

Each router runs in front of a fresh cluster (a directory replica and its engines, so every router starts with
cold caches): kvdir's gateway (`--policy kvdir`); the routers as they ship, Rust binaries from the peers venvs
(`make peers-install`): the SGLang router (`sglang-router` 0.3.2, `--policy cache_aware`), its successor SMG
(`smg` 1.13, the SGLang model gateway, `cache_aware`, in `.venv-peers-smg`), vLLM's router (`vllm-router` 0.1.17,
`cache_aware`: its `kv_aware` policy needs vLLM's ZMQ KV-event publisher, which the worker stubs do not have) and
the SGLang router's round robin; on the stubs also kvdir's gateway with its model of SGLang's policy
(`--policy sglang`), which the simulated replay uses: how far that model is from the real router, on the same
engines. SMG and vLLM's router talk to the engines over HTTP here, where their cache-aware trees are built from
the requests they routed, as the SGLang router's are. SMG's event-driven mode is not run: SMG subscribes to KV
events only over gRPC (a vLLM engine started with `--grpc`, which needs `smg-grpc-servicer` in the vLLM venv and
then serves no HTTP `/metrics`, where this bench reads the engines' cache hits), and the stubs speak HTTP only.

The engines are either worker stubs (`--engines stubs`: 4, with the tiny model's tokenizer) or real `vllm serve`
engines with the kvdir connector (`--engines vllm`: 2, on a ~32M-parameter random model whose prefill of a
2,048-token prompt takes a few hundred ms here). Two datasets, each at a light load and at one near the engines'
saturation; beside each run's figures the share of prompt tokens the engines served from cache, by their own
counters, and for kvdir's gateway its decisions by reason:
- **prefix repetition** (vLLM's own, driven by `vllm bench serve` from the vLLM venv: `make vllm-install`, at a
  request rate): a few long shared prefixes with short suffixes; TTFT p50/p90/p99, throughput, failed requests;
- **chat** (`chat_sessions`, closed loop through `/v1/chat/completions`, at a number of sessions open at once):
  each session sends its next turn only once the last one was answered and a think time has passed, the real
  answer in its history; most sessions share one long document, a few have their own or none. TTFT p50/p90/p99
  over all turns and over first turns apart, completed and failed turns.

The hot path is measured apart (`added_latency`): one engine at a low rate, straight to it and through each
router, on short prompts and on long ones (one shared long prefix with short suffixes: the per-request cost that
grows with the prompt: reading, tokenizing, hashing it); the TTFT difference is what the router adds per
request. Each of those runs draws its own prompts (its own seed), so no run is served the suffixes an earlier
one left cached.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvdir.local_cluster import ChildExited, Cluster, Gateway, NotReady, Workers, free_ports, stop_all
from kvtools.bench.chat_sessions import ChatShape, make_sessions, run_sessions, summarize, vocabulary
from kvtools.bench.cli import ROUTERS
from kvtools.bench.report import emit, header, say
from kvtools.replay.peers_real import DEFAULT_PYTHON as PEERS_PYTHON
from kvtools.vllm_launcher import BLOCK, MODEL, ROOT, VllmEngine, make_tiny_model, running, vllm_venv

KEPT = ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "request_throughput", "completed", "failed")
CACHE_COUNTERS = {  # per engine kind: (prompt tokens, prompt tokens served from cache) counters on the engine's /metrics
    "stubs": (("kvdir_worker_prompt_tokens_total",), ("kvdir_worker_cached_tokens_total",)),
    "vllm": (("vllm:prefix_cache_queries_total",), ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")),
}
Urls = tuple[list[str], list[str]]  # (directory replicas, engines)


@dataclass(frozen=True)
class Setup:
    """One kind of engine: how many, how to start them, what the gateway is told of them, the datasets' sizes and
    their two loads each (prefix repetition: requests/s over all engines; chat: sessions open at once)."""

    engines: int
    model_size: str
    prefix: tuple[int, int, int, int]  # prefixes, prefix tokens, suffix tokens, output tokens
    chat: ChatShape
    loads: dict[str, float]
    chat_loads: dict[str, int]
    prompts: tuple[int, int]  # prefix-repetition prompts per run, full and --quick
    routers: tuple[str, ...]  # of ROUTERS
    gateway_args: tuple[str, ...]
    hot_long: int  # the long hot-path prompts' shared prefix, tokens
    # The gateway reads the stubs' tokenizer.json (their chat template is the stub's own); in front of vLLM it is
    # told nothing: it finds the model's files and template through the engines' /v1/models (--tokenizer auto).
    tokenizer_file: bool = True
    # kvdir_static: kvdir's gateway as it was before it learned from what it observes, told the engines' figures by hand, with
    # nothing learned, no stay margins and requests ahead priced at their max_tokens: the "before" of the estimate
    # error and of the routing.
    static_args: tuple[str, ...] = ()


SETUPS = {
    # 10,000 prefill tokens/s and 80 decode tokens/s per stub (their defaults, and the gateway's)
    "stubs": Setup(
        engines=4,
        model_size="tiny",
        prefix=(12, 4096, 128, 16),
        chat=ChatShape(sessions=48, turns=6, document=2048, question=128, answer=64, own=4, bare=4),
        loads={"light": 2.0, "near saturation": 6.0},
        chat_loads={"light": 4, "near saturation": 24},
        prompts=(240, 60),
        routers=ROUTERS,
        gateway_args=(),
        hot_long=4096,
    ),
    # In front of vLLM the gateway is not tuned: no block size, tokenizer, prefill or decode rate nor
    # concurrency; it learns the engines' prefill rate, overhead and answers' length from what it observes. Only the
    # link is given, a fact of the deployment: pulls over Mooncake's TCP on two shared cores run at ~40 MB/s here.
    "vllm": Setup(
        engines=2,
        model_size="bench",
        prefix=(8, 2048, 128, 16),
        chat=ChatShape(sessions=24, turns=6, document=1024, question=96, answer=48, own=2, bare=2),
        loads={"light": 1.0, "near saturation": 2.5},
        chat_loads={"light": 2, "near saturation": 6},
        prompts=(120, 48),
        routers=(*ROUTERS[:5], "kvdir_static"),
        gateway_args=("--link-gbps", "0.04"),
        hot_long=2048,
        tokenizer_file=False,
        # What the gateway was told before (measured here: ~9,000 prefill tokens/s on long prompts; `--max-running
        # 4` standing for a CPU engine's batch cost), and the engines' own tokenizer.
        static_args=(
            "--tokenizer",
            "engine",
            "--block-size",
            str(BLOCK),
            "--prefill-tokens-per-s",
            "9000",
            "--decode-tokens-per-s",
            "60",
            "--max-running",
            "4",
        ),
    ),
}
VLLM_BLOCKS = 512  # each vLLM engine's KV blocks of 32 tokens: 16,384 tokens, the prefix dataset's 8 prefixes once


# kvdir_static's gateway: nothing learned, no stay margin, each request ahead priced at its own max_tokens.
STATIC = ("--ttft-learn-window", "0", "--stay-margin-ms", "0", "--stay-margin-ratio", "0", "--output-tokens-prior", "1000000")

SMG_PYTHON = ROOT / ".venv-peers-smg" / "bin" / "python"  # SMG's own venv: the Makefile says why
PEERS = {  # router: (its venv's python, its command after `python -m`, its policy); each with --host/--port
    "sglang": (PEERS_PYTHON, ("sglang_router.launch_router", "--log-level", "warn"), "cache_aware"),
    "round_robin": (PEERS_PYTHON, ("sglang_router.launch_router", "--log-level", "warn"), "round_robin"),
    "smg": (SMG_PYTHON, ("smg", "launch", "--log-level", "warn"), "cache_aware"),
    "vllm_router": (PEERS_PYTHON, ("vllm_router.launch_router", "--log-level", "warning"), "cache_aware"),
}


@contextmanager
def _peer(name: str, urls: Sequence[str], log: Path) -> Iterator[str]:
    """The real router `name` of `PEERS` in front of `urls`; its URL once it answers. It is stopped when the block
    ends, however it ends."""
    python, command, policy = PEERS[name]
    if not python.exists():
        raise FileNotFoundError(f"{python}: `make peers-install` builds the peers' venvs")
    port = free_ports(1)[0]
    cmd = [str(python), "-m", *command, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls]
    # no circuit breaker (a slow engine is not a broken one); workers checked every second at start, not every 30 s
    cmd += ["--policy", policy, "--disable-circuit-breaker", "--worker-startup-check-interval", "1"]
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise ChildExited(f"the {name} router", proc, log)
            try:
                if httpx.get(url + "/v1/models", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise NotReady(f"the {name} router was not ready within 60 s", [(name, log)], str(log))
            time.sleep(0.1)
        yield url
    finally:
        stop_all([proc], grace=10.0)


def _serve_bench(
    url: str, tokenizer_dir: Path, out: Path, dataset: Sequence[str], rate: float, prompts: int, seed: int = 0
) -> dict[str, Any]:
    """vLLM's `vllm bench serve` against `url` (prompts drawn with `seed`); the figures of its result file that this
    bench reports."""
    cmd = [str(vllm_venv() / "bin" / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", url]
    cmd += ["--model", MODEL, "--tokenizer", str(tokenizer_dir), "--request-rate", str(rate), "--num-prompts", str(prompts)]
    cmd += ["--seed", str(seed), "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90,99", "--ignore-eos"]
    cmd += ["--save-result", "--result-dir", str(out.parent), "--result-filename", out.name, *dataset]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}): {proc.stderr[-1500:]}")
    result = json.loads(out.read_text())
    figures = {k: result.get(k) for k in KEPT}
    figures["failed"] = result.get("failed", prompts - int(result.get("completed", 0)))
    return figures


def _prefix_dataset(prefixes: int, prefix_tokens: int, suffix_tokens: int, output_tokens: int) -> list[str]:
    return [
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        str(prefix_tokens),
        "--prefix-repetition-suffix-len",
        str(suffix_tokens),
        "--prefix-repetition-num-prefixes",
        str(prefixes),
        "--prefix-repetition-output-len",
        str(output_tokens),
    ]


@contextmanager
def _stubs(tmp: Path, engines: int, model: Path) -> Iterator[Urls]:
    ports = free_ports(2 + engines)
    c = Cluster(tmp, ports[:1], ports[1:2], log_level="warning")
    args = ("--model", MODEL, "--tokenizer", str(model / "tokenizer.json"), "--max-model-len", "8192", "--transfer", "tcp")
    w = Workers(tmp, ports[2:], c.replica_urls, extra_args=args)
    try:
        c.start()
        c.wait_ready(60)
        w.start()
        w.wait_ready(60)
        yield c.replica_urls, w.urls
    finally:
        w.stop()
        c.stop()


@contextmanager
def _vllm(tmp: Path, engines: int, model: Path) -> Iterator[Urls]:
    """A directory replica and `engines` vLLM engines with the kvdir connector, started together."""
    ports = free_ports(2)
    c = Cluster(tmp, ports[:1], ports[1:2], log_level="warning")
    try:
        c.start()
        c.wait_ready(60)
        started = [
            VllmEngine(f"vllm-{i}", vllm_venv(), model, c.replica_urls, tmp, num_blocks=VLLM_BLOCKS) for i in range(engines)
        ]
        with running(started):
            yield c.replica_urls, [e.url for e in started]
    finally:
        c.stop()


CLUSTERS: dict[str, Callable[[Path, int, Path], AbstractContextManager[Urls]]] = {"stubs": _stubs, "vllm": _vllm}


GATEWAY_COUNTERS = {  # what kvdir's gateway did in a run, from its /metrics: sample name -> name reported
    "kvdir_gateway_decisions_total": "decisions",  # one per reason
    "kvdir_gateway_prompt_tokens_total": "prompt tokens",
    "kvdir_gateway_reported_cached_tokens_total": "cached tokens reported",
}


def _samples(metrics: str) -> Iterator[Sample]:
    """Every sample of a /metrics page, parsed by prometheus_client."""
    for family in text_string_to_metric_families(metrics):
        yield from family.samples


def counter_sum(metrics: str, names: Sequence[str]) -> float:
    """The sum of every sample of the counters `names` on a /metrics page (all label sets)."""
    return sum(s.value for s in _samples(metrics) if s.name in names)


def cache_hit_rate(kind: str, engines: Sequence[str]) -> float:
    """The share of prompt tokens the engines served from cache (local or pulled), by their own counters: the same
    measure whatever routed the requests."""
    prompt, cached = CACHE_COUNTERS[kind]
    pages = [httpx.get(url + "/metrics", timeout=10).text for url in engines]
    total = sum(counter_sum(page, prompt) for page in pages)
    return sum(counter_sum(page, cached) for page in pages) / total if total else 0.0


def gateway_counts(metrics: str) -> dict[str, float]:
    """The `GATEWAY_COUNTERS` samples of a /metrics page: decisions by reason, prompt and cached tokens."""
    return {
        f"{GATEWAY_COUNTERS[s.name]} {s.labels.get('reason', '')}".strip(): s.value
        for s in _samples(metrics)
        if s.name in GATEWAY_COUNTERS
    }


def ttft_errors(status: dict[str, Any]) -> dict[str, float]:
    """How far the gateway's TTFT estimates were from what it observed (its /v1/status): the engines' median
    |estimated - observed| over the observed TTFT (over each engine's last 256 requests), weighted by the
    requests observed there."""
    seen = [(e["ttft_observed"], e["ttft_error_ratio"]) for e in status["engines"] if e.get("ttft_error_ratio") is not None]
    n = sum(k for k, _ in seen)
    return {"ttft estimate error ratio": sum(k * r for k, r in seen) / n} if n else {}


@contextmanager
def _router(name: str, tmp: Path, urls: Urls, model: Path, setup: Setup, counts: dict[str, float] | None = None) -> Iterator[str]:
    """`name`'s URL in front of the cluster's engines; for kvdir's gateway, `counts` gets what it did
    (`gateway_counts`) when the block ends."""
    directory, engines = urls
    if name in ("kvdir", "modeled_sglang", "kvdir_static"):
        policy = "sglang" if name == "modeled_sglang" else "kvdir"
        args = ("--policy", policy, *setup.gateway_args)
        if name == "kvdir_static":
            args += (*STATIC, *setup.static_args)
        tokenizer = str(model / "tokenizer.json") if setup.tokenizer_file else None
        g = Gateway(tmp, free_ports(1)[0], directory, extra_args=args, tokenizer=tokenizer)
        try:
            g.wait_ready(120, engines=len(engines))
            yield g.url
            if counts is not None:
                counts.update(gateway_counts(httpx.get(g.url + "/metrics", timeout=10).text))
                counts.update(ttft_errors(httpx.get(g.url + "/v1/status", timeout=10).json()))
        finally:
            g.stop()
        return
    with _peer(name, engines, tmp / f"{name}.log") as url:
        yield url


def _chat(url: str, model: Path, shape: ChatShape, concurrency: int, think_s: float) -> dict[str, float]:
    """The chat sessions of `shape` through `url`, `concurrency` open at once; `summarize`'s figures."""
    sessions = make_sessions(shape, vocabulary(model / "tokenizer.json"))
    return summarize(asyncio.run(run_sessions(url, MODEL, sessions, concurrency, think_s)))


def compare(
    tmp: Path, engines: str, model: Path, quick: bool, think_s: float, routers: Sequence[str] | None = None
) -> dict[str, Any]:
    """Every router (of the setup's, or `routers`) on both datasets at both loads, each run on a fresh cluster."""
    setup = SETUPS[engines]
    chat = replace(setup.chat, sessions=setup.chat.sessions // 2, turns=3) if quick else setup.chat
    prefix = setup.prompts[1] if quick else setup.prompts[0]
    runs = [("prefix repetition", load, f"{rate:g} requests/s", rate) for load, rate in setup.loads.items()]
    runs += [("chat", load, f"{n} sessions at once", n) for load, n in setup.chat_loads.items()]
    out: dict[str, Any] = {}
    for (dataset, load, how, amount), name in itertools.product(runs, routers or setup.routers):
        run = tmp / f"{dataset.replace(' ', '_')}-{name}-{amount:g}"
        run.mkdir()
        say(f"  {dataset}: {name} at {how} ({load}) on a fresh cluster...")
        counts: dict[str, float] = {}
        with (
            CLUSTERS[engines](run, setup.engines, model) as urls,
            _router(name, run, urls, model, setup, counts) as url,
        ):
            if dataset == "chat":
                figures: dict[str, Any] = _chat(url, model, chat, int(amount), think_s)
            else:
                figures = _serve_bench(url, model, run / "result.json", _prefix_dataset(*setup.prefix), amount, prefix)
            figures["engines' cache hit rate"] = cache_hit_rate(engines, urls[1])
        say(f"    {', '.join(f'{k} {v:.4g}' for k, v in {**figures, **counts}.items() if v is not None)}")
        out.update({f"{dataset} {load} {name} {k}": v for k, v in {**figures, **counts}.items()})
    return out


def added_latency(tmp: Path, engines: str, model: Path, quick: bool) -> dict[str, Any]:
    """TTFT straight to one engine and through each router, at a low rate (no queueing), on short prompts and on
    long ones: the difference is what the router adds. Every run has its own seed (its own prompts)."""
    setup = SETUPS[engines]
    hot_path = {  # name: (dataset, requests/s, prompts, prompts with --quick); both light enough that nothing queues
        "short": (["--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "1"], 20.0, 400, 100),
        "long": (_prefix_dataset(1, setup.hot_long, 128, 16), 2.0, 120, 30),
    }
    seeds = itertools.count(1)
    out: dict[str, Any] = {}
    with CLUSTERS[engines](tmp, 1, model) as urls:
        for shape, (dataset, rate, full, few) in hot_path.items():
            prompts = few if quick else full
            direct = _serve_bench(urls[1][0], model, tmp / f"direct-{shape}.json", dataset, rate, prompts, next(seeds))
            for name in ("kvdir", "sglang", "smg", "vllm_router"):
                with _router(name, tmp, urls, model, setup) as url:
                    via = _serve_bench(url, model, tmp / f"{name}-{shape}.json", dataset, rate, prompts, next(seeds))
                for p in ("median", "p99"):
                    out[f"{shape} prompts {name} added {p} ttft ms"] = via[f"{p}_ttft_ms"] - direct[f"{p}_ttft_ms"]
            out[f"{shape} prompts direct median ttft ms"] = direct["median_ttft_ms"]
    return out


def main(
    *, as_json: bool, quick: bool, engines: str = "stubs", think_s: float = 1.0, routers: Sequence[str] | None = None
) -> int:
    results = header(quick)
    results["engines"] = engines
    results["think s"] = think_s
    setup = SETUPS[engines]
    with tempfile.TemporaryDirectory(prefix="kvdir-bench-") as tmp:
        model = make_tiny_model(
            vllm_venv(), Path(tmp) / MODEL, kv_heads=4 if setup.model_size == "bench" else 1, size=setup.model_size
        )
        say(f"the hot path: one of the {engines}, short and long prompts, straight and through each router...")
        (Path(tmp) / "hot").mkdir()
        results.update(added_latency(Path(tmp) / "hot", engines, model, quick))
        say(f"prefix repetition and chat sessions over {setup.engines} {engines}, each router on a fresh cluster")
        results.update(compare(Path(tmp), engines, model, quick, think_s, routers))
    emit(results, as_json)
    return 0
