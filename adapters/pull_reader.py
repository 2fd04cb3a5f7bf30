"""Pulls read in threads of their own, so that no engine step waits on a read (the vLLM connector's worker half).

A `PullJob` reads a block run's tags, then its pages, then its tags again (`ReadPlan`), all into buffers of its own
(the staging buffer and the tag pairs): never into the KV blocks, which the worker writes only once the job is
done and its request still wants the bytes (adapters/connector_worker.py). That is what makes a job safe to
abandon: a read past its deadline, or of a request vLLM aborted, writes into memory nobody else uses, kept alive
until the read returns (a transfer engine's abandoned read may still write until the engine gives up).

The reader threads start unpinned from vLLM's compute cores (see `unpinned`), and wait on the transfer engine
with a blocking call: they never spin on a core the forward pass needs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from kvtransfer.engine import TransferEngine

log = logging.getLogger("kvdir.vllm")

Batch = tuple[list[int], list[int], list[int]]
"""One transfer read: (local addresses, remote addresses, lengths)."""


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """Let the calling thread, and the threads it starts meanwhile, run on every CPU.

    vLLM's CPU worker pins its main thread (and so every thread it starts) to its compute cores, the same
    cores in every engine on a machine. Mooncake's service threads, started in `register_kv_caches`, and its
    synchronous read, which busy-waits on the thread that calls it, then share one core with the peer's
    service threads: reads were measured stalling for over 5 s (timed out: recomputed) on two busy cores,
    and a few hundred ms when they completed. Off the compute cores the same reads take milliseconds.
    """
    try:
        pinned = os.sched_getaffinity(0)
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError as exc:  # no such call here, or a cpuset that refuses: keep vLLM's binding
        log.debug("cannot unpin the transfer threads: %s", exc)
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)


@dataclass(eq=False)
class ReadPlan:
    """One request's read from one source: tags (`first`), pages into `staging` (`pages`), tags again (`again`),
    and the copies that land the staged pages in the KV blocks once the read is done (`land`: KV addresses,
    staging addresses, lengths).

    The two are cut into pieces apart, because a transfer engine pays per piece: the staging buffer is one run, so
    the read's pieces break only where the source's slots do, and the landing's only where the destination blocks
    do (an engine's free blocks are scattered after evictions; a holder's prefix is often a few runs).
    `tags` holds the two tag reads, (2, blocks, 2) u64."""

    session: str
    first: Batch
    pages: Batch
    again: Batch
    tags: np.ndarray
    staging: np.ndarray
    land: Batch

    @property
    def page_bytes(self) -> int:
        return sum(self.pages[2])


@dataclass(eq=False)
class PullJob:
    """One pull for the reader threads: `prepare` (on a reader thread: it may wait for the pull sources' list)
    gives the read, which the reader then runs. The reader sets `plan`, `error` (or leaves it None), `read_s`
    (the reads alone) and then `done`; `deadline` is on `time.monotonic()`."""

    req_id: str
    deadline: float
    prepare: Callable[[], ReadPlan]
    plan: ReadPlan | None = None
    error: BaseException | None = None
    read_s: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


class PullReader:
    """`threads` reader threads over one transfer engine, taking jobs in the order they come."""

    def __init__(self, transfer: TransferEngine, threads: int) -> None:
        self._transfer = transfer
        self._jobs: queue.SimpleQueue[PullJob | None] = queue.SimpleQueue()
        self.any_done = threading.Event()
        """Set after any job's `done`: a caller clears it, checks its jobs, then waits on it for the next one."""
        with unpinned():  # the threads inherit the CPUs of the thread that starts them
            self._threads = [threading.Thread(target=self._run, name=f"kvdir-pull-{i}", daemon=True) for i in range(threads)]
            for t in self._threads:
                t.start()

    def submit(self, job: PullJob) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        """Stop the threads once they finish the read they are in (they are daemons: exit does not wait for them)."""
        for _ in self._threads:
            self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if time.monotonic() >= job.deadline:
                    raise TimeoutError("its deadline passed while it waited for a reader thread")
                plan = job.plan = job.prepare()
                t0 = time.monotonic()
                for local, remote, lengths in (plan.first, plan.pages, plan.again):
                    self._transfer.read(plan.session, local, remote, lengths)
                job.read_s = time.monotonic() - t0
            except BaseException as exc:  # every failure is the job's outcome (a recompute), never the thread's end
                job.error = exc
            job.done.set()
            self.any_done.set()
