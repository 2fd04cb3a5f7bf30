"""Raft links that a stranger who reaches the Raft port can neither take over nor stall.

pysyncobj 0.3.17 trusts whatever arrives on its port: it unpickles every frame (so one frame from
anyone runs code as the replica's user when there is no Raft password), buffers a frame of any
announced length on the Raft thread with quadratic `bytes +=` appends before it decrypts anything,
and keeps any number of connections that never identify themselves. kvdir closes each gap:

- frames decode with an unpickler that builds only the types Raft traffic carries (pysyncobj's
  nodes and plain data; kvdir's entries and snapshots are kvproto.codec's bytes): anything else,
  `os.system` included, is refused;
- a frame's announced length is checked against a cap as soon as its 4-byte header arrives, before
  any of it is buffered: 64 KiB until the peer has proven the Raft password (or, without one, named
  itself as a configured peer), `raft_max_frame_bytes` after; the inflated size has the same cap;
- reads append to a bytearray (linear) and stop after a budget per poll event, so one fast sender
  cannot keep the Raft thread from its heartbeats;
- at most `raft_max_pending_connections` connections may be waiting to identify themselves (the
  oldest is dropped for a new one) and none for longer than the Raft connection timeout.

It also makes the write path cheaper: pysyncobj pickles with protocol 2, which writes
bytes as latin-1 text (~1.5x the size, and slow to encode), once for each log entry and again
inside every message; and it zlib-compresses every message, which for random block hashes costs
milliseconds a message and saves little. Here both pickle with `PICKLE_PROTOCOL` (raw bytes), and
a message whose start does not compress is sent as a stored zlib stream (`_compress`), which any
peer still inflates.

`install` swaps the connection class that pysyncobj's server and transport construct by name and
its pickle loaders; `GuardedTransport` is passed to SyncObj as its transport class. The private
names used are pysyncobj 0.3.17's; the version is pinned.
"""

from __future__ import annotations

import _socket
import errno
import io
import logging
import pickle
import socket
import struct
import time
import zlib
from collections.abc import Callable
from typing import IO, Any

import pysyncobj.pickle as _sopickle
import pysyncobj.tcp_server as _tcp_server
import pysyncobj.transport as _transport
from pysyncobj.tcp_connection import CONNECTION_STATE, TcpConnection
from pysyncobj.transport import TCPTransport

# pysyncobj's win_inet_pton replaces socket.inet_ntop on every OS with a Windows-only one that raises
# TypeError elsewhere, for the whole process: put the real one back.
socket.inet_ntop = _socket.inet_ntop

log = logging.getLogger("kvdir.raft")

PREAUTH_FRAME_BYTES = 64 << 10
"""Largest frame from a peer that has not proven itself: its first messages are a 32-byte key or
its address, a few hundred bytes encrypted."""
READ_BUDGET_BYTES = 4 << 20
"""Most bytes read from one connection per poll event; the rest waits for the next tick."""
RECV_BYTES = 64 << 10
"""Per recv(): a larger buffer is allocated with mmap, a cost paid on every call, small frames included."""
PICKLE_PROTOCOL = 5
"""For log entries, messages and snapshots: bytes stay raw (protocol 3 on), and a bytearray is one opcode
(protocol 5), read straight into a new bytearray (`Snapshot`); out-of-band buffers are never used."""


class Snapshot:
    """What a snapshot pickles as its bytes (`raft_bytes`, called by `dump`, in the child pysyncobj forks to
    write one) and loads as one bytearray: writable, so the codec's arrays can be views of it rather than copies."""

    def raft_bytes(self) -> bytearray:
        raise NotImplementedError


class _SnapshotPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> bytearray | None:
        return obj.raft_bytes() if isinstance(obj, Snapshot) else None


COMPRESS_LEVEL = 1
"""zlib level of outgoing messages that compress (`_compress`; pysyncobj used 3, which is slower for little gain)."""
PROBE_BYTES, PROBE_RATIO = 1024, 0.9
"""A message is compressed when its first PROBE_BYTES shrink to PROBE_RATIO or less at level 1."""


def _compress(data: bytes) -> bytes:
    """`data` as a zlib stream: compressed if its start compresses, else stored (level 0).

    Block hashes are random: compressing a publish costs CPU per peer and saves little.
    Registrations (region lists, mostly text) still shrink several times, which keeps the leader's
    send buffers small when a follower lags."""
    probe = data[:PROBE_BYTES]
    if len(zlib.compress(probe, 1)) <= PROBE_RATIO * len(probe):
        return zlib.compress(data, COMPRESS_LEVEL)
    return zlib.compress(data, 0)


def _sized(kind: type) -> Any:
    """`bytes`/`bytearray` from an iterable only: `bytes(2**40)` is a few bytes of pickle."""

    def build(*args: Any) -> Any:
        if args and isinstance(args[0], int):
            raise pickle.UnpicklingError(f"{kind.__name__}(int) is not allowed in Raft traffic")
        return kind(*args)

    return build


_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    **{(m, "set"): set for m in ("builtins", "__builtin__")},
    **{(m, "frozenset"): frozenset for m in ("builtins", "__builtin__")},
    **{(m, "bytes"): _sized(bytes) for m in ("builtins", "__builtin__")},
    **{(m, "bytearray"): _sized(bytearray) for m in ("builtins", "__builtin__")},
}
_ALLOWED_BY_NAME = {("pysyncobj.node", "Node"), ("pysyncobj.node", "TCPNode")}


class _RaftUnpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> bytearray:
        """A `Snapshot`'s bytes; nothing else is persisted."""
        if type(pid) is not bytearray:
            raise pickle.UnpicklingError(f"a persistent {type(pid).__name__} is not allowed in Raft traffic")
        return pid

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return _ALLOWED_GLOBALS[module, name]
        if (module, name) in _ALLOWED_BY_NAME:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in Raft traffic")


def safe_loads(data: bytes | str) -> Any:
    """pysyncobj's `loads` (frames, log entries), building only the types Raft traffic carries."""
    return _RaftUnpickler(io.BytesIO(_sopickle.to_bytes(data))).load()


def safe_load(file: IO[bytes]) -> Any:
    """pysyncobj's `load` (snapshots, which a leader also streams to followers), likewise restricted."""
    return _RaftUnpickler(file).load()


def dumps(obj: Any, protocol: int | None = None) -> bytes:
    """pysyncobj's `dumps` (log entries, messages) with `PICKLE_PROTOCOL`, whatever it asks for."""
    return pickle.dumps(obj, PICKLE_PROTOCOL)


def dump(obj: Any, file: IO[bytes], protocol: int | None = None) -> None:
    """pysyncobj's `dump` (snapshots) with `PICKLE_PROTOCOL`, a `Snapshot` written as its bytes."""
    _SnapshotPickler(file, PICKLE_PROTOCOL).dump(obj)


def _inflate(data: bytes, limit: int) -> bytes:
    inflater = zlib.decompressobj()
    out = inflater.decompress(data, limit)
    if inflater.unconsumed_tail:
        raise ValueError(f"message inflates beyond {limit} bytes")
    return out


class _Rejections:
    """One log line a second at most for refused connections, with how many were refused meanwhile:
    an attacker must not be able to flood the log."""

    def __init__(self) -> None:
        self.count = 0
        self._last = float("-inf")
        self._since = 0

    def note(self, why: str) -> None:
        self.count += 1
        self._since += 1
        now = time.monotonic()
        if now - self._last >= 1.0:
            log.warning("raft: dropped a connection: %s (%d dropped since the last such line)", why, self._since)
            self._last, self._since = now, 0


rejections = _Rejections()


class GuardedTcpConnection(TcpConnection):  # type: ignore[misc]  # pysyncobj ships no type information
    """pysyncobj's connection with bounded, linear, checked frame reading and restricted decoding."""

    max_frame_bytes = 64 << 20  # set by `install`
    # pysyncobj's own attributes (set in TcpConnection.__init__) that this class reads and writes:
    recvLastTimestamp: int  # the newest Fernet timestamp received
    _TcpConnection__readBuffer: bytes | bytearray

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trusted = False  # proved the Raft password, or (without one) named itself as a configured peer
        self._read_this_event = 0
        self._held: list[Any] = []  # messages waiting for the journal's sync (`send`)

    def _buffer(self) -> bytearray:
        buf = self._TcpConnection__readBuffer
        if not isinstance(buf, bytearray):  # pysyncobj resets it to bytes() on (dis)connect
            buf = self._TcpConnection__readBuffer = bytearray(buf)
        return buf

    def _frame_limit(self) -> int:
        return self.max_frame_bytes if self.trusted else PREAUTH_FRAME_BYTES

    def _header_ok(self, buf: bytearray) -> bool:
        """Check the announced length of the frame at the front of `buf`; drop the link if it is out of bounds."""
        if len(buf) < 4:
            return True
        (length,) = struct.unpack_from("i", buf, 0)
        if 0 <= length <= self._frame_limit():
            return True
        rejections.note(
            f"frame of {length} bytes announced (limit {self._frame_limit()}{'' if self.trusted else ' before authentication'})"
        )
        self.disconnect()
        return False

    def send(self, message: Any) -> None:
        """Send `message` now, or once the journal is synced (`send_held`) if it may acknowledge entries.

        Only a leader's `append_entries` promises nothing about this replica's own log; anything else
        (an acknowledgement above all) waits while `unsynced()`, and so does whatever follows it on
        this connection, to keep the order."""
        if self._held or (unsynced() and not (isinstance(message, dict) and message.get("type") == "append_entries")):
            self._held.append(message)
            _holding.add(self)
            return
        self._send_now(message)

    def send_held(self) -> None:
        """Send the messages held back for the journal's sync, in order (after that sync)."""
        held, self._held = self._held, []
        for message in held:
            if self.state == CONNECTION_STATE.DISCONNECTED:
                break  # dropped with the link (`disconnect`)
            self._send_now(message)

    def disconnect(self) -> None:
        self._held = []  # as pysyncobj drops its unsent buffer: a peer is brought up to date once reconnected
        super().disconnect()

    def _send_now(self, message: Any) -> None:
        """pysyncobj's `send`, with `dumps` and `_compress`."""
        if self.sendRandKey:
            message = (self.sendRandKey, message)
        data = _compress(dumps(message))
        if self.encryptor:
            data = self.encryptor.encrypt_at_time(data, int(time.monotonic()))
        self._TcpConnection__writeBuffer += struct.pack("i", len(data)) + data
        self._TcpConnection__trySendBuffer()

    def _TcpConnection__tryReadBuffer(self) -> None:
        self._read_this_event = 0
        while self._TcpConnection__processRead():
            pass
        self._TcpConnection__lastReadTime = time.monotonic()

    def _TcpConnection__processRead(self) -> bool:
        sock = self._TcpConnection__socket
        if sock is None:
            return False
        try:
            incoming = sock.recv(RECV_BYTES)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                self.disconnect()
            return False
        if not incoming:
            self.disconnect()
            return False
        buf = self._buffer()
        buf += incoming
        self._read_this_event += len(incoming)
        return self._header_ok(buf) and self._read_this_event < READ_BUDGET_BYTES

    def _TcpConnection__processParseMessage(self) -> Any:
        if self.state == CONNECTION_STATE.DISCONNECTED:
            return None
        buf = self._buffer()
        if len(buf) < 4 or not self._header_ok(buf):
            return None
        (length,) = struct.unpack_from("i", buf, 0)
        if len(buf) - 4 < length:
            return None
        data = bytes(buf[4 : 4 + length])
        del buf[: 4 + length]  # O(1) amortised at the front of a bytearray
        try:
            if self.encryptor:
                stamp = self.encryptor.extract_timestamp(data)
                if stamp < self.recvLastTimestamp:
                    raise ValueError("frame older than the last one")
                self.recvLastTimestamp = stamp
                data = self.encryptor.decrypt(data)
                self.trusted = True
            message = safe_loads(_inflate(data, self._frame_limit()))
            if self.recvRandKey:
                rand_key, message = message
                if rand_key != self.recvRandKey:
                    raise ValueError("wrong session key")
        except Exception as exc:  # anything undecodable ends the link, as pysyncobj does
            rejections.note(f"undecodable frame ({type(exc).__name__}: {exc})"[:200])
            self.disconnect()
            return None
        return message


_holding: set[GuardedTcpConnection] = set()
"""Connections with messages held back for the journal's sync."""


def _never() -> bool:
    return False


unsynced: Callable[[], bool] = _never
"""Whether this replica's journal holds entries not yet on disk (set by `install`)."""


def send_held() -> None:
    """Send what every connection held back; call right after the journal's sync (each Raft tick)."""
    while _holding:
        _holding.pop().send_held()


class GuardedTransport(TCPTransport):  # type: ignore[misc]  # pysyncobj ships no type information
    """pysyncobj's TCP transport with a cap on, and a deadline for, connections not yet identified."""

    max_pending = 16  # set by `install`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._accepted_at: dict[TcpConnection, float] = {}
        super().__init__(*args, **kwargs)

    def _onNewIncomingConnection(self, conn: TcpConnection) -> None:
        while len(self._unknownConnections) >= self.max_pending:
            oldest = min(self._unknownConnections, key=lambda c: self._accepted_at.get(c, 0.0))
            rejections.note(f"more than {self.max_pending} connections waiting to identify themselves")
            self._drop_pending(oldest)
        self._accepted_at[conn] = time.monotonic()
        super()._onNewIncomingConnection(conn)

    def _onIncomingMessageReceived(self, conn: TcpConnection, message: Any) -> None:
        super()._onIncomingMessageReceived(conn, message)
        if conn not in self._unknownConnections:
            self._accepted_at.pop(conn, None)
            if conn.state == CONNECTION_STATE.CONNECTED:
                conn.trusted = True  # identified as a configured peer (after the password, if there is one)

    def _onOutgoingConnected(self, conn: TcpConnection) -> None:
        if not self._syncObj.encryptor:
            conn.trusted = True  # a peer we dialled; with a password it must still prove it
        super()._onOutgoingConnected(conn)

    def _onDisconnected(self, conn: TcpConnection) -> None:
        self._accepted_at.pop(conn, None)
        super()._onDisconnected(conn)

    def _onTick(self) -> None:
        super()._onTick()
        if self._accepted_at:
            deadline = time.monotonic() - self._syncObj.conf.connectionTimeout
            for conn in [c for c, t in self._accepted_at.items() if t < deadline and c in self._unknownConnections]:
                rejections.note("did not identify itself within the Raft connection timeout")
                self._drop_pending(conn)

    def _drop_pending(self, conn: TcpConnection) -> None:
        self._unknownConnections.discard(conn)
        self._accepted_at.pop(conn, None)
        conn.disconnect()


def install(max_frame_bytes: int, max_pending: int, journal_unsynced: Callable[[], bool] = _never) -> None:
    """Make pysyncobj build guarded connections, encode with `PICKLE_PROTOCOL` and decode with the
    restricted unpickler, holding messages while `journal_unsynced()` (process-wide)."""
    global unsynced
    unsynced = journal_unsynced
    GuardedTcpConnection.max_frame_bytes = max_frame_bytes
    GuardedTransport.max_pending = max_pending
    _tcp_server.TcpConnection = GuardedTcpConnection
    _transport.TcpConnection = GuardedTcpConnection
    _sopickle.loads = safe_loads
    _sopickle.load = safe_load
    _sopickle.dumps = dumps
    _sopickle.dump = dump
