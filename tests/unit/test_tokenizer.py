"""kvproto.tokenizer: a Hugging Face tokenizer.json makes the ids the `tokenizers` library's own `encode` makes.

The tokenizer is trained here (byte-level BPE, as GPT-2 and Llama 3 use), so
the test needs no download.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvproto.tokenizer import HFTokenizer, load_tokenizer

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "Prefix caching keeps the KV blocks of a shared prompt; turn 2 repeats turn 1 verbatim.",
    "naïve café façade — 東京 ☃ emoji 🙂 tabs\tand\nnewlines  double  spaces",
    "def f(x):\n    return x ** 2  # code, numbers 12345 and 3.14159",
] * 20


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def loaded(tokenizer_file: Path) -> tuple[Tokenizer, HFTokenizer]:
    """The library's tokenizer and ours, from the same file."""
    return Tokenizer.from_file(str(tokenizer_file)), HFTokenizer(tokenizer_file)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=600) | st.sampled_from(CORPUS).map(lambda t: t * 30))
def test_encode_makes_the_libraries_own_ids(loaded: tuple[Tokenizer, HFTokenizer], text: str) -> None:
    reference, ours = loaded
    assert ours.encode(text) == reference.encode(text, add_special_tokens=False).ids


def test_a_tokenizer_json_is_loaded_and_round_trips(tokenizer_file: Path) -> None:
    tok = load_tokenizer(str(tokenizer_file))
    text = CORPUS[2]
    ids = tok.encode(text)
    assert len(ids) < len(text.encode("utf-8"))  # merges applied: not one token per byte
    assert tok.decode(ids) == text
