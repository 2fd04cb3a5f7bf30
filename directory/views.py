"""What a replica's reads return: copies taken under the state lock, still consistent once it is released."""

from __future__ import annotations

import copy
from typing import NamedTuple

from kvproto.state import DirectoryState, Node


class NodeView(NamedTuple):
    """A registered node as read at one moment: a copy of its record, and the blocks it holds."""

    node: Node
    blocks: int


class Counts(NamedTuple):
    nodes: int
    entries: int


class Digest(NamedTuple):
    """`DirectoryState.digest` with what it covers, all read at one moment."""

    digest: str
    applied: int
    entries: int
    nodes: int


def node_view(state: DirectoryState, node: Node) -> NodeView:
    # A shallow copy is a consistent snapshot: commands replace a node's fields (`load` too), never mutate them.
    return NodeView(copy.copy(node), state.blocks_held(node))
