"""Tenant keys (directory.tenancy): a bijection per tenant, the identity for the shared tenant, unrelated across tenants."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from directory.tenancy import Tenancy, mix
from kvproto.hashing import U64_MAX, block_hashes

M = 2**64


def _unxorshift(y: int, s: int) -> int:
    x = y
    for _ in range(64 // s):
        x = y ^ (x >> s)
    return x


def unmix(key: int, value: int) -> int:
    """The inverse of `mix` for one value: its existence is what makes `mix` a bijection."""
    x = _unxorshift(value, 31)
    x = (x * pow(0x94D049BB133111EB, -1, M)) % M
    x = _unxorshift(x, 27)
    x = (x * pow(0xBF58476D1CE4E5B9, -1, M)) % M
    x = _unxorshift(x, 30)
    return x ^ key


SAMPLES = np.concatenate(
    [
        np.arange(100_000, dtype=np.uint64),  # dense low values
        np.uint64(U64_MAX) - np.arange(1000, dtype=np.uint64),  # top of the range
        (np.uint64(1) << np.arange(64, dtype=np.uint64)),  # single bits
        np.random.default_rng(7).integers(0, U64_MAX, 100_000, dtype=np.uint64, endpoint=True),
        np.asarray(block_hashes(list(range(4096))), dtype=np.uint64),
    ]
)


@given(key=st.integers(0, U64_MAX), value=st.integers(0, U64_MAX))
def test_mix_is_inverted_by_unmix(key: int, value: int) -> None:
    out = int(mix(np.array([value], dtype=np.uint64), key)[0])
    assert unmix(key, out) == value


@pytest.mark.parametrize("tenant", ["a", "acme", "tenant-b", "x" * 64])
def test_distinct_hashes_keep_distinct_keys_within_a_tenant(tenant: str) -> None:
    samples = np.unique(SAMPLES)
    keys = Tenancy(b"s3cr3t").keys(samples, tenant)
    assert keys.dtype == np.uint64 and keys.shape == samples.shape
    assert len(np.unique(keys)) == len(samples)


def test_the_shared_tenant_keeps_raw_hashes() -> None:
    for secret in (b"", b"s3cr3t"):
        assert np.array_equal(Tenancy(secret).keys(SAMPLES, ""), SAMPLES)


def test_keys_are_deterministic_and_leave_the_input_alone() -> None:
    before = SAMPLES.copy()
    a = Tenancy(b"s3cr3t").keys(SAMPLES, "acme")
    assert np.array_equal(SAMPLES, before)
    assert np.array_equal(a, Tenancy(b"s3cr3t").keys(SAMPLES, "acme"))  # any replica, any process
    assert np.array_equal(a, Tenancy(b"s3cr3t").keys(SAMPLES.tolist(), "acme"))
    assert Tenancy(b"s3cr3t").fingerprint() == Tenancy(b"s3cr3t").fingerprint() != Tenancy(b"other").fingerprint()


def test_tenants_and_secrets_give_unrelated_keys() -> None:
    hashes = SAMPLES[:100_000]
    t = Tenancy(b"s3cr3t")
    views = {
        "": t.keys(hashes, ""),
        "a": t.keys(hashes, "a"),
        "b": t.keys(hashes, "b"),
        "A": t.keys(hashes, "A"),
        "a/other secret": Tenancy(b"other").keys(hashes, "a"),
        "a/no secret": Tenancy().keys(hashes, "a"),
    }
    names = list(views)
    for i, x in enumerate(names):
        for y in names[i + 1 :]:
            # The same hash never lands on the same key, and no key of one tenant is any key of another.
            assert not np.any(views[x] == views[y]), (x, y)
            assert len(np.intersect1d(views[x], views[y])) == 0, (x, y)
    assert len({t.key(n) for n in ("a", "b", "A", "a.", "tenant-1", "tenant-2")}) == 6
