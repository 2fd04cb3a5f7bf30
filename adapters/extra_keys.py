"""vLLM's per-block extra keys of a stored event (docs/protocol.md §1.1), sorted into the adapter and salt
they name and the extra-key bytes folded into our blocks' hashes (`adapters.hash_mapper` hashes with them).

vLLM carries the LoRA adapter and the cache salt inside the per-block ``extra_keys`` (vLLM 0.32's
``generate_block_hash_extra_keys``: a tuple of keys per block, msgpack arrays on the wire), where
SGLang sends ``lora_name`` and ``cache_salt`` fields:

* ``("lora", name, path)``: the adapter (it must agree with ``lora_name`` when both are sent);
* ``("cache_salt", salt)``: the salt, on the request's first block only. A child event carries no
  salt, so it inherits its parent's (each map entry keeps the salt it was hashed under): the whole
  chain is hashed under the salted identity, as the gateway hashes the salted request;
* ``("mm", identifier, offset)``: a multimodal input the block covers, starting ``offset`` tokens
  after the block's first token (negative: before). It is our extra key ``mm:IDENTIFIER:OFFSET``,
  folded into the block's local hash (``kvproto.hashing.mix_extra``), so such a block hashes
  exactly as ``identity_hashes(..., extra=multimodal_extra_keys(...))`` would;
* anything else (``("prompt_embeds", digest)``, kinds nobody here knows) is folded in as the key
  ``raw:`` + the hex of its msgpack: no gateway lookup ever names it, so the block and every later
  block of its chain are misses, never wrong hits.

Older vLLM sent the same keys untagged (the LoRA name as a string, ``(identifier, offset)`` pairs, the
salt as a string on the first block, the embeddings' digest as bytes); those are understood too: a
string equal to the event's ``lora_name`` is the adapter, another string on a root event's first
block is the salt. With an engine block size k times ours, an input's key goes to each of our k
blocks it covers; where that cannot be told from the event (an input that starts in the engine block
and does not visibly continue into the next one: its length is not sent), the later blocks get a key
no lookup names (a miss).
"""

from __future__ import annotations

from typing import Any

import msgspec

from adapters.engine_events import Stored
from kvproto.hashing import extra_key_bytes


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def raw_key(key: Any) -> str:
    """The extra key of an engine key nothing here can map: no lookup ever names it, so its block is a miss."""
    try:
        return "raw:" + msgspec.msgpack.encode(key).hex()
    except (TypeError, ValueError, OverflowError):
        return "raw:" + repr(key).encode("utf-8", "backslashreplace").hex()


class ExtraKeys:
    """One event's vLLM extra keys, sorted out (see the module docstring): the adapter and salt they name,
    and per block of ours the keys to fold in (`mm:ID:OFFSET`, then raw keys)."""

    def __init__(self, ev: Stored, k: int, block_size: int) -> None:
        self.k, self.block_size, self.engine_block = k, block_size, ev.block_size
        self.lora = ""
        self.salt = ""
        self.raw_count = 0
        assert ev.extra_keys is not None
        n = len(ev.engine_hashes)
        self._mm: list[list[tuple[int, str]]] = [[] for _ in range(n)]
        self._raw: list[list[str]] = [[] for _ in range(n)]
        for i, block in enumerate(ev.extra_keys):
            if block is None:
                continue
            for key in block if isinstance(block, tuple) else (block,):
                self._sort(i, key, ev)

    def _sort(self, i: int, key: Any, ev: Stored) -> None:
        if isinstance(key, tuple) and key:
            kind = key[0]
            if kind == "lora" and len(key) == 3 and isinstance(key[1], str) and key[1]:
                self._named("lora", key[1], i, key)
            elif kind == "cache_salt" and len(key) == 2 and isinstance(key[1], str) and key[1]:
                self._named("cache_salt", key[1], i, key)
            elif kind == "mm" and len(key) == 3 and isinstance(key[1], str) and key[1] and _is_int(key[2]):
                self._input(i, key[1], key[2], key)
            elif len(key) == 2 and isinstance(kind, str) and kind and _is_int(key[1]):  # older vLLM: (identifier, offset)
                self._input(i, kind, key[1], key)
            else:
                self.unmappable(i, key)
        elif isinstance(key, str) and key and key == ev.lora_name:  # older vLLM: the LoRA name
            self._named("lora", key, i, key)
        elif isinstance(key, str) and key and i == 0 and ev.parent is None:  # older vLLM: the salt, first block only
            self._named("cache_salt", key, i, key)
        else:
            self.unmappable(i, key)

    def _named(self, what: str, name: str, i: int, key: Any) -> None:
        have = self.lora if what == "lora" else self.salt
        if have and have != name:
            self.unmappable(i, key)  # two adapters or salts in one event: nothing matches it
        elif what == "lora":
            self.lora = name
        else:
            self.salt = name

    def _input(self, i: int, ident: str, offset: int, key: Any) -> None:
        if offset >= self.engine_block:
            self.unmappable(i, key)  # an input after the block is not in it: vLLM never sends this
        else:
            self._mm[i].append((offset, ident))

    def unmappable(self, i: int, key: Any) -> None:
        self.raw_count += 1
        self._raw[i].append(raw_key(key))

    def blocks(self) -> dict[int, bytes] | None:
        """Block index (ours, within the event) -> its extra-key bytes, for the blocks that have some: the
        `mm:ID:OFFSET` keys in the order of their inputs' offsets (as `multimodal_extra_keys` gives them),
        then the raw ones."""
        k, bs, eb = self.k, self.block_size, self.engine_block
        out: dict[int, bytes] = {}
        for i, (mm, raw) in enumerate(zip(self._mm, self._raw)):
            if not mm and not raw:
                continue
            named: list[list[str]] = [[] for _ in range(k)]
            unnamed: list[list[str]] = [[] for _ in range(k)]
            unnamed[0].extend(raw)  # the rest of the engine block chains from its first block of ours
            for offset, ident in sorted(mm):
                first = max(0, offset // bs)  # the block of ours the input starts in (0: it started before)
                # Covered further on? Only known when the next engine block of this event still has it.
                goes_on = i + 1 < len(self._mm) and (offset - eb, ident) in self._mm[i + 1]
                for j in range(first, k):
                    rel = offset - j * bs
                    if j == first or goes_on:
                        named[j].append(f"mm:{ident}:{rel}")
                    else:
                        unnamed[j].append(raw_key(("mm-extent", ident, rel)))  # its length is not sent: a miss
            for j in range(k):
                if named[j] or unnamed[j]:
                    out[i * k + j] = extra_key_bytes(named[j] + unnamed[j])
        return out or None
