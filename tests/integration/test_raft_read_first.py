"""A follower's Raft thread that stalls after it read its sockets and before pysyncobj judges its election deadline
(a slow journal sync, the process stopped there) reads again first: the heartbeats that queued meanwhile keep the
leader in place. Two real pysyncobj nodes on loopback, in this process (the stall is placed where a signal cannot
be aimed)."""

from __future__ import annotations

import threading
import time

from pysyncobj import SyncObjConf

from directory.replica import _ReadFirstSyncObj
from kvdir.local_cluster import free_ports
from tests.support.wait import wait_for

ELECTION_TIMEOUT = (0.3, 0.5)


def _node(me: str, peer: str) -> _ReadFirstSyncObj:
    conf = SyncObjConf(
        raftMinTimeout=ELECTION_TIMEOUT[0],
        raftMaxTimeout=ELECTION_TIMEOUT[1],
        appendEntriesPeriod=0.05,
        autoTickPeriod=0.05,
        connectionRetryTime=0.05,
        dynamicMembershipChange=False,
    )
    return _ReadFirstSyncObj(me, [peer], conf, election_timeout=ELECTION_TIMEOUT, compaction_bytes=1 << 30)


def test_a_follower_stalled_between_its_read_and_the_deadline_check_keeps_its_leader() -> None:
    a, b = (f"127.0.0.1:{p}" for p in free_ports(2))
    nodes = [_node(a, b), _node(b, a)]
    try:
        leader = wait_for(lambda: next((n for n in nodes if n._isLeader()), None), timeout=30, what="a leader")
        follower = next(n for n in nodes if n is not leader)
        wait_for(lambda: follower._getLeader() is not None, timeout=30, what="the follower to know its leader")
        term = leader.raftCurrentTerm
        stalled = threading.Event()
        after_read = False
        poll, sync = follower._poller.poll, follower._sync_journal

        def watched_poll(timeout: float) -> None:
            """A tick's read polls without waiting; its last poll waits for the next tick."""
            nonlocal after_read
            after_read = timeout == 0
            poll(timeout)

        def stall_after_the_read() -> None:
            """The journal sync that follows a tick's read: the thread stops there, once, for twice the election
            timeout, while the leader goes on sending heartbeats."""
            sync()
            if after_read and not stalled.is_set():
                time.sleep(2 * ELECTION_TIMEOUT[1])
                stalled.set()

        follower._poller.poll = watched_poll
        follower._sync_journal = stall_after_the_read  # type: ignore[method-assign]
        assert stalled.wait(30)
        # A few ticks after the stall: an election would have moved both terms by now.
        resumed = time.monotonic()
        wait_for(lambda: time.monotonic() - resumed > 2 * ELECTION_TIMEOUT[1], timeout=30, what="ticks after the stall")
        assert (leader.raftCurrentTerm, follower.raftCurrentTerm) == (term, term)
        assert leader._isLeader()
    finally:
        for n in nodes:
            n.destroy()
