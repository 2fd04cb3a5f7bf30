"""A directory replica without Raft, for driving the REST API in-process (unit tier: no sockets, no threads).

`create_app(settings, MemoryReplica)` serves the real routes over a `DirectoryState` that applies
each command at once, as a single-replica leader would. It keeps every command it applied, so a
test can see what the API handed the state machine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import msgspec
import numpy as np

from directory.config import DirectorySettings
from directory.views import Digest
from kvproto.schemas import Holder
from kvproto.state import Command, DirectoryState, Register, Result
from kvproto.tasks import TaskFailures

T = TypeVar("T")


class MemoryReplica:
    """The part of `directory.replica.Replica` the API's block and lookup routes use: always a caught-up leader.

    Registrations start epochs at base 0 (a real replica draws a random base), so two of these fed the
    same requests reach equal digests.
    """

    has_leader = caught_up = ready = is_leader = True

    def __init__(self, settings: DirectorySettings) -> None:
        self.settings = settings
        self.state = DirectoryState(max_nodes=settings.max_nodes, max_entries=settings.max_entries)
        self.commands: list[Command] = []
        self._on_commit: Callable[[list[Command], list[Result], float], None] | None = None

    async def start(
        self, *, on_commit: Callable[[list[Command], list[Result], float], None] | None = None, tasks: TaskFailures
    ) -> None:
        self._on_commit = on_commit

    async def stop(self) -> None:
        pass

    async def submit(self, cmd: Command, timeout: float | None = None) -> Result:
        if isinstance(cmd, Register):
            cmd = msgspec.structs.replace(cmd, epoch_base=0)
        self.commands.append(cmd)
        res = self.state.apply(cmd)
        if self._on_commit is not None:
            self._on_commit([cmd], [res], 0.0)
        return res

    async def read(self, fn: Callable[[DirectoryState], T]) -> T:
        return fn(self.state)

    async def has_room_for(self, node_id: str) -> bool:
        return node_id in self.state.nodes or len(self.state.nodes) < self.state.max_nodes

    async def lookup(self, keys: np.ndarray, with_slots: bool = False) -> list[Holder]:
        return self.state.lookup(keys, with_slots)

    async def digest(self) -> Digest:
        s = self.state
        return Digest(s.digest(), s.applied, len(s.index), len(s.nodes))
