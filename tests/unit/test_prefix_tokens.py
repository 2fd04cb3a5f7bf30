"""kvproto.prefix_tokens: a prompt tokenized by reusing an earlier prompt's tokens gets the ids the whole prompt
gets from the `tokenizers` library, for each pre-tokenizer it supports; the others are never cut.

The tokenizers are trained here (byte-level BPE with GPT-2's regex, and with Llama 3's and Qwen 2's Split
patterns as their tokenizer.json files have them), so the test needs no download.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from kvproto.prefix_tokens import _LLAMA3, _QWEN2, SEGMENT_CHARS, PrefixTokenCache, supported

CORPUS = [
    "the quick brown fox jumps over the lazy dog, and the dog's owner didn't mind",
    "Prefix caching keeps the KV blocks of a shared prompt; turn 2 repeats turn 1 verbatim.",
    "naïve café façade — 東京 ☃ emoji 🙂 tabs\tand\nnewlines  double  spaces 12345 3.14159",
    "def f(x):\n    return x ** 2  # code\n\n\nclass A:\n\tpass",
] * 20


def _train(pre: pre_tokenizers.PreTokenizer, normalizer: normalizers.Normalizer | None = None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return Tokenizer.from_str(tok.to_str())  # as loaded from a tokenizer.json


def _split(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


TOKENIZERS = {
    "gpt2": _train(pre_tokenizers.ByteLevel(add_prefix_space=False)),
    "llama3": _train(_split(_LLAMA3)),
    "qwen2": _train(_split(_QWEN2), normalizers.NFC()),
}

piece = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12) | st.sampled_from(
    ["the", "dog's", "12345", "3.14", "東京", "🙂", "e\u0301", "--", "x" * 40]
)
separator = st.sampled_from([" ", " ", " ", "  ", "\n", " \n ", "\t", "", ". ", " ' "])
long_text = st.lists(st.tuples(piece, separator), min_size=150, max_size=500).map(lambda ps: "".join(a + b for a, b in ps))


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_the_trained_pipelines_are_the_supported_ones(name: str) -> None:
    assert supported(json.loads(TOKENIZERS[name].to_str()))


@settings(max_examples=60, deadline=None)
@given(prefix=long_text, suffix=long_text, cut=st.integers(0, 4000))
def test_a_prompt_extending_another_gets_the_whole_prompts_ids(prefix: str, suffix: str, cut: int) -> None:
    """Every tokenizer on each example: drawing two texts of 150-500 pieces takes Hypothesis about three times as long
    as one tokenizer's checks, so the three share the draws (60 examples each, as when each drew its own)."""
    first = prefix + suffix
    second = first[: cut % (len(first) + 1)] + suffix[::-1]  # shares a prefix of any length with the first
    for name, hf in sorted(TOKENIZERS.items()):
        cache = PrefixTokenCache(hf, entries=8)
        for text in (first, second, first + second):
            assert cache.encode(text) == hf.encode(text, add_special_tokens=False).ids, name


def test_a_chats_next_turn_tokenizes_only_what_follows_the_shared_prefix() -> None:
    hf = TOKENIZERS["llama3"]
    cache = PrefixTokenCache(hf, entries=8)
    turn1 = " ".join(CORPUS)
    turn2 = turn1 + " and the assistant answered at length about foxes."
    assert cache.encode(turn1) == hf.encode(turn1, add_special_tokens=False).ids
    before = cache.tokenized_chars
    assert cache.encode(turn2) == hf.encode(turn2, add_special_tokens=False).ids
    # What follows the last cut inside turn 1: at most one segment of turn 1, plus the new text.
    assert cache.tokenized_chars - before < SEGMENT_CHARS + 2 * (len(turn2) - len(turn1)) + 64


def test_the_least_recently_used_prompt_is_forgotten() -> None:
    hf = TOKENIZERS["gpt2"]
    cache = PrefixTokenCache(hf, entries=2)
    texts = [f"{i} " + " ".join(CORPUS) for i in range(3)]  # three different openings
    for t in texts:
        cache.encode(t)
    before = cache.tokenized_chars
    cache.encode(texts[0] + " more")  # forgotten: tokenized whole
    assert cache.tokenized_chars - before == len(texts[0]) + 5
    before = cache.tokenized_chars
    cache.encode(texts[2] + " more")  # remembered
    assert cache.tokenized_chars - before < len(texts[2]) / 2


def test_the_remembered_tokens_are_capped_whatever_the_entry_count() -> None:
    hf = TOKENIZERS["gpt2"]
    texts = [f"{i} " + " ".join(CORPUS) for i in range(10)]  # as many tokens each
    cache = PrefixTokenCache(hf, entries=100, max_tokens=3 * len(hf.encode(texts[0]).ids))
    for text in texts:
        assert cache.encode(text) == hf.encode(text, add_special_tokens=False).ids
        assert cache.held_tokens <= cache._max_tokens
    assert len(cache._entries) == 3  # three prompts' tokens, not the 100 entries allowed


@pytest.mark.parametrize(
    "change",
    [
        lambda c: c.update(normalizer={"type": "Lowercase"}),
        lambda c: c.update(pre_tokenizer={"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}),
        lambda c: c["pre_tokenizer"].update(add_prefix_space=True),
        lambda c: c["pre_tokenizer"].update(use_regex=False),
        lambda c: c.update(added_tokens=[{"id": 0, "content": "<|start header|>", "special": True}]),
    ],
    ids=["normalizer", "metaspace", "prefix space", "no regex", "added token with a space"],
)
def test_other_pipelines_are_not_cut(change) -> None:
    config = json.loads(TOKENIZERS["gpt2"].to_str())
    change(config)
    assert not supported(config)


def test_a_split_by_another_pattern_is_not_cut() -> None:
    config = json.loads(_train(_split(r"\s+|\w+")).to_str())
    assert not supported(config)
    cache = PrefixTokenCache(Tokenizer.from_str(json.dumps(config)), entries=8)
    assert not cache.enabled


def test_a_prompt_reuses_only_what_prompts_of_its_own_cache_salt_left() -> None:
    """Texts are remembered per salt: one salt's prompt tokenizes as fast whether or not another salt's shared it,
    so its timing tells nothing of other salts' prompts."""
    hf = TOKENIZERS["gpt2"]
    cache = PrefixTokenCache(hf, entries=8)
    secret = " ".join(CORPUS)
    cache.encode(secret, salt="alice")
    probe = secret + " guessed?"
    before = cache.tokenized_chars
    assert cache.encode(probe, salt="mallory") == hf.encode(probe, add_special_tokens=False).ids
    assert cache.tokenized_chars - before == len(probe)  # tokenized whole: nothing of alice's was reused
    before = cache.tokenized_chars
    assert cache.encode(probe) == hf.encode(probe, add_special_tokens=False).ids  # no salt is a salt of its own
    assert cache.tokenized_chars - before == len(probe)
    before = cache.tokenized_chars
    cache.encode(secret + " her next turn", salt="alice")
    assert cache.tokenized_chars - before < len(secret) / 2  # her own prompt is reused
