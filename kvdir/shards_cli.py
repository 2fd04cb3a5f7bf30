"""`kvdir shards show|apply`: read a sharded directory's map, or change it without downtime (docs/scale-out.md §5).

`apply FILE` reads every shard's committed map and registered nodes, asks `kvproto.shardmap.apply_order`
for the order that never lets two groups hold one node, and commits the new map (`PUT /v1/shards`) to
each shard in that order, retrying a shard without a leader until the deadline. A change with no safe
order (a shard that would both give and take nodes) is refused before anything is written. A shard
that already holds FILE's map is skipped, so an interrupted apply is finished by running it again.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from kvdir.roles import Role, add_settings_flags, build_settings
from kvproto.client import DirectoryClient
from kvproto.client_settings import DirectoryClientSettings
from kvproto.errors import DirectoryError
from kvproto.shardmap import ShardMap, ShardMapError, UnsafeChange, apply_order, load


class ShardsSettings(DirectoryClientSettings):
    """The directory client's settings (an admin token when the directory has auth: `apply` changes the map),
    and how long to wait for a shard that has no leader."""

    deadline_s: float = Field(
        30.0, gt=0, description="how long each request may retry a shard that does not answer (no leader, 503)"
    )


ROLE = Role(
    "shards", "show or change the directory's shard map", "kvdir.shards_cli:ShardsSettings", "kvdir.shards_cli:run_shards"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    show = actions.add_parser("show", help="print the shard map and each shard's committed version and node count")
    add_settings_flags(show, ROLE)
    apply = actions.add_parser(
        "apply", help="commit the shard map in FILE to every shard, in the order that keeps each node in one group"
    )
    apply.add_argument("file", type=Path, metavar="FILE", help="the new shard map (JSON; its version above the current one)")
    add_settings_flags(apply, ROLE)


@dataclass(frozen=True)
class ShardView:
    """What one shard's group has committed: its map (version 0 and "" if none yet) and its registered nodes."""

    name: str
    urls: list[str]
    version: int
    document: str
    nodes: list[str]


class ShardsError(Exception):
    """Why `kvdir shards` stopped; `status` is its exit status (2: bad input or an unsafe change, 1: the directory)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def run_shards(args: argparse.Namespace) -> int:
    settings: ShardsSettings = build_settings(ROLE, args)
    try:
        if args.action == "show":
            asyncio.run(show(settings))
        else:
            asyncio.run(apply(settings, args.file))
    except ShardsError as exc:
        print(f"kvdir shards {args.action}: {exc}", file=sys.stderr)
        return exc.status
    return 0


def _client(urls: list[str], s: ShardsSettings, *, sharded: bool = False) -> DirectoryClient:
    return DirectoryClient(urls, token=s.directory_token, deadline=s.deadline_s, sharded=sharded)


async def current_map(s: ShardsSettings) -> ShardMap:
    """The map of the replica that answers first among `--directory`; ShardsError if the directory is not sharded."""
    try:
        async with _client(s.directory_urls, s, sharded=True) as d:
            m = await d.shard_map(refresh=True)
    except DirectoryError as exc:
        raise ShardsError(f"cannot read the shard map: {exc}", 1) from exc
    if m is None:
        raise ShardsError("the directory is not sharded (its replicas run without --shard-map-file)", 2)
    return m


async def view(name: str, urls: list[str], s: ShardsSettings) -> ShardView:
    """One shard's committed map and registered nodes, read from any of its replicas."""
    try:
        async with _client(urls, s) as d:
            doc = await d.request("GET", "/v1/shards")
            nodes = [n.node_id for n in await d.nodes()]
    except DirectoryError as exc:
        raise ShardsError(f"shard {name} ({', '.join(urls)}) did not answer: {exc}", 1) from exc
    if doc.get("shard") != name:
        raise ShardsError(f"{', '.join(urls)} is shard {doc.get('shard')!r}, not {name!r}: is the map's URL list right?", 2)
    committed = ShardMap.model_validate({k: v for k, v in doc.items() if k != "shard"})
    return ShardView(name, urls, committed.version, committed.document(), sorted(nodes))


async def views(shards: dict[str, list[str]], s: ShardsSettings) -> dict[str, ShardView]:
    found = await asyncio.gather(*(view(name, urls, s) for name, urls in shards.items()))
    return {v.name: v for v in found}


async def show(s: ShardsSettings) -> None:
    m = await current_map(s)
    seen = await views({name: m.urls(name) for name in m.names}, s)
    print(f"shard map version {m.version}: {len(m.names)} shards, {sum(len(v.nodes) for v in seen.values())} nodes")
    for name in m.names:
        v = seen[name]
        behind = "" if v.version == m.version else f" (has version {v.version}: a change is not applied everywhere)"
        print(f"  {name}: {len(v.nodes)} node{'s' * (len(v.nodes) != 1)}, map version {v.version}{behind}, {', '.join(v.urls)}")
    for node, shard in sorted(m.nodes.items()):
        print(f"  pinned: {node} -> {shard}")


async def apply(s: ShardsSettings, path: Path) -> None:
    try:
        new = load(path)
    except ShardMapError as exc:
        raise ShardsError(str(exc), 2) from exc
    old = await current_map(s)
    # Every shard of either map: a shard the new map removes must drop its nodes, one it adds must be running.
    urls = {name: old.urls(name) for name in old.names} | {name: new.urls(name) for name in new.names}
    seen = await views(urls, s)
    document = new.document()
    for v in seen.values():
        if v.version >= new.version and v.document != document:
            raise ShardsError(
                f"shard {v.name} has map version {v.version}, as new as {path}'s ({new.version}): raise its version", 2
            )
    homes = {node: v.name for v in seen.values() for node in v.nodes}
    try:
        order = apply_order(new, homes)
    except UnsafeChange as exc:
        raise ShardsError(str(exc), 2) from exc
    moves = sorted((node, shard, new.home(node)) for node, shard in homes.items() if new.home(node) != shard)
    print(
        f"shard map version {new.version}: {len(moves)} registered node{'s' * (len(moves) != 1)} move; order {', '.join(order)}"
    )
    for node, src, dst in moves:
        print(f"  {node}: {src} -> {dst}")
    for name in order:
        v = seen[name]
        if v.document == document:
            print(f"  {name}: already at version {new.version}")
            continue
        try:
            async with _client(v.urls, s) as d:
                res = await d.request("PUT", "/v1/shards", new.model_dump())
        except DirectoryError as exc:
            raise ShardsError(f"shard {name}: {exc} (the shards before it have version {new.version}: apply again)", 1) from exc
        print(f"  {name}: version {new.version} committed, {res['dropped']} node{'s' * (res['dropped'] != 1)} dropped")
    print("done: moved nodes register again at their new home shard (their sessions do on their next write)")
