"""Prometheus metrics of one replica, in a registry of its own (one per app, so tests can run several)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvproto.state import OK, Command, DirectoryState, Result
from kvproto.tasks import TaskFailures

if TYPE_CHECKING:
    from directory.replica import Replica

_LATENCY = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


KNOWN_REJECTIONS = ("commit_timeout", "index_full", "node_limit", "unauthorized", "forbidden", "invalid_request", "too_many")
"""Errors a replica's alerts and dashboard name, shown at zero before the first one."""


class DirectoryMetrics:
    def __init__(self, replica: Replica) -> None:
        r = self.registry = CollectorRegistry()
        self.commands = Counter(
            "kvdir_directory_commands_total", "Commands applied, by kind and result", ["kind", "status"], registry=r
        )
        self.commits = Counter(
            "kvdir_directory_commits_total", "Raft commands committed through this replica (each a group of writes)", registry=r
        )
        self.group_size = Histogram(
            "kvdir_directory_group_commit_writes",
            "Writes per Raft command",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096),
            registry=r,
        )
        self.commit_seconds = Histogram(
            "kvdir_directory_commit_seconds", "Time for a Raft command to commit", buckets=_LATENCY, registry=r
        )
        self.tasks = TaskFailures("kvdir_directory", ("lease_check",), r)
        self.watchers = Gauge("kvdir_directory_watchers", "Watch streams open on this replica", registry=r)
        self.watch_refused = Counter(
            "kvdir_directory_watch_refused_total", "Watch streams refused (429), by the cap hit", ["cap"], registry=r
        )
        self.watch_cut = Counter(
            "kvdir_directory_watch_cut_total", "Watch streams this replica ended, by reason", ["reason"], registry=r
        )
        self.lookups = Counter("kvdir_directory_lookups_total", "Lookups answered", ["consistency"], registry=r)
        self.lookup_seconds = Histogram(
            "kvdir_directory_lookup_seconds", "Time to answer a lookup (index part)", buckets=_LATENCY, registry=r
        )
        self.write_seconds = Histogram(
            "kvdir_directory_write_seconds", "Time from a write request to its commit", ["kind"], buckets=_LATENCY, registry=r
        )
        self.rejected = Counter(
            "kvdir_directory_requests_rejected_total", "Requests answered 4xx/5xx, by error", ["error"], registry=r
        )
        # Series the dashboards and alerts read exist from the start, at zero (a rate over no series is "no data").
        for kind in get_args(Command):
            self.commands.labels(kind.__name__.lower(), OK)
        for consistency in ("local", "linearizable"):
            self.lookups.labels(consistency)
        for kind in ("publish", "remove"):
            self.write_seconds.labels(kind)
        for error in KNOWN_REJECTIONS:
            self.rejected.labels(error)
        state: Callable[[], DirectoryState] = lambda: replica.state  # noqa: E731 - the state object is replaced when a snapshot is installed
        Gauge("kvdir_directory_entries", "(block, holder) entries in the index", registry=r).set_function(
            lambda: len(state().index)
        )
        Gauge("kvdir_directory_index_bytes", "Bytes of the index's arrays", registry=r).set_function(
            lambda: state().index.nbytes()
        )
        Gauge("kvdir_directory_nodes", "Registered nodes", registry=r).set_function(lambda: len(state().nodes))
        Gauge("kvdir_directory_raft_term", "Current Raft term", registry=r).set_function(lambda: replica.raft.raftCurrentTerm)
        Gauge("kvdir_directory_raft_role", "0 follower, 1 candidate, 2 leader", registry=r).set_function(
            lambda: 2 if replica.is_leader else 0
        )
        Gauge("kvdir_directory_raft_commit_index", "Raft commit index", registry=r).set_function(
            lambda: replica.raft.raftCommitIndex
        )
        Gauge("kvdir_directory_raft_last_applied", "Raft index last applied here", registry=r).set_function(
            lambda: replica.raft.raftLastApplied
        )

    def on_commit(self, commands: list[Command], results: list[Result], seconds: float) -> None:
        self.commits.inc()
        self.group_size.observe(len(commands))
        self.commit_seconds.observe(seconds)
        for c, res in zip(commands, results):
            self.commands.labels(type(c).__name__.lower(), res.status).inc()
