"""`kvdir bench routers`: kvdir's gateway against the real SGLang router, live, on the same engines.

Each router runs in front of a fresh cluster of worker stubs (a directory replica and `ENGINES` stubs with the
tiny model's tokenizer, so every router starts with cold caches): kvdir's gateway (`--policy kvdir`), the
SGLang router as it ships (`sglang-router`, a Rust binary, `--policy cache_aware`, from the peers venv:
`make peers-install`) and the SGLang router's round robin. vLLM's own client drives each one (`vllm bench
serve`, its prefix-repetition dataset: `PREFIXES` prompts of `PREFIX_TOKENS` shared tokens each, from the
vLLM venv: `make vllm-install`) at a light load and at one near the stubs' saturation, and reports what it
measures: TTFT p50/p90/p99, throughput, failed requests.

The hot path is measured apart (`added_latency`): one stub at a low rate, straight to the stub and through
each router, on short prompts and on long ones (one shared 4,096-token prefix with 128-token suffixes, the
per-request cost that grows with the prompt: reading, tokenizing, hashing it); the TTFT difference is what
the router adds per request. Each of those runs draws its own prompts (its own seed), so no run is served
the suffixes an earlier one left cached.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from kvdir.local_cluster import ChildExited, Cluster, Gateway, NotReady, Workers, free_ports, stop_all
from kvtools.bench.report import emit, header, say
from kvtools.replay.peers_real import DEFAULT_PYTHON as PEERS_PYTHON
from kvtools.vllm_launcher import MODEL, make_tiny_model, vllm_venv

ENGINES = 4
PREFIXES, PREFIX_TOKENS, SUFFIX_TOKENS, OUTPUT_TOKENS = 12, 4096, 128, 16
LOADS = {"light": 2.0, "near saturation": 6.0}  # requests/s over the 4 stubs (10,000 prefill tokens/s each)
KEPT = ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "request_throughput", "completed", "failed")
ROUTERS = ("kvdir", "sglang", "round_robin")


def _stub_args(tokenizer: Path) -> tuple[str, ...]:
    return ("--model", MODEL, "--tokenizer", str(tokenizer), "--max-model-len", "8192", "--transfer", "tcp")


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


def _prefix_dataset(prefixes: int = PREFIXES) -> list[str]:
    return [
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        str(PREFIX_TOKENS),
        "--prefix-repetition-suffix-len",
        str(SUFFIX_TOKENS),
        "--prefix-repetition-num-prefixes",
        str(prefixes),
        "--prefix-repetition-output-len",
        str(OUTPUT_TOKENS),
    ]


@contextmanager
def _cluster(tmp: Path, engines: int, tokenizer: Path) -> Iterator[tuple[Cluster, Workers]]:
    ports = free_ports(2 + engines)
    c = Cluster(tmp, ports[:1], ports[1:2], log_level="warning")
    w = Workers(tmp, ports[2:], c.replica_urls, extra_args=_stub_args(tokenizer))
    try:
        c.start()
        c.wait_ready(60)
        w.start()
        w.wait_ready(60)
        yield c, w
    finally:
        w.stop()
        c.stop()


@contextmanager
def _router(name: str, tmp: Path, c: Cluster, w: Workers, tokenizer: Path) -> Iterator[str]:
    """`name`'s URL in front of the cluster's stubs."""
    if name == "kvdir":
        g = Gateway(tmp, free_ports(1)[0], c.replica_urls, extra_args=("--tokenizer", str(tokenizer)))
        try:
            g.wait_ready(60, engines=len(w.urls))
            yield g.url
        finally:
            g.stop()
        return
    with _sglang(w.urls, "cache_aware" if name == "sglang" else "round_robin", tmp / f"{name}.log") as url:
        yield url


def bench_prefixes(tmp: Path, tokenizer_dir: Path, quick: bool) -> dict[str, Any]:
    """Every router at every load of `LOADS`, each on a fresh cluster."""
    prompts = 60 if quick else 240
    tokenizer = tokenizer_dir / "tokenizer.json"
    out: dict[str, Any] = {}
    for load, rate in LOADS.items():
        for name in ROUTERS:
            run = tmp / f"{name}-{rate:g}"
            run.mkdir()
            say(f"  {name} at {rate:g} requests/s ({load}), {prompts} prompts on a fresh cluster...")
            with _cluster(run, ENGINES, tokenizer) as (c, w), _router(name, run, c, w, tokenizer) as url:
                figures = _serve_bench(url, tokenizer_dir, run / "result.json", _prefix_dataset(), rate, prompts)
            out.update({f"{load} {name} {k}": v for k, v in figures.items()})
    return out


HOT_PATH = {  # name: (dataset, requests/s, prompts, prompts with --quick); both rates light enough that nothing queues
    "short": (["--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "1"], 20.0, 400, 100),
    "long": (_prefix_dataset(1), 2.0, 120, 30),
}


def added_latency(tmp: Path, tokenizer_dir: Path, quick: bool) -> dict[str, Any]:
    """TTFT straight to one stub and through each router, at a low rate (no queueing), on each `HOT_PATH` prompt
    shape: the difference is what the router adds. Every run has its own seed (its own prompts)."""
    tokenizer = tokenizer_dir / "tokenizer.json"
    seeds = itertools.count(1)
    out: dict[str, Any] = {}
    with _cluster(tmp, 1, tokenizer) as (c, w):
        for shape, (dataset, rate, full, few) in HOT_PATH.items():
            prompts = few if quick else full
            direct = _serve_bench(w.urls[0], tokenizer_dir, tmp / f"direct-{shape}.json", dataset, rate, prompts, next(seeds))
            for name in ("kvdir", "sglang"):
                with _router(name, tmp, c, w, tokenizer) as url:
                    via = _serve_bench(url, tokenizer_dir, tmp / f"{name}-{shape}.json", dataset, rate, prompts, next(seeds))
                for p in ("median", "p99"):
                    out[f"{shape} prompts {name} added {p} ttft ms"] = via[f"{p}_ttft_ms"] - direct[f"{p}_ttft_ms"]
            out[f"{shape} prompts direct median ttft ms"] = direct["median_ttft_ms"]
    return out


def main(*, as_json: bool, quick: bool) -> int:
    results = header(quick)
    with tempfile.TemporaryDirectory(prefix="kvdir-bench-") as tmp:
        tokenizer_dir = make_tiny_model(vllm_venv(), Path(tmp) / MODEL)
        say("the hot path: one stub, 64-token prompts at 20/s and 4,224-token ones at 2/s, straight and through each router...")
        (Path(tmp) / "hot").mkdir()
        results.update(added_latency(Path(tmp) / "hot", tokenizer_dir, quick))
        say(
            f"prefix repetition: {PREFIXES} prefixes x {PREFIX_TOKENS} tokens over {ENGINES} stubs, each router on a fresh cluster"
        )
        results.update(bench_prefixes(Path(tmp), tokenizer_dir, quick))
    emit(results, as_json)
    return 0
