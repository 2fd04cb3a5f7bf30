"""Moving KV-cache bytes between worker processes.

Over 400 lines: the `TransferEngine` protocol and its two engines (Mooncake and the TCP fallback),
kept side by side so they stay interchangeable.

A worker that holds KV blocks *registers* the memory they live in; a worker
that wants them *reads* byte ranges of that memory straight into its own
buffers (one-sided: the holder's Python code is not involved per read). Two
engines implement the same small `TransferEngine` protocol:

* `MooncakeEngine`: the Mooncake Transfer Engine (TCP here, RDMA where the
  hardware exists) -- the one to use.
* `TcpEngine`: a thin stdlib fallback with the same semantics, for machines
  where Mooncake cannot be installed, and as a second implementation that
  keeps the protocol honest.

Memory is named by integer addresses (``arr.ctypes.data`` of a numpy array);
the caller keeps every registered or destination buffer alive while an engine
may touch it. Every failure of a read surfaces as `TransferError`, within a
bounded time, never as a hang.
"""

from __future__ import annotations

import bisect
import ctypes
import ipaddress
import logging
import math
import os
import socket
import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from kvtransfer.socket_filter import EarlyConnectionError, confine_listeners, own_tcp_listeners

__all__ = [
    "ENGINES",
    "MooncakeEngine",
    "TcpEngine",
    "TransferEngine",
    "TransferError",
    "create_engine",
    "mooncake_rpc_ports",
]

DEFAULT_TIMEOUT_S = 10.0

log = logging.getLogger(__name__)


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


class TransferError(Exception):
    """A read did not complete: peer gone or stalled, range not registered, engine closed."""


@runtime_checkable
class TransferEngine(Protocol):
    """Moves KV bytes between processes: registers local memory, reads remote memory."""

    @property
    def session(self) -> str:
        """What peers pass as `peer` to `read` to reach this engine, e.g. "127.0.0.1:PORT"."""
        ...

    def register(self, addr: int, length: int) -> None:
        """Expose [addr, addr+length) of this process to peers' reads (addr = buffer address)."""
        ...

    def read(self, peer: str, local_addrs: list[int], remote_addrs: list[int], lengths: list[int]) -> None:
        """Copy peer's registered remote_addrs[i] .. +lengths[i] to local_addrs[i], for all i.

        Raises TransferError on any failure; then the destination holds unspecified bytes.
        """
        ...

    def close(self) -> None:
        """Stop serving and drop connections; idempotent."""
        ...


def _check_batch(local_addrs: Sequence[int], remote_addrs: Sequence[int], lengths: Sequence[int]) -> None:
    """Caller bugs (mismatched lists, negative lengths) are ValueErrors, not transfer failures."""
    if not (len(local_addrs) == len(remote_addrs) == len(lengths)):
        raise ValueError(
            f"local_addrs, remote_addrs and lengths differ in size: {len(local_addrs)}, {len(remote_addrs)}, {len(lengths)}"
        )
    if any(n < 0 for n in lengths):
        raise ValueError("lengths must be >= 0")


# --------------------------------------------------------------------------- Mooncake


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
    when `mooncake.engine` is first imported, which is why it is imported here). And every call runs on a watchdog
    thread: if the native call has not returned after `timeout_s` + 2 s, the
    read raises TransferError and the call is *abandoned*, not cancelled --
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
        """One `batch_transfer_sync_read`; bounded by the watchdog (see class doc)."""
        self._check_open()
        _check_batch(local_addrs, remote_addrs, lengths)
        if not lengths:
            return
        rc = self._bounded(
            f"read of {len(lengths)} piece(s), {sum(lengths)} B, from {peer}",
            self._te.batch_transfer_sync_read,
            peer,
            list(local_addrs),
            list(remote_addrs),
            list(lengths),
        )
        if rc != 0:
            raise TransferError(
                f"Mooncake read of {len(lengths)} piece(s) from {peer} failed with code {rc}: peer gone or stalled, "
                "or a remote range outside its registered memory (the engine's log on stderr says which)"
            )

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

    def _bounded(self, what: str, fn: Callable[..., int], *args: Any) -> int:
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
        return int(result)


# --------------------------------------------------------------------------- stdlib TCP

_MAGIC = b"KVR1"
_REQ_HEAD = struct.Struct("!4sI")  # magic, piece count
_REQ_PIECE = struct.Struct("!QQ")  # remote addr, length
_REPLY = struct.Struct("!BQ")  # status (0 ok, 1 error), then that many payload bytes / error-message bytes
_MAX_PIECES = 1 << 20


def _view(addr: int, length: int) -> memoryview:
    """A writable byte view of raw process memory (the caller vouches for the range)."""
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


def _recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


class TcpEngine:
    """`TransferEngine` in plain sockets: a fallback, deliberately thin.

    A listening thread bound to `host` only (port chosen by the OS) serves
    reads of registered ranges; each connection gets a thread. Wire format:
    request = b"KVR1", u32 count, count x (u64 addr, u64 length); reply =
    u8 status, u64 n, then n bytes -- the pieces concatenated (status 0), or
    an error message (status 1, e.g. a range outside every registered
    region: nothing is sent from it). The reader recv_into()s each piece
    straight into its destination memory; connections are pooled per peer.

    Anyone who can reach the port can read the registered memory (there is no
    write request): bind to a private address; a wildcard one logs a WARNING.
    A piece must lie inside one registration (like Mooncake).

    Bounds: connecting and every receive time out after `timeout_s` without
    progress, so a dead peer fails at once (refused / reset) and a stalled
    one within `timeout_s`; the socket is then dropped, so nothing writes
    into the destination after `read` returns.
    """

    def __init__(self, host: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._starts: list[int] = []  # sorted registration starts, parallel to _ends
        self._ends: list[int] = []
        self._idle: dict[str, list[socket.socket]] = {}
        self._served: set[socket.socket] = set()
        self._closed = False
        self._listener = socket.create_server((host, 0), backlog=64)
        bound, port = self._listener.getsockname()[:2]
        if ipaddress.ip_address(bound).is_unspecified:
            log.warning(
                "TCP transfer port %d listens on all interfaces (transfer host %r): anyone who reaches it can "
                "read every KV region this worker registers; give a private address",
                port,
                host,
            )
        self._session = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"tcp-engine-{port}", daemon=True)
        self._acceptor.start()

    @property
    def session(self) -> str:
        return self._session

    def register(self, addr: int, length: int) -> None:
        if length <= 0:
            raise ValueError("length must be > 0")
        with self._lock:
            i = bisect.bisect(self._starts, addr)
            self._starts.insert(i, addr)
            self._ends.insert(i, addr + length)

    def read(self, peer: str, local_addrs: list[int], remote_addrs: list[int], lengths: list[int]) -> None:
        if self._closed:
            raise TransferError("engine is closed")
        _check_batch(local_addrs, remote_addrs, lengths)
        if not lengths:
            return
        if len(lengths) > _MAX_PIECES:
            raise ValueError(f"at most {_MAX_PIECES} pieces per read")
        request = bytearray(_REQ_HEAD.pack(_MAGIC, len(lengths)))
        for remote, n in zip(remote_addrs, lengths):
            request += _REQ_PIECE.pack(remote, n)
        sock = self._checkout(peer)
        try:
            sock.sendall(request)
            status, n = _REPLY.unpack(_recv_exact(sock, _REPLY.size))
            if status != 0:
                message = _recv_exact(sock, n).decode("utf-8", "replace")
                self._checkin(peer, sock)  # the stream is still in step
                raise TransferError(f"read from {peer} refused: {message}")
            if n != sum(lengths):
                raise ConnectionError(f"peer announced {n} B, expected {sum(lengths)}")
            for local, length in zip(local_addrs, lengths):
                if length:
                    _recv_exact_into(sock, _view(local, length))
        except TransferError:
            raise
        except (OSError, struct.error) as exc:  # socket.timeout is an OSError
            sock.close()
            raise TransferError(f"read of {len(lengths)} piece(s) from {peer} failed: {exc!r}") from exc
        self._checkin(peer, sock)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sockets = [s for pool in self._idle.values() for s in pool] + list(self._served)
            self._idle.clear()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
        except OSError:
            pass
        self._listener.close()
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self._acceptor.join(timeout=5)

    # client side

    def _checkout(self, peer: str) -> socket.socket:
        with self._lock:
            pool = self._idle.get(peer)
            if pool:
                return pool.pop()
        host, sep, port = peer.rpartition(":")
        if not sep or not port.isdigit():
            raise TransferError(f"bad peer session {peer!r}; expected HOST:PORT")
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=self._timeout_s)
        except OSError as exc:
            raise TransferError(f"cannot connect to {peer}: {exc!r}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _checkin(self, peer: str, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.setdefault(peer, []).append(sock)
                return
        sock.close()

    # server side

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._served.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="tcp-engine-conn", daemon=True).start()

    def _registered(self, addr: int, length: int) -> bool:
        with self._lock:
            i = bisect.bisect(self._starts, addr) - 1
            # registrations may overlap: any one that starts at or before addr and covers the range
            return any(self._ends[j] >= addr + length for j in range(i, -1, -1)) if i >= 0 else False

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                try:
                    head = conn.recv(_REQ_HEAD.size, socket.MSG_WAITALL)
                except OSError:
                    return
                if len(head) < _REQ_HEAD.size:
                    return  # client went away
                magic, count = _REQ_HEAD.unpack(head)
                if magic != _MAGIC or count > _MAX_PIECES:
                    return  # not our protocol: drop it
                raw = _recv_exact(conn, count * _REQ_PIECE.size)
                pieces = [_REQ_PIECE.unpack_from(raw, k * _REQ_PIECE.size) for k in range(count)]
                bad = next(((a, n) for a, n in pieces if n and not self._registered(a, n)), None)
                if bad is not None:
                    msg = f"range 0x{bad[0]:x}+{bad[1]} is not inside a registered region".encode()
                    conn.sendall(_REPLY.pack(1, len(msg)) + msg)
                    continue
                conn.sendall(_REPLY.pack(0, sum(n for _, n in pieces)))
                for addr, n in pieces:
                    if n:
                        conn.sendall(_view(addr, n))
        except OSError:
            return
        finally:
            with self._lock:
                self._served.discard(conn)
            conn.close()


ENGINES: dict[str, Callable[..., TransferEngine]] = {"mooncake": MooncakeEngine, "tcp": TcpEngine}


def create_engine(name: str, host: str, **options: Any) -> TransferEngine:
    """The engine called `name` on `host` (options, e.g. timeout_s, go to its constructor)."""
    try:
        factory = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown transfer engine {name!r}; valid: {', '.join(sorted(ENGINES))}") from None
    return factory(host, **options)
