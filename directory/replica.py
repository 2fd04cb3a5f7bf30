"""A directory replica: the state machine replicated with pysyncobj, plus group commit and leases.

Threads: pysyncobj applies commands on its own thread; the HTTP server runs
on an asyncio loop. `StateMachine.lock` (directory.state_machine) serialises
the two around the state, and results travel back to the loop with
`call_soon_threadsafe`. The loop reads the state only through `Replica.read`
and the read methods built on it, which never wait for that lock on the loop
(see `Replica.read`).

Writes from many concurrent requests are coalesced into one Raft command
(directory.group_commit); the leader expires silent nodes (directory.leases).
This module holds the replica that ties them to its Raft node, and that node:
pysyncobj with ticks that read first (`_ReadFirstSyncObj`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import numpy as np
from pysyncobj import SyncObj, SyncObjException

from directory import journal, raft_transport
from directory.changefeed import ChangeFeed
from directory.config import DirectorySettings
from directory.group_commit import GroupCommitter
from directory.leases import LeaseKeeper
from directory.raft_conf import BIND_RETRY_S, BIND_TRIES, ENTRY_SHARE, raft_conf
from directory.state_machine import StateMachine
from directory.views import Counts, Digest, NodeView, node_view
from kvproto import index
from kvproto.errors import CommitTimeout
from kvproto.schemas import Holder
from kvproto.state import AnnounceReplica, AssignShards, Command, DirectoryState, Result
from kvproto.tasks import TaskFailures, cancel_and_wait

log = logging.getLogger("kvdir.directory")

ROLES = {0: "follower", 1: "candidate", 2: "leader"}
READ_THREADS = 8  # reads that wait for the Raft thread to finish applying, each on a thread of its own (`Replica.read`)

T = TypeVar("T")


class _ReadFirstSyncObj(SyncObj):  # type: ignore[misc]  # pysyncobj ships no type information
    """pysyncobj that lets a healthy leader keep its place.

    pysyncobj judges a follower's election deadline at the top of each tick, before reading its
    sockets, and restarts it when a leader's message arrives rather than when it has been journaled
    and applied. So a follower that stalled (a slow fsync, a GC pause, a starved CPU) or took long to
    catch up started an election with its leader's heartbeats unread in the socket buffer, and the
    higher term deposed a healthy leader. Likewise a restarted replica, whose deadline ran out while
    it loaded its snapshot and journal, stood for election the moment its first link came up, before
    the leader could reach it. Here a tick first reads what has arrived, a follower reads again for
    as long as reading took long (what queued up meanwhile restarts its deadline), and again if the thread
    stalled between its read and the deadline's judgment, and a replica that had no link to anyone waits a
    whole election timeout after its first link comes up.
    `kvdir bench elections` measures all three (BENCHMARKS.md). It also notes when the replica was
    last caught up with its leader, which bounds the staleness of local reads (`fresh_within`).
    The private names are pysyncobj 0.3.17's; the version is pinned.
    """

    #: a follower drains its sockets at most this many times per tick, so a tick always ends
    MAX_DRAIN_PASSES = 16
    #: pysyncobj's own (set in SyncObj.__init__): when a follower starts an election, in monotonic seconds
    _SyncObj__raftElectionDeadline: float
    #: pysyncobj's own: per follower, the index of the next entry the leader sends it
    _SyncObj__raftNextIndex: dict[Any, int]

    def __init__(self, *args: Any, election_timeout: tuple[float, float], compaction_bytes: int, **kwargs: Any) -> None:
        # Set before super() starts the tick thread, which reads them.
        self._election_timeout = election_timeout
        self._compaction_bytes = compaction_bytes
        self._log_entries = self._log_bytes = 0
        self._compact_at: float | None = None  # log bytes that trigger a compaction; inf once asked for
        self._quick_pass_s = election_timeout[0] / 4
        self._was_connected = False
        self._fresh_at = float("-inf")
        super().__init__(*args, **kwargs)
        self.addOnTickCallback(self._note_fresh)
        self.addOnTickCallback(self._compact_by_size)

    def _compact_by_size(self) -> None:
        """Compact once the log holds more bytes than `compaction_bytes` and than the last snapshot.

        pysyncobj compacts by entry count and age only, so a few thousand large entries (registrations
        with many regions) grew memory and the journal without bound. Measuring against the snapshot's
        size too keeps a big index from being dumped again after every few megabytes of publishes.
        """
        entries = self._SyncObj__raftLog
        n = len(entries)
        if n < self._log_entries:  # compacted or truncated: count afresh
            self._log_entries, self._log_bytes, self._compact_at = 0, 0, None
        self._log_bytes += sum(len(entries[i][0]) for i in range(self._log_entries, n))
        self._log_entries = n
        if self._log_bytes < self._compaction_bytes:
            return
        if self._compact_at is None:  # the snapshot's size, read once per stretch of log rather than every tick
            dump = self.conf.fullDumpFile
            self._compact_at = max(self._compaction_bytes, os.path.getsize(dump) if dump and os.path.exists(dump) else 0)
        if self._log_bytes >= self._compact_at:
            self._compact_at = math.inf  # asked: not again until the log shrinks
            self.forceLogCompaction()

    def _SyncObj__onMessageReceived(self, node: Any, message: Any) -> None:
        """pysyncobj's message handler, except that a leader's acknowledgement never moves a follower's
        next index back.

        A leader sends entries ahead of their acknowledgements (pipelined: each send moves the follower's
        next index past it), but pysyncobj set the next index to the acknowledged position on every
        acknowledgement that raised the match index. Acknowledgements wait for the follower's journal
        sync (directory.raft_transport), so under write load each one arrived behind what had been sent:
        the leader sent the same entries again, and the follower, which had them (and had applied them),
        deleted them from its journal and appended them anew ("truncating already-applied log entries",
        logged as critical, dozens of times a minute during a bulk fill): twice the traffic and journal
        writes. A refusal (`reset`) still sets the next index, as Raft has it.
        """
        ahead = None
        if (
            isinstance(message, dict)
            and message.get("type") == "next_node_idx"
            and message.get("success")
            and not message.get("reset")
        ):
            ahead = self._SyncObj__raftNextIndex.get(node)
        super()._SyncObj__onMessageReceived(node, message)
        if ahead is not None and self._isLeader() and ahead > self._SyncObj__raftNextIndex.get(node, ahead):
            self._SyncObj__raftNextIndex[node] = ahead

    @staticmethod
    def _sync_journal() -> None:
        """One journal sync for all the entries appended since the last, then the messages held for it
        (acknowledgements above all; see directory.journal)."""
        journal.sync()
        raft_transport.send_held()

    def _note_fresh(self) -> None:
        """Each tick, once committed entries are applied: note the time if this replica leads, or
        follows a leader and has applied all that the leader had committed when it last wrote."""
        if self._isLeader() or (
            self._getLeader() is not None and self.raftLastApplied >= (self._SyncObj__leaderCommitIndex or 0)
        ):
            self._fresh_at = time.monotonic()

    def fresh_within(self, bound_s: float) -> bool:
        """Whether this replica was caught up with a leader at most `bound_s` ago. False for a replica
        catching up after a restart, or resumed after a stall before its Raft thread has caught up,
        which still believe they follow a leader."""
        return time.monotonic() - self._fresh_at <= bound_s

    def _drain(self, passes: int) -> None:
        """Read what has arrived, again for as long as a read took long (what queued meanwhile), at most `passes`."""
        for _ in range(passes):
            started = time.monotonic()
            self._poller.poll(0)
            if time.monotonic() - started < self._quick_pass_s:
                return

    def _onTick(self, timeToWait: float = 0.0) -> None:
        self._sync_journal()  # what the last tick appended, before pysyncobj counts it towards a commit
        leader = self._isLeader()
        self._drain(1 if leader else self.MAX_DRAIN_PASSES)
        for _ in range(self.MAX_DRAIN_PASSES):
            read_at = time.monotonic()
            self._sync_journal()  # what these reads appended: acknowledge it before the tick's final, waiting poll
            # A follower that stalled since it read (a slow sync, the process stopped there) reads again before
            # pysyncobj judges its election deadline: the heartbeats that queued meanwhile are its leader's.
            if leader or time.monotonic() - read_at < self._quick_pass_s:
                break
            self._drain(self.MAX_DRAIN_PASSES)
        connected = any(self.isNodeConnected(n) for n in self.otherNodes)
        if connected and not self._was_connected and not leader:
            lo, hi = self._election_timeout
            deadline = time.monotonic() + random.uniform(lo, hi)
            self._SyncObj__raftElectionDeadline = max(self._SyncObj__raftElectionDeadline, deadline)
        self._was_connected = connected
        super()._onTick(timeToWait)


SCRATCH_PREFIX = "kvdir-raft-"  # a replica without a data dir: TMPDIR/kvdir-raft-<pid>-<random>, its snapshots


def _sweep_scratch() -> None:
    """Remove the scratch directories of replicas that are gone: one killed (SIGKILL, OOM) could not remove its
    own, and each held up to a snapshot of its state. A directory whose pid is alive (or reused) is left."""
    for path in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*-*"):
        pid = path.name.removeprefix(SCRATCH_PREFIX).split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed %s, the scratch directory of a replica that is gone", path)
        except PermissionError:  # alive, another user's
            pass


class Replica:
    """One directory replica: Raft node, state machine, group commit and lease keeper."""

    def __init__(self, settings: DirectorySettings) -> None:
        self.settings = settings
        self.sm = StateMachine(
            DirectoryState(max_nodes=settings.max_nodes, max_entries=settings.max_entries),
            ChangeFeed(settings.watch_buffer_bytes),
        )
        conf = raft_conf(settings, self._log_role_change)
        # Without a data dir the log stays in memory, but pysyncobj then writes its compaction snapshots on the Raft
        # thread (pickled and gzipped: over a second at 5M entries, an election each time); with a file to write
        # them to, it forks a child for them. So the snapshot goes to a private scratch file, removed at stop.
        self._scratch: tempfile.TemporaryDirectory[str] | None = None
        if conf.fullDumpFile is None:
            _sweep_scratch()
            self._scratch = tempfile.TemporaryDirectory(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")
            conf.fullDumpFile = os.path.join(self._scratch.name, "raft.dump")
        journal.install(settings.fsync, conf.fullDumpFile)
        journal.isolate_dump_children()
        raft_transport.install(settings.raft_max_frame_bytes, settings.raft_max_pending_connections, journal.unsynced)
        if settings.raft_password is None:
            log.warning(
                "raft: no Raft password: whoever reaches %s can forge Raft messages (set KVDIR_RAFT_PASSWORD_FILE)", settings.raft
            )
        started = time.monotonic()
        cached, compiled = index.warm_up()  # before the Raft thread exists: a first compile there would stall its heartbeats
        log.info(
            "index kernels ready in %.2f s (%d loaded from numba's cache, %d compiled)",
            time.monotonic() - started,
            cached,
            compiled,
        )
        self.raft = _ReadFirstSyncObj(
            settings.raft,
            settings.peer_list,
            conf,
            consumers=[self.sm],
            transportClass=raft_transport.GuardedTransport,
            election_timeout=(settings.raft_min_timeout_s, settings.raft_max_timeout_s),
            compaction_bytes=settings.raft_log_compaction_bytes,
        )
        try:
            self.raft.waitBinded()
        except SyncObjException as exc:
            self.raft.destroy()
            self._remove_scratch()
            raise RuntimeError(
                f"cannot listen for Raft on {settings.raft} after {BIND_TRIES} tries "
                f"over {BIND_TRIES * BIND_RETRY_S:g} s: is another process using that port?"
            ) from exc
        self.committer: GroupCommitter | None = None
        self.leases: LeaseKeeper | None = None
        self._announce: asyncio.Task[None] | None = None
        self._bootstrap: asyncio.Task[None] | None = None
        self._readers: anyio.CapacityLimiter | None = None

    def _log_role_change(self, old: int, new: int) -> None:
        """One line per Raft role change: elections are the first thing an operator looks for."""
        raft = getattr(self, "raft", None)  # the tick thread may report before __init__ has returned
        term = raft.getStatus()["raft_term"] if raft is not None else None
        if new == 1:  # pysyncobj raises the term just after switching to candidate
            term = None if term is None else term + 1
        log.info("raft: %s -> %s in term %s", ROLES.get(old, old), ROLES.get(new, new), term)

    async def start(
        self, *, on_commit: Callable[[list[Command], list[Result], float], None] | None = None, tasks: TaskFailures
    ) -> None:
        """Start the loop-side machinery; call from the server's event loop. `tasks` counts the lease check's
        failures."""
        # A batch of commands is one Raft entry, of at most ENTRY_SHARE of the frame cap by `command_size` (plus the
        # one command that may overshoot it): see APPEND_SHARE (directory.raft_conf) for why entries stay well under the cap.
        self.committer = GroupCommitter(
            self.sm,
            max_bytes=self.settings.raft_max_frame_bytes // ENTRY_SHARE,
            command_timeout=max(1.0, self.settings.write_timeout_s / 2),
            on_commit=on_commit,
        )
        self._readers = anyio.CapacityLimiter(READ_THREADS)
        self.leases = LeaseKeeper(self, self.settings.lease_ttl_s, tasks.failed("lease_check"))
        self._announce = asyncio.create_task(self._announce_self())
        self._bootstrap = asyncio.create_task(self._commit_first_shard_map())

    async def stop(self) -> None:
        await cancel_and_wait(self._announce, self._bootstrap)
        if self.leases is not None:
            await self.leases.close()
        if self.committer is not None:
            await self.committer.close()
        self.raft.destroy()
        self._remove_scratch()

    def _remove_scratch(self) -> None:
        if self._scratch is not None:
            self._scratch.cleanup()

    async def submit(self, cmd: Command, timeout: float | None = None) -> Result:
        assert self.committer is not None, "Replica.start() was not called"
        return await self.committer.submit(cmd, self.settings.write_timeout_s if timeout is None else timeout)

    async def _announce_self(self) -> None:
        # Tell every replica which HTTP URL this Raft address serves, so /v1/cluster can name the leader's URL.
        cmd = AnnounceReplica(self.settings.raft, self.settings.url)
        while True:
            try:
                await self.submit(cmd, timeout=5.0)
                return
            except CommitTimeout:
                await asyncio.sleep(0.5)

    async def _commit_first_shard_map(self) -> None:
        """Commit the map of --shard-map-file if the group has none yet: until then the group admits no node.

        Every replica of the group tries; the state machine keeps the first and ignores the rest, whatever
        their versions (`AssignShards.bootstrap`). A group that already has a map keeps it: changes go
        through PUT /v1/shards, in the order that keeps fencing exact (kvproto.shardmap.apply_order),
        never through a restart with a new file.
        """
        wanted, shard = self.settings.shard_map, self.settings.shard
        if wanted is None or shard is None:
            return
        while True:
            committed = await self.read(lambda s: s.shard_map)
            if committed is not None:
                if committed.version != wanted.version:
                    log.info(
                        "shard %s: keeping the committed shard map version %d (the file has %d)",
                        committed.shard,
                        committed.version,
                        wanted.version,
                    )
                return
            try:
                await self.submit(AssignShards.of(wanted, shard, bootstrap=True), timeout=5.0)
            except CommitTimeout:
                await asyncio.sleep(0.5)

    # -- reads --------------------------------------------------------------------

    def read_now(self, fn: Callable[[DirectoryState], T]) -> T:
        """`fn(state)` under the state-machine lock, waiting for it: for threads other than the event loop."""
        with self.sm.lock:
            return fn(self.sm.state)

    async def read(self, fn: Callable[[DirectoryState], T]) -> T:
        """`fn(state)` under the state-machine lock, without ever waiting for that lock on the event loop.

        The Raft thread holds the lock while it applies a batch (a large publish, a snapshot being
        installed). When the lock is free, as it nearly always is, `fn` runs right here on the loop: a
        thread hop costs several times a lookup itself. When the Raft
        thread holds it, `fn` runs on a worker thread (at most READ_THREADS at once; further reads wait
        on the loop, asynchronously) once the lock is free. `fn` must be quick and return nothing that
        the next command could change (copies, not the state's own objects).
        """
        lock = self.sm.lock
        if lock.acquire(blocking=False):
            try:
                return fn(self.sm.state)
            finally:
                lock.release()
        if self._readers is None:
            self._readers = anyio.CapacityLimiter(READ_THREADS)
        return await anyio.to_thread.run_sync(self.read_now, fn, limiter=self._readers)

    async def lookup(self, keys: np.ndarray, with_slots: bool = False) -> list[Holder]:
        """Holders of the longest prefixes of `keys` (`DirectoryState.lookup`)."""
        return await self.read(lambda s: s.lookup(keys, with_slots))

    async def nodes(self) -> list[NodeView]:
        """Every registered node, in the order the state holds them."""
        return await self.read(lambda s: [node_view(s, n) for n in s.nodes.values()])

    async def node(self, node_id: str) -> NodeView | None:
        """The node `node_id`, or None if it is not registered."""

        def one(s: DirectoryState) -> NodeView | None:
            n = s.nodes.get(node_id)
            return None if n is None else node_view(s, n)

        return await self.read(one)

    async def has_room_for(self, node_id: str) -> bool:
        """Whether registering `node_id` stays within the node limit here (it is registered, or there is room)."""
        return await self.read(lambda s: node_id in s.nodes or len(s.nodes) < s.max_nodes)

    async def counts(self) -> Counts:
        """How many nodes and index entries this replica holds."""
        return await self.read(lambda s: Counts(len(s.nodes), len(s.index)))

    async def digest(self) -> Digest:
        """The state's digest (equal on replicas that applied the same commands) and what it covers."""
        return await self.read(lambda s: Digest(s.digest(), s.applied, len(s.index), len(s.nodes)))

    # -- status -------------------------------------------------------------------

    @property
    def state(self) -> DirectoryState:
        """The state itself, unlocked: for tests and lock-free gauges; the API reads through `read`."""
        return self.sm.state

    @property
    def is_leader(self) -> bool:
        leader: bool = self.raft._isLeader()
        return leader

    def status(self) -> dict[str, Any]:
        s = self.raft.getStatus()
        leader = s.get("leader")
        leader_addr = getattr(leader, "address", None) if leader is not None else None
        replicas = self.sm.state.replicas
        others = [
            {"raft": n.address, "url": replicas.get(n.address), "connected": self.raft.isNodeConnected(n)}
            for n in self.raft.otherNodes
        ]
        return {
            "self": self.settings.raft,
            "self_url": self.settings.url,
            "role": ROLES.get(s["state"], str(s["state"])),
            "leader": leader_addr,
            "leader_url": replicas.get(leader_addr) if leader_addr else None,
            "term": s["raft_term"],
            "commit_index": s["commit_idx"],
            "last_applied": s["last_applied"],
            "has_quorum": bool(s["has_quorum"]),
            "replicas": [{"raft": self.settings.raft, "url": self.settings.url, "connected": True}, *others],
        }

    @property
    def has_leader(self) -> bool:
        """Whether this replica currently follows (or is) a leader."""
        return self.raft._getLeader() is not None

    @property
    def caught_up(self) -> bool:
        """Whether this replica was caught up with its leader within one election timeout (the
        staleness bound of local reads)."""
        return self.raft.fresh_within(self.settings.raft_max_timeout_s)

    @property
    def ready(self) -> bool:
        return self.raft._getLeader() is not None and self.raft.isReady()
