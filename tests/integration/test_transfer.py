"""Transfer engines, conformance over every engine: real peer processes on 127.0.0.1, no mocks.

Each engine reads from a second process (`PeerProcess`, multiprocessing spawn)
that serves `pattern` bytes. Failures must surface as TransferError within a
bounded time: unregistered ranges, a killed peer, a stalled (SIGSTOPped) peer.
Every process started here is killed at teardown, pass or fail.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvtools.bench.transfer_read import PeerProcess, measure_read_bandwidth, pattern
from kvtransfer.backends import ENGINES, create_engine
from kvtransfer.engine import TransferEngine, TransferError
from kvtransfer.mooncake import MooncakeEngine
from kvtransfer.tcp import TcpEngine
from tests.support.wait import wait_for

HOST = "127.0.0.1"
NAMES = sorted(ENGINES)
TIMEOUT_S = 1.0  # engines' own timeouts here: keeps the stalled-peer tests short
PEER_BYTES = 4 << 20
PIECE = 16 << 10
# A stalled read must fail by: the engine timeout, Mooncake's watchdog grace, and slack for a loaded 2-core box.
STALL_BOUND_S = TIMEOUT_S + MooncakeEngine.WATCHDOG_GRACE_S + 3.0

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def shared_peer() -> Iterator[Callable[[str], PeerProcess]]:
    """One healthy peer per engine for the tests that do not hurt it; killed at module end."""
    started: dict[str, PeerProcess] = {}

    def get(name: str) -> PeerProcess:
        if name not in started:
            started[name] = PeerProcess(name, PEER_BYTES, host=HOST, timeout_s=TIMEOUT_S)
        return started[name]

    yield get
    for p in started.values():
        p.kill()


@pytest.fixture(scope="module")
def shared_engine() -> Iterator[Callable[[str], TransferEngine]]:
    """One local engine per name (closing a Mooncake engine takes up to ~1 s)."""
    made: dict[str, TransferEngine] = {}

    def get(name: str) -> TransferEngine:
        if name not in made:
            made[name] = create_engine(name, HOST, timeout_s=TIMEOUT_S)
        return made[name]

    yield get
    for e in made.values():
        e.close()


@pytest.fixture
def new_peer() -> Iterator[Callable[[str], PeerProcess]]:
    """Peers a test may kill or pause; all killed at teardown."""
    started: list[PeerProcess] = []

    def make(name: str) -> PeerProcess:
        p = PeerProcess(name, PEER_BYTES, host=HOST, timeout_s=TIMEOUT_S)
        started.append(p)
        return p

    yield make
    for p in started:
        p.kill()


@pytest.fixture
def new_engine() -> Iterator[Callable[[str], TransferEngine]]:
    made: list[TransferEngine] = []

    def make(name: str) -> TransferEngine:
        e = create_engine(name, HOST, timeout_s=TIMEOUT_S)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


_KEEP: list[np.ndarray] = []  # destination buffers registered with module-scoped engines stay alive


def warm_read(engine: TransferEngine, peer: PeerProcess) -> None:
    buf = np.zeros(64, dtype=np.uint8)
    engine.read(peer.session, [buf.ctypes.data], [peer.addr], [64])
    assert np.array_equal(buf, pattern(64))


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- conformance


@pytest.mark.parametrize("name", NAMES)
def test_engine_implements_protocol(name: str, shared_engine: Callable[[str], TransferEngine]) -> None:
    engine = shared_engine(name)
    assert isinstance(engine, TransferEngine)
    host, _, port = engine.session.rpartition(":")
    assert host == HOST and 0 < int(port) < 65536


@pytest.mark.parametrize("name", NAMES)
def test_scattered_read(
    name: str, shared_engine: Callable[[str], TransferEngine], shared_peer: Callable[[str], PeerProcess]
) -> None:
    """64 pieces of 16 KiB from unaligned remote offsets into shuffled local slots, plus the region's last byte."""
    engine, peer = shared_engine(name), shared_peer(name)
    rng = np.random.default_rng(7)
    n = 64
    remote_offsets = rng.integers(0, PEER_BYTES - PIECE, size=n)
    remote_offsets[0], remote_offsets[1] = 0, PEER_BYTES - PIECE  # both ends of the region
    slots = rng.permutation(n)
    local = np.zeros(n * PIECE + 1, dtype=np.uint8)
    _KEEP.append(local)
    engine.register(local.ctypes.data, local.nbytes)
    base = local.ctypes.data
    local_addrs = [base + int(s) * PIECE for s in slots] + [base + n * PIECE]
    remote_addrs = [peer.addr + int(o) for o in remote_offsets] + [peer.addr + PEER_BYTES - 1]
    lengths = [PIECE] * n + [1]

    for _ in range(2):  # the second read reuses the connection / cached handshake
        local[:] = 0
        engine.read(peer.session, local_addrs, remote_addrs, lengths)
        src = pattern(PEER_BYTES)
        for s, o in zip(slots, remote_offsets):
            assert np.array_equal(local[s * PIECE : (s + 1) * PIECE], src[o : o + PIECE]), f"piece from offset {o}"
        assert local[-1] == src[-1]

    engine.read(peer.session, [], [], [])  # an empty batch is a no-op


@pytest.mark.parametrize("name", NAMES)
def test_concurrent_reads(
    name: str, shared_engine: Callable[[str], TransferEngine], shared_peer: Callable[[str], PeerProcess]
) -> None:
    engine, peer = shared_engine(name), shared_peer(name)
    k, size = 4, 256 << 10
    bufs = [np.zeros(size, dtype=np.uint8) for _ in range(k)]
    _KEEP.extend(bufs)
    for b in bufs:
        engine.register(b.ctypes.data, b.nbytes)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for _ in range(5):
                engine.read(peer.session, [bufs[i].ctypes.data], [peer.addr + i * size], [size])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    src = pattern(PEER_BYTES)
    for i, b in enumerate(bufs):
        assert np.array_equal(b, src[i * size : (i + 1) * size])


@pytest.mark.parametrize("name", NAMES)
def test_unregistered_range_fails(
    name: str, shared_engine: Callable[[str], TransferEngine], shared_peer: Callable[[str], PeerProcess]
) -> None:
    """The peer refuses any piece not inside a registered region (Mooncake checks on the serving side too)."""
    engine, peer = shared_engine(name), shared_peer(name)
    local = np.zeros(2 * PIECE, dtype=np.uint8)
    _KEEP.append(local)
    engine.register(local.ctypes.data, local.nbytes)
    dst = local.ctypes.data
    end = peer.addr + PEER_BYTES
    bad_ranges = [(end, 4096), (end - 100, 4096), (peer.addr - 4096, 4096), (peer.addr - 1, 2)]
    for remote, length in bad_ranges:
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            engine.read(peer.session, [dst], [remote], [length])
        assert time.monotonic() - t0 < STALL_BOUND_S
    with pytest.raises(TransferError):  # one bad piece fails the whole batch
        engine.read(peer.session, [dst, dst + PIECE], [peer.addr, end], [PIECE, 16])
    engine.read(peer.session, [dst], [peer.addr + 5], [PIECE])  # engine and peer still fine afterwards
    assert np.array_equal(local[:PIECE], pattern(PEER_BYTES)[5 : 5 + PIECE])


@pytest.mark.parametrize("name", NAMES)
def test_dead_peer_fails_fast(
    name: str, shared_engine: Callable[[str], TransferEngine], new_peer: Callable[[str], PeerProcess]
) -> None:
    """SIGKILLed peer: the connection is refused or reset, so the read fails well within the timeout."""
    engine, peer = shared_engine(name), new_peer(name)
    warm_read(engine, peer)
    peer.kill()
    buf = np.zeros(PIECE, dtype=np.uint8)
    for _ in range(2):  # on the cached connection, then on a fresh attempt
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            engine.read(peer.session, [buf.ctypes.data], [peer.addr], [PIECE])
        assert time.monotonic() - t0 < TIMEOUT_S + 2.0


@pytest.mark.parametrize("name", NAMES)
def test_never_reachable_peer_fails_fast(name: str, shared_engine: Callable[[str], TransferEngine]) -> None:
    engine = shared_engine(name)
    buf = np.zeros(64, dtype=np.uint8)
    t0 = time.monotonic()
    with pytest.raises(TransferError):
        engine.read(f"{HOST}:{free_port()}", [buf.ctypes.data], [0x10000], [64])
    assert time.monotonic() - t0 < TIMEOUT_S + 2.0


@pytest.mark.parametrize("name", NAMES)
def test_stalled_peer_fails_within_bound(
    name: str, shared_engine: Callable[[str], TransferEngine], new_peer: Callable[[str], PeerProcess]
) -> None:
    """SIGSTOPped peer after a first read: the kernel keeps the connection open, only a timeout can end it."""
    engine, peer = shared_engine(name), new_peer(name)
    warm_read(engine, peer)
    peer.pause()
    buf = np.zeros(PIECE, dtype=np.uint8)
    t0 = time.monotonic()
    with pytest.raises(TransferError):
        engine.read(peer.session, [buf.ctypes.data], [peer.addr], [PIECE])
    assert time.monotonic() - t0 < STALL_BOUND_S
    peer.kill()


@pytest.mark.parametrize("name", NAMES)
def test_stalled_peer_on_first_contact_fails_within_bound(
    name: str, new_engine: Callable[[str], TransferEngine], new_peer: Callable[[str], PeerProcess]
) -> None:
    """SIGSTOPped before any contact: TCP connects (the kernel accepts), then nothing answers.

    Mooncake's handshake waits 60 s here, so MooncakeEngine's watchdog gives
    up and leaves the native call in flight; killing the peer ends that call.
    """
    engine, peer = new_engine(name), new_peer(name)
    peer.pause()
    buf = np.zeros(PIECE, dtype=np.uint8)
    t0 = time.monotonic()
    with pytest.raises(TransferError):
        engine.read(peer.session, [buf.ctypes.data], [peer.addr], [PIECE])
    assert time.monotonic() - t0 < STALL_BOUND_S
    peer.kill()
    if isinstance(engine, MooncakeEngine):
        wait_for(lambda: not engine.abandoned_in_flight, 10, interval=0.01, what="the abandoned Mooncake call to end")
    assert np.count_nonzero(buf) == 0  # the failed read wrote nothing here


# --------------------------------------------------------------------------- API edges


@pytest.mark.parametrize("name", NAMES)
def test_closed_engine_refuses_reads(name: str, new_engine: Callable[[str], TransferEngine]) -> None:
    engine = new_engine(name)
    session = engine.session
    engine.close()
    engine.close()  # idempotent
    buf = np.zeros(8, dtype=np.uint8)
    with pytest.raises(TransferError, match="closed"):
        engine.read(session, [buf.ctypes.data], [buf.ctypes.data], [8])


@pytest.mark.parametrize("name", NAMES)
def test_mismatched_batch_is_a_caller_error(name: str, shared_engine: Callable[[str], TransferEngine]) -> None:
    engine = shared_engine(name)
    with pytest.raises(ValueError, match="differ in size"):
        engine.read(engine.session, [1, 2], [3], [4, 5])
    with pytest.raises(ValueError, match=">= 0"):
        engine.read(engine.session, [1], [3], [-1])


def test_create_engine() -> None:
    with pytest.raises(ValueError, match="mooncake, tcp"):
        create_engine("carrier-pigeon", HOST)
    engine = create_engine("tcp", HOST, timeout_s=TIMEOUT_S)
    try:
        assert isinstance(engine, TcpEngine)
        assert engine._listener.getsockname()[0] == HOST  # bound to the given host only, not 0.0.0.0
    finally:
        engine.close()
    assert ENGINES["mooncake"] is MooncakeEngine


@pytest.mark.parametrize("name", NAMES)
def test_measure_read_bandwidth(name: str) -> None:
    result = measure_read_bandwidth(name, 1 << 20, 64 << 10, repeats=1)
    assert result["engine"] == name and result["pieces"] == 16
    assert result["single_read_gbps"] > 0 and result["batched_gbps"] > 0
