"""The pysyncobj consumer around the directory's state: what Raft applies and snapshots on its own thread.

What Raft carries of it is kvproto.codec's bytes: an entry is a batch of commands (`encode_entry`), a snapshot the
state (`encode_state`), so the Raft port's unpickler builds no kvdir class (directory/raft_transport.py)."""

from __future__ import annotations

import logging
import threading
from typing import Any

from pysyncobj import SyncObjConsumer, replicated

from directory import raft_transport
from directory.changefeed import ChangeFeed
from kvproto import codec
from kvproto.state import DirectoryState, Result

log = logging.getLogger("kvdir.raft")


class _Encoded(raft_transport.Snapshot):
    """The state in a snapshot: its codec bytes, which pysyncobj writes in the child it forks for a snapshot (so the
    O(entries) encoding never runs on the Raft thread when there is a data dir)."""

    __slots__ = ("state",)

    def __init__(self, state: DirectoryState) -> None:
        self.state = state

    def raft_bytes(self) -> bytearray:
        return codec.encode_state(self.state)


class StateMachine(SyncObjConsumer):  # type: ignore[misc]  # pysyncobj ships no type information
    """The pysyncobj consumer around DirectoryState; only `state` is snapshotted."""

    def __init__(self, state: DirectoryState, feed: ChangeFeed) -> None:
        # Attributes set before SyncObjConsumer.__init__ are left out of snapshots: the feed is this
        # replica's own record of what it applied, for watchers (GET /v1/watch), not replicated state.
        self.lock = threading.RLock()
        self.feed = feed
        super().__init__()
        self.state = state

    @replicated  # type: ignore[untyped-decorator]  # pysyncobj ships no type information (it adds `callback`, `sync`)
    def apply_batch(self, entry: bytes) -> list[Result]:
        """Apply one entry (`codec.encode_entry`). An entry this replica cannot read (another codec version) stops
        it, rather than leave it with another state than its peers."""
        try:
            commands = codec.decode_entry(entry)
        except codec.WireError:
            log.critical("a Raft entry this replica cannot read; it stops here (docs/protocol.md §3.3)", exc_info=True)
            raise
        with self.lock:
            results = [self.state.apply(c) for c in commands]
            self.feed.append(self.state.applied, commands)
            return results

    def _serialize(self) -> dict[str, Any]:
        return {"state": _Encoded(self.state)}

    def _deserialize(self, data: dict[str, Any]) -> None:
        state = codec.decode_state(data["state"])
        with self.lock:
            self.state = state
            self.feed.reset(self.state.applied)
