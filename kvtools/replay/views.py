"""The simulated cluster as the gateway's `Router` reads it: `gateway.router.EngineView` and `HolderView` over the
replay's engines, so the simulation routes through the gateway's own code (candidates, in-flight prefixes, the
policy, the pull plan) and cannot drift from it.

A view reads the engine's live state when the router asks; what a gateway knows of the engine's pending prefill
is `pending_estimate` (its own and its peers' notes, plus the rest of the engine's last report).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

SIM_EPOCH = 1  # simulated engines never restart
SIM_FINGERPRINT = "replay"  # one KV layout for every simulated engine: any may pull from any


def pending_estimate(own: float, reported: float, own_at_report: float, age_s: float, prefill_tokens_per_s: float) -> float:
    """An engine's prefill backlog as one of several gateways can know it: its own pending prefill now, plus the
    others' part of what the engine last reported (``reported - own_at_report``) less what the engine can have
    prefilled since (``age_s * prefill_tokens_per_s``). A gateway alone gets its own count (the rest is ~0).
    The simulation's `--heartbeat-s` model only: the live gateway counts its own pending prefill (docs/replay.md)."""
    others = reported - own_at_report - age_s * prefill_tokens_per_s
    return own + others if others > 0 else own


class SimNode(Protocol):
    """What a view reads of a simulated engine (kvtools.replay.cluster's `_Node`)."""

    running: int
    inflight: list[int]
    pending: list[float]
    peer_pending: list[float]
    own_reported: list[float]
    reported: float

    @property
    def queued(self) -> int: ...
    @property
    def cached(self) -> int: ...


class SimClock(Protocol):
    """The simulation's clock and the engines' last heartbeat, read by the views."""

    now: float
    report_time: float


class SimEngine:
    """One simulated engine as one gateway sees it."""

    __slots__ = ("_clock", "_gw", "_node", "block_bytes", "block_size", "capacity_blocks", "node_id", "prefill_tokens_per_s")

    epoch = SIM_EPOCH
    healthy = True
    can_pull = True
    pull_gbps = 0.0  # pulls are priced at the simulated link (the cost model's)
    fingerprint = SIM_FINGERPRINT
    tp_size = 1  # a simulated engine is one holder: a DP rank is an engine of its own, as in the gateway
    tenant = ""  # one tenant's engines, none shared: any may pull from any
    shared = False

    def __init__(
        self,
        node_id: str,
        node: SimNode,
        gw: int,
        clock: SimClock,
        *,
        block_size: int,
        block_bytes: int,
        capacity_blocks: int,
        prefill_tokens_per_s: float,
    ) -> None:
        self.node_id = node_id
        self._node = node
        self._gw = gw
        self._clock = clock
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.capacity_blocks = capacity_blocks
        self.prefill_tokens_per_s = prefill_tokens_per_s

    @property
    def running(self) -> float:
        return self._node.running

    @property
    def waiting(self) -> float:
        return self._node.queued

    @property
    def inflight(self) -> int:
        return self._node.inflight[self._gw]

    @property
    def reported_inflight(self) -> int:
        """`running` and `waiting` are the node's now: they include this gateway's requests in flight now."""
        return self.inflight

    @property
    def pending_prefill_tokens(self) -> float:
        nd, g, c = self._node, self._gw, self._clock
        return pending_estimate(
            nd.pending[g] + nd.peer_pending[g], nd.reported, nd.own_reported[g], c.now - c.report_time, self.prefill_tokens_per_s
        )

    @property
    def blocks(self) -> int:
        return self._node.cached


@dataclass(frozen=True, slots=True)
class SimHolder:
    """A node's leading run of a prompt's blocks, as the directory (lagged) lists it."""

    matched_blocks: int
    slots: Sequence[int]
    epoch: int = SIM_EPOCH
