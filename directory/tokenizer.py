"""Tokenizers and the chat template shared by the gateway and the engines (worker stub).

Both sides must turn the same text into the same token ids, or their block
hashes never match (the "zero overlap" failure). The default tokenizer needs
no download: UTF-8 bytes, one token per byte. A Hugging Face `tokenizer.json`
can be used instead (the engine's own tokenizer, for real engines).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    """Text <-> token ids. Implementations are stateless and thread-safe."""

    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids (0..255): deterministic, dependency-free, identical everywhere."""

    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (no special tokens added, as engines hash the prompt as given)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _HF

        self._tok = _HF.from_file(str(path))
        self.name = f"hf:{Path(path).name}"

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


def load_tokenizer(spec: str | None) -> Tokenizer:
    """`None` or "bytes" -> ByteTokenizer; otherwise a path to a tokenizer.json."""
    if spec in (None, "", "bytes"):
        return ByteTokenizer()
    if not Path(spec).is_file():
        raise ValueError(f"tokenizer {spec!r}: expected 'bytes' or the path of a tokenizer.json file")
    return HFTokenizer(spec)


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
