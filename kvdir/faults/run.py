"""The fault harness: a real cluster, a load, a fault schedule, then the checker.

`run()` starts N directory replicas (each in its own network namespace when
that is possible, see `netns`), the simulated engines of `load`, injects the
scheduled faults one after another with steady load between them, heals
everything, waits for the replicas to converge, reads back what each one
holds and hands history and final state to `checker`. `kvdir bench soak
--minutes N` cycles the schedule for N minutes; tests/faults runs it short.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import statistics
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvdir.faults import checker, netns
from kvdir.faults.history import OK, WRITES, Fault, History, seq_hashes
from kvdir.faults.load import Load
from kvdir.faults.proxy import ProxyNetwork
from kvdir.launcher import Cluster, free_ports, write_raft_password

log = logging.getLogger("kvdir.faults")

FAULTS = (
    "kill_leader",
    "kill_follower",
    "pause_leader",
    "pause_follower",
    "partition_leader",
    "partition_follower",
    "restart_all",
)
SOAK = (
    "kill_leader",
    "partition_leader",
    "kill_leader",
    "kill_follower",
    "pause_leader",
    "kill_leader",
    "partition_follower",
    "pause_follower",
    "restart_all",
)
"""The soak's round: three leader kills, two partitions and one full restart each."""
PARTITIONS = frozenset({"partition_leader", "partition_follower"})
POWER_LOSS = "power_loss"
"""Not in FAULTS: every replica SIGKILLed and its data dir rolled back a few seconds, i.e. a power loss
of every machine *without* `--fsync` (with it the disk holds everything acknowledged, and the same
crash is `restart_all`). It reproduces the gap pysyncobj leaves, for the checker to catch."""
LEADER_LOSS = frozenset({"kill_leader", "pause_leader", "partition_leader"})
RAFT_MAX_TIMEOUT_S = 0.5  # the replicas' default --raft-max-timeout-s
STALE_BOUND_S = 2 * RAFT_MAX_TIMEOUT_S + 0.6
"""How far a local lookup may lag (docs/guarantees.md, "Staleness bound"): a replica cut off from its leader stops
serving local lookups within one election timeout; the rest is scheduling slack on a busy machine."""


@dataclass
class Plan:
    replicas: int = 3
    faults: list[str] = field(default_factory=lambda: list(FAULTS))
    minutes: float = 0.0  # 0: run the schedule once; else cycle it until this much time has passed
    steady_s: float = 1.5  # load between faults, and while a fault holds
    nodes: int = 4
    seed: int = 1
    data_dir: Path | None = None
    use_netns: bool = True
    replica_args: tuple[str, ...] = ()


class _Run:
    def __init__(self, plan: Plan, data_dir: Path) -> None:
        self.plan = plan
        self.history = History()
        n = plan.replicas
        ports = free_ports(2 * n)
        self.netns_missing = netns.available() if plan.use_netns else "not asked for"
        self.net: netns.Network | ProxyNetwork
        if self.netns_missing is None:
            self.net = netns.Network(n)
            prefix, peers = self.net.prefix, None
        else:
            self.net = ProxyNetwork(n, ports[n:])
            prefix, peers = None, self.net.peers
        self.cluster = Cluster(
            data_dir,
            ports[:n],
            ports[n:],
            lease_ttl_s=300,
            log_level="info",
            extra_args=("--write-timeout-s", "3", *plan.replica_args),
            hosts=self.net.hosts,
            prefix=prefix,
            peers=peers,
            raft_password_file=write_raft_password(data_dir / "secrets"),
        )
        self.http = httpx.Client(timeout=2.0, trust_env=False)

    # -- helpers --------------------------------------------------------------------------

    def leader(self, among: list[int] | None = None, timeout: float = 60) -> int:
        """The replica among the running ones (or `among`) that leads with every one of them following it.

        Judged by roles and terms, not by leader URLs: behind link proxies a replica knows its
        leader by the proxy's address.
        """
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            group = self.cluster.alive() if among is None else among
            status = {}
            for i in group:
                try:
                    status[i] = self.http.get(self.cluster.replica_urls[i] + "/v1/cluster", timeout=1.0).json()
                except (httpx.HTTPError, ValueError):
                    break
            else:
                leaders = [i for i, s in status.items() if s["role"] == "leader"]
                if len(leaders) == 1 and all(
                    s["leader"] is not None and s["term"] == status[leaders[0]]["term"] for s in status.values()
                ):
                    return leaders[0]
            time.sleep(0.05)
        raise TimeoutError(f"no leader agreed among replicas {among or 'all'} within {timeout}s")

    def commit_index(self, i: int) -> int:
        return int(self.http.get(self.cluster.replica_urls[i] + "/v1/cluster").json()["commit_index"])

    def all_back(self) -> None:
        for i in range(self.plan.replicas):
            if i not in self.cluster.alive():
                self.cluster.start_replica(i)
            else:
                self.cluster.kill(i, signal.SIGCONT)
        self.leader()

    # -- faults -----------------------------------------------------------------------------

    def inject(self, kind: str) -> Fault:
        n, steady = self.plan.replicas, self.plan.steady_s
        leader = self.leader()
        others = [i for i in range(n) if i != leader]
        if kind == "kill_leader":
            f = self.history.fault(Fault(kind, [leader], time.monotonic(), leader_before=leader))
            self.cluster.kill(leader)
            self.leader(others)
            f.recovered_s = time.monotonic() - f.t0
            time.sleep(steady)
            self.cluster.start_replica(leader)
        elif kind == "kill_follower":
            victim = others[0]
            f = self.history.fault(Fault(kind, [victim], time.monotonic(), leader_before=leader))
            self.cluster.kill(victim)
            time.sleep(steady)
            self.cluster.start_replica(victim)
        elif kind == "pause_leader":
            f = self.history.fault(Fault(kind, [leader], time.monotonic(), leader_before=leader))
            self.cluster.kill(leader, signal.SIGSTOP)
            self.leader(others)
            f.recovered_s = time.monotonic() - f.t0
            time.sleep(steady)
            self.cluster.kill(leader, signal.SIGCONT)
        elif kind == "pause_follower":
            victim = others[0]
            f = self.history.fault(Fault(kind, [victim], time.monotonic(), leader_before=leader))
            self.cluster.kill(victim, signal.SIGSTOP)
            time.sleep(steady)
            self.cluster.kill(victim, signal.SIGCONT)
        elif kind in PARTITIONS:
            minority = [leader] if kind == "partition_leader" else [others[0]]
            if n >= 5:
                minority.append(others[-1])
            majority = [i for i in range(n) if i not in minority]
            self.net.partition([minority, majority])
            # The window starts once every route is cut: a write invoked after that cannot commit on the minority.
            f = self.history.fault(Fault(kind, minority, time.monotonic(), leader_before=leader, minority=minority))
            self.leader(majority)
            f.recovered_s = time.monotonic() - f.t0
            # From one election timeout after the cut, the minority has no leader and commits nothing.
            time.sleep(max(0.0, f.t0 + RAFT_MAX_TIMEOUT_S + 0.3 - time.monotonic()))
            settled = {i: self.commit_index(i) for i in minority}
            time.sleep(steady)
            f.minority_commit = {i: (settled[i], self.commit_index(i)) for i in minority}
            self.net.heal()
        elif kind == POWER_LOSS:
            # Every machine loses what its disk did not have: the data dirs as of `steady` seconds ago,
            # taken while every replica was stopped (so consistent), are put back after a SIGKILL of all.
            for i in range(n):
                self.cluster.kill(i, signal.SIGSTOP)
            disk = self.cluster.data_dir / "disk-at-last-sync"
            for i in range(n):
                shutil.copytree(self.cluster.data_dir / f"replica{i + 1}", disk / f"replica{i + 1}")
            for i in range(n):
                self.cluster.kill(i, signal.SIGCONT)
            time.sleep(steady)
            f = self.history.fault(Fault(kind, list(range(n)), time.monotonic(), leader_before=leader))
            for i in range(n):
                self.cluster.kill(i)
                shutil.rmtree(self.cluster.data_dir / f"replica{i + 1}")
                shutil.move(disk / f"replica{i + 1}", self.cluster.data_dir / f"replica{i + 1}")
            self.cluster.start()
            self.leader()
            f.recovered_s = time.monotonic() - f.t0
        elif kind == "restart_all":
            f = self.history.fault(Fault(kind, list(range(n)), time.monotonic(), leader_before=leader))
            for i in range(n):
                self.cluster.kill(i)
            self.cluster.start()
            self.leader()
            f.recovered_s = time.monotonic() - f.t0
        else:
            raise ValueError(f"unknown fault {kind!r}; expected one of {', '.join(FAULTS)} or power_loss")
        f.t1 = time.monotonic()
        self.all_back()
        log.info("fault %s on %s: recovered in %s", kind, f.replicas, f"{f.recovered_s:.2f}s" if f.recovered_s else "-")
        return f

    # -- the end -------------------------------------------------------------------------

    def converge(self, timeout: float = 90) -> list[str]:
        end = time.monotonic() + timeout
        urls = self.cluster.replica_urls
        digests: list[str] = []
        while time.monotonic() < end:
            try:
                digests = [self.http.get(u + "/v1/digest").json()["digest"] for u in urls]
            except httpx.HTTPError:
                digests = []
            if digests and len(set(digests)) == 1:
                return digests
            time.sleep(0.2)
        return digests

    def observe(self, digests: list[str]) -> list[checker.Observed]:
        seqs = sorted({o.seq for o in self.history.ops if o.kind == "publish" and o.seq is not None})

        def holders(url: str, seq: int) -> dict[str, tuple[int, int, tuple[int, ...]]]:
            end = time.monotonic() + 30
            while True:  # a replica without a leader (an election after the restarts) answers 503: wait it out
                r = self.http.post(url + "/v1/lookup", json={"hashes": seq_hashes(seq), "with_slots": True})
                if r.status_code != 503 or time.monotonic() > end:
                    break
                time.sleep(0.1)
            r.raise_for_status()
            return {h["node_id"]: (h["epoch"], h["matched_blocks"], tuple(h["slots"])) for h in r.json()["holders"]}

        out = []
        with ThreadPoolExecutor(8) as pool:
            for i, url in enumerate(self.cluster.replica_urls):
                nodes = {n["node_id"]: n["epoch"] for n in self.http.get(url + "/v1/nodes").json()["nodes"]}
                found = dict(zip(seqs, pool.map(lambda s, u=url: holders(u, s), seqs)))
                out.append(checker.Observed(i, nodes, {s: h for s, h in found.items() if h}, digests[i] if digests else ""))
        return out

    def execute(self) -> dict[str, Any]:
        plan = self.plan
        schedule = list(plan.faults)
        if isinstance(self.net, netns.Network):
            self.net.setup()
        self.cluster.start()
        self.leader()
        load = Load(self.cluster.replica_urls, self.history, nodes=plan.nodes, seed=plan.seed)
        load.start()
        deadline = time.monotonic() + plan.minutes * 60
        try:
            time.sleep(plan.steady_s)
            rounds = 0
            while True:
                for kind in schedule:
                    self.inject(kind)
                    time.sleep(plan.steady_s)
                rounds += 1
                if time.monotonic() >= deadline:
                    break
        finally:
            load.stop()
        self.net.heal()
        self.all_back()
        digests = self.converge()
        observed = self.observe(digests)
        ops, faults = self.history.ops, self.history.faults
        final_v, final_stats = checker.check_final(ops, observed)
        read_v, read_stats = checker.check_reads(ops, STALE_BOUND_S)
        minority_v = checker.check_minority(ops, faults)
        epoch_v = checker.check_epochs(ops)
        resume = []
        for f in faults:
            if f.kind in LEADER_LOSS:
                acked = [o.t1 for o in ops if o.kind in WRITES and o.outcome == OK and o.t0 >= f.t0]
                if acked:
                    resume.append((f.kind, min(acked) - f.t0))
        kills = [s for k, s in resume if k == "kill_leader"]
        return {
            "replicas": plan.replicas,
            "network": "namespaces"
            if self.netns_missing is None
            else f"loopback link proxies (no namespaces: {self.netns_missing})",
            "rounds": rounds,
            "seconds": round(time.monotonic() - self.history.start, 1),
            "history": self.history.counts(),
            "faults": dict(Counter(f.kind for f in faults)),
            "fault_log": [
                {
                    "kind": f.kind,
                    "replicas": f.replicas,
                    "at_s": round(f.t0 - self.history.start, 2),
                    "recovered_s": None if f.recovered_s is None else round(f.recovered_s, 3),
                    **({"minority_commit": f.minority_commit} if f.minority else {}),
                }
                for f in faults
            ],
            "writes_resume_after_leader_kill_s": {
                "median": round(statistics.median(kills), 3) if kills else None,
                "max": round(max(kills), 3) if kills else None,
                "n": len(kills),
            },
            "writes_resume_s": [(k, round(s, 3)) for k, s in resume],
            "stale_bound_s": STALE_BOUND_S,
            "checker": {**final_stats, **read_stats},
            "violations": final_v + read_v + minority_v + epoch_v,
        }

    def close(self) -> None:
        self.cluster.stop()
        self.http.close()
        self.net.close()


def run(plan: Plan) -> dict[str, Any]:
    """Run the plan and return its report; every process and namespace it made is gone afterwards."""
    with tempfile.TemporaryDirectory(prefix="kvdir-faults-") as tmp:
        data_dir = plan.data_dir or Path(tmp)
        data_dir.mkdir(parents=True, exist_ok=True)
        r = _Run(plan, data_dir)
        try:
            return r.execute()
        finally:
            r.close()


def format_report(report: dict[str, Any]) -> str:
    h = report["history"]
    lines = [
        f"replicas {report['replicas']}, {report['seconds']}s, {report['rounds']} rounds of the schedule, "
        f"network: {report['network']}",
        f"history: {h['ops']} operations: "
        + ", ".join(f"{k} {v['ok']} ok/{v['fail']} failed/{v['unknown']} unknown" for k, v in h.items() if k != "ops"),
        "faults: " + ", ".join(f"{k} x{v}" for k, v in report["faults"].items()),
        f"writes resume after a leader kill: median {report['writes_resume_after_leader_kill_s']['median']}s, "
        f"max {report['writes_resume_after_leader_kill_s']['max']}s over {report['writes_resume_after_leader_kill_s']['n']}",
        "checker: " + ", ".join(f"{k} {v}" for k, v in report["checker"].items()),
        f"violations: {len(report['violations'])}",
        *(f"  {v}" for v in report["violations"][:50]),
    ]
    return "\n".join(lines)


def main(*, minutes: float, replicas: int, as_json: bool) -> int:
    """`kvdir bench soak`: exit status 1 if the checker found any violation."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    report = run(Plan(replicas=replicas, minutes=minutes, faults=list(SOAK)))
    print(json.dumps(report) if as_json else format_report(report))
    return 1 if report["violations"] else 0
