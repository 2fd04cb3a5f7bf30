"""The Mooncake transfer engine (TCP here, RDMA where the hardware exists): the one to use.

Its listeners bind to the wildcard address whatever host it is given, and serve every registered byte
without authentication: `MooncakeEngine` confines them to its host (kvtransfer.socket_filter) and bounds
every native call, whose own timeouts do not cover every stall.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvtransfer.engine import DEFAULT_TIMEOUT_S, LOGGER, TransferError, check_batch
from kvtransfer.socket_filter import EarlyConnectionError, confine_listeners, own_tcp_listeners

log = logging.getLogger(LOGGER)


def mooncake_rpc_ports(env: Mapping[str, str] = os.environ) -> range:
    """The ports a Mooncake engine may bind at random when it starts (its handshake port and, for
    protocol tcp, its data port): `MC_MIN_RPC_PORT`..`MC_MAX_RPC_PORT`, with Mooncake's misspelt
    `MC_*_PRC_PORT` fallbacks, 15000-17000 by default. A server port picked in it can be taken by a
    worker's transfer engine before the server binds it."""

    def read(name: str, misspelt: str, default: int) -> int:
        try:
            return int(env.get(name, env.get(misspelt, default)))
        except ValueError:
            return default

    low = read("MC_MIN_RPC_PORT", "MC_MIN_PRC_PORT", 15000)
    high = read("MC_MAX_RPC_PORT", "MC_MAX_PRC_PORT", 17000)
    return range(low, high + 1) if 0 < low <= high <= 65535 else range(15000, 17001)


class MooncakeEngine:
    """`TransferEngine` over Mooncake's `mooncake.engine.TransferEngine` (P2P handshake, no metadata server).

    Session: ``f"{host}:{rpc_port}"``. Mooncake binds its listeners to the
    wildcard address whatever `host` is (0.3.13.post1, and Mooncake's main
    branch): the P2P handshake port (`INADDR_ANY`, `IN6ADDR_ANY` with
    MC_USE_IPV6) and, for protocol "tcp", the data port (`[::]` dual-stack);
    no setting changes that (MC_TCP_BIND_ADDRESS and MC_RDMA_BIND_ADDRESS
    only change the *advertised* address). Both serve every registered byte
    to anyone, for reading and for writing, without authentication. So the
    constructor confines every listener `initialize` opened with a socket
    filter (`confine_listeners`): the kernel drops packets not addressed to
    `host`, so only peers that reach `host` itself can connect. `ss` still
    shows them on 0.0.0.0 / `*`. Where that cannot be done (a wildcard
    `host`, not Linux) it logs a WARNING naming the ports.

    Failure behaviour measured with mooncake-transfer-engine-non-cuda
    0.3.13.post1, protocol "tcp", on loopback (`batch_transfer_sync_read`
    returns 0 on success and a negative code, -1, on any failure; it never raises):

    * remote range not inside one registered region: the *peer* checks and
      rejects it ("not within any registered buffer"), -1 at once or, now and
      then, after ~1 s; a batch with one bad piece fails whole.
    * peer process dead (SIGKILL): -1 within milliseconds (EOF / connection
      refused), both on a cached connection and on a fresh handshake.
    * peer stalled (SIGSTOP, or a partition without RST) on an established
      connection: -1 after MC_TCP_PROGRESS_TIMEOUT_SEC / MC_TCP_STATUS_TIMEOUT_SEC
      (default 30 s each).
    * `batch_transfer_async_read` returns a batch id at once (once the peer's
      handshake is done), and `transfer_check_status` answers 0 while it runs,
      1 once done, negative once failed or timed out; `read` polls it.
    * peer stalled during the *first* contact (P2P handshake): the handshake
      socket has a hard-coded 60 s receive timeout (SO_RCVTIMEO in
      transfer_metadata_plugin.cpp); no setting shortens it.
    * local destination need not be registered for "tcp" (it is for "rdma",
      so register destination buffers too; it is harmless for tcp).

    Hence the bounds here: the constructor sets the progress, status and
    handshake-connect timeouts to `timeout_s` (with `os.environ.setdefault`:
    an operator's own MC_* values win; the settings are process-wide, so the
    first engine of a process decides them; MC_LOG_LEVEL -- measured -- and
    MC_HANDSHAKE_CONNECT_TIMEOUT, from the same global config, are only read
    when `mooncake.engine` is first imported, which is why it is imported here). And a read is bounded by a
    watchdog: if it has not ended after `timeout_s` + 2 s (its submission, which may be a blocking handshake,
    runs on a thread of its own), it raises TransferError and the read is *abandoned*, not cancelled --
    it may still write into the destination until Mooncake gives up (at most
    ~60 s, the handshake case). Do not reuse destination memory of an
    abandoned read until `abandoned_in_flight` drops to 0.
    """

    #: Grace beyond the engine's own timeouts before the watchdog gives up:
    #: Mooncake's sync wait polls at ~1 s granularity, and its own timeout
    #: cancels the transfer cleanly, which the watchdog cannot.
    WATCHDOG_GRACE_S = 2.0

    def __init__(
        self,
        host: str,
        protocol: str = "tcp",
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        device: str = "",
        log_level: str = "WARNING",
    ) -> None:
        seconds = str(max(1, math.ceil(timeout_s)))
        for var in ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC", "MC_HANDSHAKE_CONNECT_TIMEOUT"):
            os.environ.setdefault(var, seconds)
        os.environ.setdefault("MC_LOG_LEVEL", log_level)  # its INFO lines log every new peer and engine
        try:
            from mooncake.engine import TransferEngine as _NativeEngine
        except ImportError as exc:  # libibverbs1 missing is the usual cause, even for tcp
            raise TransferError(f"cannot load the Mooncake transfer engine ({exc}); `make install` provides it") from exc

        self._host = host
        self._protocol = protocol
        self._watchdog_s = timeout_s + self.WATCHDOG_GRACE_S
        self._lock = threading.Lock()
        self._abandoned = 0
        self._registered: list[int] = []
        self._closed = False
        self._te: Any = _NativeEngine()
        before = {li.inode for li in own_tcp_listeners()}
        rc = self._te.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransferError(f"Mooncake initialize({host!r}, P2PHANDSHAKE, {protocol!r}) failed with code {rc}")
        self._session = f"{host}:{self._te.get_rpc_port()}"
        # Before any memory is registered: until then the listeners have nothing to serve.
        listeners = [li for li in own_tcp_listeners() if li.inode not in before]
        ports = ", ".join(str(li.port) for li in listeners) or "(in MC_MIN_RPC_PORT..MC_MAX_RPC_PORT, 15000-17000 by default)"
        try:
            confine_listeners(listeners, host)
        except EarlyConnectionError as exc:
            raise TransferError(str(exc)) from exc
        except OSError as exc:
            log.warning(
                "Mooncake transfer ports %s listen on all interfaces and cannot be confined to %s (%s): anyone who "
                "reaches them can read and overwrite every KV region this worker registers, without authentication; "
                "firewall them or keep them on a private network",
                ports,
                host,
                exc,
            )
        else:
            log.info("Mooncake transfer ports %s (bound to all interfaces) accept only connections addressed to %s", ports, host)

    @property
    def session(self) -> str:
        return self._session

    @property
    def abandoned_in_flight(self) -> int:
        """Native calls given up by the watchdog that have not returned yet (see class doc)."""
        with self._lock:
            return self._abandoned

    def register(self, addr: int, length: int) -> None:
        """Expose a region; Mooncake refuses overlapping registrations (code -7)."""
        self._check_open()
        rc = self._te.register_memory(addr, length)
        if rc != 0:
            raise TransferError(f"Mooncake register_memory(0x{addr:x}, {length}) failed with code {rc}")
        self._registered.append(addr)

    def read(self, peer: str, local_addrs: list[int], remote_addrs: list[int], lengths: list[int]) -> None:
        """The pieces submitted as asynchronous reads (bounded by the watchdog: the first contact with a peer is a
        blocking handshake), then polled with sleeps until every one ended or the watchdog time is up.

        Polled, not waited for in `batch_transfer_sync_read`, which busy-waits on its thread: measured here on a
        32 MiB read, 19.7 ms of the calling thread's CPU against 1.5 ms polled, and no slower. The sleeps grow to
        1 ms at most: a read ends, on average, half a sleep before it is seen, and a pull's reads are a few
        milliseconds each (BENCHMARKS.md, "A slow source, and steps that wait for a read"). One batch per piece, because Mooncake's
        `transfer_check_status` reports (and frees the batch on) its first task only."""
        self._check_open()
        check_batch(local_addrs, remote_addrs, lengths)
        if not lengths:
            return
        what = f"read of {len(lengths)} piece(s), {sum(lengths)} B, from {peer}"
        deadline = time.monotonic() + self._watchdog_s
        pieces = list(zip(local_addrs, remote_addrs, lengths))
        batches = self._bounded(what, self._submit, peer, pieces)
        if len(batches) < len(pieces):  # one could not start: the others may be under way, so they are polled out too
            self._poll(batches, deadline, what)
            raise TransferError(
                f"Mooncake could not start the {what}: peer gone, or a remote range outside its registered memory "
                "(the engine's log on stderr says which)"
            )
        if not self._poll(batches, deadline, what):
            raise TransferError(
                f"Mooncake {what} failed: peer gone or stalled, or a remote range outside its registered memory "
                "(the engine's log on stderr says which)"
            )

    def _submit(self, peer: str, pieces: list[tuple[int, int, int]]) -> list[int]:
        """Each piece's batch id, up to the first piece that could not be submitted."""
        out = []
        for local, remote, length in pieces:
            batch = int(self._te.batch_transfer_async_read(peer, [local], [remote], [length]))
            if batch <= 0:
                break
            out.append(batch)
        return out

    def _poll(self, batches: list[int], deadline: float, what: str) -> bool:
        """Whether every batch completed; those still running at the deadline are abandoned (TransferError)."""
        pending, ok, pause = set(batches), True, 0.0002
        while pending:
            for batch in list(pending):
                status = int(self._te.transfer_check_status(batch))
                if status != 0:
                    pending.discard(batch)
                    ok = ok and status == 1
            if pending and time.monotonic() >= deadline:
                self._abandon(pending)
                raise TransferError(
                    f"{what}: no answer within {self._watchdog_s:.1f} s; the read is abandoned and may still write "
                    "into the destination until Mooncake gives up"
                )
            if pending:
                time.sleep(pause)
                pause = min(pause * 2, 0.001)
        return ok

    def _abandon(self, batches: set[int]) -> None:
        """Count the batches as one abandoned read until Mooncake ends them (its own timeouts fail them)."""
        te = self._te
        with self._lock:
            self._abandoned += 1

        def reap() -> None:
            pending = set(batches)
            while pending:
                pending = {b for b in pending if int(te.transfer_check_status(b)) == 0}
                time.sleep(0.05)
            with self._lock:
                self._abandoned -= 1

        threading.Thread(target=reap, name="mooncake-reap", daemon=True).start()

    def close(self) -> None:
        """Unregister and drop the native engine (its destructor stops the listeners; can take ~1 s)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for addr in self._registered:
            self._te.unregister_memory(addr)
        self._registered.clear()
        self._te = None  # an abandoned call's thread still holds a reference; destruction waits for it

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("engine is closed")

    def _bounded(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a blocking native call on a daemon thread; give up on it after the watchdog time.

        A daemon thread, not an executor: a stuck call must not block
        interpreter exit, nor queue the next reads behind it.
        """
        outcome: list[Any] = []
        state = {"finished": False, "abandoned": False}  # guarded by self._lock
        done = threading.Event()

        def run() -> None:
            try:
                outcome.append(fn(*args))
            except BaseException as exc:
                outcome.append(exc)
            finally:
                with self._lock:
                    state["finished"] = True
                    if state["abandoned"]:
                        self._abandoned -= 1
                done.set()

        threading.Thread(target=run, name="mooncake-call", daemon=True).start()
        if not done.wait(self._watchdog_s):
            with self._lock:
                if not state["finished"]:
                    state["abandoned"] = True
                    self._abandoned += 1
            if state["abandoned"]:
                raise TransferError(
                    f"{what}: no answer within {self._watchdog_s:.1f} s; the call is abandoned and may still "
                    "write into the destination until Mooncake gives up (up to ~60 s for a stalled handshake)"
                )
            done.wait()  # finished just now: set() follows the locked block at once
        result = outcome[0]
        if isinstance(result, BaseException):
            raise TransferError(f"{what}: {result}") from result
        return result
