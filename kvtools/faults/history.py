"""The fault harness's record: every operation with its outcome, every fault with its window.

An operation is *ok* (acknowledged: a 2xx), *fail* (a definite refusal: a
4xx, so it did not and will not happen) or *unknown* (timeout, connection
error, 503: it may have happened, now or later, since the replica keeps
retrying a command until the request's deadline). The checker treats
unknown operations as possibly applied at any time after their start.

Block hashes are derived from a sequence number, so the history stores one
integer per publish instead of the hashes: `seq_hashes(seq)`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

SEQ_BLOCKS = 8
"""Blocks per published sequence: a publish, a remove and a lookup each cover one whole sequence."""

OK, FAIL, UNKNOWN = "ok", "fail", "unknown"
WRITES = frozenset({"register", "publish", "remove", "heartbeat"})


def _mix(x: int) -> int:
    # splitmix64's finaliser: a bijection on 64-bit integers, so distinct inputs give distinct hashes.
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def seq_hashes(seq: int) -> list[int]:
    """The block hashes of sequence `seq` (distinct across all sequences)."""
    return [_mix(seq * SEQ_BLOCKS + k) for k in range(SEQ_BLOCKS)]


@dataclass(slots=True)
class Op:
    """One request to one replica. Times are `time.monotonic()` seconds."""

    kind: str  # register | publish | remove | heartbeat | lookup
    node: str
    replica: int  # over all shards, shard by shard: shard 1's first replica follows shard 0's last
    t0: float
    t1: float = 0.0
    outcome: str = UNKNOWN
    status: int | None = None  # HTTP status, None without an answer
    epoch: int | None = None  # the epoch sent (publish, remove, heartbeat) or returned (register)
    seq: int | None = None
    slots: tuple[int, ...] | None = None
    consistency: str | None = None  # lookups: local | linearizable
    holders: dict[str, tuple[int, int, tuple[int, ...]]] | None = None  # lookups: node -> (epoch, matched, slots)
    incarnation: str | None = None  # registrations: the process start it stands for
    shard: int = 0  # the index of the shard (Raft group) that `replica` belongs to


@dataclass(slots=True)
class Fault:
    """One injected fault: what, on which replicas (of which shard), when, and what was measured around it."""

    kind: str
    replicas: list[int]
    t0: float
    t1: float = 0.0
    leader_before: int | None = None
    minority: list[int] = field(default_factory=list)
    minority_commit: dict[int, tuple[int, int]] = field(default_factory=dict)  # replica -> (after settling, at heal)
    recovered_s: float | None = None
    shard: int = 0  # the index of the shard whose replicas these are


class History:
    """Thread-safe append-only lists of operations and faults."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.faults: list[Fault] = []
        self.start = time.monotonic()
        self._lock = threading.Lock()

    def add(self, op: Op) -> None:
        with self._lock:
            self.ops.append(op)

    def fault(self, f: Fault) -> Fault:
        with self._lock:
            self.faults.append(f)
        return f

    def counts(self, shard: int | None = None) -> dict[str, Any]:
        """Outcomes by kind, of every operation or of those sent to `shard`."""
        with self._lock:
            ops = [o for o in self.ops if shard is None or o.shard == shard]
        out: dict[str, Any] = {"ops": len(ops)}
        for kind in ("register", "publish", "remove", "heartbeat", "lookup"):
            mine = [o for o in ops if o.kind == kind]
            out[kind] = {k: sum(o.outcome == k for o in mine) for k in (OK, FAIL, UNKNOWN)}
        return out
