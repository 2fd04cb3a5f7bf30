"""Binary batches: the msgpack bodies of publish, remove and lookup (docs/protocol.md §3.1), for server and client.

A JSON body spells every hash as a number that the server parses and checks one by one. In a
binary batch the bulk fields are msgpack bin values holding packed little-endian arrays (hashes
uint64, slots and tokens uint32), which each side turns into or out of a numpy array in one
copy, with no Python object per element. The other fields are the JSON bodies' own, with the
same validation (kvproto.schemas).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
import numpy as np

from kvproto import media
from kvproto.schemas import BlockSize, Consistency, Epoch, IdentityPart, Label, Namespace, NodeId, Tenant

JSON = "application/json"
MSGPACK = "application/msgpack"

U64 = np.dtype("<u8")
"""Hashes: unsigned 64-bit, little-endian."""
U32 = np.dtype("<u4")
"""Slots and tokens: unsigned 32-bit, little-endian."""


class _Batch(msgspec.Struct, omit_defaults=True):
    """A binary request body: unknown fields are ignored, as in JSON bodies; defaults are not sent."""


class PublishBatch(_Batch):
    node_id: NodeId
    epoch: Epoch
    hashes: bytes
    slots: bytes  # slots[i] is where hashes[i] is held, in `medium`
    medium: Label | None = None
    tenant: Tenant | None = None

    def __post_init__(self) -> None:
        self.medium = media.canonical(self.medium)


class RemoveBatch(_Batch):
    node_id: NodeId
    epoch: Epoch
    hashes: bytes
    tenant: Tenant | None = None


class LookupBatch(_Batch):
    hashes: bytes | None = None
    tokens: bytes | None = None
    namespace: Namespace = ""
    model: IdentityPart = ""
    adapter: IdentityPart = ""
    cache_salt: IdentityPart = ""
    block_size: BlockSize = 16
    with_slots: bool = False
    consistency: Consistency = "local"
    tenant: Tenant | None = None


def count(packed: bytes, dtype: np.dtype, field: str) -> int:
    """How many values `packed` holds; ValueError unless its length is a whole number of them."""
    if len(packed) % dtype.itemsize:
        raise ValueError(
            f"`{field}` holds {len(packed)} bytes, not a multiple of {dtype.itemsize}: "
            f"it must be packed little-endian {_name(dtype)} values"
        )
    return len(packed) // dtype.itemsize


def unpack(packed: bytes, dtype: np.dtype) -> np.ndarray:
    """The values of `packed` (whose length `count` checked) as a new, writable array in native byte order.

    A copy, not a view of the body: the index's numba kernels are compiled for writable arrays, and a
    read-only one would have them compile anew on the Raft thread (docs/guarantees.md, "Keeping a healthy leader").
    """
    return np.frombuffer(packed, dtype=dtype).astype(dtype.newbyteorder("="))


def pack(values: Iterable[int], dtype: np.dtype, field: str) -> bytes:
    """`values` as a packed little-endian array; ValueError for a value out of the type's range."""
    try:
        return np.fromiter(values, dtype=dtype).tobytes()
    except OverflowError as exc:
        raise ValueError(f"{field} must be {_name(dtype)} values (0..2**{8 * dtype.itemsize}-1): {exc}") from exc


def _name(dtype: np.dtype) -> str:
    return f"uint{8 * dtype.itemsize}"
