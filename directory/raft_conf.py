"""pysyncobj's configuration of a replica, from its settings, and the sizes that keep Raft entries whole."""

from __future__ import annotations

from collections.abc import Callable

from pysyncobj import SyncObjConf

from directory.config import DirectorySettings

BIND_TRIES, BIND_RETRY_S = 10, 0.5  # how long a replica waits for its Raft port before it gives up
# pysyncobj sends an entry of at least appendEntriesBatchSizeBytes (64 KiB by default) in pieces, and
# marks the last piece by the entry's size where it should use the size of what it sends (the entry
# pickled again, ~1.5x bigger for binary data): followers unpickled truncated entries ("pickle data
# was truncated"), and after the errors one truncated entries it had already applied. So no entry is
# ever sent in pieces: entries are capped at 1/ENTRY_SHARE of the frame cap by `command_size` (numpy bytes;
# pickled ~1.5x, plus one command of at most max_blocks_per_publish blocks), below the
# 1/APPEND_SHARE that pysyncobj splits at; a message (entries up to that share, plus one, pickled
# again) stays under the frame cap that peers enforce.
ENTRY_SHARE, APPEND_SHARE = 8, 4


def raft_conf(settings: DirectorySettings, on_state_changed: Callable[[int, int], None]) -> SyncObjConf:
    """The replica's SyncObjConf; creates `data_dir`, where its journal and snapshot go."""
    conf = SyncObjConf(
        appendEntriesUseBatch=False,
        appendEntriesBatchSizeBytes=settings.raft_max_frame_bytes // APPEND_SHARE,
        commandsWaitLeader=True,
        raftMinTimeout=settings.raft_min_timeout_s,
        raftMaxTimeout=settings.raft_max_timeout_s,
        appendEntriesPeriod=settings.raft_append_period_s,
        autoTickPeriod=settings.raft_tick_s,
        connectionRetryTime=settings.raft_min_timeout_s / 5,
        connectionTimeout=settings.raft_connection_timeout_s,
        # A Raft port that stays taken fails the start (Replica) instead of leaving a replica that
        # serves HTTP but never hears its peers (pysyncobj retries the bind forever, silently).
        bindRetryTime=BIND_RETRY_S,
        maxBindRetries=BIND_TRIES,
        # A leader cut off from the majority steps down within one election timeout (pysyncobj's
        # default is 30 s), so it stops serving local reads about when the majority elects anew.
        leaderFallbackTimeout=settings.raft_max_timeout_s,
        logCompactionMinEntries=20000,
        logCompactionMinTime=300,
        password=settings.raft_password.get_secret_value() if settings.raft_password else None,
        # Listen on the address given, never on every interface (pysyncobj's default for a node address).
        bindAddress=settings.raft,
        dynamicMembershipChange=False,
        onStateChanged=on_state_changed,
    )
    if settings.data_dir is not None:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        conf.journalFile = str(settings.data_dir / "raft.journal")
        conf.fullDumpFile = str(settings.data_dir / "raft.dump")
    return conf
