"""Tokenizers and the chat template shared by the gateway and the engines (worker stub).

Both sides must turn the same text into the same token ids, or their block
hashes never match (the "zero overlap" failure). The default tokenizer needs
no download: UTF-8 bytes, one token per byte. A Hugging Face `tokenizer.json`
can be used instead (the engine's own tokenizer, for real engines).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, Protocol

import msgspec

from kvproto.prefix_tokens import PrefixTokenCache


class Tokenizer(Protocol):
    """Text <-> token ids. Implementations are deterministic (a cache never changes an answer) and thread-safe.

    `salt` is the request's cache salt ("" for none): a cache reuses the work of earlier texts of the same salt
    only, so its timing tells nothing across salts.
    """

    name: str

    def encode(self, text: str, salt: str = "") -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids (0..255): deterministic, dependency-free, identical everywhere."""

    name = "bytes"

    def encode(self, text: str, salt: str = "") -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (no special tokens added, as engines hash the prompt as given).

    `encode` goes through `encode_batch_fast`, which makes the same ids as
    `encode` without tracking character offsets: nobody here reads them, and
    tracking them costs time on the gateway's request path, before routing.
    With `prefix_cache_entries`, it reuses the tokens of the remembered text of
    the same salt a prompt extends (kvproto.prefix_tokens: the same ids, for the
    tokenizers it supports; the others tokenize whole).
    """

    def __init__(self, path: str | Path, prefix_cache_entries: int = 0) -> None:
        from tokenizers import Tokenizer as _HF

        self._tok = _HF.from_file(str(path))
        self.name = f"hf:{Path(path).name}"
        self.prefix_cache = PrefixTokenCache(self._tok, prefix_cache_entries)

    def encode(self, text: str, salt: str = "") -> list[int]:
        return self.prefix_cache.encode(text, salt)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


def load_tokenizer(spec: str | None, prefix_cache_entries: int = 0) -> Tokenizer:
    """`None` or "bytes" -> ByteTokenizer; otherwise a path to a tokenizer.json (see HFTokenizer for the cache)."""
    if spec in (None, "", "bytes"):
        return ByteTokenizer()
    if not Path(spec).is_file():
        raise ValueError(f"tokenizer {spec!r}: expected 'bytes' or the path of a tokenizer.json file")
    return HFTokenizer(spec, prefix_cache_entries)


def render_chat(messages: Sequence[Mapping[str, object]]) -> str:
    """The chat template of the worker stub (and the gateway's default).

    Each message becomes `<|role|>\\ncontent\\n`, and the prompt ends with
    `<|assistant|>\\n`. Turn 2 of a conversation therefore starts with the exact
    text of turn 1, so its blocks share turn 1's hashes.
    """
    parts = []
    for m in messages:
        content = m.get("content", "")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        parts.append(f"<|{m.get('role', 'user')}|>\n{content}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def max_chars_per_token(tokenizer: Tokenizer | None) -> int | None:
    """The most characters one token can stand for, where known: a longer text is provably too many tokens
    without tokenizing it (with the bytes tokenizer a character is at least one token)."""
    return 1 if isinstance(tokenizer, ByteTokenizer) else None


class _Role(msgspec.Struct):
    role: Literal["system", "user", "assistant", "tool", "developer"]


class _Messages(msgspec.Struct):
    messages: list[_Role] | None = None


def count_messages(body: bytes) -> int:
    """The chat messages in a raw JSON request body, read before validating it: only each message's role
    is parsed and the first message without one stops the count (msgspec.ValidationError), so a body of
    millions of messages costs one fast pass, not millions of validation errors. Raises msgspec's errors."""
    return len(msgspec.json.decode(body, type=_Messages).messages or ())
