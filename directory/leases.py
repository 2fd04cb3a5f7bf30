"""The leader's lease keeper: nodes not heard from within their lease are expired through Raft."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvproto.errors import CommitTimeout
from kvproto.state import Expire
from kvproto.tasks import cancel_and_wait, every

if TYPE_CHECKING:
    from directory.replica import Replica

log = logging.getLogger("kvdir.directory")


class LeaseKeeper:
    """On the leader, expires nodes not heard from for `ttl` seconds.

    A node counts as heard from when its `seen` counter changes. A replica that
    becomes leader gives every node a full fresh lease, so a leader change
    never expires a live node. The Expire command carries the `seen` value the
    leader judged, so a node heard from in the meantime survives it.
    """

    def __init__(self, replica: Replica, ttl: float, failed: Callable[[], object]) -> None:
        """`failed`: counts a lease check that raised (logged; the next check comes as usual)."""
        self._replica = replica
        self._ttl = ttl
        self._seen: dict[tuple[str, int], tuple[int, float]] = {}
        self._expiring: set[asyncio.Task[None]] = set()  # the loop keeps only weak references to tasks
        self._task = asyncio.create_task(
            every(
                min(1.0, ttl / 4),
                lambda: self.check(time.monotonic()),
                what="lease check",
                log=log,
                failed=failed,
                first_now=False,
            ),
            name="leases",
        )

    async def close(self) -> None:
        await cancel_and_wait(self._task, *self._expiring)

    async def check(self, now: float) -> None:
        if not self._replica.is_leader:
            self._seen.clear()
            return
        snapshot = await self._replica.read(lambda s: [(n.node_id, n.epoch, n.seen) for n in s.nodes.values()])
        current = set()
        for node_id, epoch, seen in snapshot:
            key = (node_id, epoch)
            current.add(key)
            last = self._seen.get(key)
            if last is None or last[0] != seen:
                self._seen[key] = (seen, now)
            elif now - last[1] > self._ttl:
                log.info("lease of node %s epoch %d lapsed (%.1fs silent): expiring", node_id, epoch, now - last[1])
                self._seen[key] = (seen, now)  # do not fire again while this one commits
                task = asyncio.create_task(self._expire(node_id, epoch, seen))
                self._expiring.add(task)
                task.add_done_callback(self._expiring.discard)
        for key in [k for k in self._seen if k not in current]:
            del self._seen[key]

    async def _expire(self, node_id: str, epoch: int, seen: int) -> None:
        try:
            await self._replica.submit(Expire(node_id, epoch, seen))
        except CommitTimeout:
            log.warning("expiry of %s epoch %d did not commit; will retry", node_id, epoch)
