"""Block hashing: docs/protocol.md §1 (chained XXH3-64 over full token blocks).

Compatible with the scheme of NVIDIA Dynamo's KV router and Mooncake's
Conductor, so their events and ours name the same blocks. The token-to-bytes
step is vectorised with numpy; the XXH3 calls themselves run over zero-copy
memoryview slices of one buffer, so a 100k-token prompt hashes in a few ms.
"""

from __future__ import annotations

import json
import struct
import sys
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

DEFAULT_BLOCK_SIZE = 16
BASE_SEED = 1337
U64_MAX = 2**64 - 1
U32_MAX = 2**32 - 1

_xxh3 = xxhash.xxh3_64_intdigest
_pair = struct.Struct("<QQ")
_u64 = struct.Struct("<Q")


def seed_for(namespace: str = "") -> int:
    """The XXH3 seed of a namespace: 1337 for "", else 1337 + XXH3(namespace) mod 2**64."""
    if not namespace:
        return BASE_SEED
    return (BASE_SEED + _xxh3(namespace.encode("utf-8"), 0)) & U64_MAX


@dataclass(frozen=True, slots=True)
class KvIdentity:
    """What makes two blocks' KV interchangeable besides their tokens (docs/protocol.md §1.1).

    Equal tokens computed under another model, LoRA adapter or cache salt are other KV: a hit or a pull
    across them would run a request on the wrong KV, silently. So the identity seeds the whole chain, and
    equal tokens under two identities never share a hash. `model` is the base model's name as the engine
    serves it, `adapter` the LoRA adapter's name ("" for the base model), `cache_salt` the request's
    (vLLM's and SGLang's `cache_salt`; "" for none), `namespace` the deployment's own separator.
    """

    namespace: str = ""
    model: str = ""
    adapter: str = ""
    cache_salt: str = ""

    @property
    def key(self) -> str:
        """The string the seed is derived from: the namespace alone when nothing else is set (the hashes of
        before identities), else the compact JSON array [namespace, model, adapter, cache_salt]: one string per
        identity, whatever characters the names hold. A namespace that starts with "[" always takes the array
        form, so that no namespace spells another identity's key."""
        return _identity_key(self)[0]

    @property
    def seed(self) -> int:
        return _identity_key(self)[1]


IDENTITY_CACHE_ENTRIES = 4096
IDENTITY_CACHE_BYTES = 8 << 20
"""Identities whose key and seed are remembered: at most this many, holding at most this many bytes of strings."""


class _IdentityKeys:
    """Identity -> (key, seed), the least recently used dropped past `max_entries` or `max_bytes`.

    Bounded by bytes as well as by count: the names in an identity come from clients (a request's model and
    cache salt), so a count alone would let a few thousand long names pin any amount of memory. Thread-safe.
    """

    def __init__(self, max_entries: int = IDENTITY_CACHE_ENTRIES, max_bytes: int = IDENTITY_CACHE_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.held_bytes = 0
        self._entries: OrderedDict[KvIdentity, tuple[str, int, int]] = OrderedDict()  # -> key, seed, bytes held
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, identity: KvIdentity) -> tuple[str, int]:
        with self._lock:
            hit = self._entries.get(identity)
            if hit is not None:
                self._entries.move_to_end(identity)
                return hit[0], hit[1]
        key, seed = _derive(identity)
        i = identity
        size = sum(sys.getsizeof(x) for x in (key, i.namespace, i.model, i.adapter, i.cache_salt))
        if size > self.max_bytes:
            return key, seed
        with self._lock:
            old = self._entries.pop(identity, None)
            self.held_bytes += size - (old[2] if old is not None else 0)
            self._entries[identity] = (key, seed, size)
            while len(self._entries) > self.max_entries or self.held_bytes > self.max_bytes:
                self.held_bytes -= self._entries.popitem(last=False)[1][2]
        return key, seed


def _derive(i: KvIdentity) -> tuple[str, int]:
    """An identity's key and seed (a JSON dump and an XXH3)."""
    if not (i.model or i.adapter or i.cache_salt or i.namespace.startswith("[")):
        return i.namespace, seed_for(i.namespace)
    key = json.dumps([i.namespace, i.model, i.adapter, i.cache_salt], ensure_ascii=False, separators=(",", ":"))
    return key, seed_for(key)


_identity_keys = _IdentityKeys()


def _identity_key(identity: KvIdentity) -> tuple[str, int]:
    """An identity's key and seed, computed once per identity seen lately (`_IdentityKeys`)."""
    return _identity_keys.get(identity)


def mix_extra(local: int, extra: bytes, seed: int) -> int:
    """A block's local hash with its extra keys folded in (multimodal inputs: docs/protocol.md §1.1).

    vLLM puts the hashes of the multimodal inputs a block covers into that block's hash; the chain then
    carries them into every later block. `extra` is their canonical bytes (`extra_key_bytes`).
    """
    return _xxh3(_u64.pack(local) + extra, seed)


def extra_key_bytes(keys: Sequence[str]) -> bytes:
    """The canonical bytes of one block's extra keys: each key's UTF-8, each followed by a NUL."""
    return b"".join(k.encode("utf-8") + b"\0" for k in keys)


def multimodal_extra_keys(block_size: int, n_blocks: int, inputs: Sequence[tuple[int, int, str]]) -> dict[int, bytes]:
    """Per block, the extra-key bytes of the multimodal inputs whose placeholder tokens it covers.

    `inputs` are (offset, length, content hash) of each input's placeholder run in the prompt, as vLLM's
    `mm_features` give them. As in vLLM, a block's key for an input is its hash and where the input starts
    relative to the block (`mm:HASH:OFFSET`), so the same input at another place is another block. Blocks
    that cover none are absent.
    """
    keys: dict[int, list[str]] = {}
    for offset, length, ident in sorted(inputs):
        if length <= 0:
            continue
        for b in range(offset // block_size, min(n_blocks, -(-(offset + length) // block_size))):
            keys.setdefault(b, []).append(f"mm:{ident}:{offset - b * block_size}")
    return {b: extra_key_bytes(k) for b, k in keys.items()}


def _token_bytes(tokens: Sequence[int] | np.ndarray, block_size: int) -> tuple[memoryview, int]:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError("tokens must be a flat sequence of integers")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError("tokens must be integers")
    if arr.size and arr.dtype != np.uint32:
        if int(arr.min()) < 0 or int(arr.max()) > U32_MAX:
            raise ValueError("tokens must be unsigned 32-bit integers (0..2**32-1)")
    n_blocks = arr.size // block_size
    le = np.ascontiguousarray(arr[: n_blocks * block_size], dtype="<u4")
    return memoryview(le.tobytes()), n_blocks


def local_hashes(
    tokens: Sequence[int] | np.ndarray,
    block_size: int = DEFAULT_BLOCK_SIZE,
    namespace: str = "",
) -> list[int]:
    """XXH3 of each full block's little-endian u32 tokens; a trailing partial block is ignored."""
    buf, n_blocks = _token_bytes(tokens, block_size)
    seed = seed_for(namespace)
    step = 4 * block_size
    return [_xxh3(buf[i * step : (i + 1) * step], seed) for i in range(n_blocks)]


def chain_next(prev: int | None, local: int, seed: int) -> int:
    """One step of the chain (docs/protocol.md §1): seq[0] = local[0], seq[i] = XXH3(le64(seq[i-1]) || le64(local[i]))."""
    return local if prev is None else _xxh3(_pair.pack(prev, local), seed)


def chain_hashes(local: Sequence[int], seed: int, parent: int | None = None) -> list[int]:
    """Sequence hashes from local hashes (`chain_next` over them).

    `parent` continues a chain whose last sequence hash is known (incremental hashing).
    """
    out: list[int] = []
    prev = parent
    pack = _pair.pack
    for h in local:
        prev = h if prev is None else _xxh3(pack(prev, h), seed)  # chain_next, inlined: this loop is the hot path
        out.append(prev)
    return out


def block_hashes(
    tokens: Sequence[int] | np.ndarray,
    block_size: int = DEFAULT_BLOCK_SIZE,
    namespace: str = "",
) -> list[int]:
    """The directory keys (sequence hashes) of every full block of `tokens`."""
    return chain_hashes(local_hashes(tokens, block_size, namespace), seed_for(namespace))


def identity_hashes(
    tokens: Sequence[int] | np.ndarray,
    identity: KvIdentity,
    block_size: int = DEFAULT_BLOCK_SIZE,
    extra: Mapping[int, bytes] | None = None,
    parent: int | None = None,
    first_block: int = 0,
) -> list[int]:
    """The sequence hashes of `tokens`' full blocks under `identity`, with `extra` (block index -> extra-key
    bytes) folded into the blocks that have some. `parent` and `first_block` continue a chain: `tokens` then
    start at block `first_block` of the prompt, whose previous sequence hash is `parent`."""
    key = identity.key
    seed = seed_for(key)
    local = local_hashes(tokens, block_size, key)
    if extra:
        local = [mix_extra(h, extra[first_block + i], seed) if first_block + i in extra else h for i, h in enumerate(local)]
    return chain_hashes(local, seed, parent)
