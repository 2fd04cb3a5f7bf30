"""A Raft journal that reaches the disk before pysyncobj acts on it.

pysyncobj 0.3.17 keeps its log in an mmap-ed file and its term and vote in a
`.meta` file written with a rename, and never syncs either: that survives a
process crash (the page cache outlives the process) but not a machine crash
or power loss. Raft's safety needs an entry on disk before the replica
acknowledges it, and the term and vote on disk before the replica votes;
otherwise a majority that loses power together can forget a committed write
or vote twice in one term. `DurableJournal` syncs:

- appended entries: once for all the entries appended since the last sync,
  before the replica acts on them: before it acknowledges them to a leader
  (raft_transport holds every message but the leader's `append_entries`
  while `unsynced()`), before a leader counts its own log towards a commit
  (`sync()` at the start of each Raft tick, before pysyncobj computes the
  commit index and applies) and before the commit index is stored. A sync
  per entry would make the Raft thread wait for a disk flush per entry on
  every replica; grouped, one sync covers all that arrived meanwhile;
- truncated entries (`deleteEntriesFrom`, `clear`): before they return;
- the sync is an `fdatasync` of the journal file. pysyncobj's own flush is an
  `msync` of the mapping, which does the same on Linux (its pages are the
  file's page cache) but which CPython calls holding the GIL: every sync
  froze the replica's HTTP loop too; `os.fdatasync` releases it;
- term, vote and commit index: the journal is synced, then the temporary
  file is fsynced before the rename and the directory after it;
- log compaction: the snapshot (`raft.dump`) and its directory are fsynced
  before the journal entries it replaces are dropped.

pysyncobj offers no journal option, so `install` swaps the journal factory
that `SyncObj.__init__` calls (`pysyncobj.syncobj.createJournal`). The
private names used below are pysyncobj 0.3.17's; the version is pinned.
"""

from __future__ import annotations

import ctypes
import functools
import gzip
import os
import shutil
import signal
import socket
import weakref
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pysyncobj.serializer as _serializer
import pysyncobj.syncobj as _syncobj
from pysyncobj.journal import FileJournal, MetaStorer, createJournal
from pysyncobj.pickle import dumps


def fsync_path(path: str | Path) -> None:
    """fsync a file or directory by path (a directory sync makes a rename or a new file durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DurableMetaStorer(MetaStorer):  # type: ignore[misc]  # pysyncobj ships no type information
    """pysyncobj's term/vote/commit-index file, written crash-safely: fsync, rename, fsync the directory.

    `before` (the journal's sync) runs first, so a stored commit index never covers entries that are
    not on disk."""

    def __init__(self, path: str, before: Callable[[], None]) -> None:
        super().__init__(path)
        self._before = before

    def storeMeta(self, meta: dict[str, Any]) -> None:
        self._before()
        path = self.getPath()
        with open(path + ".tmp", "wb") as f:
            f.write(dumps(meta))
            f.flush()
            os.fsync(f.fileno())
        shutil.move(path + ".tmp", path)
        fsync_path(os.path.dirname(path) or ".")


class DurableJournal(FileJournal):  # type: ignore[misc]  # pysyncobj ships no type information
    """pysyncobj's FileJournal, synced to disk before every change is acted on."""

    def __init__(self, journal_file: str, dump_file: str | None) -> None:
        self.unsynced = False  # entries appended since the last sync (FileJournal's reload appends none)
        super().__init__(journal_file)
        self._FileJournal__metaStorer = DurableMetaStorer(journal_file + ".meta", self.sync)
        self._dump_file = dump_file
        self._deferred = False
        fsync_path(os.path.dirname(journal_file) or ".")  # the journal file itself may be new
        _journals.add(self)

    def flush(self) -> None:
        """Sync the journal's pages to disk without holding the GIL (see the module's docstring)."""
        os.fdatasync(self._FileJournal__journalFile._ResizableFile__f.fileno())
        self.unsynced = False

    def sync(self) -> None:
        """Make the entries appended since the last sync durable: one sync for all of them."""
        if self.unsynced:
            self.flush()

    def add(self, command: bytes, idx: int, term: int) -> None:
        super().add(command, idx, term)
        self.unsynced = True  # synced before anything acts on it (see the module's docstring)

    def clear(self) -> None:
        super().clear()
        if not self._deferred:
            self.flush()

    def deleteEntriesFrom(self, entryFrom: int) -> None:
        super().deleteEntriesFrom(entryFrom)
        self.flush()

    def deleteEntriesTo(self, entryTo: int) -> None:
        # Called once a snapshot covering these entries is written: make it durable before they go.
        if self._dump_file is not None and os.path.exists(self._dump_file):
            fsync_path(self._dump_file)
            fsync_path(os.path.dirname(self._dump_file) or ".")
        self._deferred = True  # it rewrites the log with clear() + add() per entry: one sync at the end
        try:
            super().deleteEntriesTo(entryTo)
        finally:
            self._deferred = False
        self.flush()


_journals: weakref.WeakSet[DurableJournal] = weakref.WeakSet()


def unsynced() -> bool:
    """Whether a journal of this process holds entries not yet on disk."""
    return any(j.unsynced for j in _journals)


def sync() -> None:
    """Sync every journal of this process that holds entries not yet on disk."""
    for j in list(_journals):
        j.sync()


DUMP_GZIP_LEVEL = 0
"""pysyncobj gzips its snapshots at level 9: 58 s of CPU for a 5M-entry state (119 MB pickled, to 58 MB), and
level 1 still takes 1.7-2.0 s (to 63 MB); stored blocks (level 0) take 0.26-0.6 s for 120 MB, and load in
0.3-0.43 s where level 1's took 0.58-0.75 s. The block hashes that are a third of a snapshot are random and the rest is
small integers that compress to half at best, so compressing buys half the disk and half a lagging follower's
transfer for seconds of CPU on every replica at once (their logs reach the threshold together), which starved
their Raft threads (elections all through a bulk fill), and without a data dir it runs on the Raft thread
itself."""


def install(fsync: bool, dump_file: str | None) -> None:
    """Make the next SyncObj in this process use a `DurableJournal` (fsync=True) or pysyncobj's own, and
    gzip its snapshots at `DUMP_GZIP_LEVEL` (reading takes any level: older snapshots load as before)."""

    def factory(journal_file: str | None = None) -> Any:
        if journal_file is None or not fsync:
            return createJournal(journal_file)
        return DurableJournal(journal_file, dump_file)

    _syncobj.createJournal = factory
    _serializer.gzip = SimpleNamespace(GzipFile=functools.partial(gzip.GzipFile, compresslevel=DUMP_GZIP_LEVEL))


_PR_SET_PDEATHSIG = 1


def _isolate_dump_child() -> None:
    """In a child that pysyncobj forked to write a snapshot (the only fork in a replica): close every
    listening socket inherited from the replica, die with it, and yield the CPU to the replicas.

    The child holds the replica's Raft and HTTP listening sockets for as long as the dump takes (tens
    of seconds for a big state): a replica killed meanwhile could not rebind its ports when restarted
    and exited with "cannot listen for Raft". A child that outlives a killed replica only finishes a
    dump nobody will read (the replica starts from the last complete one).

    The dump is background work (it pickles and gzips the whole index: over a second of CPU at 5M
    entries, see DUMP_GZIP_LEVEL), and the replicas of a cluster reach their size thresholds together:
    three children at normal priority compete with the Raft threads for the cores. At the lowest
    priority (nice 19) a dump still gets a share of a busy CPU, so it finishes under load.
    """
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            s = socket.socket(fileno=fd)
        except OSError:  # not a socket
            continue
        try:
            listening = s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        except OSError:
            listening = 0
        if listening:
            s.close()
        else:
            s.detach()  # leave the fd as it was
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        pass
    os.nice(19)


def isolate_dump_children() -> None:
    """Make every later fork of this process a dump child that holds no listening socket (once per process)."""
    global _isolated
    if not _isolated:
        os.register_at_fork(after_in_child=_isolate_dump_child)
        _isolated = True


_isolated = False
