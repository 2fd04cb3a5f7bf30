"""KV identities (docs/protocol.md §1.1): the model, LoRA adapter and cache salt seed the whole chain, and
multimodal inputs' extra keys are folded into the blocks that cover them. Test vectors and properties, each
checked against a reference written out here from struct, xxhash and json alone."""

from __future__ import annotations

import json
import random
import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.prefix_hasher import PrefixHasher
from kvproto.hashing import (
    KvIdentity,
    block_hashes,
    extra_key_bytes,
    identity_hashes,
    mix_extra,
    multimodal_extra_keys,
    seed_for,
)

TOKENS_1_40 = list(range(1, 41))
U64 = 2**64


# -- an independent reference ------------------------------------------------------------------


def ref_key(namespace: str, model: str, adapter: str, cache_salt: str) -> str:
    if not (model or adapter or cache_salt):
        return namespace
    return json.dumps([namespace, model, adapter, cache_salt], ensure_ascii=False, separators=(",", ":"))


def ref_seed(key: str) -> int:
    return 1337 if not key else (1337 + xxhash.xxh3_64_intdigest(key.encode("utf-8"), 0)) % U64


def ref_extra_bytes(keys: list[str]) -> bytes:
    return b"".join(k.encode("utf-8") + b"\x00" for k in keys)


def ref_hashes(
    tokens: list[int],
    block_size: int,
    namespace: str = "",
    model: str = "",
    adapter: str = "",
    cache_salt: str = "",
    extra: dict[int, bytes] | None = None,
) -> list[int]:
    """§1 and §1.1 for a whole prompt: seed from the identity's key, each block's local hash (with its extra
    keys: XXH3(le_u64(local) || extra)), then the chain."""
    seed = ref_seed(ref_key(namespace, model, adapter, cache_salt))
    out: list[int] = []
    for b in range(len(tokens) // block_size):
        block = tokens[b * block_size : (b + 1) * block_size]
        local = xxhash.xxh3_64_intdigest(struct.pack(f"<{block_size}I", *block), seed)
        if extra is not None and b in extra:
            local = xxhash.xxh3_64_intdigest(struct.pack("<Q", local) + extra[b], seed)
        out.append(local if not out else xxhash.xxh3_64_intdigest(struct.pack("<QQ", out[-1], local), seed))
    return out


def ref_mm_keys(block_size: int, n_blocks: int, inputs: list[tuple[int, int, str]]) -> dict[int, bytes]:
    """Per block, `mm:ID:START` of each input whose placeholder tokens [offset, offset + length) it covers
    (START: where the input starts relative to the block's first token), in the order of the sorted inputs;
    the blocks found token by token rather than by arithmetic."""
    out: dict[int, list[str]] = {}
    for offset, length, ident in sorted(inputs):
        covered = sorted({t // block_size for t in range(offset, offset + length)} & set(range(n_blocks)))
        for b in covered:
            out.setdefault(b, []).append(f"mm:{ident}:{offset - b * block_size}")
    return {b: ref_extra_bytes(ids) for b, ids in out.items()}


# -- docs/protocol.md §1.1 test vectors ---------------------------------------------------------

# (namespace, model, adapter, cache_salt) -> (key, seed, seq) of tokens 1..40, B = 16
VECTORS = [
    (("", "m", "", ""), '["","m","",""]', 2584506696513934537, [17575364930229200160, 14926259037993209659]),
    (("", "m", "a", ""), '["","m","a",""]', 12207021075719783693, [4273418628168339338, 2566009361833922152]),
    (("", "m", "", "s"), '["","m","","s"]', 1470560804857453351, [7188572031181744010, 3684692769510705727]),
    (
        ("tenant-a", "m", "", ""),
        '["tenant-a","m","",""]',
        6676579023108269440,
        [8181439120791806163, 363984382797531095],
    ),
]


@pytest.mark.parametrize(("parts", "key", "seed", "seq"), VECTORS, ids=[v[1] for v in VECTORS])
def test_identity_vectors(parts: tuple[str, str, str, str], key: str, seed: int, seq: list[int]) -> None:
    identity = KvIdentity(*parts)
    assert ref_key(*parts) == key == identity.key
    assert ref_seed(key) == seed == identity.seed == seed_for(key)
    expected = ref_hashes(TOKENS_1_40, 16, *parts)
    got = identity_hashes(TOKENS_1_40, identity, 16)
    print(f"tokens 1..40, B 16, {key}: seed {seed}, seq {got}")
    assert expected == seq == got
    # None of them is the plain §1 vector, nor another identity's.
    assert got[0] not in (16863443419780771464, 384476474989831235)
    assert sum(v[3][0] == got[0] for v in VECTORS) == 1


def test_multimodal_vector() -> None:
    """An image whose placeholders are tokens 10..19 (offset 10, length 10) covers blocks 0 and 1."""
    identity = KvIdentity(model="m")
    extra = multimodal_extra_keys(16, 2, [(10, 10, "img-1")])
    assert extra == {0: b"mm:img-1:10\x00", 1: b"mm:img-1:-6\x00"}
    got = identity_hashes(TOKENS_1_40, identity, 16, extra)
    print(f"tokens 1..40, B 16, model m, image img-1 at 10+10: seq {got}")
    assert got == ref_hashes(TOKENS_1_40, 16, model="m", extra={0: b"mm:img-1:10\x00", 1: b"mm:img-1:-6\x00"})
    assert got == [9556735729466240224, 8227786132236180889]
    assert got[0] != VECTORS[0][3][0] and got[1] != VECTORS[0][3][1]


def test_the_same_input_elsewhere_is_another_block() -> None:
    """An input's key says where it starts in the block: moved by one token, every covered block changes."""
    tokens = list(range(100, 164))
    here = multimodal_extra_keys(16, 4, [(10, 10, "img-1")])
    there = multimodal_extra_keys(16, 4, [(11, 10, "img-1")])
    assert set(here) == set(there) == {0, 1} and all(here[b] != there[b] for b in here)
    a, b = identity_hashes(tokens, ID_A, 16, here), identity_hashes(tokens, ID_A, 16, there)
    assert all(x != y for x, y in zip(a, b))
    # Another input with the same placement: other keys too.
    other = identity_hashes(tokens, ID_A, 16, multimodal_extra_keys(16, 4, [(10, 10, "img-2")]))
    assert all(x != y for x, y in zip(a, other))


def test_the_key_is_compact_json_with_unicode_kept() -> None:
    assert KvIdentity("ns", "Qwen/Qwen3-8B", "ü-lora", 'salt "x"').key == '["ns","Qwen/Qwen3-8B","ü-lora","salt \\"x\\""]'
    assert KvIdentity().key == "" and KvIdentity("tenant-a").key == "tenant-a"
    assert KvIdentity(adapter="a").key == '["","","a",""]'
    assert KvIdentity(cache_salt="s").key == '["","","","s"]'


def test_fields_cannot_be_confused_by_separators() -> None:
    """Names with the characters a naive join would use still give distinct keys."""
    a = KvIdentity(model="m", adapter="a,b")
    b = KvIdentity(model="m,a", adapter="b")
    c = KvIdentity(model='m","a', adapter="")
    assert len({a.key, b.key, c.key}) == 3
    assert len({identity_hashes(TOKENS_1_40, i, 16)[0] for i in (a, b, c)}) == 3


def test_mix_extra_and_extra_key_bytes() -> None:
    assert extra_key_bytes([]) == b""
    assert extra_key_bytes(["a", "ü"]) == b"a\x00\xc3\xbc\x00"
    assert extra_key_bytes(["ab"]) != extra_key_bytes(["a", "b"])
    assert mix_extra(5, b"x\x00", 1337) == xxhash.xxh3_64_intdigest(struct.pack("<Q", 5) + b"x\x00", 1337)
    assert mix_extra(2**64 - 1, b"", 7) == xxhash.xxh3_64_intdigest(b"\xff" * 8, 7)


# -- properties -----------------------------------------------------------------------------------

NAMES = ["", "m", "m2", "Qwen/Qwen3-8B", "ü", '"', ","]
names = st.sampled_from(NAMES)
identities = st.builds(KvIdentity, st.sampled_from(["", "tenant-a", "ns"]), names, names, names)
u32 = st.integers(0, 2**32 - 1)
FIELDS = ["model", "adapter", "cache_salt"]


def _replace(identity: KvIdentity, field: str, value: str) -> KvIdentity:
    parts = {"namespace": identity.namespace, "model": identity.model, "adapter": identity.adapter}
    parts["cache_salt"] = identity.cache_salt
    parts[field] = value
    return KvIdentity(**parts)


@settings(max_examples=80, derandomize=True, deadline=None)
@given(
    block_size=st.integers(1, 8),
    data=st.data(),
    identity=identities,
    field=st.sampled_from(FIELDS),
    other=names,
)
def test_changing_model_adapter_or_salt_changes_every_hash(
    block_size: int, data: st.DataObject, identity: KvIdentity, field: str, other: str
) -> None:
    tokens = data.draw(st.lists(u32, min_size=block_size, max_size=6 * block_size + block_size - 1), "tokens")
    changed = _replace(identity, field, other)
    a, b = identity_hashes(tokens, identity, block_size), identity_hashes(tokens, changed, block_size)
    parts = (identity.namespace, identity.model, identity.adapter, identity.cache_salt)
    assert a == ref_hashes(tokens, block_size, *parts)
    assert len(a) == len(b) == len(tokens) // block_size >= 1
    if changed == identity:
        assert a == b
    else:
        assert all(x != y for x, y in zip(a, b)), (identity, changed)


@settings(max_examples=60, derandomize=True, deadline=None)
@given(data=st.data(), identity=identities, block_size=st.integers(1, 8), key=st.sampled_from(["img-1", "img-2", "ü"]))
def test_an_extra_key_changes_its_block_and_every_later_one_only(
    data: st.DataObject, identity: KvIdentity, block_size: int, key: str
) -> None:
    tokens = data.draw(st.lists(u32, min_size=block_size, max_size=6 * block_size), "tokens")
    n = len(tokens) // block_size
    k = data.draw(st.integers(0, n - 1), "k")
    parts = (identity.namespace, identity.model, identity.adapter, identity.cache_salt)
    plain = identity_hashes(tokens, identity, block_size)
    with_key = identity_hashes(tokens, identity, block_size, {k: extra_key_bytes([key])})
    assert with_key == ref_hashes(tokens, block_size, *parts, extra={k: ref_extra_bytes([key])})
    assert with_key[:k] == plain[:k]
    assert all(x != y for x, y in zip(with_key[k:], plain[k:]))
    # Another key on the same block: again every hash from k on differs, none before.
    other = identity_hashes(tokens, identity, block_size, {k: extra_key_bytes([key + "'"])})
    assert other[:k] == plain[:k]
    assert all(x != y for x, y in zip(with_key[k:], other[k:]))
    # Extra keys beyond the last full block change nothing.
    assert identity_hashes(tokens, identity, block_size, {n: b"x\x00", n + 5: b"y\x00"}) == plain


@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    tokens=st.lists(u32, max_size=60),
    block_size=st.integers(1, 9),
    namespace=st.sampled_from(["", "tenant-a", "lora:x", "ü-ns", 'x["","m","",""]']),
)
def test_the_empty_identity_is_the_plain_namespace_hash(tokens: list[int], block_size: int, namespace: str) -> None:
    expected = block_hashes(tokens, block_size, namespace)
    assert identity_hashes(tokens, KvIdentity(namespace), block_size) == expected
    assert identity_hashes(tokens, KvIdentity(namespace), block_size, {}) == expected
    assert expected == ref_hashes(tokens, block_size, namespace)


@pytest.mark.parametrize("namespace", ['["","m","",""]', '["tenant-a","m","",""]', "["])
def test_no_namespace_spells_another_identitys_key(namespace: str) -> None:
    """A namespace that starts with "[" takes the array form, so it never equals an identity's JSON key."""
    ident = KvIdentity(namespace)
    assert ident.key == json.dumps([namespace, "", "", ""], ensure_ascii=False, separators=(",", ":"))
    assert ident.key not in (KvIdentity(model="m").key, KvIdentity("tenant-a", model="m").key)
    tokens = list(range(1, 41))
    assert not set(identity_hashes(tokens, ident)) & set(identity_hashes(tokens, KvIdentity(model="m")))


extras = st.dictionaries(st.integers(0, 7), st.lists(st.sampled_from(["a", "b", "ü"]), min_size=1, max_size=2), max_size=4)


@settings(max_examples=80, derandomize=True, deadline=None)
@given(data=st.data(), identity=identities, block_size=st.integers(1, 6), extra_ids=extras)
def test_a_chain_split_at_a_block_boundary_continues(
    data: st.DataObject, identity: KvIdentity, block_size: int, extra_ids: dict[int, list[str]]
) -> None:
    n = data.draw(st.integers(0, 8), "n_blocks")
    size = n * block_size + data.draw(st.integers(0, block_size - 1), "partial")
    tokens = data.draw(st.lists(u32, min_size=size, max_size=size), "tokens")
    split = data.draw(st.integers(0, n), "split")
    extra = {b: extra_key_bytes(ids) for b, ids in extra_ids.items()}
    whole = identity_hashes(tokens, identity, block_size, extra)
    parts = (identity.namespace, identity.model, identity.adapter, identity.cache_salt)
    assert whole == ref_hashes(tokens, block_size, *parts, extra={b: ref_extra_bytes(i) for b, i in extra_ids.items()})
    head = identity_hashes(tokens[: split * block_size], identity, block_size, extra)
    tail = identity_hashes(
        tokens[split * block_size :],
        identity,
        block_size,
        extra,
        parent=head[-1] if head else None,
        first_block=split,
    )
    assert head + tail == whole
    assert len(head) == split


def test_a_continued_chain_takes_the_extra_keys_of_its_own_blocks() -> None:
    """`extra` is indexed by the block's place in the whole prompt, not in the continued part."""
    tokens = list(range(1, 16 * 6 + 1))
    extra = {4: extra_key_bytes(["mm:img-1:0"])}
    whole = identity_hashes(tokens, ID_A, 16, extra)
    tail = identity_hashes(tokens[32:], ID_A, 16, extra, parent=whole[1], first_block=2)
    assert tail == whole[2:]
    assert whole[:4] == identity_hashes(tokens, ID_A, 16)[:4] and whole[4] != identity_hashes(tokens, ID_A, 16)[4]


# -- multimodal_extra_keys ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("block_size", "n_blocks", "inputs", "expected"),
    [
        (16, 4, [], {}),
        (16, 4, [(0, 16, "a")], {0: b"mm:a:0\x00"}),  # exactly block 0
        (16, 4, [(15, 2, "a")], {0: b"mm:a:15\x00", 1: b"mm:a:-1\x00"}),  # straddles 0|1
        (16, 4, [(16, 1, "a")], {1: b"mm:a:0\x00"}),  # starts on a boundary
        (16, 4, [(10, 40, "a")], {0: b"mm:a:10\x00", 1: b"mm:a:-6\x00", 2: b"mm:a:-22\x00", 3: b"mm:a:-38\x00"}),
        (16, 4, [(5, 0, "a"), (20, -3, "b")], {}),  # zero and negative lengths cover nothing
        (16, 2, [(30, 10, "a")], {1: b"mm:a:14\x00"}),  # runs past the last full block: cut there
        (16, 2, [(32, 5, "a"), (100, 5, "b")], {}),  # wholly beyond n_blocks
        (16, 4, [(20, 5, "b"), (2, 20, "a")], {0: b"mm:a:2\x00", 1: b"mm:a:-14\x00mm:b:4\x00"}),  # sorted by offset
        (4, 3, [(1, 1, "x"), (2, 1, "y")], {0: b"mm:x:1\x00mm:y:2\x00"}),  # two inputs in one block
        (4, 0, [(0, 4, "x")], {}),
        (4, 3, [(2, 4, "ü")], {0: "mm:ü:2\x00".encode(), 1: "mm:ü:-2\x00".encode()}),
    ],
)
def test_multimodal_extra_keys_cases(
    block_size: int, n_blocks: int, inputs: list[tuple[int, int, str]], expected: dict[int, bytes]
) -> None:
    assert multimodal_extra_keys(block_size, n_blocks, inputs) == expected
    assert ref_mm_keys(block_size, n_blocks, inputs) == expected


@settings(max_examples=100, derandomize=True, deadline=None)
@given(
    block_size=st.integers(1, 8),
    n_blocks=st.integers(0, 8),
    inputs=st.lists(st.tuples(st.integers(0, 80), st.integers(0, 30), st.sampled_from(["img-1", "img-2", "aud"])), max_size=5),
)
def test_multimodal_extra_keys_match_the_token_by_token_reference(
    block_size: int, n_blocks: int, inputs: list[tuple[int, int, str]]
) -> None:
    got = multimodal_extra_keys(block_size, n_blocks, inputs)
    assert got == ref_mm_keys(block_size, n_blocks, inputs)
    assert all(0 <= b < n_blocks and v for b, v in got.items())


# -- the gateway's PrefixHasher -------------------------------------------------------------------

ID_A = KvIdentity(model="m")
ID_B = KvIdentity(model="m", adapter="a")


def _ref(tokens: list[int], identity: KvIdentity | None, namespace: str = "") -> list[int]:
    if identity is None:
        return ref_hashes(tokens, 16, namespace)
    return ref_hashes(tokens, 16, identity.namespace, identity.model, identity.adapter, identity.cache_salt)


@pytest.mark.parametrize("n_tokens", [0, 15, 16, 40, 63 * 16 + 5, 64 * 16, 64 * 16 + 7, 150 * 16 + 3, 300 * 16])
@pytest.mark.parametrize("identity", [None, KvIdentity(), KvIdentity("tenant-a"), ID_A, ID_B, KvIdentity("ns", "m", "", "s")])
def test_prefix_hasher_equals_identity_hashes(n_tokens: int, identity: KvIdentity | None) -> None:
    """Short prompts (< 64 blocks: no checkpoints) and long ones (the checkpoint path), hashed twice (the
    second time from the checkpoints)."""
    rng = random.Random(n_tokens)
    tokens = [rng.randrange(2**32) for _ in range(n_tokens)]
    ph = PrefixHasher(block_size=16)
    expected = _ref(tokens, identity)
    if identity is not None:
        assert identity_hashes(tokens, identity, 16) == expected
    assert ph.hashes(tokens, identity) == expected
    assert ph.hashes(tokens, identity) == expected
    if n_tokens >= 64 * 16:
        assert ph.reused_blocks > 0  # the second pass did resume from a checkpoint


def test_prefix_hasher_identities_interleaved_never_share_checkpoints() -> None:
    """The same growing conversation under two identities (and the hasher's own namespace), interleaved in
    one hasher with a small stride: every answer is its own identity's, though the tokens are equal."""
    rng = random.Random(7)
    ph = PrefixHasher(block_size=16, namespace="tenant-a", stride_blocks=2, capacity=64)
    idents: list[KvIdentity | None] = [ID_A, ID_B, None, KvIdentity("tenant-a", "m"), KvIdentity("tenant-a")]
    history: list[int] = []
    for _ in range(10):
        history += [rng.randrange(2**32) for _ in range(rng.randrange(1, 200))]
        answers = []
        for identity in idents:
            got = ph.hashes(history, identity)
            assert got == _ref(history, identity, "tenant-a"), identity
            answers.append(got)
        # None and KvIdentity("tenant-a") are one identity; every other pair shares no hash.
        assert answers[2] == answers[4]
        for i in range(4):
            for j in range(i + 1, 4):
                assert not set(answers[i]) & set(answers[j]), (idents[i], idents[j])
    assert ph.reused_blocks > 0


def test_prefix_hasher_checkpoint_of_one_identity_is_not_reused_by_another() -> None:
    """A long prompt hashed under A leaves checkpoints; the same prompt under B then hashes every block."""
    rng = random.Random(3)
    tokens = [rng.randrange(2**32) for _ in range(200 * 16)]
    ph = PrefixHasher(block_size=16)
    assert ph.hashes(tokens, ID_A) == _ref(tokens, ID_A)
    reused = ph.reused_blocks
    assert ph.hashes(tokens, ID_B) == _ref(tokens, ID_B)
    assert ph.reused_blocks == reused
    assert ph.hashes(tokens, ID_A) == _ref(tokens, ID_A)
    assert ph.reused_blocks > reused
