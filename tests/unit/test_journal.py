"""DurableJournal: pysyncobj's file journal, synced before every change is acted on."""

from __future__ import annotations

import os
from pathlib import Path

import pysyncobj.syncobj as syncobj_module
import pytest
from pysyncobj.journal import FileJournal, createJournal

from directory import journal


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths os.fsync was called on, in order (the real fsync still runs)."""
    paths: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return paths


def test_entries_term_and_vote_survive_reopening(tmp_path: Path) -> None:
    path = str(tmp_path / "raft.journal")
    j = journal.DurableJournal(path, None)
    for i in range(1, 50):
        j.add(b"cmd%d" % i, i, 3)
    j.deleteEntriesFrom(40)  # a follower truncating a diverged tail
    j.setCurrentTerm(7, "10.0.0.2:8201")
    j._destroy()
    again = FileJournal(path)  # pysyncobj's own reader sees the same log
    assert [again[i][0] for i in range(len(again))] == [b"cmd%d" % i for i in range(1, 41)]
    assert again.getCurrentTerm() == 7 and again.getVotedForNodeId() == "10.0.0.2:8201"
    again._destroy()


def test_term_and_vote_are_fsynced_before_the_rename_and_the_directory_after(tmp_path: Path, synced: list[str]) -> None:
    j = journal.DurableJournal(str(tmp_path / "raft.journal"), None)
    synced.clear()
    j.setCurrentTerm(2, None)
    assert synced == [str(tmp_path / "raft.journal.meta.tmp"), str(tmp_path)]
    j._destroy()


def test_appended_entries_are_synced_together_before_the_commit_index_and_truncations_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    j = journal.DurableJournal(str(tmp_path / "raft.journal"), None)
    flushes: list[int] = []
    real = j.flush
    monkeypatch.setattr(j, "flush", lambda: (flushes.append(len(j)), real()))
    j.add(b"a", 1, 1)
    j.add(b"b", 2, 1)
    assert flushes == [] and j.unsynced
    j.sync()
    j.sync()  # nothing new since: no second sync
    assert flushes == [2] and not j.unsynced
    j.add(b"c", 3, 1)
    j.setRaftCommitIndex(3)
    j.onOneSecondTimer()  # stores the commit index: only once the entries it covers are on disk
    assert flushes == [2, 3]
    j.deleteEntriesFrom(1)
    j.clear()
    assert flushes == [2, 3, 1, 0]
    j._destroy()


def test_compaction_syncs_the_snapshot_before_dropping_entries(tmp_path: Path, synced: list[str]) -> None:
    dump = tmp_path / "raft.dump"
    dump.write_bytes(b"snapshot")
    j = journal.DurableJournal(str(tmp_path / "raft.journal"), str(dump))
    for i in range(1, 11):
        j.add(b"x", i, 1)
    synced.clear()
    j.deleteEntriesTo(8)
    assert synced[:2] == [str(dump), str(tmp_path)]
    assert [j[i][1] for i in range(len(j))] == [9, 10]
    j._destroy()


def test_install_swaps_the_factory_syncobj_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(syncobj_module, "createJournal", createJournal)  # restored after the test
    journal.install(True, None)
    j = syncobj_module.createJournal(str(tmp_path / "a.journal"))
    assert isinstance(j, journal.DurableJournal)
    j._destroy()
    journal.install(False, None)
    j = syncobj_module.createJournal(str(tmp_path / "b.journal"))
    assert type(j) is FileJournal
    j._destroy()
