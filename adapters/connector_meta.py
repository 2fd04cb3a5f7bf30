"""What the vLLM connector's two halves pass each other every step, as plain data (no vLLM here).

vLLM runs the scheduler half in the EngineCore process and the worker half in each TP rank's worker process; it
carries one `StepPlan` from the first to the second with each step, and one `WorkerReport` per rank back, which
it merges over the ranks (`WorkerReport.merge`). The facade (adapters/vllm_connector.py) wraps both in vLLM's
metadata classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from adapters.vllm_plan import KvLayout

K = TypeVar("K")
N = TypeVar("N", int, float)


@dataclass(frozen=True, slots=True)
class RankHandshake:
    """One TP rank's worker, sent once to the scheduler half (vLLM's handshake metadata), which registers it: its transfer session, KV layout and host tier's."""

    session: str
    layout: KvLayout
    host: KvLayout | None = None


@dataclass(slots=True)
class Load:
    """One request's pull: destination blocks here, the source's slots (locations, medium bits included), the
    blocks' kvdir hashes."""

    req_id: str
    source_node: str
    source_epoch: int
    dst_blocks: list[int]
    src_slots: list[int]
    hashes: list[int]


@dataclass(slots=True)
class HostLoad:
    """One request's blocks loaded back from this engine's host tier: destination blocks, host slots, hashes."""

    req_id: str
    dst_blocks: list[int]
    host_slots: list[int]
    hashes: list[int]


@dataclass(slots=True)
class StepPlan:
    """Scheduler -> worker, one step.

    `written`: blocks about to be written (their tags are invalidated first); `complete`: (req id, block, hash) of
    the blocks complete after this step's forward pass; `loads`: pulls to start (asynchronous: they land in a later
    step); `host_loads`: loads back from the host tier (synchronous: before this step's forward pass); `saves`:
    (req id, block, host slot, hash) of complete blocks to copy to the host tier; `idle`: the step runs no
    token (vLLM steps again at once while a request waits for its pull: the worker may wait a little for one).
    """

    written: list[int] = field(default_factory=list)
    complete: list[tuple[str, int, int]] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    host_loads: list[HostLoad] = field(default_factory=list)
    saves: list[tuple[str, int, int, int]] = field(default_factory=list)
    idle: bool = False


@dataclass(slots=True)
class WorkerReport:
    """Worker -> scheduler, one step, of one TP rank or (merged) of all.

    `complete`: (block, hash) computed and complete, as each rank reports them; `pulled`: (req id, block, hash) of
    pulled blocks that landed and validated on the reporting rank (the scheduler half counts a pull's outcome once
    it ends, over every rank: the ranks' reads may end in different steps); `read_bytes` / `read_s`: per rank, page bytes and seconds of the reads that completed
    (tags, pages, tags: the pull bandwidth); `saved` / `unsaved`: (hash, host slot) saved to the host tier or not
    (its request failed); `host_loaded` / `host_failed`: destination blocks loaded back from the host tier, and
    those that failed the tag check.
    """

    complete: list[tuple[int, int]] = field(default_factory=list)
    pulled: list[tuple[str, int, int]] = field(default_factory=list)
    read_bytes: dict[int, int] = field(default_factory=dict)
    read_s: dict[int, float] = field(default_factory=dict)
    saved: list[tuple[int, int]] = field(default_factory=list)
    unsaved: list[tuple[int, int]] = field(default_factory=list)
    host_loaded: list[int] = field(default_factory=list)
    host_failed: list[int] = field(default_factory=list)

    def merge(self, other: WorkerReport) -> WorkerReport:
        return WorkerReport(
            self.complete + other.complete,
            self.pulled + other.pulled,
            summed(self.read_bytes, other.read_bytes),
            summed(self.read_s, other.read_s),
            self.saved + other.saved,
            self.unsaved + other.unsaved,
            self.host_loaded + other.host_loaded,
            self.host_failed + other.host_failed,
        )

    def __bool__(self) -> bool:
        return bool(self.complete or self.pulled or self.saved or self.unsaved or self.host_loaded or self.read_s)


def summed(a: dict[K, N], b: dict[K, N]) -> dict[K, N]:
    """Two tallies as one, key by key: the ranks' read bytes and seconds, and the pull counts the worker half reports
    through vLLM's connector stats (`pulls`, `pulled_blocks`, `failed_blocks`, `read_bytes`, `read_s`), two intervals'
    or two TP ranks'."""
    return {k: a.get(k, 0) + b.get(k, 0) for k in a.keys() | b.keys()}


def reduce_pull_stats(stats: dict[str, float]) -> dict[str, int | float]:
    """The figures vLLM logs for an interval ("KV Transfer metrics: ..."), summed over TP ranks."""
    read_s = stats.get("read_s", 0.0)
    read_bytes = stats.get("read_bytes", 0)
    return {
        "pulls": int(stats.get("pulls", 0)),
        "pulled_blocks": int(stats.get("pulled_blocks", 0)),
        "failed_blocks": int(stats.get("failed_blocks", 0)),
        "read_MiB": round(read_bytes / 2**20, 3),
        "read_GB_per_s": round(read_bytes / read_s / 1e9, 3) if read_s > 0 else 0.0,
    }
