"""`kvdir bench routers`: its multi-turn dataset (each session's prompts extend its last one, every session shares
the system prompt, turns go out in turn order, and `vllm bench serve` is told to keep that order) and what it
reads of kvdir's gateway's /metrics.

The tokenizer is trained here on the tiny model's corpus (tests/compose/make_tiny_model.py), so no download."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvtools.bench.routers import CACHE_COUNTERS, MultiTurn, counter_sum, gateway_counts, write_multi_turn

CORPUS = "the quick brown fox jumps over the lazy dog while a support assistant answers briefly " * 20
SHAPE = MultiTurn(sessions=3, turns=4, system=40, user=12, reply=5)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_sessions_extend_their_last_prompt_in_turn_order(tmp_path: Path, tokenizer_file: Path) -> None:
    path = tmp_path / "mt.jsonl"
    flags, count = write_multi_turn(path, tokenizer_file, SHAPE)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert count == len(lines) == SHAPE.sessions * SHAPE.turns
    assert flags[flags.index("--dataset-path") + 1] == str(path)
    assert "--disable-shuffle" in flags and "--skip-chat-template" in flags
    assert {line["output_tokens"] for line in lines} == {SHAPE.reply}
    prompts = [line["prompt"] for line in lines]
    system = prompts[0].split("\n", 1)[0]
    assert all(p.startswith(system + "\n") for p in prompts)  # one system prompt for every session
    for i, p in enumerate(prompts[SHAPE.sessions :], start=SHAPE.sessions):
        last = prompts[i - SHAPE.sessions]  # the same session, one turn earlier
        assert p.startswith(last) and len(p) > len(last)
        assert p.endswith("<|assistant|>") and p.count("<|user|>") == i // SHAPE.sessions + 1
    assert len(set(prompts[: SHAPE.sessions])) == SHAPE.sessions  # sessions differ after the system prompt
    tok = Tokenizer.from_file(str(tokenizer_file))
    first_user = prompts[0].split("<|user|>")[1].removesuffix("\n<|assistant|>")
    assert len(tok.encode(first_user).ids) == SHAPE.user  # words of the vocabulary: a token each


def test_the_same_seed_writes_the_same_dataset(tmp_path: Path, tokenizer_file: Path) -> None:
    a, b, c = (tmp_path / n for n in ("a", "b", "c"))
    write_multi_turn(a, tokenizer_file, SHAPE, seed=3)
    write_multi_turn(b, tokenizer_file, SHAPE, seed=3)
    write_multi_turn(c, tokenizer_file, SHAPE, seed=4)
    assert a.read_text() == b.read_text() != c.read_text()


def test_the_gateways_decisions_and_cached_tokens_are_read_from_its_metrics_page() -> None:
    r = CollectorRegistry()  # the gateway's names (gateway/metrics.py), as prometheus_client writes them
    decisions = Counter("kvdir_gateway_decisions_total", "Routing decisions, by reason", ["reason"], registry=r)
    prompt = Counter("kvdir_gateway_prompt_tokens_total", "Prompt tokens routed", registry=r)
    cached = Counter("kvdir_gateway_reported_cached_tokens_total", "Cached tokens the engines reported", registry=r)
    decisions.labels("affinity").inc(7)
    decisions.labels("pull").inc(2)
    prompt.inc(4096)
    cached.inc(3000)
    assert gateway_counts(generate_latest(r).decode()) == {
        "decisions affinity": 7.0,
        "decisions pull": 2.0,
        "prompt tokens": 4096.0,
        "cached tokens reported": 3000.0,
    }


def test_an_engines_cached_share_sums_every_label_set_of_its_counters() -> None:
    """vLLM's counters carry engine and model labels and the stub's cached tokens a source: all are summed, and a
    counter whose name merely starts alike is not."""
    r = CollectorRegistry()
    queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens", ["engine"], registry=r)
    hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens", ["engine"], registry=r)
    external = Counter("vllm:external_prefix_cache_hits", "External prefix cache hits, in tokens", ["engine"], registry=r)
    decoy = Counter("vllm:prefix_cache_hits_by_tier", "Not one of them", registry=r)
    queries.labels("0").inc(1000)
    queries.labels("1").inc(500)
    hits.labels("0").inc(600)
    external.labels("0").inc(64)
    decoy.inc(9999)
    page = generate_latest(r).decode()
    prompt, cached = CACHE_COUNTERS["vllm"]
    assert (counter_sum(page, prompt), counter_sum(page, cached)) == (1500.0, 664.0)
