"""The stdlib TCP transfer engine: a thin fallback with Mooncake's semantics, for machines where Mooncake
cannot be installed, and a second implementation that keeps the `TransferEngine` protocol honest."""

from __future__ import annotations

import bisect
import ctypes
import ipaddress
import logging
import socket
import struct
import threading

from kvtransfer.engine import DEFAULT_TIMEOUT_S, LOGGER, TransferError, check_batch

log = logging.getLogger(LOGGER)


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
        check_batch(local_addrs, remote_addrs, lengths)
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
