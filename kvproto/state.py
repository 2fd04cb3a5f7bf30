"""The directory's replicated state machine.

Rules (everything that changes replicated state lives here):
- Pure and deterministic: no clocks, randomness or I/O. Every replica applies
  the same commands in the same order and reaches the same state. Time-based
  decisions (lease expiry) are taken by the leader outside and arrive here as
  `Expire` commands.
- Every node registration gets a new epoch from one global counter, so epochs
  strictly increase per node id without remembering departed nodes. The
  counter starts at a random base (drawn by the replica that took the first
  registration and committed in it), so a directory rebuilt from nothing
  never hands out an epoch that an earlier incarnation of it handed out: a
  zombie write fenced by the old directory stays fenced by the new one.
- A write carrying an epoch other than the node's current one changes nothing
  (fencing). A new epoch for a node drops every entry of the old one, as do
  expiry and deregistration: an entry is only ever handed out while its node's
  registration is current.
- Commands are idempotent, so a command whose outcome was unknown
  (leader change, timeout) can be applied again safely. Registration is made
  idempotent by the node's `incarnation` (one per process start).
- An engine endpoint (API origin or transfer session, `schemas.endpoint_key`) belongs to one tenant at a
  time: a registration naming one that a node of another tenant holds is refused (ENDPOINT_TAKEN), so a
  tenant's node cannot route its gateway's prompts to, nor plan pulls from, another tenant's engine. The
  index of who holds what is derived from the nodes, never replicated on its own.
- `seen` counts a node's accepted commands; an `Expire` names the count the
  leader saw and is void if the node has been heard from since.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple

import msgspec
import numpy as np
import xxhash

from kvproto import media
from kvproto.index import BlockIndex
from kvproto.schemas import Holder, Region, endpoint_key
from kvproto.shardmap import SHARD_BITS, home_of

if TYPE_CHECKING:
    from kvproto.shardmap import ShardMap

# -- commands -------------------------------------------------------------------


class _Struct(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """What the replicated log carries: encoded by kvproto.codec as a msgpack array of the fields in their order
    (a command's led by its one-letter tag), decoded there with every field's type and range checked."""


MAX_INT = (1 << 63) - 1
Int64 = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT)]
"""Epochs, counts and positions: int64 on every replica (an epoch of 2**63 would encode as msgpack's uint64)."""
Finite = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
"""A load figure: NaN and infinities are refused (they would make routing's comparisons meaningless)."""
Rank = Annotated[int, msgspec.Meta(ge=0, le=65535)]


if TYPE_CHECKING:
    U64Array = np.ndarray
    U32Array = np.ndarray
else:

    class U64Array(np.ndarray):
        """The declared type of a command's uint64 field, which kvproto.codec's decoder reads from the packed
        little-endian bytes the wire carries; a command holds a plain ndarray (`_array`), so nothing downstream
        sees this class, and to the type checker it is one."""

    class U32Array(np.ndarray):
        """As `U64Array`, of uint32."""


def _array(cmd: _Struct, name: str, dtype: str) -> np.ndarray:
    value = np.ascontiguousarray(getattr(cmd, name), dtype=dtype)
    msgspec.structs.force_setattr(cmd, name, value)
    return value


class NodeProfile(_Struct, frozen=True):
    """What a registration says of the engine besides where its memory is (docs/protocol.md §2.1).

    `models`: the model and adapter names it serves (empty: unknown, from a client of before profiles).
    `fingerprint`: a digest of what makes its KV interchangeable with another engine's (model and weights,
    dtype, KV layout, block size); pulls are planned and accepted only between equal fingerprints, and
    never from or to an engine without one. `tenant`: the registrant's tenant, decided by the API from the
    token; a tenant's gateway routes only to its own tenant's engines and to `shared` ones (set only by a
    token not confined to a tenant). `dp_rank`: the data-parallel rank of the engine behind `api_url` that
    this node is (its own cache), which a request to it names (None: the API server has one rank).
    """

    models: tuple[str, ...] = ()
    fingerprint: str | None = None
    tenant: str = ""
    shared: bool = False
    dp_rank: Rank | None = None


class Register(_Struct, tag="G", frozen=True):
    node_id: str
    incarnation: str
    api_url: str
    transfer_url: str | None = None
    regions: tuple[Region, ...] = ()
    capacity_blocks: Int64 | None = None
    block_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_INT)] | None = None
    epoch_base: Int64 = 0
    """Where the epoch counter starts if no epoch was ever handed out (see `new_epoch_base`)."""
    profile: NodeProfile | None = None
    """What the engine serves and whom (docs/protocol.md §2.1); None: a registration that names none."""


EPOCH_BASE_BITS = 31
"""An epoch is `high << EPOCH_BASE_BITS | low`, exact as an int64 (below 2**63): `high` (32 bits) is a group's
SHARD_BITS shard index under `EPOCH_HIGH_RANDOM_BITS` random bits, fixed by its first registration (its identity,
kvproto.codec.group_of); `low` starts at a random offset below 2**EPOCH_OFFSET_BITS and counts
registrations."""
EPOCH_HIGH_RANDOM_BITS = 32 - SHARD_BITS
EPOCH_OFFSET_BITS = EPOCH_BASE_BITS - 1
EPOCH_RANDOM_BITS = EPOCH_HIGH_RANDOM_BITS + EPOCH_OFFSET_BITS
"""The random bits an epoch base takes (54): two directory incarnations (or two groups of one shard index)
hand out a common epoch only if their `high` parts are equal (2**-24) and their counted ranges overlap,
which for incarnations that each registered at most R times is about 2*R / 2**30: 2**-34 for R = 1,000
registrations each, 2**-44 for one registration each. Every guarantee holds for up to 2**30 registrations
per group (then `low` could carry into `high` and, on the largest base, past an int64)."""


def new_epoch_base(random_bits: int, shard_index: int = 0) -> int:
    """The epoch base for `EPOCH_RANDOM_BITS` random bits (drawn outside the state machine; more are ignored).

    The low EPOCH_HIGH_RANDOM_BITS random bits go into the high part, above the SHARD_BITS that hold the
    shard's index in the shard map, so two shards of one map never hand out the same epoch (docs/scale-out.md
    §4): a writer fenced by a node's move to another shard cannot match the epoch the node gets there. The
    next EPOCH_OFFSET_BITS are the counter's starting offset. (Below 2**23 random bits, the base is the one
    of before offsets.)
    """
    high = (random_bits & ((1 << EPOCH_HIGH_RANDOM_BITS) - 1)) << SHARD_BITS
    offset = (random_bits >> EPOCH_HIGH_RANDOM_BITS) & ((1 << EPOCH_OFFSET_BITS) - 1)
    return (high | (shard_index & ((1 << SHARD_BITS) - 1))) << EPOCH_BASE_BITS | offset


class Heartbeat(_Struct, tag="H", frozen=True):
    node_id: str
    epoch: Int64
    load: dict[str, Finite] | None = None


class Deregister(_Struct, tag="D", frozen=True):
    node_id: str
    epoch: Int64 | None
    """The registration it ends: refused (STALE_EPOCH) if the node has registered again since, so a retried or
    resent deregistration never drops a newer registration. None: whatever registration is current (an admin's
    deregistration), said explicitly, never by leaving the field out."""


class Publish(_Struct, tag="P", frozen=True):
    node_id: str
    epoch: Int64
    hashes: U64Array
    slots: U32Array
    medium: str | None = None

    def __post_init__(self) -> None:
        if len(_array(self, "hashes", "<u8")) != len(_array(self, "slots", "<u4")):
            raise ValueError(f"a publish of {len(self.hashes)} hashes and {len(self.slots)} slots")


class Remove(_Struct, tag="R", frozen=True):
    node_id: str
    epoch: Int64
    hashes: U64Array

    def __post_init__(self) -> None:
        _array(self, "hashes", "<u8")


class Clear(_Struct, tag="C", frozen=True):
    node_id: str
    epoch: Int64


class Expire(_Struct, tag="E", frozen=True):
    node_id: str
    epoch: Int64
    seen: Int64


class AnnounceReplica(_Struct, tag="A", frozen=True):
    raft_addr: str
    http_url: str


class AssignShards(_Struct, tag="S", frozen=True):
    """Commit a shard map (kvproto.shardmap) in this group, which is shard `shard` of it.

    Applied only if `version` is newer than the group's map, and a `bootstrap` command only if the group
    has no map at all. The group then drops every node the map homes elsewhere, exactly as an expiry does,
    and refuses to register such nodes (WRONG_SHARD).
    """

    version: Int64
    shard: str
    names: tuple[str, ...]
    pins: tuple[tuple[str, str], ...]
    document: str
    """The map's canonical JSON (kvproto.shardmap.ShardMap.document), served on GET /v1/shards."""
    bootstrap: bool
    """A replica's --shard-map-file: the group's first map, never a change to one. Replicas started with
    different versions of the file race to commit it; whichever commits first is kept, so a file edited
    between restarts never bypasses the safe order of PUT /v1/shards (kvproto.shardmap.apply_order)."""

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError("a shard map of no shards")

    @classmethod
    def of(cls, m: ShardMap, shard: str, bootstrap: bool = False) -> AssignShards:
        """The command that commits map `m` in the group that is shard `shard`."""
        return cls(m.version, shard, m.names, tuple(sorted(m.nodes.items())), m.document(), bootstrap)


class Noop(_Struct, tag="N", frozen=True):
    """A barrier: once applied locally, every write committed before the read is visible."""


Command = Register | Heartbeat | Deregister | Publish | Remove | Clear | Expire | AnnounceReplica | AssignShards | Noop


def command_size(cmd: Command) -> int:
    """About the size of a command in bytes (numpy payloads counted as raw): what keeps a Raft entry under the
    peers' frame cap (directory.raft_conf's ENTRY_SHARE) and the watch stream's history under its budget (directory.changefeed)."""
    if isinstance(cmd, Publish):
        return 128 + cmd.hashes.nbytes + cmd.slots.nbytes
    if isinstance(cmd, Remove):
        return 128 + cmd.hashes.nbytes
    if isinstance(cmd, AssignShards):
        return 256 + len(cmd.document)
    if isinstance(cmd, Register):
        return (
            256
            + len(cmd.api_url)
            + len(cmd.transfer_url or "")
            + len(msgspec.msgpack.encode(cmd.regions))
            + (sum(16 + len(m) for m in cmd.profile.models) + len(cmd.profile.fingerprint or "") if cmd.profile else 0)
        )
    return 256


# -- results ------------------------------------------------------------------------

OK = "ok"
STALE_EPOCH = "stale_epoch"
UNKNOWN_NODE = "unknown_node"
NODE_LIMIT = "node_limit"
INDEX_FULL = "index_full"
INVALID = "invalid"
WRONG_SHARD = "wrong_shard"
ENDPOINT_TAKEN = "endpoint_taken"


class Result(NamedTuple):
    status: str
    value: Any = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK


# -- state --------------------------------------------------------------------------


@dataclass(slots=True)
class Node:
    node_id: str
    idx: int
    epoch: int
    incarnation: str
    api_url: str
    transfer_url: str | None
    regions: tuple[Region, ...]
    capacity_blocks: int | None
    block_size: int | None
    load: dict[str, float] = field(default_factory=dict)
    seen: int = 0
    profile: NodeProfile | None = None


def tenant_of(profile: NodeProfile | None) -> str:
    """The tenant a node belongs to: its registrant's (a shared node's too), "" for a registration without a profile."""
    return "" if profile is None else profile.tenant


def endpoint_keys(api_url: str, transfer_url: str | None, regions: tuple[Region, ...]) -> set[str]:
    """The endpoints a registration names: its API origin, its transfer session and its ranks' own sessions."""
    keys = {endpoint_key(api_url)}
    for url in (transfer_url, *(r.transfer_url for r in regions)):
        if url is not None:
            keys.add(endpoint_key(url))
    return keys


class DirectoryState:
    """Nodes, their epochs and the block index; mutated only through `apply`."""

    def __init__(self, max_nodes: int = 1024, max_entries: int = 20_000_000, merge_threshold: int = 16384):
        self.max_nodes = max_nodes
        self.max_entries = max_entries
        self.index = BlockIndex(merge_threshold)
        self.nodes: dict[str, Node] = {}
        self.by_idx: dict[int, Node] = {}
        self.replicas: dict[str, str] = {}
        self.epoch_counter = 0
        self.applied = 0
        self.shard_map: AssignShards | None = None
        self._free_idx: list[int] = []
        self._next_idx = 0
        self._endpoints: dict[str, dict[str, set[str]]] = {}
        """endpoint key -> tenant -> ids of the nodes of that tenant that name it (derived from `nodes`)."""

    def rebuild_endpoints(self) -> None:
        """Derive the endpoint index from `nodes`: after a snapshot is decoded (kvproto.codec)."""
        self._endpoints = {}
        for node in self.nodes.values():
            self._hold(node)

    def endpoint_holders(self, key: str) -> dict[str, set[str]]:
        """tenant -> ids of that tenant's nodes that name endpoint `key` (a copy)."""
        return {t: set(ids) for t, ids in self._endpoints.get(key, {}).items()}

    def _hold(self, node: Node) -> None:
        tenant = tenant_of(node.profile)
        for key in endpoint_keys(node.api_url, node.transfer_url, node.regions):
            self._endpoints.setdefault(key, {}).setdefault(tenant, set()).add(node.node_id)

    def _release(self, node: Node) -> None:
        tenant = tenant_of(node.profile)
        for key in endpoint_keys(node.api_url, node.transfer_url, node.regions):
            tenants = self._endpoints.get(key)
            ids = tenants.get(tenant) if tenants is not None else None
            if tenants is None or ids is None:
                continue
            ids.discard(node.node_id)
            if not ids:
                del tenants[tenant]
                if not tenants:
                    del self._endpoints[key]

    def _taken(self, cmd: Register) -> str | None:
        """An endpoint of `cmd` that a node of another tenant holds (another than the node it registers), or None."""
        tenant = tenant_of(cmd.profile)
        for key in endpoint_keys(cmd.api_url, cmd.transfer_url, cmd.regions):
            for other, ids in self._endpoints.get(key, {}).items():
                if other != tenant and len(ids) > (cmd.node_id in ids):
                    return key
        return None

    # -- apply ----------------------------------------------------------------

    def apply(self, cmd: Command) -> Result:
        """Apply one command; never raises for a well-typed command."""
        self.applied += 1
        handler = _HANDLERS.get(type(cmd))
        if handler is None:
            return Result(INVALID, detail=f"unknown command {type(cmd).__name__}")
        return handler(self, cmd)

    def home(self, node_id: str) -> str | None:
        """The shard `node_id` belongs to under this group's map, or None if this directory is not sharded."""
        m = self.shard_map
        return None if m is None else home_of(node_id, m.names, dict(m.pins))

    def _register(self, cmd: Register) -> Result:
        home = self.home(cmd.node_id)
        if home is not None and self.shard_map is not None and home != self.shard_map.shard:
            m = self.shard_map
            return Result(
                WRONG_SHARD,
                {"version": m.version, "home": home},
                f"node {cmd.node_id!r} belongs to shard {home!r} under shard map version {m.version}, "
                f"not to this shard ({m.shard!r}): register there (GET /v1/shards)",
            )
        node = self.nodes.get(cmd.node_id)
        if node is not None and node.incarnation == cmd.incarnation:
            node.seen += 1
            return Result(OK, node.epoch)
        taken = self._taken(cmd)
        if taken is not None:
            return Result(
                ENDPOINT_TAKEN,
                detail=f"endpoint {taken!r} is registered by a node of another tenant: an engine's API origin and "
                "transfer sessions belong to one tenant",
            )
        if node is None:
            if len(self.nodes) >= self.max_nodes:
                return Result(NODE_LIMIT, detail=f"the directory holds its maximum of {self.max_nodes} nodes")
            idx = self._free_idx.pop() if self._free_idx else self._take_idx()
        else:
            idx = node.idx
            self.index.drop_node(idx)
            self._release(node)
        if self.epoch_counter == 0:
            self.epoch_counter = cmd.epoch_base
        self.epoch_counter += 1
        node = Node(
            cmd.node_id,
            idx,
            self.epoch_counter,
            cmd.incarnation,
            cmd.api_url,
            cmd.transfer_url,
            cmd.regions,
            cmd.capacity_blocks,
            cmd.block_size,
            profile=cmd.profile,
        )
        self.nodes[cmd.node_id] = node
        self.by_idx[idx] = node
        self._hold(node)
        return Result(OK, node.epoch)

    def _take_idx(self) -> int:
        self._next_idx += 1
        return self._next_idx - 1

    def _current(self, node_id: str, epoch: int) -> Node | Result:
        node = self.nodes.get(node_id)
        if node is None:
            return Result(
                UNKNOWN_NODE, detail=f"node {node_id!r} is not registered (expired or never registered): register again"
            )
        if node.epoch != epoch:
            return Result(
                STALE_EPOCH, node.epoch, f"epoch {epoch} of node {node_id!r} is not current ({node.epoch}): register again"
            )
        node.seen += 1
        return node

    def _heartbeat(self, cmd: Heartbeat) -> Result:
        node = self._current(cmd.node_id, cmd.epoch)
        if isinstance(node, Result):
            return node
        if cmd.load is not None:
            node.load = dict(cmd.load)
        return Result(OK, node.epoch)

    def _deregister(self, cmd: Deregister) -> Result:
        node = self.nodes.get(cmd.node_id)
        if node is None:
            return Result(UNKNOWN_NODE, detail=f"node {cmd.node_id!r} is not registered")
        if cmd.epoch is not None and node.epoch != cmd.epoch:
            # A deregistration of an earlier registration (retried, or resent after the node registered again):
            # the current registration and its entries stay.
            return Result(
                STALE_EPOCH,
                node.epoch,
                f"epoch {cmd.epoch} of node {cmd.node_id!r} is not current ({node.epoch}): nothing deregistered",
            )
        return Result(OK, self._drop(node))

    def _drop(self, node: Node) -> int:
        removed = self.index.drop_node(node.idx)
        self._release(node)
        del self.nodes[node.node_id]
        del self.by_idx[node.idx]
        self._free_idx.append(node.idx)
        return removed

    def _publish(self, cmd: Publish) -> Result:
        node = self._current(cmd.node_id, cmd.epoch)
        if isinstance(node, Result):
            return node
        code = media.applied_code(cmd.medium)
        why = media.out_of_range(cmd.slots, code, media.capacity(node.capacity_blocks, node.regions, code), node.node_id)
        if why:
            return Result(INVALID, detail=why)
        if (
            len(self.index) + len(cmd.hashes) > self.max_entries
            and len(self.index) + self.index.missing(node.idx, cmd.hashes) > self.max_entries
        ):
            # Only new entries count against the limit, so a retried or slot-updating publish still succeeds.
            return Result(INDEX_FULL, detail=f"the index holds its maximum of {self.max_entries} entries")
        # One location per (block, node): a publish in another medium moves the entry (kvproto.media).
        return Result(OK, self.index.put(node.idx, cmd.hashes, media.locations(cmd.slots, code)))

    def _remove(self, cmd: Remove) -> Result:
        node = self._current(cmd.node_id, cmd.epoch)
        if isinstance(node, Result):
            return node
        return Result(OK, self.index.remove(node.idx, cmd.hashes))

    def _clear(self, cmd: Clear) -> Result:
        node = self._current(cmd.node_id, cmd.epoch)
        if isinstance(node, Result):
            return node
        return Result(OK, self.index.drop_node(node.idx))

    def _expire(self, cmd: Expire) -> Result:
        node = self.nodes.get(cmd.node_id)
        if node is None or node.epoch != cmd.epoch or node.seen != cmd.seen:
            return Result(OK, False)  # heard from since, re-registered or already gone
        self._drop(node)
        return Result(OK, True)

    def _announce(self, cmd: AnnounceReplica) -> Result:
        self.replicas[cmd.raft_addr] = cmd.http_url
        return Result(OK)

    def _assign_shards(self, cmd: AssignShards) -> Result:
        if self.shard_map is not None and (cmd.bootstrap or cmd.version <= self.shard_map.version):
            return Result(OK, 0)  # a second first map, or an older or repeated one: idempotent
        self.shard_map = cmd
        pins = dict(cmd.pins)
        gone = [n for n in self.nodes.values() if home_of(n.node_id, cmd.names, pins) != cmd.shard]
        for node in gone:
            self._drop(node)
        return Result(OK, len(gone))

    def _noop(self, cmd: Noop) -> Result:
        return Result(OK)

    # -- queries --------------------------------------------------------------

    def lookup(self, hashes: np.ndarray, with_slots: bool = False) -> list[Holder]:
        """Holders of the longest prefixes of `hashes`, longest first (docs/protocol.md §3): the lookup answer's
        own type, so that a replica's answer and a gateway mirror's are one thing (built unvalidated: the index
        holds only what validated publishes put there)."""
        nodes, matched, slots = self.index.lookup(hashes, with_slots)
        found = map(self.by_idx.__getitem__, nodes.tolist())
        make = Holder.model_construct
        if not with_slots:
            return [make(node_id=n.node_id, epoch=n.epoch, matched_blocks=k) for n, k in zip(found, matched.tolist())]
        return [
            make(node_id=n.node_id, epoch=n.epoch, matched_blocks=k, slots=slots[j, :k].tolist())
            for j, (n, k) in enumerate(zip(found, matched.tolist()))
        ]

    def blocks_held(self, node: Node) -> int:
        return self.index.count(node.idx)

    def digest(self) -> str:
        """Equal on replicas that hold the same nodes (ids, epochs) and entries."""
        h = xxhash.xxh3_128()
        if self.shard_map is not None:
            h.update(f"map\0{self.shard_map.version}\0{self.shard_map.shard}\0".encode())
        for node_id in sorted(self.nodes):
            h.update(f"{node_id}\0{self.nodes[node_id].epoch}\0".encode())
        h.update(self.index.digest({n.idx: n.node_id for n in self.nodes.values()}).encode())
        return h.hexdigest()


_HANDLERS: dict[type[Command], Callable[[DirectoryState, Any], Result]] = {
    Register: DirectoryState._register,
    Heartbeat: DirectoryState._heartbeat,
    Deregister: DirectoryState._deregister,
    Publish: DirectoryState._publish,
    Remove: DirectoryState._remove,
    Clear: DirectoryState._clear,
    Expire: DirectoryState._expire,
    AnnounceReplica: DirectoryState._announce,
    AssignShards: DirectoryState._assign_shards,
    Noop: DirectoryState._noop,
}
