"""Tokenizing a prompt by reusing the tokens of an earlier prompt it extends.

Turn N of a chat repeats turns 1..N-1 verbatim, and many prompts open with the same system prompt or
document: a gateway that tokenizes each prompt whole spends most of its per-request time on text it
tokenized a moment ago (3.4 ms for a 4,224-token prompt with a byte-level BPE tokenizer here, where
the rest of routing takes about one). `PrefixTokenCache` tokenizes a text in segments cut at *safe
cuts*, remembers recent texts' segments, and for a new text tokenizes only what follows the last cut
inside the prefix it shares with a remembered one.

A safe cut is a space with a non-space character on each side. For a tokenizer whose pre-tokenizer is
GPT-2's byte-level regex, or a Split by Llama 3's or Qwen 2's regex followed by byte-level mapping,
and whose normalizer is none or NFC, every such space starts a pre-token in the whole text and in
the text from the cut, and no pre-token before it reads past it (the patterns look ahead only after
whitespace runs, and a cut has none before it): the model tokenizes pre-tokens one at a time, so the
segments' tokens joined are the whole text's tokens. Other tokenizers are not cut (`supported`).
Cuts are found the same way from the same position whether or not a prefix was reused, so a cached
answer is the answer tokenizing from scratch gives.

Texts are remembered per cache salt (the request's `cache_salt`, "" for none), as engines keep KV per salt:
a text is reused only for a text of the same salt, so how fast a prompt tokenizes tells a client nothing of
what other salts' prompts held.

The gateway's tokens only route: the engine tokenizes the prompt itself, and a pulled block that does
not carry the engine's own hash for its position fails validation and is recomputed.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

SEGMENT_CHARS = 512  # a cut is sought this many characters after the last one
MAX_HELD_TOKENS = 2_000_000  # tokens remembered in all (~70 MB of ids), whatever the entry count: long contexts
KEY_CHARS = 256  # texts are found by their first this many characters
_CUT = re.compile(r"(?<=\S) (?=\S)")

# Llama 3's and Qwen 2's pre-tokenizer patterns, as their tokenizer.json files spell them.
_LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
KNOWN_SPLITS = frozenset({_LLAMA3, _QWEN2})


def supported(config: dict[str, Any]) -> bool:
    """Whether a tokenizer.json's pipeline tokenizes safe cuts apart (the module's docstring says which)."""
    normalizer = config.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        return False
    if any(any(c.isspace() for c in t.get("content", "")) for t in config.get("added_tokens") or ()):
        return False  # a cut could fall inside an added token's text
    pre = config.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel":
        return bool(pre.get("use_regex", True)) and not pre.get("add_prefix_space", False)
    if pre.get("type") != "Sequence":
        return False
    steps = pre.get("pretokenizers") or []
    if len(steps) != 2:
        return False
    split, byte_level = steps
    return (
        split.get("type") == "Split"
        and (split.get("pattern") or {}).get("Regex") in KNOWN_SPLITS
        and split.get("behavior") == "Isolated"
        and not split.get("invert", False)
        and byte_level.get("type") == "ByteLevel"
        and not byte_level.get("use_regex", True)
        and not byte_level.get("add_prefix_space", False)
    )


@dataclass(frozen=True, slots=True)
class _Entry:
    text: str
    cuts: list[int]  # character offsets of the cuts, increasing
    ends: list[int]  # ends[i]: tokens before cuts[i]
    ids: list[int]


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of `a` and `b` (binary search over slice comparisons: memcmp)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTokenCache:
    """A tokenizer.json's `encode`, reusing the tokens of the remembered text sharing the longest prefix with the
    text under the same salt; `entries` texts and `max_tokens` tokens at most are remembered (least recently used
    dropped), one text per salt and `KEY_CHARS` opening."""

    def __init__(self, hf: Any, entries: int, max_tokens: int = MAX_HELD_TOKENS) -> None:
        self._hf = hf  # a tokenizers.Tokenizer
        self.enabled = entries > 0 and supported(json.loads(hf.to_str()))
        self._capacity = entries
        self._max_tokens = max_tokens
        self.held_tokens = 0
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()  # (salt, opening) -> its text
        self._lock = threading.Lock()
        self.tokenized_chars = 0  # characters tokenized rather than reused, in all (what tests and benches read)

    def _tokens(self, segments: list[str]) -> list[list[int]]:
        return [e.ids for e in self._hf.encode_batch_fast(segments, add_special_tokens=False)]

    def encode(self, text: str, salt: str = "") -> list[int]:
        """`text`'s ids, reusing only what a text of the same `salt` left."""
        if not self.enabled or len(text) < 2 * SEGMENT_CHARS:
            self.tokenized_chars += len(text)
            return self._tokens([text])[0]
        key = (salt, text[:KEY_CHARS])
        with self._lock:
            old = self._entries.get(key)
        cuts: list[int] = [0]
        ends: list[int] = [0]
        ids: list[int] = []  # a list of its own: the remembered one is sliced, never extended
        if old is not None:
            shared = _common_prefix(old.text, text)
            # A cut is reused only if the characters on both its sides are shared (the rule reads them).
            j = max((i for i, c in enumerate(old.cuts) if c + 1 < shared), default=0)
            cuts, ends, ids = old.cuts[: j + 1], old.ends[: j + 1], old.ids[: old.ends[j]]
        start = cuts[-1]
        segments: list[str] = []
        pos = start
        while True:
            m = _CUT.search(text, pos + SEGMENT_CHARS)
            if m is None:
                segments.append(text[pos:])
                break
            segments.append(text[pos : m.start()])
            pos = m.start()
            cuts.append(pos)
        self.tokenized_chars += len(text) - start
        for tokens in self._tokens(segments):
            ids += tokens
            if len(ends) < len(cuts):
                ends.append(len(ids))
        with self._lock:
            replaced = self._entries.pop(key, None)
            self.held_tokens += len(ids) - (len(replaced.ids) if replaced is not None else 0)
            self._entries[key] = _Entry(text, cuts, ends, ids)
            while len(self._entries) > self._capacity or self.held_tokens > self._max_tokens:
                self.held_tokens -= len(self._entries.popitem(last=False)[1].ids)
        return ids
