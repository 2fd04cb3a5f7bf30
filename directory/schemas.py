"""REST wire types of the directory (protocol §3), shared by the server and the client.

Hashes are JSON unsigned 64-bit integers, strictly typed: strings, floats and
booleans are rejected (422), as are values outside 0..2**64-1.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from directory.hashing import U32_MAX, U64_MAX
from directory.tenancy import TENANT_MAX_LEN, TENANT_PATTERN

U64 = Annotated[int, Field(strict=True, ge=0, le=U64_MAX)]
U32 = Annotated[int, Field(strict=True, ge=0, le=U32_MAX)]
Epoch = Annotated[int, Field(strict=True, ge=1)]
NodeId = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:@/-]+$")]
Url = Annotated[str, StringConstraints(min_length=1, max_length=2048)]
Label = Annotated[str, StringConstraints(max_length=64)]
TenantField = Annotated[
    str | None,
    Field(max_length=TENANT_MAX_LEN, pattern=TENANT_PATTERN,
          description='the tenant whose entries this touches (directory.tenancy); omitted: the token\'s own, else the shared ""'),
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Region(_Model):
    """One registered KV memory region (a TP rank, optionally a layer): RDMA-style base address and key."""

    rank: Annotated[int, Field(strict=True, ge=0, le=65535)]
    base_addr: U64
    length: U64
    rkey: U64 | Annotated[str, StringConstraints(max_length=256)] = 0
    block_bytes: Annotated[int, Field(strict=True, ge=1, le=U64_MAX)]
    layer: Annotated[int, Field(strict=True, ge=0, le=65535)] | None = None


class RegisterRequest(_Model):
    node_id: NodeId
    api_url: Url
    transfer_url: Url | None = None
    regions: Annotated[list[Region], Field(max_length=4096)] = []
    capacity_blocks: Annotated[int, Field(strict=True, ge=1, le=U32_MAX + 1)] | None = None
    block_size: Annotated[int, Field(strict=True, ge=1, le=65536)] | None = None
    incarnation: Annotated[str, StringConstraints(min_length=1, max_length=128)] | None = Field(
        None, description="unique per process start; retrying a registration with the same value returns the same epoch"
    )


class RegisterResponse(_Model):
    node_id: str
    epoch: int
    lease_ttl_s: float


# NaN and infinities (Python's JSON parser accepts `NaN`, `Infinity` and 1e999) would be stored in the
# replicated state and make every answer listing the node unserialisable (500): refused with 422.
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


class HeartbeatRequest(_Model):
    epoch: Epoch
    load: Annotated[dict[Label, FiniteFloat], Field(max_length=64)] | None = None


class HeartbeatResponse(_Model):
    node_id: str
    epoch: int


class BlockRef(_Model):
    hash: U64
    slot: U32


class PublishRequest(_Model):
    node_id: NodeId
    epoch: Epoch
    blocks: list[BlockRef]
    medium: Label | None = None
    tenant: TenantField = None


class PublishResponse(_Model):
    node_id: str
    epoch: int
    stored: int = Field(description="entries that were new")


class RemoveRequest(_Model):
    node_id: NodeId
    epoch: Epoch
    hashes: list[U64]
    tenant: TenantField = None


class ClearRequest(_Model):
    node_id: NodeId
    epoch: Epoch


class RemoveResponse(_Model):
    node_id: str
    epoch: int
    removed: int


class LookupRequest(_Model):
    hashes: list[U64] | None = None
    tokens: list[U32] | None = None
    namespace: Annotated[str, StringConstraints(max_length=256)] = ""
    block_size: Annotated[int, Field(strict=True, ge=1, le=65536)] = 16
    with_slots: bool = False
    consistency: Literal["local", "linearizable"] = "local"
    tenant: TenantField = None


class Holder(_Model):
    node_id: str
    epoch: int
    matched_blocks: int
    slots: list[int] | None = None


class LookupResponse(_Model):
    num_blocks: int
    holders: list[Holder]


class NodeInfo(_Model):
    node_id: str
    epoch: int
    alive: bool
    api_url: str
    transfer_url: str | None = None
    regions: list[Region] = []
    capacity_blocks: int | None = None
    block_size: int | None = None
    blocks: int
    load: dict[str, float] = {}


class NodesResponse(_Model):
    nodes: list[NodeInfo]


class DeregisterResponse(_Model):
    node_id: str
    removed: int


class ErrorResponse(_Model):
    error: str
    detail: object = None
