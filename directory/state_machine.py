"""The pysyncobj consumer around the directory's state: what Raft applies and snapshots on its own thread."""

from __future__ import annotations

import threading
from typing import Any

from pysyncobj import SyncObjConsumer, replicated

from directory.changefeed import ChangeFeed
from kvproto.state import Command, DirectoryState, Result


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
    def apply_batch(self, commands: list[Command]) -> list[Result]:
        with self.lock:
            results = [self.state.apply(c) for c in commands]
            self.feed.append(self.state.applied, commands)
            return results

    def _deserialize(self, data: dict[str, Any]) -> None:
        with self.lock:
            super()._deserialize(data)
            self.feed.reset(self.state.applied)
