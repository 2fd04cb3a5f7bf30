"""PrefixHasher: the same hashes as docs/protocol.md §1, with a conversation's earlier turns reused."""

from __future__ import annotations

import random

import pytest

from gateway.prefix_hasher import PrefixHasher
from kvproto.hashing import block_hashes


@pytest.mark.parametrize("namespace", ["", "tenant-a"])
def test_equal_to_direct_hashing_on_growing_conversations(namespace: str) -> None:
    rng = random.Random(1)
    ph = PrefixHasher(block_size=16, namespace=namespace, stride_blocks=4, capacity=64)
    history: list[int] = []
    for _ in range(12):
        history += [rng.randrange(2**32) for _ in range(rng.randrange(1, 300))]
        assert ph.hashes(history) == block_hashes(history, 16, namespace)
    assert ph.reused_blocks > ph.hashed_blocks  # later turns hashed only their new blocks


def test_unrelated_prompts_and_eviction_stay_correct() -> None:
    rng = random.Random(2)
    ph = PrefixHasher(block_size=4, stride_blocks=2, capacity=3)
    prompts = [[rng.randrange(100) for _ in range(rng.randrange(0, 80))] for _ in range(40)]
    for p in prompts + prompts[::-1]:
        assert ph.hashes(p) == block_hashes(p, 4)
    assert len(ph._checkpoints) <= 3


def test_a_changed_token_inside_the_reused_prefix_is_not_reused() -> None:
    ph = PrefixHasher(block_size=16, stride_blocks=2)
    a = list(range(200))
    ph.hashes(a)
    b = list(a)
    b[5] = 999  # differs in the first block: nothing may be reused
    assert ph.hashes(b + [1] * 40) == block_hashes(b + [1] * 40)


def test_short_prompts_hash_as_the_reference_and_refuse_what_it_refuses() -> None:
    ph = PrefixHasher(block_size=16, namespace="t", stride_blocks=64)
    for n in (0, 15, 16, 80, 1000):
        tokens = [(i * 2654435761) % 2**32 for i in range(n)]
        assert ph.hashes(tokens) == block_hashes(tokens, 16, "t")
    with pytest.raises(ValueError):
        ph.hashes([2**32] * 32)
