"""REST wire types of the directory (docs/protocol.md §3), shared by the server and the client.

Request bodies are msgspec Structs: the API decodes them straight from the
raw JSON with bounded cost (msgspec stops at the first invalid element, and
the API counts bulk arrays on the raw bytes before decoding them), so no
body, however large, holds the GIL long enough to starve the Raft thread.
Responses are pydantic models (the client validates them).

Hashes are JSON unsigned 64-bit integers, strictly typed: strings, floats and
booleans are rejected (422), as are values outside 0..2**64-1.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import httpx
import msgspec
from pydantic import BaseModel, ConfigDict, Field

from kvproto import media
from kvproto.hashing import U32_MAX, U64_MAX
from kvproto.ranks import check_ranks

TENANT_MAX_LEN = 64
TENANT_PATTERN = r"^[A-Za-z0-9._-]*$"
"""Tenant names: no `:` nor `@`, which delimit them in the tokens file (directory.auth)."""
NODE_ID_MAX_LEN = 128
ORIGIN_MAX_LEN = 300  # scheme, a 253-character host name and a port
TRANSFER_URL_MAX_LEN = 2048
RKEY_MAX_LEN = 256
LABEL_MAX_LEN = 64
MAX_LOAD_LABELS = 64
PULL_GBPS_LABEL = "pull_gbps"
"""The load label of a pulling engine's measured pull bandwidth in GB/s: the gateway prices pulls to it with it."""

# msgspec bounds integers only within int64: the u64 maximum is documented here and checked after decoding
# (`check_u64`, or numpy's conversion of bulk arrays).
U64 = Annotated[int, msgspec.Meta(ge=0, extra_json_schema={"maximum": U64_MAX})]
U32 = Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)]
EPOCH_MAX = (1 << 63) - 1
"""Epochs are int64 everywhere (kvproto.state's layout, the replicated log's codec): a larger one is out of range
(422), never a command; one in range that is not the node's is 409."""
Epoch = Annotated[int, msgspec.Meta(ge=1, le=EPOCH_MAX)]
# msgspec matches patterns with Python's re, where "$" also matches before a final newline: "(?!\n)" refuses it.
NODE_ID_PATTERN = r"^[A-Za-z0-9._:@/-]+$"
"""Node ids: what every component's settings and the wire accept (no spaces, no `,`, which separate lists)."""
NodeId = Annotated[str, msgspec.Meta(min_length=1, max_length=NODE_ID_MAX_LEN, pattern=NODE_ID_PATTERN + r"(?!\n)")]
Label = Annotated[str, msgspec.Meta(max_length=LABEL_MAX_LEN)]
# 1e999 decodes to infinity: the bounds refuse it (a non-finite load would make every answer listing the node a 500).
FiniteFloat = Annotated[float, msgspec.Meta(ge=-1.7976931348623157e308, le=1.7976931348623157e308)]
Tenant = Annotated[
    str,
    msgspec.Meta(
        max_length=TENANT_MAX_LEN,
        pattern=TENANT_PATTERN + r"(?!\n)",
        description='the tenant whose entries this touches (directory.tenancy); omitted: the token\'s own, else the shared ""',
    ),
]


def check_u64(value: int, what: str) -> None:
    if value > U64_MAX:
        raise ValueError(f"{what} must be at most 2**64-1")


_ORIGIN = re.compile(
    r"(?P<scheme>https?)://(?P<host>\[[0-9a-f:.]+\]|[a-z0-9_-]+(?:\.[a-z0-9_-]+)*\.?)(?::(?P<port>[0-9]{1,5}))?/?",
    re.ASCII | re.IGNORECASE,
)


@functools.lru_cache(maxsize=4096)
def _url(scheme: str, host: str, port: int, path: str) -> httpx.URL:
    """An engine URL, built once: httpx validates and encodes each part, and with `--tokenizer engine`
    the gateway asks an engine's /tokenize on every request (its forward builds httpcore's URL: gateway.proxy)."""
    return httpx.URL(scheme=scheme, host=host, port=port, path=path)


@dataclass(frozen=True, slots=True)
class Origin:
    """Where an engine's API is: scheme, host and port, and nothing else."""

    scheme: str
    host: str  # an IPv6 address without its brackets
    port: int

    def url(self, path: str) -> httpx.URL:
        """The URL of `path` (one of the caller's own constants) on this engine, built from the parts."""
        return _url(self.scheme, self.host, self.port, path)

    def __str__(self) -> str:
        return f"{self.scheme}://{f'[{self.host}]' if ':' in self.host else self.host}:{self.port}"


def parse_origin(url: str) -> Origin:
    """`url` as an origin, `http(s)://HOST[:PORT]` with one trailing "/" allowed; ValueError for anything more or less.

    A node's API URL is where the gateway sends users' prompts: with a path, query, fragment or user info
    an engine token could point the gateway at any endpoint of any host. The directory refuses
    such a registration and the gateway refuses to route to one, both by this one definition.
    """
    m = _ORIGIN.fullmatch(url)
    if m is None:
        raise ValueError(f"{url[:200]!r} is not a plain http(s)://HOST:PORT origin (no path, query, fragment or user info)")
    scheme, host = m["scheme"].lower(), m["host"].lower()
    if host.startswith("["):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError as exc:
            raise ValueError(f"{url[:200]!r}: {host!r} is not an IPv6 address") from exc
    port = int(m["port"]) if m["port"] else (443 if scheme == "https" else 80)
    if not 0 < port < 65536:
        raise ValueError(f"{url[:200]!r}: port {port} is not in 1..65535")
    return Origin(scheme, host, port)


def _host_key(host: str) -> str:
    """`host` in one spelling per address: IPv4 in dotted quads (also from the short, octal and hex forms the
    resolver accepts, and from IPv4-mapped IPv6), IPv6 compressed, names lower-case without a final dot."""
    host = host.lower().removeprefix("[").removesuffix("]").rstrip(".")
    if ":" in host:
        try:
            v6 = ipaddress.IPv6Address(host)
        except ValueError:
            return host
        return str(v6.ipv4_mapped or v6)
    try:
        return socket.inet_ntoa(socket.inet_aton(host))
    except OSError:
        return host


def endpoint_key(url: str) -> str:
    """`HOST:PORT` of an engine's API origin or transfer session, one spelling per endpoint (no scheme: whatever
    listens there answers both), so that two spellings of one engine compare equal; a string that names no
    host and port is kept, lower-case. Pure: names are not resolved."""
    text = url.strip().lower()
    try:
        o = parse_origin(text)
    except ValueError:
        pass
    else:
        return f"{_host_key(o.host)}:{o.port}"
    text = text.split("://", 1)[-1].rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or "/" in host:
        return text
    return f"{_host_key(host)}:{int(port)}"


def origin(url: str) -> str:
    """A registration's `api_url` checked by `parse_origin`, as given but for a lower-case scheme and no trailing "/"."""
    try:
        parse_origin(url)
    except ValueError as exc:
        raise ValueError(f"api_url: {exc}") from exc
    scheme, rest = url.split("://", 1)
    return f"{scheme.lower()}://{rest.removesuffix('/')}"


class _Body(msgspec.Struct):
    """A request body: unknown fields are ignored (older replicas accept newer clients' bodies)."""


class Region(_Body):
    """One registered KV memory region (a TP rank, optionally a layer): RDMA-style base address and key."""

    rank: Annotated[int, msgspec.Meta(ge=0, le=65535)]
    base_addr: U64
    length: U64
    block_bytes: Annotated[int, msgspec.Meta(ge=1, extra_json_schema={"maximum": U64_MAX})]
    rkey: U64 | Annotated[str, msgspec.Meta(max_length=RKEY_MAX_LEN)] = 0
    layer: Annotated[int, msgspec.Meta(ge=0, le=65535)] | None = None
    transfer_url: (
        Annotated[
            str,
            msgspec.Meta(
                min_length=1,
                max_length=TRANSFER_URL_MAX_LEN,
                description="the session this region is read through, if not the node's transfer_url (a TP rank's own)",
            ),
        ]
        | None
    ) = None
    medium: (
        Annotated[
            str,
            msgspec.Meta(
                max_length=32,
                description="where the region lies: device (the default), host or disk (docs/protocol.md §2.3)",
            ),
        ]
        | None
    ) = None

    def __post_init__(self) -> None:
        self.medium = media.canonical(self.medium)
        check_u64(self.base_addr, "base_addr")
        check_u64(self.length, "length")
        check_u64(self.block_bytes, "block_bytes")
        if isinstance(self.rkey, int):
            check_u64(self.rkey, "rkey")
        if self.base_addr + self.length > U64_MAX:
            raise ValueError(f"base_addr + length ({self.base_addr} + {self.length}) must be below 2**64")
        if self.block_bytes > self.length:
            raise ValueError(f"block_bytes ({self.block_bytes}) must be at most length ({self.length}): a region holds a block")


MODEL_NAME_MAX_LEN = 256
MAX_MODELS = 256
FINGERPRINT_MAX_LEN = 128
ModelName = Annotated[str, msgspec.Meta(min_length=1, max_length=MODEL_NAME_MAX_LEN)]
Fingerprint = Annotated[str, msgspec.Meta(min_length=1, max_length=FINGERPRINT_MAX_LEN)]


class RegisterRequest(_Body):
    node_id: NodeId
    api_url: Annotated[
        str,
        msgspec.Meta(
            min_length=1, max_length=ORIGIN_MAX_LEN, description="the engine's origin: http(s)://HOST[:PORT], nothing else"
        ),
    ]
    transfer_url: Annotated[str, msgspec.Meta(min_length=1, max_length=TRANSFER_URL_MAX_LEN)] | None = None
    regions: list[Region] = []
    capacity_blocks: Annotated[int, msgspec.Meta(ge=1, le=media.MAX_SLOTS)] | None = None
    block_size: Annotated[int, msgspec.Meta(ge=1, le=65536)] | None = None
    incarnation: (
        Annotated[
            str,
            msgspec.Meta(
                min_length=1,
                max_length=128,
                description="unique per process start; retrying a registration with the same value returns the same epoch",
            ),
        ]
        | None
    ) = None
    models: Annotated[
        list[ModelName],
        msgspec.Meta(max_length=MAX_MODELS, description="model and LoRA adapter names the engine serves (docs/protocol.md §2.1)"),
    ] = []
    fingerprint: (
        Annotated[
            str,
            msgspec.Meta(
                min_length=1,
                max_length=FINGERPRINT_MAX_LEN,
                description="digest of what makes the engine's KV interchangeable (model, weights, dtype, layout, block size)",
            ),
        ]
        | None
    ) = None
    tenant: Tenant | None = None
    shared: Annotated[
        bool, msgspec.Meta(description="routed to by every tenant's gateway (a token not confined to a tenant only)")
    ] = False
    dp_rank: (
        Annotated[
            int,
            msgspec.Meta(
                ge=0,
                le=65535,
                description="the data-parallel rank this node is behind api_url: requests carry X-data-parallel-rank",
            ),
        ]
        | None
    ) = None

    def __post_init__(self) -> None:
        self.api_url = origin(self.api_url)
        why = check_ranks(self.regions)
        if why:
            raise ValueError(f"regions: {why}")


class HeartbeatRequest(_Body):
    epoch: Epoch
    load: Annotated[dict[Label, FiniteFloat], msgspec.Meta(max_length=MAX_LOAD_LABELS)] | None = None


class BlockRef(_Body):
    hash: U64
    slot: Annotated[int, msgspec.Meta(ge=0, le=media.SLOT_MASK, description="the slot within the publish's medium")]


class PublishRequest(_Body):
    node_id: NodeId
    epoch: Epoch
    blocks: list[BlockRef]
    medium: Label | None = None
    """Where the blocks lie (kvproto.media: device, host or disk, or an engine's name for one): each block's entry
    for this node moves there."""
    tenant: Tenant | None = None

    def __post_init__(self) -> None:
        self.medium = media.canonical(self.medium)


class RemoveRequest(_Body):
    node_id: NodeId
    epoch: Epoch
    hashes: list[U64]
    tenant: Tenant | None = None


class ClearRequest(_Body):
    node_id: NodeId
    epoch: Epoch


Namespace = Annotated[str, msgspec.Meta(max_length=256)]
IdentityPart = Annotated[str, msgspec.Meta(max_length=1024, description="of the tokens' KV identity (docs/protocol.md §1.1)")]
BlockSize = Annotated[int, msgspec.Meta(ge=1, le=65536)]
Consistency = Literal["local", "linearizable"]


class LookupRequest(_Body):
    hashes: list[U64] | None = None
    tokens: list[U32] | None = None
    namespace: Namespace = ""
    model: IdentityPart = ""
    adapter: IdentityPart = ""
    cache_salt: IdentityPart = ""
    block_size: BlockSize = 16
    with_slots: bool = False
    consistency: Consistency = "local"
    tenant: Tenant | None = None


DP_RANK_HEADER = "X-data-parallel-rank"
"""The request header naming the data-parallel rank to serve it: vLLM's OpenAI API server's (docs/engines.md)."""
PULL_PLAN_FIELD = "kvdir_pull"
"""The completion-body field that carries a `PullPlan` (written by the gateway only: it drops one a client sent)."""
KV_TRANSFER_PARAMS_FIELD = "kv_transfer_params"
"""vLLM's per-request connector field: the gateway also puts the plan there, under `PULL_PLAN_FIELD`, for
adapters/vllm_connector.py (vLLM hands connectors nothing else of the body)."""


class PullPlan(_Body):
    """Where an engine reads a prompt's first `len(slots)` blocks instead of computing them (docs/protocol.md §4).

    The gateway writes it into a completion body under `PULL_PLAN_FIELD`; the
    engine reads those blocks from `source_node`'s registered memory, provided
    that node still has epoch `source_epoch` (else the slots may hold anything).
    """

    source_node: NodeId
    source_epoch: Epoch
    slots: Annotated[list[U32], msgspec.Meta(max_length=1 << 20)]
    fingerprint: Fingerprint | None = None
    """The source's registered KV fingerprint: an engine whose own differs refuses the plan (recomputes)."""

    def to_json(self) -> dict[str, Any]:
        """The plan as a JSON object, as it goes into a completion body."""
        plan: dict[str, Any] = {"source_node": self.source_node, "source_epoch": self.source_epoch, "slots": list(self.slots)}
        if self.fingerprint is not None:
            plan["fingerprint"] = self.fingerprint
        return plan


REQUEST_BODIES: tuple[type[msgspec.Struct], ...] = (
    RegisterRequest,
    HeartbeatRequest,
    PublishRequest,
    RemoveRequest,
    ClearRequest,
    LookupRequest,
)


def request_schemas() -> dict[str, Any]:
    """OpenAPI components of the request bodies (their `$ref`s point into components/schemas)."""
    return msgspec.json.schema_components(REQUEST_BODIES, ref_template="#/components/schemas/{name}")[1]


# -- responses --------------------------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RegisterResponse(_Model):
    node_id: str
    epoch: int
    lease_ttl_s: float
    warnings: list[str] = Field(default=[], description="what the registration left out and what follows from it")


class HeartbeatResponse(_Model):
    node_id: str
    epoch: int


class PublishResponse(_Model):
    node_id: str
    epoch: int
    stored: int = Field(description="entries that were new")


class RemoveResponse(_Model):
    node_id: str
    epoch: int
    removed: int


# A location names its medium in its top bits (kvproto.media): one in no medium is a malformed answer.
Location = Annotated[int, Field(ge=0, lt=len(media.MEDIA) << media.SHIFT)]


class Holder(_Model):
    node_id: str
    epoch: int
    matched_blocks: int = Field(ge=0)
    slots: list[Location] | None = None


class LookupResponse(_Model):
    num_blocks: int
    holders: list[Holder]


class RegionInfo(_Model):
    """A registered region as the directory reports it (see `Region`)."""

    rank: int
    base_addr: int
    length: int
    rkey: int | str = 0
    block_bytes: int = Field(ge=1)  # what the gateway divides by: a 0 is a malformed answer
    layer: int | None = None
    transfer_url: str | None = None
    medium: str | None = None


class NodeInfo(_Model):
    node_id: str
    epoch: int
    alive: bool
    api_url: str
    transfer_url: str | None = None
    regions: list[RegionInfo] = []
    capacity_blocks: int | None = None
    block_size: int | None = None
    blocks: int
    load: dict[str, float] = {}
    models: list[str] = []
    fingerprint: str | None = None
    tenant: str = ""
    shared: bool = False
    dp_rank: int | None = None


class NodesResponse(_Model):
    nodes: list[NodeInfo]


class DeregisterResponse(_Model):
    node_id: str
    removed: int


class ErrorResponse(_Model):
    error: str
    detail: object = None
