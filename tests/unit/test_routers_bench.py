"""`kvdir bench routers`: its chat dataset (most sessions share one long document in their first message, a few
have their own or none; the same seed, the same sessions), the figures it reports of a run's turns, and what it
reads of kvdir's gateway's /metrics.

The tokenizer is trained here on the tiny model's corpus (tests/compose/make_tiny_model.py), so no download."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvtools.bench.chat_sessions import ChatShape, Turn, make_sessions, summarize, vocabulary
from kvtools.bench.routers import CACHE_COUNTERS, counter_sum, gateway_counts, ttft_errors

CORPUS = "the quick brown fox jumps over the lazy dog while a support assistant answers briefly " * 20
SHAPE = ChatShape(sessions=12, turns=4, document=60, question=8, answer=5, own=2, bare=1)


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


def _document(first_message: str) -> str:
    """The document in a session's first user message ("" without one): between the instruction and the question."""
    parts = first_message.split("\n\n")
    return parts[1] if len(parts) == 3 else ""


def test_most_sessions_share_one_long_document_a_few_have_their_own_or_none(tokenizer_file: Path) -> None:
    sessions = make_sessions(SHAPE, vocabulary(tokenizer_file))
    assert [s.index for s in sessions] == list(range(SHAPE.sessions))
    assert all(len(s.questions) == SHAPE.turns and s.max_tokens == SHAPE.answer for s in sessions)
    documents = {s.index: _document(s.questions[0]) for s in sessions}
    by_kind = {kind: [documents[s.index] for s in sessions if s.document == kind] for kind in ("shared", "own", "none")}
    assert [len(by_kind[k]) for k in ("shared", "own", "none")] == [SHAPE.sessions - 3, 2, 1]
    assert len(set(by_kind["shared"])) == 1  # the very same document in every sharing session
    assert len(set(by_kind["own"]) | set(by_kind["shared"])) == 3  # each own document differs from all others
    assert by_kind["none"] == [""]
    tok = Tokenizer.from_file(str(tokenizer_file))
    for doc in by_kind["shared"][:1] + by_kind["own"]:
        assert len(tok.encode(doc).ids) == SHAPE.document  # words of the vocabulary: a token each
    for s in sessions:  # later turns carry no document, and every question differs
        assert all("\n" not in q for q in s.questions[1:])
    assert len({q for s in sessions for q in s.questions}) == SHAPE.sessions * SHAPE.turns


def test_the_same_seed_draws_the_same_sessions(tokenizer_file: Path) -> None:
    words = vocabulary(tokenizer_file)
    assert make_sessions(SHAPE, words, seed=3) == make_sessions(SHAPE, words, seed=3) != make_sessions(SHAPE, words, seed=4)


def test_more_own_and_bare_sessions_than_sessions_are_refused(tokenizer_file: Path) -> None:
    with pytest.raises(ValueError, match="exceed 4 sessions"):
        make_sessions(ChatShape(sessions=4, turns=2, document=5, question=2, answer=1, own=3, bare=2), ["a"])


def test_first_turns_are_summarized_apart_and_failed_turns_counted() -> None:
    turns = [Turn(0, 0, 0.100), Turn(0, 1, 0.010), Turn(0, 2, 0.020), Turn(1, 0, 0.300), Turn(1, 1, None, "HTTP 500")]
    figures = summarize(turns)
    assert figures["first turns p50 ttft ms"] == pytest.approx(200.0)  # of 100 and 300 ms only
    assert figures["p50 ttft ms"] == pytest.approx(60.0)  # of 10, 20, 100 and 300 ms: the failed turn has none
    assert figures["p99 ttft ms"] == pytest.approx(294.0)
    assert (figures["completed"], figures["failed"]) == (4, 1)
    assert math.isnan(summarize([Turn(0, 0, None, "refused")])["p50 ttft ms"])


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


def test_the_ttft_estimate_error_is_weighted_by_the_requests_each_engine_saw() -> None:
    status = {
        "engines": [
            {"ttft_observed": 30, "ttft_error_ratio": 0.1},
            {"ttft_observed": 10, "ttft_error_ratio": 0.5},
            {"ttft_observed": 0, "ttft_error_ratio": None},
        ]
    }
    assert ttft_errors(status) == {"ttft estimate error ratio": pytest.approx(0.2)}
    assert ttft_errors({"engines": [{"ttft_observed": 0, "ttft_error_ratio": None}]}) == {}
