"""Read bandwidth of a transfer engine between two real processes, plus the peer helper it needs.

`PeerProcess` starts a second process (multiprocessing "spawn": no inherited
threads or sockets) that registers a buffer filled with `pattern` and waits;
the tests use it too, so what is benchmarked is what is tested.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import statistics
import time
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any, Self

import numpy as np

from kvtools.bench import proc
from kvtransfer.backends import create_engine
from kvtransfer.engine import TransferEngine

__all__ = ["PeerProcess", "measure_read_bandwidth", "pattern"]

_PERIOD = 251  # prime, so a piece read from the wrong offset does not match by accident


def pattern(nbytes: int) -> np.ndarray:
    """The bytes a peer serves: byte i is i % 251."""
    return np.resize(np.arange(_PERIOD, dtype=np.uint8), nbytes)


def _peer_main(engine_name: str, host: str, nbytes: int, options: dict[str, Any], conn: Connection) -> None:
    """Child: register a patterned buffer, report (session, addr, nbytes), serve until told or orphaned."""
    engine = create_engine(engine_name, host, **options)
    buf = pattern(nbytes)
    engine.register(buf.ctypes.data, buf.nbytes)
    conn.send((engine.session, buf.ctypes.data, buf.nbytes))
    try:
        conn.recv()  # "stop" from the parent, or EOFError when the parent is gone
    except EOFError:
        pass
    engine.close()


class PeerProcess:
    """A peer process serving `nbytes` of `pattern` through engine `engine_name`; always reaped.

    Use as a context manager; `kill` (SIGKILL) and `pause`/`resume`
    (SIGSTOP/SIGCONT) simulate a dead and a stalled peer.
    """

    def __init__(
        self, engine_name: str, nbytes: int, host: str = "127.0.0.1", startup_timeout_s: float = 60.0, **options: Any
    ) -> None:
        self.engine_name = engine_name
        self._paused = False
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(
            target=_peer_main, args=(engine_name, host, nbytes, options, child_conn), name=f"peer-{engine_name}", daemon=True
        )
        self._proc.start()
        child_conn.close()
        try:
            if not self._conn.poll(startup_timeout_s):
                raise RuntimeError(f"{engine_name} peer did not report ready within {startup_timeout_s} s")
            try:
                self.session, self.addr, self.nbytes = self._conn.recv()
            except EOFError:
                self._proc.join(5)
                raise RuntimeError(f"{engine_name} peer died on start (exit code {self._proc.exitcode})") from None
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int:
        assert self._proc.pid is not None
        return self._proc.pid

    def kill(self) -> None:
        """SIGKILL and reap (works on a paused peer too)."""
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(10)

    def pause(self, timeout_s: float = 10.0) -> None:
        """SIGSTOP, and return only once the kernel reports the process stopped."""
        os.kill(self.pid, signal.SIGSTOP)
        self._paused = True
        deadline = time.monotonic() + timeout_s
        while proc.state(self.pid) != "T":
            if time.monotonic() > deadline:
                raise RuntimeError(f"peer {self.pid} did not stop within {timeout_s} s")
            time.sleep(0.001)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        self._paused = False

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the peer to close its engine and exit; SIGKILL if it does not (or is paused)."""
        if self._proc.is_alive() and not self._paused:
            try:
                self._conn.send("stop")
            except OSError:
                pass
            self._proc.join(timeout_s)
        self.kill()
        self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if et is None:
            self.stop()
        else:
            self.kill()
            self._conn.close()


def measure_read_bandwidth(
    engine_name: str,
    total_bytes: int,
    piece_bytes: int,
    *,
    host: str = "127.0.0.1",
    pieces_per_batch: int = 256,
    repeats: int = 3,
) -> dict[str, Any]:
    """Read `total_bytes` from a peer process: as one single read, and as scattered `piece_bytes` pieces.

    Pieces are read from a random permutation of remote offsets, `pieces_per_batch`
    per `read` call (one call per KV fetch is the model). Each mode runs `repeats`
    times after a warm-up read that pays the connection/handshake; GB/s are 1e9 B/s,
    medians over repeats (best in *_best_gbps). Returned bytes are checked.
    """
    if total_bytes <= 0 or piece_bytes <= 0 or total_bytes % piece_bytes:
        raise ValueError("total_bytes must be a positive multiple of piece_bytes")
    pieces = total_bytes // piece_bytes
    engine: TransferEngine = create_engine(engine_name, host)
    try:
        with PeerProcess(engine_name, total_bytes, host=host) as peer:
            local = np.zeros(total_bytes, dtype=np.uint8)
            engine.register(local.ctypes.data, local.nbytes)  # needed by RDMA destinations, harmless otherwise
            base, rbase = local.ctypes.data, peer.addr

            t0 = time.perf_counter()
            engine.read(peer.session, [base], [rbase], [min(total_bytes, 4096)])
            first_read_s = time.perf_counter() - t0

            single: list[float] = []
            for _ in range(repeats):
                local[:] = 0
                t0 = time.perf_counter()
                engine.read(peer.session, [base], [rbase], [total_bytes])
                single.append(time.perf_counter() - t0)
            if not np.array_equal(local, pattern(total_bytes)):
                raise AssertionError("single read returned wrong bytes")

            order = np.random.default_rng(0).permutation(pieces)
            locals_ = [base + i * piece_bytes for i in range(pieces)]
            remotes = [rbase + int(j) * piece_bytes for j in order]
            lengths = [piece_bytes] * pieces
            batched: list[float] = []
            for _ in range(repeats):
                local[:] = 0
                t0 = time.perf_counter()
                for s in range(0, pieces, pieces_per_batch):
                    e = s + pieces_per_batch
                    engine.read(peer.session, locals_[s:e], remotes[s:e], lengths[s:e])
                batched.append(time.perf_counter() - t0)
            expected = pattern(total_bytes).reshape(pieces, piece_bytes)[order].reshape(-1)
            if not np.array_equal(local, expected):
                raise AssertionError("batched read returned wrong bytes")
    finally:
        engine.close()

    def gbps(seconds: float) -> float:
        return total_bytes / seconds / 1e9

    return {
        "engine": engine_name,
        "total_bytes": total_bytes,
        "piece_bytes": piece_bytes,
        "pieces": pieces,
        "pieces_per_batch": pieces_per_batch,
        "repeats": repeats,
        "first_read_s": first_read_s,
        "single_read_gbps": gbps(statistics.median(single)),
        "single_read_best_gbps": gbps(min(single)),
        "batched_gbps": gbps(statistics.median(batched)),
        "batched_best_gbps": gbps(min(batched)),
    }
