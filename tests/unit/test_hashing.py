"""Block hashing (docs/protocol.md §1): test vectors, input validation, chaining, namespaces."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto.hashing import (
    BASE_SEED,
    DEFAULT_BLOCK_SIZE,
    KvIdentity,
    _derive,
    _IdentityKeys,
    block_hashes,
    chain_hashes,
    local_hashes,
    seed_for,
)

TOKENS_1_40 = list(range(1, 41))


# -- docs/protocol.md §1 test vectors ----------------------------------------------------


def test_vector_block16_empty_namespace():
    assert block_hashes(TOKENS_1_40, 16, "") == [16863443419780771464, 12466389667045779788]


def test_vector_block4_empty_namespace_first_three():
    hashes = block_hashes(TOKENS_1_40, 4, "")
    assert len(hashes) == 10
    assert hashes[:3] == [14643705804678351452, 4945711292740353085, 12583592247330656132]


def test_vector_block16_tenant_a():
    assert block_hashes(TOKENS_1_40, 16, "tenant-a") == [384476474989831235, 2887310933367392331]


def test_seed_for_namespaces():
    assert seed_for("tenant-a") == 7159698576361520314
    assert seed_for("") == BASE_SEED == 1337
    assert seed_for() == 1337
    assert seed_for("tenant-a") == (1337 + xxhash.xxh3_64_intdigest(b"tenant-a", 0)) % 2**64


def test_default_block_size_is_16():
    assert DEFAULT_BLOCK_SIZE == 16
    assert block_hashes(TOKENS_1_40) == block_hashes(TOKENS_1_40, 16, "")


def _reference(tokens, block_size, namespace):
    """Protocol §1 written out independently of the implementation."""
    seed = 1337 if not namespace else (1337 + xxhash.xxh3_64_intdigest(namespace.encode(), 0)) % 2**64
    out = []
    for b in range(len(tokens) // block_size):
        blk = tokens[b * block_size : (b + 1) * block_size]
        local = xxhash.xxh3_64_intdigest(struct.pack(f"<{block_size}I", *blk), seed)
        out.append(local if not out else xxhash.xxh3_64_intdigest(struct.pack("<QQ", out[-1], local), seed))
    return out


@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=70),
    block_size=st.integers(1, 9),
    namespace=st.sampled_from(["", "tenant-a", "lora:x", "ü-ns"]),
)
def test_matches_independent_reference(tokens, block_size, namespace):
    assert block_hashes(tokens, block_size, namespace) == _reference(tokens, block_size, namespace)


def test_local_hashes_are_per_block_xxh3():
    local = local_hashes(TOKENS_1_40, 16)
    assert len(local) == 2
    assert local[0] == xxhash.xxh3_64_intdigest(struct.pack("<16I", *range(1, 17)), 1337)
    assert local[1] == xxhash.xxh3_64_intdigest(struct.pack("<16I", *range(17, 33)), 1337)
    # seq[0] == local[0]; seq[1] chains.
    seq = block_hashes(TOKENS_1_40, 16)
    assert seq[0] == local[0]
    assert seq[1] != local[1]


# -- partial blocks, empty input ----------------------------------------------------


def test_trailing_partial_block_ignored():
    full = block_hashes(list(range(1, 33)), 16)
    assert block_hashes(TOKENS_1_40, 16) == full
    assert block_hashes(list(range(1, 48)), 16) == full  # 47 tokens: 2 full blocks
    assert len(block_hashes(list(range(1, 49)), 16)) == 3
    # the partial block's contents do not matter
    assert block_hashes(list(range(1, 33)) + [999] * 15, 16) == full
    assert len(local_hashes(TOKENS_1_40, 16)) == 2


def test_fewer_tokens_than_a_block():
    assert block_hashes(list(range(15)), 16) == []
    assert local_hashes(list(range(15)), 16) == []


@pytest.mark.parametrize("empty", [[], (), np.array([], dtype=np.uint32), np.array([], dtype=np.int64), np.array([])])
def test_empty_input(empty):
    assert block_hashes(empty) == []
    assert local_hashes(empty) == []
    assert block_hashes(empty, 4, "tenant-a") == []


def test_chain_hashes_of_nothing():
    assert chain_hashes([], 1337) == []
    assert chain_hashes([], 1337, parent=123) == []


# -- input types ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.uint32, np.int64, np.uint64, np.int32, np.uint16, np.int16])
def test_numpy_and_list_inputs_agree(dtype):
    tokens = list(range(1, 41))
    arr = np.asarray(tokens, dtype=dtype)
    for bs in (4, 16):
        assert block_hashes(arr, bs) == block_hashes(tokens, bs)
        assert block_hashes(arr, bs, "tenant-a") == block_hashes(tokens, bs, "tenant-a")
        assert local_hashes(arr, bs) == local_hashes(tokens, bs)


def test_numpy_and_list_agree_at_u32_extremes():
    tokens = [0, 1, 2**31, 2**32 - 1] * 8
    expected = block_hashes(tokens, 8)
    assert len(expected) == 4
    assert block_hashes(np.asarray(tokens, dtype=np.uint32), 8) == expected
    assert block_hashes(np.asarray(tokens, dtype=np.int64), 8) == expected
    assert block_hashes(np.asarray(tokens, dtype=np.uint64), 8) == expected
    assert block_hashes(tuple(tokens), 8) == expected
    assert expected == _reference(tokens, 8, "")


def test_non_contiguous_numpy_input():
    base = np.arange(0, 160, dtype=np.int64)
    strided = base[::2]  # 80 tokens, not contiguous
    assert not strided.flags["C_CONTIGUOUS"]
    assert block_hashes(strided, 16) == block_hashes(strided.tolist(), 16)


@pytest.mark.parametrize(
    "tokens",
    [
        [-1],
        [1, 2, -1, 4],
        [2**32],
        [0, 2**32 + 5],
        [2**64 - 1],
        np.array([-1, 5], dtype=np.int64),
        np.array([2**32, 0], dtype=np.uint64),
        np.array([-5], dtype=np.int8),
    ],
)
def test_out_of_range_tokens_raise(tokens):
    with pytest.raises(ValueError):
        block_hashes(tokens, 1)
    with pytest.raises(ValueError):
        local_hashes(tokens, 1)


def test_out_of_range_token_in_partial_block_still_raises():
    # validation covers the whole input, not only the hashed part
    with pytest.raises(ValueError):
        block_hashes(list(range(16)) + [-1], 16)


@pytest.mark.parametrize(
    "tokens",
    [
        [1.5],
        [1.0, 2.0],
        np.array([1.0, 2.0]),
        ["a", "b"],
        [b"x"],
        [1, None],
        [True, False],
        [2**64],  # too large for any integer dtype: object array
    ],
)
def test_non_integer_tokens_raise(tokens):
    with pytest.raises(ValueError):
        block_hashes(tokens, 1)


def test_nested_input_raises():
    with pytest.raises(ValueError):
        block_hashes([[1, 2], [3, 4]], 2)


@pytest.mark.parametrize("bs", [0, -1])
def test_bad_block_size_raises(bs):
    with pytest.raises(ValueError):
        block_hashes(TOKENS_1_40, bs)


# -- chaining ------------------------------------------------------------------------


@pytest.mark.parametrize("namespace", ["", "tenant-a"])
@pytest.mark.parametrize("split_blocks", [1, 2, 5, 9])
def test_chain_with_parent_continues(namespace, split_blocks):
    bs = 4
    tokens = list(range(1, 41))
    seed = seed_for(namespace)
    whole = block_hashes(tokens, bs, namespace)
    cut = split_blocks * bs
    first = chain_hashes(local_hashes(tokens[:cut], bs, namespace), seed)
    rest = chain_hashes(local_hashes(tokens[cut:], bs, namespace), seed, parent=first[-1])
    assert first + rest == whole
    # without a parent, the second piece starts a fresh chain and differs
    fresh = chain_hashes(local_hashes(tokens[cut:], bs, namespace), seed)
    assert fresh != whole[split_blocks:]


@settings(max_examples=40, derandomize=True, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=2, max_size=64),
    block_size=st.integers(1, 6),
    split=st.integers(1, 64),
    namespace=st.sampled_from(["", "n1"]),
)
def test_chain_in_two_pieces_at_any_block_boundary(tokens, block_size, split, namespace):
    n_blocks = len(tokens) // block_size
    if n_blocks < 2:
        return
    k = 1 + split % (n_blocks - 1)  # 1..n_blocks-1
    seed = seed_for(namespace)
    local = local_hashes(tokens, block_size, namespace)
    head = chain_hashes(local[:k], seed)
    tail = chain_hashes(local[k:], seed, parent=head[-1])
    assert head + tail == block_hashes(tokens, block_size, namespace)


def test_chain_hashes_formula():
    seed = 99
    local = [1, 2, 3]
    out = chain_hashes(local, seed)
    assert out[0] == 1
    assert out[1] == xxhash.xxh3_64_intdigest(struct.pack("<QQ", 1, 2), seed)
    assert out[2] == xxhash.xxh3_64_intdigest(struct.pack("<QQ", out[1], 3), seed)
    # parent=0 is a real parent, not "no parent"
    with_zero = chain_hashes(local, seed, parent=0)
    assert with_zero[0] == xxhash.xxh3_64_intdigest(struct.pack("<QQ", 0, 1), seed)
    assert with_zero != out


def test_prefix_property():
    """seq[i] depends only on blocks 0..i: a shared prefix gives shared hashes, then they diverge."""
    a = list(range(64))
    b = list(range(32)) + [7] * 32
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert ha[:2] == hb[:2]
    assert ha[2] != hb[2] and ha[3] != hb[3]
    # a change in block 0 changes every later hash
    c = [1000] + a[1:]
    hc = block_hashes(c, 16)
    assert all(x != y for x, y in zip(ha, hc))


def test_same_block_at_different_positions_hashes_differently():
    tokens = [5] * 48  # three identical blocks
    local = local_hashes(tokens, 16)
    assert local[0] == local[1] == local[2]
    seq = block_hashes(tokens, 16)
    assert len(set(seq)) == 3


# -- namespaces ---------------------------------------------------------------------


def test_namespaces_never_collide():
    namespaces = ["", "tenant-a", "tenant-b", "model-x", "model-x:lora-1", "Tenant-A", " "]
    seen: dict[int, str] = {}
    for ns in namespaces:
        for h in block_hashes(TOKENS_1_40, 4, ns):
            assert h not in seen, f"hash from namespace {ns!r} collides with {seen[h]!r}"
            seen[h] = ns
        for h in local_hashes(TOKENS_1_40, 4, ns):
            # local hashes of one namespace never equal a seq hash of another either
            assert seen.get(h, ns) == ns
    assert len({seed_for(ns) for ns in namespaces}) == len(namespaces)


@settings(max_examples=40, derandomize=True, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=40),
    ns_a=st.text(max_size=8),
    ns_b=st.text(max_size=8),
)
def test_namespaces_never_collide_property(tokens, ns_a, ns_b):
    if ns_a == ns_b:
        return
    ha = block_hashes(tokens, 4, ns_a)
    hb = block_hashes(tokens, 4, ns_b)
    assert ha and not set(ha) & set(hb)


# -- the identity cache ------------------------------------------------------------------


def test_the_identity_cache_is_bounded_by_the_bytes_of_its_names_not_only_their_count():
    """Identities carry clients' names (model, cache salt): long unique ones must not pin memory past the byte bound,
    and an identity's key and seed are the same whether it was remembered, dropped or never cached."""
    cache = _IdentityKeys(max_entries=1000, max_bytes=64 << 10)
    identities = [KvIdentity("ns", model=f"{i}" + "m" * 4096, cache_salt="s" * 1024) for i in range(100)]
    for identity in identities:
        assert cache.get(identity) == _derive(identity)
        assert cache.held_bytes <= cache.max_bytes
    assert 0 < len(cache) < 20  # a dozen of these fill 64 KiB: the count bound (1000) never came into play
    assert cache.get(identities[0]) == _derive(identities[0])  # dropped long ago: derived again, alike
    huge = KvIdentity(model="m" * (128 << 10))
    assert cache.get(huge) == _derive(huge) and huge not in cache._entries  # larger than the whole bound: not kept
    assert KvIdentity(model="x").key == _derive(KvIdentity(model="x"))[0]


def test_the_identity_cache_drops_the_least_recently_used_past_its_count():
    cache = _IdentityKeys(max_entries=2)
    a, b, c = (KvIdentity(model=m) for m in "abc")
    cache.get(a)
    cache.get(b)
    cache.get(a)  # a is now the most recent
    cache.get(c)
    assert list(cache._entries) == [a, c]
