"""The vLLM connector's worker half (adapters/connector_worker.py) without vLLM: two engines' KV as numpy memory in
this process, a transfer engine that copies between them (with a gate to hold a read), and the pull sources as a
fixed map. What it must do: pulls run off the calling thread and land only in `get_finished`, a failed or stale
block is a load error, an aborted request's bytes never land, a read past its deadline is given up at once."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from adapters import connector_worker
from adapters.config import ConnectorSettings
from adapters.connector_meta import Load, StepPlan, reduce_pull_stats
from adapters.connector_peers import probe_source
from adapters.connector_worker import WorkerHalf
from adapters.kv_memory import HostKvMemory
from adapters.vllm_plan import KvLayout, LayerRegion, PullSource
from kvtransfer.engine import TransferError
from tests.support.fakes import FixedPeers
from tests.support.wait import wait_for

BLOCKS, PAGE, LAYERS = 16, 256, 2


class MemTransfer:
    """Reads by copying within this process; `gate` (when set) holds every read until released or its timeout."""

    def __init__(self, session: str, timeout_s: float = 5.0) -> None:
        self.session = session
        self.gate: threading.Event | None = None
        self.timeout_s = timeout_s
        self.reads = 0
        self.pieces: list[int] = []  # each read's pieces
        self.threads: set[str] = set()

    def register(self, addr: int, length: int) -> None:
        return

    def read(self, peer: str, local_addrs: list[int], remote_addrs: list[int], lengths: list[int]) -> None:
        self.threads.add(threading.current_thread().name)
        if self.gate is not None and not self.gate.wait(self.timeout_s):
            raise TransferError("held past its timeout")
        self.reads += 1
        self.pieces.append(len(lengths))
        for to, frm, n in zip(local_addrs, remote_addrs, lengths):
            ctypes.memmove(to, frm, n)

    def close(self) -> None:
        return


def _engine(node_id: str, peers: FixedPeers, transfer: MemTransfer, probe_blocks: int = 0) -> tuple[WorkerHalf, list[np.ndarray]]:
    s = ConnectorSettings(
        node_id=node_id,
        api_url="http://127.0.0.1:9",
        transfer="tcp",
        transfer_timeout_s=1.0,
        peer_refresh_s=0.01,
        pull_probe_blocks=probe_blocks,
    )
    w = WorkerHalf(s, node_id=node_id, tp_size=1, fingerprint_of=lambda _: "fp", transfer_factory=lambda: transfer, peers=peers)
    pages = [np.zeros((BLOCKS, PAGE), dtype=np.uint8) for _ in range(LAYERS)]
    w.register(HostKvMemory(pages), 0)
    return w, pages


@pytest.fixture
def pair() -> Iterator[tuple[WorkerHalf, list[np.ndarray], WorkerHalf, list[np.ndarray], MemTransfer]]:
    """A source engine holding blocks 0..3 (hashes 101..104, layer l block b filled with 10*b + l + 1) and a puller."""
    peers = FixedPeers()
    transfer = MemTransfer("puller:1")
    src, src_pages = _engine("src", peers, MemTransfer("src:1"))
    dst, dst_pages = _engine("dst", peers, transfer)
    for b in range(4):
        for layer, p in enumerate(src_pages):
            p[b] = 10 * b + layer + 1
    src.bind(StepPlan(written=[0, 1, 2, 3]))
    src.wait_for_save(StepPlan(complete=[("r", b, 101 + b) for b in range(4)]))
    handshake = src.handshake()
    assert handshake is not None
    peers.sources[("src", 7)] = PullSource([handshake.session], [handshake.layout], "fp", None, None)
    yield src, src_pages, dst, dst_pages, transfer
    src.shutdown()
    dst.shutdown()


def _load(req: str = "q", dst_blocks: list[int] | None = None, epoch: int = 7) -> Load:
    return Load(req, "src", epoch, dst_blocks or [5, 6, 7], [0, 1, 2], [101, 102, 103])


def _finished(w: WorkerHalf, aborted: set[str] | None = None, deadline: float = 5.0) -> set[str]:
    """Poll `get_finished` as vLLM's steps would, until a request is reported (or fail at the deadline)."""
    done: set[str] = wait_for(lambda: w.get_finished(aborted or set()), deadline, interval=0.005, what="a finished pull")
    return done


def test_a_pull_reads_off_the_calling_thread_and_lands_in_get_finished(pair) -> None:
    _, src_pages, dst, dst_pages, transfer = pair
    transfer.gate = threading.Event()
    plan = StepPlan(written=[5, 6, 7], loads=[_load()])
    dst.bind(plan)
    dst.start_loads(plan)  # returns while the read is held
    assert dst.get_finished(set()) == set() and not dst_pages[0][5].any()
    transfer.gate.set()
    assert _finished(dst) == {"q"}
    assert transfer.threads and threading.current_thread().name not in transfer.threads
    for layer in range(LAYERS):
        for b, s in zip([5, 6, 7], [0, 1, 2]):
            assert (dst_pages[layer][b] == src_pages[layer][s]).all()
    assert dst.load_errors() == set()
    report = dst.report()
    assert report is not None and report.pulled == [("q", 5, 101), ("q", 6, 102), ("q", 7, 103)]
    assert report.read_bytes[0] == 3 * LAYERS * PAGE
    assert [int(x) for x in dst._tags[5:8, 0]] == [101, 102, 103]  # the puller serves them to its own peers now
    stats = dst.take_stats()  # what vLLM's connector stats carry, then nothing until the next pull ends
    assert stats is not None and reduce_pull_stats(stats) == {
        "pulls": 1,
        "pulled_blocks": 3,
        "failed_blocks": 0,
        "read_MiB": round(3 * LAYERS * PAGE / 2**20, 3),
        "read_GB_per_s": round(3 * LAYERS * PAGE / stats["read_s"] / 1e9, 3),
    }
    assert dst.take_stats() is None


def test_scattered_destination_blocks_are_read_in_the_sources_runs_and_land_each_in_its_place(pair) -> None:
    """The read goes into one staging run, so only the source's slots cut it into pieces: three consecutive source
    slots are one piece per layer whatever blocks they land in (before: a piece per block per layer)."""
    _, src_pages, dst, dst_pages, transfer = pair
    scattered = [9, 5, 7]
    plan = StepPlan(written=scattered, loads=[_load(dst_blocks=scattered)])
    dst.bind(plan)
    dst.start_loads(plan)
    assert _finished(dst) == {"q"} and dst.load_errors() == set()
    assert transfer.pieces == [1, LAYERS, 1]  # tags, pages, tags
    for layer in range(LAYERS):
        for b, s in zip(scattered, [0, 1, 2]):
            assert (dst_pages[layer][b] == src_pages[layer][s]).all()


def test_a_stale_block_is_a_load_error_and_the_others_land(pair) -> None:
    src, _, dst, _, _ = pair
    src.bind(StepPlan(written=[1]))  # the source reuses block 1: its tag no longer holds hash 102
    plan = StepPlan(written=[5, 6, 7], loads=[_load()])
    dst.bind(plan)
    dst.start_loads(plan)
    assert _finished(dst) == {"q"}
    assert dst.load_errors() == {6}
    stats = dst.take_stats()
    assert stats is not None and (stats["pulled_blocks"], stats["failed_blocks"]) == (2, 1)
    report = dst.report()
    assert report is not None and [b for _, b, _ in report.pulled] == [5, 7]
    assert int(dst._tags[6, 0]) == 0


def test_a_source_no_list_names_fails_without_a_read(pair) -> None:
    _, _, dst, _, transfer = pair
    plan = StepPlan(written=[5, 6, 7], loads=[_load(epoch=8)])  # the source restarted since the plan was made
    dst.bind(plan)
    dst.start_loads(plan)
    assert _finished(dst) == {"q"}
    assert dst.load_errors() == {5, 6, 7} and transfer.reads == 0


def test_a_source_registered_since_the_last_list_is_waited_for_and_read(pair) -> None:
    """The gateway planned from a registration newer than the list this engine last read: the reader waits for
    the next read of the list rather than refusing the plan."""
    _, _, dst, dst_pages, transfer = pair
    peers = dst._peers
    peers.listed[("src", 8)] = peers.sources.pop(("src", 7))  # type: ignore[attr-defined]
    plan = StepPlan(written=[5, 6, 7], loads=[_load(epoch=8)])
    dst.bind(plan)
    dst.start_loads(plan)
    assert _finished(dst) == {"q"}
    assert dst.load_errors() == set() and transfer.reads == 3 and dst_pages[0][5].any()


def test_an_aborted_pull_never_lands(pair) -> None:
    _, _, dst, dst_pages, transfer = pair
    transfer.gate = threading.Event()
    plan = StepPlan(written=[5, 6, 7], loads=[_load()])
    dst.bind(plan)
    dst.start_loads(plan)
    assert dst.get_finished({"q"}) == {"q"}  # vLLM may free its blocks now: the read goes on into its own buffer
    (orphan,) = dst._orphans  # the aborted pull's read, still running
    transfer.gate.set()
    assert orphan.done.wait(5)  # the read has returned: had its bytes been going to land, they would now
    assert dst.get_finished(set()) == set() and dst.load_errors() == set()
    assert not any(p[5:8].any() for p in dst_pages) and not dst._tags[5:8, 0].any()
    report = dst.report()
    assert report is None or not report.pulled


def test_a_read_past_its_deadline_is_given_up_while_it_still_runs(pair) -> None:
    _, _, dst, dst_pages, transfer = pair
    transfer.gate = threading.Event()  # held: the source hangs
    plan = StepPlan(written=[5, 6, 7], loads=[_load()])
    dst.bind(plan)
    t0 = time.monotonic()
    dst.start_loads(plan)
    assert _finished(dst) == {"q"}
    assert 0.9 <= time.monotonic() - t0 < 3.0  # transfer_timeout_s = 1
    assert dst.load_errors() == {5, 6, 7}
    (orphan,) = dst._orphans
    transfer.gate.set()  # the read returns after all: its bytes stay in its own buffer
    assert orphan.done.wait(5)
    dst.get_finished(set())
    assert not any(p[5:8].any() for p in dst_pages)


def test_a_step_that_runs_no_token_waits_for_the_read_and_others_do_not(pair, monkeypatch) -> None:
    """vLLM steps again at once while a request waits for its pull: an idle step waits for the read (up to
    IDLE_WAIT_S, long here) and wakes when it ends; a step that runs tokens, or reports an abort, reports at once."""
    _, _, dst, _, transfer = pair
    monkeypatch.setattr(connector_worker, "IDLE_WAIT_S", 30.0)
    transfer.gate = threading.Event()
    plan = StepPlan(written=[5, 6, 7], loads=[_load()])
    dst.bind(plan)
    dst.start_loads(plan)
    busy = threading.Timer(30.0, transfer.gate.set)  # frees a step that waits when it should not, failing below
    busy.start()
    try:
        dst.bind(StepPlan())  # a step that runs tokens
        t0 = time.monotonic()
        assert dst.get_finished(set()) == set() and time.monotonic() - t0 < 10
        dst.bind(StepPlan(idle=True))
        t0 = time.monotonic()
        assert dst.get_finished({"other"}) == set() and time.monotonic() - t0 < 10  # an abort to report
        threading.Timer(0.2, transfer.gate.set).start()
        t0 = time.monotonic()
        assert dst.get_finished(set()) == {"q"}  # the idle step waited for the read, and it landed
        assert time.monotonic() - t0 < 10  # woken by the read, not at the end of the wait
    finally:
        busy.cancel()
        transfer.gate.set()
    assert dst.load_errors() == set()


def test_a_held_read_does_not_hold_the_next_one(pair) -> None:
    """Two reader threads: a pull from a hung source leaves the other free for the next pull."""
    _, _, dst, _, transfer = pair
    hung, started = threading.Event(), threading.Event()
    real = transfer.read
    calls = iter(range(1 << 30))

    def read(peer: str, local: list[int], remote: list[int], lengths: list[int]) -> None:
        if next(calls) == 0:  # the slow pull's first read, whichever thread took it
            started.set()
            hung.wait(5)
        real(peer, local, remote, lengths)

    transfer.read = read  # type: ignore[method-assign]
    first = StepPlan(written=[5, 6, 7], loads=[_load("slow")])
    dst.bind(first)
    dst.start_loads(first)
    assert started.wait(5)  # the slow pull is in a reader thread
    second = StepPlan(written=[8, 9, 10], loads=[_load("fast", [8, 9, 10])])
    dst.bind(second)
    dst.start_loads(second)
    assert _finished(dst) == {"fast"}
    hung.set()
    assert _finished(dst) == {"slow"}


def test_a_probe_measures_the_pull_bandwidth_before_any_pull_and_lands_nothing(pair) -> None:
    """The first pull priced right: an engine with a probe reads a pull's worth of a source's blocks as a pull
    reads them (tags, pages, tags: three reads) into buffers of its own, and its next report carries the read's
    bytes and seconds (the scheduler half's pull_gbps); its own KV and tags stay as they were."""
    src, _, _, _, _ = pair
    peers = FixedPeers()
    handshake = src.handshake()
    assert handshake is not None
    peers.sources[("src", 7)] = PullSource([handshake.session], [handshake.layout], "fp", None, None)
    transfer = MemTransfer("prober:1")
    prober, pages = _engine("prober", peers, transfer, probe_blocks=3)
    try:
        reports = []
        wait_for(lambda: reports.append(prober.report()) or reports[-1], what="the probe's report", timeout=10)
        (report,) = [r for r in reports if r]
        assert report.read_bytes == {0: 3 * LAYERS * PAGE} and report.read_s[0] > 0
        assert report.pulled == [] and transfer.reads == 3  # one probe, read as a pull is: tags, pages, tags
        assert all(not p.any() for p in pages) and not prober._tags.any()  # nothing landed in its KV or tags
        assert prober.report() is None  # reported once
    finally:
        prober.shutdown()


def test_a_probe_reads_no_source_a_plan_could_not_name() -> None:
    layout = KvLayout((LayerRegion(1 << 40, PAGE, BLOCKS),), 1 << 41)
    ok = PullSource(["s:1"], [layout], "fp", None, None)
    known = {
        ("a-me", 1): ok,
        ("b-tenant", 1): ok._replace(refusal="source b-tenant is of tenant 't2'"),
        ("c-model", 1): ok._replace(fingerprint="other"),
        ("d-tp", 1): ok._replace(sessions=["s:1", "s:2"], layouts=[layout, layout]),
        ("e-nosession", 1): ok._replace(sessions=[None]),
    }
    assert probe_source(known, "a-me", "fp", 1, 0) is None
    assert probe_source(known, "x", None, 1, 0) is None  # no fingerprint of its own yet
    assert probe_source(known | {("z", 2): ok, ("f", 3): ok}, "a-me", "fp", 1, 0) == ("f", 3)
