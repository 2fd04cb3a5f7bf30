"""Prompt hashing for the gateway, incremental across a conversation's turns.

Turn N of a chat repeats turns 1..N-1 verbatim, so re-hashing the whole
history on every turn wastes most of the work on long contexts. One pass of
streaming XXH3 over the token bytes yields a digest of every prefix that ends
on a checkpoint (every `stride` blocks); an LRU maps those digests to the
sequence hash at that point. A new prompt resumes the chain from its longest
checkpoint seen before and hashes only the blocks after it. Each prompt is hashed
under its KV identity (docs/protocol.md §1.1); the prefix digests are seeded by it
too, so checkpoints of two identities never meet.
"""

from __future__ import annotations

import array
import sys
from collections import OrderedDict

import numpy as np
import xxhash

from kvproto.hashing import KvIdentity, chain_hashes, local_hashes, seed_for

_xxh3 = xxhash.xxh3_64_intdigest
_PACKS_U32 = array.array("I").itemsize == 4 and sys.byteorder == "little"  # `array` can pack the protocol's tokens


class PrefixHasher:
    """Sequence hashes (docs/protocol.md §1) of token lists, reusing recently hashed prefixes. Not thread-safe."""

    def __init__(self, block_size: int = 16, namespace: str = "", stride_blocks: int = 64, capacity: int = 4096) -> None:
        self.block_size = block_size
        self.namespace = namespace
        self.seed = seed_for(namespace)
        self.stride = stride_blocks
        self.capacity = capacity
        # prefix digest -> seq hashes up to it (views of one array per prompt, so memory is
        # about 8 bytes per block of each retained prompt)
        self._checkpoints: OrderedDict[int, np.ndarray] = OrderedDict()
        self.reused_blocks = 0
        self.hashed_blocks = 0

    def hashes(self, tokens: list[int], identity: KvIdentity | None = None) -> list[int]:
        """The sequence hashes of `tokens` under `identity` (None: the hasher's namespace alone)."""
        key = self.namespace if identity is None else identity.key
        seed = self.seed if identity is None else identity.seed
        n_blocks = len(tokens) // self.block_size
        if n_blocks < self.stride:
            self.hashed_blocks += n_blocks
            return chain_hashes(self._local_hashes(tokens, n_blocks, key, seed), seed)
        arr = np.asarray(tokens[: n_blocks * self.block_size], dtype="<u4")
        data = memoryview(arr).cast("B")  # type: ignore[arg-type]  # numpy stubs give ndarray __buffer__ only for Python >= 3.12
        step = self.stride * self.block_size * 4
        running = xxhash.xxh3_64(seed=seed)
        digests = []
        for start in range(0, (n_blocks // self.stride) * step, step):
            running.update(data[start : start + step])
            digests.append(running.intdigest())
        done: list[int] = []
        for i in range(len(digests) - 1, -1, -1):
            hit = self._checkpoints.get(digests[i])
            if hit is not None:
                self._checkpoints.move_to_end(digests[i])
                done = hit.tolist()
                break
        start_block = len(done)
        rest = local_hashes(arr[start_block * self.block_size :], self.block_size, key)
        out = done + chain_hashes(rest, seed, parent=done[-1] if done else None)
        self.reused_blocks += start_block
        self.hashed_blocks += n_blocks - start_block
        kept = np.asarray(out, dtype=np.uint64)
        for i, d in enumerate(digests):
            if (i + 1) * self.stride > start_block:
                self._checkpoints[d] = kept[: (i + 1) * self.stride]
        while len(self._checkpoints) > self.capacity:
            self._checkpoints.popitem(last=False)
        return out

    def _local_hashes(self, tokens: list[int], n_blocks: int, key: str, seed: int) -> list[int]:
        """`kvproto.hashing.local_hashes` of a short prompt, packed by `array` rather than numpy: numpy's
        fixed cost per call is most of the work for the few blocks of a typical prompt."""
        try:
            packed = array.array("I", tokens[: n_blocks * self.block_size]) if _PACKS_U32 else None
        except (OverflowError, TypeError):  # not all u32: the reference raises its ValueError
            packed = None
        if packed is None:
            return local_hashes(tokens, self.block_size, key)
        data = memoryview(packed).cast("B")
        step = 4 * self.block_size
        return [_xxh3(data[i : i + step], seed) for i in range(0, n_blocks * step, step)]
