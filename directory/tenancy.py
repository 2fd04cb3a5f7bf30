"""Tenants: the directory keys every entry by (block hash, tenant), so tenants never see each other's entries.

The block hash names content (docs/protocol.md §1, seeded by the hash namespace); the
tenant names who may see it. The API layer turns each hash into the key
`mix(hash, tenant)` before a command goes through Raft, so the replicated
state machine (kvproto.state) knows nothing of tenants. For each tenant,
`mix` is a bijection of the 64-bit space: an xor with the tenant's key, then
the splitmix64 finaliser (xorshifts and multiplications by odd constants are
all invertible modulo 2**64), so distinct hashes of one tenant never share a
key. The shared tenant "" keeps raw hashes: data, clients and tests from
before tenants work unchanged. Answers carry node ids, epochs, counts and
slots, never keys, so nothing is ever mapped back.

Every bijection is invertible by whoever knows its key: a client that could
compute tenant A's key could pick, in its own tenant B, the hash h' with
mix(h', B) == mix(h, A) and reach A's entries. Tenant keys are therefore
HMAC-SHA256(secret, tenant) with a secret that only the replicas hold
(`tenant_secret_file`, the same on every replica). Without a secret the keys
are public: tenants then keep well-behaved clients apart, not hostile ones,
and the directory refuses tokens confined to a tenant (directory.config).
"""

from __future__ import annotations

import hashlib
import hmac

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S1, _S2, _S3 = np.uint64(30), np.uint64(27), np.uint64(31)


def mix(hashes: np.ndarray, key: int) -> np.ndarray:
    """splitmix64's finaliser of `hashes ^ key`, as a new uint64 array: a bijection for every key."""
    x = np.asarray(hashes, dtype=np.uint64) ^ np.uint64(key)  # a new array: the caller's is left alone
    x ^= x >> _S1
    x *= _M1  # wraps modulo 2**64, as intended
    x ^= x >> _S2
    x *= _M2
    x ^= x >> _S3
    return x


class Tenancy:
    """The directory keys of each tenant, from the replicas' shared secret (b"": public keys)."""

    def __init__(self, secret: bytes = b"") -> None:
        self._secret = secret

    def fingerprint(self) -> str:
        """A short digest of the secret, to compare replicas' logs: they must all hold the same secret."""
        return hmac.new(self._secret, b"kvdir-tenant-fingerprint", hashlib.sha256).hexdigest()[:8]

    def key(self, tenant: str) -> int:
        """The 64-bit key of a non-empty tenant."""
        digest = hmac.new(self._secret, b"kvdir-tenant\0" + tenant.encode(), hashlib.sha256).digest()
        return int.from_bytes(digest[:8], "little")

    def keys(self, hashes: np.ndarray, tenant: str) -> np.ndarray:
        """The directory keys of a tenant's block hashes; the hashes themselves for the shared tenant ""."""
        return hashes if not tenant else mix(hashes, self.key(tenant))
