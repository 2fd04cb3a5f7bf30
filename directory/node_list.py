"""The node list (`GET /v1/nodes`, `GET /v1/nodes/{id}`) as each reader may see it, encoded cheaply.

A token confined to a tenant sees its tenant's nodes in full and shared nodes without their memory
coordinates (transfer sessions, regions' addresses and keys): whoever reads those can read, or with
Mooncake write, the engine's KV pool, so only a token not confined to a tenant (or anyone, with auth
off) sees every node in full. Other tenants' nodes are left out, as if absent.

Every gateway, engine rank and worker polls the list, and a node's registration (its regions) is most of
its bytes and changes only when it registers again: each node's unchanging part is encoded once per
registration and view, and a whole answer once per state and view. The answer's ETag is the state's
position in its group (replicated: every replica gives the same state the same tag) and the view, so a
poll that names it in `If-None-Match` is answered 304 without copying or encoding anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import Request

from directory.auth import PRINCIPAL, Principal
from directory.replica import Replica
from kvproto import state as st
from kvproto.codec import group_of

_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class View:
    """What a reader sees of the nodes: all in full (`tenant` None), or those of `tenant` in full and shared
    ones without their memory coordinates."""

    tenant: str | None = None

    @property
    def tag(self) -> str:
        """This view's part of an ETag."""
        return "all" if self.tenant is None else f"t.{self.tenant}"

    def sees(self, node: st.Node) -> bool | None:
        """None: the node is not listed to this reader; else whether its memory coordinates are withheld."""
        if self.tenant is None or st.tenant_of(node.profile) == self.tenant:
            return False
        if node.profile is not None and node.profile.shared:
            return True
        return None


def view_of(request: Request) -> View:
    """The view of the request's token: a confined token's tenant, else every node in full."""
    principal: Principal | None = request.scope.get(PRINCIPAL) if request.app.state.auth else None
    return View(None if principal is None else principal.tenant)


def _profile_info(p: st.NodeProfile | None) -> dict[str, Any]:
    if p is None:
        return {"models": [], "fingerprint": None, "tenant": "", "shared": False, "dp_rank": None}
    return {"models": list(p.models), "fingerprint": p.fingerprint, "tenant": p.tenant, "shared": p.shared, "dp_rank": p.dp_rank}


def _registration(node: st.Node, withheld: bool) -> bytes:
    """The node's fields that change only with its registration, as a JSON object without its closing brace."""
    return _encode(
        {
            "node_id": node.node_id,
            "epoch": node.epoch,
            "alive": True,
            "api_url": node.api_url,
            "transfer_url": None if withheld else node.transfer_url,
            "regions": [] if withheld else node.regions,
            "capacity_blocks": node.capacity_blocks,
            "block_size": node.block_size,
            **_profile_info(node.profile),
        }
    )[:-1]


_Key = tuple[str, int, str, bool]  # node id, epoch, incarnation, withheld
_Listed = tuple[st.Node, bool, int, dict[str, float]]  # a node, withheld, blocks held, load


class NodeList:
    """Encoded node lists of one replica: the latest state's answers by ETag, and each registration's part."""

    def __init__(self, replica: Replica) -> None:
        self._replica = replica
        self._generation = ""
        self._answers: dict[str, bytes] = {}
        self._parts: dict[_Key, bytes] = {}

    async def answer(self, view: View, if_none_match: str | None) -> tuple[str, bytes | None]:
        """The list's ETag and its JSON body, or None for the body when `if_none_match` names the ETag."""
        known = self._generation, set(self._answers)

        def read(s: st.DirectoryState) -> tuple[str, list[_Listed] | None, set[tuple[str, int]]]:
            generation = f"{group_of(s) or 0}.{s.applied}"
            etag = _etag(generation, view)
            if _matches(if_none_match, etag) or (generation == known[0] and etag in known[1]):
                return generation, None, set()
            listed = []
            for n in s.nodes.values():
                withheld = view.sees(n)
                if withheld is not None:
                    listed.append((n, withheld, s.blocks_held(n), n.load))
            return generation, listed, {(n.node_id, n.epoch) for n in s.nodes.values()}

        generation, listed, live = await self._replica.read(read)
        etag = _etag(generation, view)
        if _matches(if_none_match, etag):
            return etag, None
        cached = self._answers.get(etag) if generation == self._generation else None
        if cached is not None:
            return etag, cached
        if listed is None:  # another request moved this cache on to a later state meanwhile
            return await self.answer(view, None)
        body = b'{"nodes":[' + b",".join(self._node(*n) for n in listed) + b"]}"
        if generation != self._generation:
            self._generation, self._answers = generation, {}
            self._parts = {k: v for k, v in self._parts.items() if (k[0], k[1]) in live}
        self._answers[etag] = body
        return etag, body

    async def one(self, view: View, node_id: str) -> bytes | None:
        """The JSON of node `node_id` as this view shows it, or None if it is not registered or not listed to it."""

        def read(s: st.DirectoryState) -> _Listed | None:
            n = s.nodes.get(node_id)
            withheld = None if n is None else view.sees(n)
            return None if n is None or withheld is None else (n, withheld, s.blocks_held(n), n.load)

        found = await self._replica.read(read)
        return None if found is None else self._node(*found)

    def _node(self, node: st.Node, withheld: bool, blocks: int, load: dict[str, float]) -> bytes:
        # Commands replace a node's record and its load, never mutate them: encoding them off the lock is safe.
        key = (node.node_id, node.epoch, node.incarnation, withheld)
        part = self._parts.get(key)
        if part is None:
            part = self._parts[key] = _registration(node, withheld)
        return part + b',"blocks":' + str(blocks).encode() + b',"load":' + _encode(load) + b"}"


def _etag(generation: str, view: View) -> str:
    return f'"{generation}.{view.tag}"'


def _matches(if_none_match: str | None, etag: str) -> bool:
    """Whether an If-None-Match header names `etag` (weak or strong, in a list, or `*`)."""
    if not if_none_match:
        return False
    return any(t.strip().removeprefix("W/") in (etag, "*") for t in if_none_match.split(","))
