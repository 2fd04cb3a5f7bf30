"""`kvdir bench routers`: kvdir's gateway against the real SGLang router, live, on the same engines.

Each router runs in front of a fresh cluster (a directory replica and its engines, so every router starts with
cold caches): kvdir's gateway (`--policy kvdir`), the SGLang router as it ships (`sglang-router`, a Rust binary,
`--policy cache_aware`, from the peers venv: `make peers-install`) and the SGLang router's round robin; on the
stubs also kvdir's gateway with its model of SGLang's policy (`--policy sglang`), which the simulated replay
uses: how far that model is from the real router, on the same engines. The
engines are either worker stubs (`--engines stubs`: 4, with the tiny model's tokenizer) or real `vllm serve`
engines with the kvdir connector (`--engines vllm`: 2, on a ~32M-parameter random model whose prefill of a
2,048-token prompt takes a few hundred ms here). vLLM's own client drives each one (`vllm bench serve`, from
the vLLM venv: `make vllm-install`) on two datasets, at a light load and at one near the engines' saturation,
and reports what it measures: TTFT p50/p90/p99, throughput, failed requests; beside them the share of prompt
tokens the engines served from cache, by their own counters, and for kvdir's gateway its decisions. The datasets:
- **prefix repetition** (vLLM's own): a few long shared prefixes with short suffixes;
- **multi-turn** (vLLM 0.32's client has none, so it is written here as a custom dataset): sessions that share
  a system prompt, each turn's prompt the whole conversation so far plus a new user message, sent in turn order
  with every session's turn k before any turn k+1 (`--disable-shuffle`). The earlier replies in a prompt are
  written here, not the engine's own output: what a prompt shares with the last one is what routing sees.

The hot path is measured apart (`added_latency`): one engine at a low rate, straight to it and through each
router, on short prompts and on long ones (one shared long prefix with short suffixes: the per-request cost that
grows with the prompt: reading, tokenizing, hashing it); the TTFT difference is what the router adds per
request. Each of those runs draws its own prompts (its own seed), so no run is served the suffixes an earlier
one left cached.
"""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from tokenizers import Tokenizer

from kvdir.local_cluster import ChildExited, Cluster, Gateway, NotReady, Workers, free_ports, stop_all
from kvtools.bench.report import emit, header, say
from kvtools.replay.peers_real import DEFAULT_PYTHON as PEERS_PYTHON
from kvtools.vllm_launcher import BLOCK, MODEL, VllmEngine, make_tiny_model, running, vllm_venv

KEPT = ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "request_throughput", "completed", "failed")
ROUTERS = ("kvdir", "sglang", "round_robin", "modeled_sglang")  # the last: kvdir's gateway with `--policy sglang`
CACHE_COUNTERS = {  # per engine kind: (prompt tokens, prompt tokens served from cache) counters on the engine's /metrics
    "stubs": (("kvdir_worker_prompt_tokens_total",), ("kvdir_worker_cached_tokens_total",)),
    "vllm": (("vllm:prefix_cache_queries_total",), ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")),
}
Urls = tuple[list[str], list[str]]  # (directory replicas, engines)


@dataclass(frozen=True)
class MultiTurn:
    """A multi-turn dataset's shape, in tokens of the model's tokenizer (words of its corpus, about one each)."""

    sessions: int
    turns: int
    system: int
    user: int
    reply: int


@dataclass(frozen=True)
class Setup:
    """One kind of engine: how many, how to start them, what the gateway is told of them, the datasets' sizes and
    the two loads (requests/s over all engines)."""

    engines: int
    model_size: str
    prefix: tuple[int, int, int, int]  # prefixes, prefix tokens, suffix tokens, output tokens
    multi_turn: MultiTurn
    loads: dict[str, float]
    prompts: tuple[int, int]  # prefix-repetition prompts per run, full and --quick
    routers: tuple[str, ...]  # of ROUTERS
    gateway_args: tuple[str, ...]
    hot_long: int  # the long hot-path prompts' shared prefix, tokens


SETUPS = {
    # 10,000 prefill tokens/s and 80 decode tokens/s per stub (their defaults, and the gateway's)
    "stubs": Setup(
        engines=4,
        model_size="tiny",
        prefix=(12, 4096, 128, 16),
        multi_turn=MultiTurn(sessions=32, turns=6, system=1024, user=256, reply=64),
        loads={"light": 2.0, "near saturation": 6.0},
        prompts=(240, 60),
        routers=ROUTERS,
        gateway_args=(),
        hot_long=4096,
    ),
    # measured here (`vllm serve` on one core each, the ~32M model): ~9,000 prefill tokens/s on long prompts, ~45 ms
    # TTFT of a fully cached one, and pulls over Mooncake's TCP on two shared cores at ~40 MB/s (below the
    # break-even: the gateway is told so, else it learns it from each engine's first pull, which stalls that
    # engine for up to 2 s). `--max-running 4` stands for what a CPU engine's batch costs: each request beyond
    # 3 running waits a quarter of a running one's decode, about the ~45 ms fixed cost of a step here.
    "vllm": Setup(
        engines=2,
        model_size="bench",
        prefix=(8, 2048, 128, 16),
        multi_turn=MultiTurn(sessions=16, turns=6, system=512, user=160, reply=48),
        loads={"light": 1.0, "near saturation": 2.5},
        prompts=(120, 48),
        routers=ROUTERS[:3],
        gateway_args=(
            "--block-size",
            str(BLOCK),
            "--prefill-tokens-per-s",
            "9000",
            "--decode-tokens-per-s",
            "60",
            "--max-running",
            "4",
            "--link-gbps",
            "0.04",
        ),
        hot_long=2048,
    ),
}
VLLM_BLOCKS = 512  # each vLLM engine's KV blocks of 32 tokens: 16,384 tokens, the prefix dataset's 8 prefixes once


@contextmanager
def _sglang(urls: Sequence[str], policy: str, log: Path) -> Iterator[str]:
    """The SGLang router in front of `urls`, with `policy`; its URL once it answers."""
    if not PEERS_PYTHON.exists():
        raise FileNotFoundError(f"{PEERS_PYTHON}: `make peers-install` builds the peers venv with sglang-router")
    port = free_ports(1)[0]
    cmd = [str(PEERS_PYTHON), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--worker-urls", *urls, "--policy", policy, "--log-level", "warn", "--disable-circuit-breaker"]
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise ChildExited("the SGLang router", proc, log)
            try:
                if httpx.get(url + "/v1/models", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise NotReady("the SGLang router was not ready within 60 s", [("sglang-router", log)], str(log))
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


def write_multi_turn(path: Path, tokenizer: Path, shape: MultiTurn, seed: int = 0) -> tuple[list[str], int]:
    """Write `shape`'s conversations as a custom dataset (JSONL, one prompt per line, in the order they are sent)
    and return `vllm bench serve`'s flags for it and the number of prompts. Each message is words of the
    tokenizer's vocabulary drawn with `seed`, in the tiny chat template's turns; a prompt ends by opening the
    assistant's turn, and the next turn's prompt repeats it with a reply and the next user message."""
    tok = Tokenizer.from_file(str(tokenizer))
    words = sorted({w.lstrip("Ġ") for w in tok.get_vocab() if w.startswith("Ġ") and w[1:].isalpha()})
    rng = random.Random(seed)

    def text(tokens: int) -> str:
        return " ".join(rng.choice(words) for _ in range(tokens))

    system = f"<|system|>{text(shape.system)}\n"
    conversations = [system for _ in range(shape.sessions)]
    lines = []
    for turn in range(shape.turns):
        for s in range(shape.sessions):
            if turn:
                conversations[s] += f"{text(shape.reply)}\n"
            conversations[s] += f"<|user|>{text(shape.user)}\n<|assistant|>"
            lines.append(json.dumps({"prompt": conversations[s], "output_tokens": shape.reply}))
    path.write_text("\n".join(lines) + "\n")
    flags = ["--dataset-name", "custom", "--dataset-path", str(path), "--disable-shuffle", "--skip-chat-template"]
    return flags, len(lines)


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


@contextmanager
def _router(
    name: str, tmp: Path, urls: Urls, model: Path, gateway_args: Sequence[str], counts: dict[str, float] | None = None
) -> Iterator[str]:
    """`name`'s URL in front of the cluster's engines; for kvdir's gateway, `counts` gets what it did
    (`gateway_counts`) when the block ends."""
    directory, engines = urls
    if name in ("kvdir", "modeled_sglang"):
        policy = "sglang" if name == "modeled_sglang" else "kvdir"
        args = ("--tokenizer", str(model / "tokenizer.json"), "--policy", policy, *gateway_args)
        g = Gateway(tmp, free_ports(1)[0], directory, extra_args=args)
        try:
            g.wait_ready(120, engines=len(engines))
            yield g.url
            if counts is not None:
                counts.update(gateway_counts(httpx.get(g.url + "/metrics", timeout=10).text))
        finally:
            g.stop()
        return
    with _sglang(engines, "cache_aware" if name == "sglang" else "round_robin", tmp / f"{name}.log") as url:
        yield url


def compare(tmp: Path, engines: str, model: Path, quick: bool) -> dict[str, Any]:
    """Every router on every dataset at every load of the setup, each on a fresh cluster."""
    setup = SETUPS[engines]
    multi, turns = write_multi_turn(tmp / "multi_turn.jsonl", model / "tokenizer.json", setup.multi_turn)
    datasets = {
        "prefix repetition": (_prefix_dataset(*setup.prefix), setup.prompts[1] if quick else setup.prompts[0]),
        "multi-turn": (multi, turns // 3 if quick else turns),
    }
    out: dict[str, Any] = {}
    for (dataset, (flags, prompts)), (load, rate) in itertools.product(datasets.items(), setup.loads.items()):
        for name in setup.routers:
            run = tmp / f"{dataset.replace(' ', '_')}-{name}-{rate:g}"
            run.mkdir()
            say(f"  {dataset}: {name} at {rate:g} requests/s ({load}), {prompts} prompts on a fresh cluster...")
            counts: dict[str, float] = {}
            with (
                CLUSTERS[engines](run, setup.engines, model) as urls,
                _router(name, run, urls, model, setup.gateway_args, counts) as url,
            ):
                figures = _serve_bench(url, model, run / "result.json", flags, rate, prompts)
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
            for name in ("kvdir", "sglang"):
                with _router(name, tmp, urls, model, setup.gateway_args) as url:
                    via = _serve_bench(url, model, tmp / f"{name}-{shape}.json", dataset, rate, prompts, next(seeds))
                for p in ("median", "p99"):
                    out[f"{shape} prompts {name} added {p} ttft ms"] = via[f"{p}_ttft_ms"] - direct[f"{p}_ttft_ms"]
            out[f"{shape} prompts direct median ttft ms"] = direct["median_ttft_ms"]
    return out


def main(*, as_json: bool, quick: bool, engines: str = "stubs") -> int:
    results = header(quick)
    results["engines"] = engines
    setup = SETUPS[engines]
    with tempfile.TemporaryDirectory(prefix="kvdir-bench-") as tmp:
        model = make_tiny_model(
            vllm_venv(), Path(tmp) / MODEL, kv_heads=4 if setup.model_size == "bench" else 1, size=setup.model_size
        )
        say(f"the hot path: one of the {engines}, short and long prompts, straight and through each router...")
        (Path(tmp) / "hot").mkdir()
        results.update(added_latency(Path(tmp) / "hot", engines, model, quick))
        say(f"prefix repetition and multi-turn over {setup.engines} {engines}, each router on a fresh cluster")
        results.update(compare(Path(tmp), engines, model, quick))
    emit(results, as_json)
    return 0
