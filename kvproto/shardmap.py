"""The shard map: which Raft group (shard) is each node's home (docs/scale-out.md).

The directory splits by node: a node's registration, epoch, lease and entries live in one group,
its home shard, so fencing stays exactly the single-group argument. The map is a small versioned
document, written by an operator or by `kvdir up --shards N`, committed into every shard's log
(`kvproto.state.AssignShards`) and served by every replica on `GET /v1/shards`:

    {"version": 2,
     "shards": {"s0": ["http://10.0.0.1:8001", ...], "s1": [...]},
     "nodes": {"node-7": "s1"}}

Nodes that `nodes` does not name are placed by rendezvous hashing: the shard whose XXH3-64 of
`shard NUL node_id` is highest. Adding a shard then moves nodes only to the new shard, and removing
one moves only its own nodes, so every such change has a safe commit order (`apply_order`).
Explicit entries move or pin a node. This module is pure (no I/O but `load`), shared by the
replica, the state machine and the clients.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import xxhash
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

MAX_SHARDS = 256
"""At most this many shards: a shard's index goes into its epoch base (`kvproto.state.new_epoch_base`)."""

SHARD_BITS = 8

ShardName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
_URL = re.compile(r"^https?://[^/\s]+/?$")


def home_of(node_id: str, names: tuple[str, ...], pins: Mapping[str, str]) -> str:
    """The home shard of `node_id` among the sorted shard `names` (deterministic: used in the state machine)."""
    pinned = pins.get(node_id)
    if pinned is not None:
        return pinned
    key = b"\0" + node_id.encode()
    return max(names, key=lambda shard: xxhash.xxh3_64_intdigest(shard.encode() + key))


class ShardMap(BaseModel):
    """A validated shard map; `home(node_id)` places a node."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = Field(ge=1, description="raised by every change; a group ignores a map not newer than its own")
    shards: dict[ShardName, list[str]] = Field(min_length=1, max_length=MAX_SHARDS)
    nodes: dict[str, ShardName] = Field(default_factory=dict, description="node id -> shard, for moved or pinned nodes")

    @model_validator(mode="after")
    def _check(self) -> ShardMap:
        for name, urls in self.shards.items():
            if not urls:
                raise ValueError(f"shard {name!r} lists no replica URL")
            bad = [u for u in urls if not _URL.match(u)]
            if bad:
                raise ValueError(f"shard {name!r}: {bad[0]!r} is not an http(s)://host:port URL")
        unknown = {s for s in self.nodes.values() if s not in self.shards}
        if unknown:
            raise ValueError(f"nodes are assigned to shards the map does not list: {sorted(unknown)}")
        return self

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.shards))

    def index_of(self, shard: str) -> int:
        """The shard's position among the sorted names: what keeps epochs of different shards apart."""
        return self.names.index(shard)

    def home(self, node_id: str) -> str:
        return home_of(node_id, self.names, self.nodes)

    def urls(self, shard: str) -> list[str]:
        return [u.rstrip("/") for u in self.shards[shard]]

    def document(self) -> str:
        """The canonical JSON text: what the groups commit and `GET /v1/shards` serves."""
        return json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":"))


class ShardMapError(ValueError):
    """A shard map file or body that is not a valid map."""


def parse(text: str | bytes) -> ShardMap:
    try:
        return ShardMap.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "map"
        raise ShardMapError(f"invalid shard map ({where}): {first.get('msg')}") from exc


def load(path: Path) -> ShardMap:
    """The map in the JSON file `path`; ShardMapError with the reason if it is not one."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ShardMapError(f"cannot read the shard map {path}: {exc}") from exc
    return parse(text)


class UnsafeChange(ShardMapError):
    """A map change with no safe commit order: some shard would both give and take registered nodes."""


def apply_order(new: ShardMap, homes: Mapping[str, str]) -> list[str]:
    """The shards of `new` in the order a change must be committed to them (docs/scale-out.md §5).

    `homes` maps each registered node to the shard that holds it now. A shard that gives nodes away
    must drop them before their new home admits them, or a restarted node could be registered in two
    groups at once, the old one still serving its fenced entries. So shards that give come first,
    then the rest. A shard that both gives and takes has no safe place in that order: the change
    must be split into two map versions (UnsafeChange says which nodes).
    """
    gives = {old for node, old in homes.items() if new.home(node) != old}
    takes = {new.home(node) for node, old in homes.items() if new.home(node) != old}
    both = gives & takes
    if both:
        moving = sorted(n for n, old in homes.items() if new.home(n) != old and (old in both or new.home(n) in both))
        raise UnsafeChange(
            f"shards {sorted(both)} would both give and take nodes ({moving[:5]}...): "
            "split the change into two map versions, moves out first"
        )
    return sorted(gives) + [s for s in new.names if s not in gives]  # a removed shard gives, and is listed
