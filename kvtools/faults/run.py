"""The fault harness: a real cluster, a load, a fault schedule, then the checker.

`run()` starts N directory replicas (each in its own network namespace when
that is possible, see `netns`), the simulated engines of `load`, injects the
scheduled faults one after another with steady load between them, heals
everything, waits for the replicas to converge, reads back what each one
holds and hands history and final state to `checker`. `kvdir bench soak
--minutes N` cycles the schedule for N minutes; tests/faults runs it short.

With `Plan.shards` > 1 it starts that many Raft groups of N replicas joined by
a shard map (docs/scale-out.md): each node writes to its home shard, the reader
asks every shard, each fault hits one shard (each shard's faults run on their
own timeline, side by side with the other shards'), and the checker judges
every node against its home shard's replicas (and that no other shard
registers or serves it).
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvdir.local_cluster import Cluster, free_ports, write_raft_password
from kvdir.sharded import shard_names
from kvproto.shardmap import ShardMap, home_of
from kvtools.faults import checker, netns
from kvtools.faults.history import OK, WRITES, Fault, History, seq_hashes
from kvtools.faults.load import Load, node_ids
from kvtools.faults.proxy import ProxyNetwork

log = logging.getLogger("kvtools.faults")

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


class PlanError(ValueError):
    """A plan that cannot run (bad fault names or shards): raised before anything starts."""


@dataclass
class Plan:
    replicas: int = 3
    faults: list[str] = field(default_factory=lambda: list(FAULTS))
    """Sharded, `kind@name` is injected into shard `name`, a plain `kind` into every shard (each on its own timeline)."""
    minutes: float = 0.0  # 0: run the schedule once; else cycle it until this much time has passed
    steady_s: float = 1.5  # load between faults, and while a fault holds
    nodes: int = 4
    seed: int = 1
    data_dir: Path | None = None
    use_netns: bool = True
    replica_args: tuple[str, ...] = ()
    shards: int = 1
    """Raft groups of `replicas` replicas each, joined by a shard map (docs/scale-out.md); 1: not sharded."""


@dataclass
class _Shard:
    """One Raft group of the run. Its replicas are 0..replicas-1 to `cluster`, `first + i` in the history."""

    name: str
    index: int
    first: int
    cluster: Cluster

    def members(self) -> list[int]:
        return [self.first + i for i in range(len(self.cluster.replica_urls))]


class _Run:
    def __init__(self, plan: Plan, data_dir: Path) -> None:
        if plan.shards < 1:
            raise PlanError(f"a run needs at least one shard, not {plan.shards}")
        self.plan = plan
        self.history = History()
        n, total = plan.replicas, plan.replicas * plan.shards
        ports = free_ports(2 * total)
        http_ports, raft_ports = ports[:total], ports[total:]
        groups = [list(range(k * n, (k + 1) * n)) for k in range(plan.shards)]
        names = shard_names(plan.shards) if plan.shards > 1 else ["directory"]
        self.schedule = [self._target(entry, names) for entry in plan.faults]
        # Nodes are placed as the replicas place them: by the map's hash of the node id (no pinned nodes).
        self.homes = {node: names.index(home_of(node, tuple(sorted(names)), {})) for node in node_ids(plan.nodes)}
        idle = [name for k, name in enumerate(names) if k not in self.homes.values()]
        if idle:
            raise PlanError(f"no simulated node has its home on shard(s) {idle}: run with more nodes than {plan.nodes}")
        self.netns_missing = netns.available() if plan.use_netns else "not asked for"
        self.net: netns.Network | ProxyNetwork
        if self.netns_missing is None:
            self.net = netns.Network(total)
        else:
            self.net = ProxyNetwork(total, raft_ports, groups)
        password = write_raft_password(data_dir / "secrets")
        map_file: Path | None = None
        if plan.shards > 1:
            shard_map = ShardMap(
                version=1,
                shards={name: [f"http://{self.net.hosts[g]}:{http_ports[g]}" for g in groups[k]] for k, name in enumerate(names)},
            )
            map_file = data_dir / "shards.json"
            map_file.write_text(shard_map.document())
        self.shards: list[_Shard] = []
        for k, name in enumerate(names):
            first = k * n
            shard_dir = data_dir / name if plan.shards > 1 else data_dir
            shard_dir.mkdir(exist_ok=True)
            cluster = Cluster(
                shard_dir,
                http_ports[first : first + n],
                raft_ports[first : first + n],
                lease_ttl_s=300,
                log_level="info",
                extra_args=(
                    "--write-timeout-s",
                    "3",
                    *plan.replica_args,
                    *(["--shard-map-file", str(map_file), "--shard", name] if map_file else []),
                ),
                hosts=self.net.hosts[first : first + n],
                prefix=self._on(self.net.prefix, first) if isinstance(self.net, netns.Network) else None,
                peers=self._on(self.net.peers, first) if isinstance(self.net, ProxyNetwork) else None,
                raft_password_file=password,
            )
            self.shards.append(_Shard(name, k, first, cluster))
        self.http = httpx.Client(timeout=2.0, trust_env=False)

    @staticmethod
    def _on(fn: Callable[[int], list[str]], first: int) -> Callable[[int], list[str]]:
        """A network's per-host function (indices over all shards) as one shard's cluster calls it (its own indices)."""
        return lambda i: fn(first + i)

    @staticmethod
    def _target(entry: str, names: list[str]) -> tuple[str, int | None]:
        kind, _, shard = entry.partition("@")
        if kind not in FAULTS and kind != POWER_LOSS:
            raise PlanError(f"unknown fault {kind!r}; expected one of {', '.join(FAULTS)} or power_loss")
        if not shard:
            return kind, None
        if shard not in names or len(names) == 1:
            raise PlanError(f"fault {entry!r}: no shard {shard!r} in this run (shards: {', '.join(names)})")
        return kind, names.index(shard)

    # -- helpers --------------------------------------------------------------------------

    def leader(self, sh: _Shard, among: list[int] | None = None, timeout: float = 60) -> int:
        """The replica of shard `sh` among its running ones (or `among`) that leads with every one of them following it.

        Judged by roles and terms, not by leader URLs: behind link proxies a replica knows its
        leader by the proxy's address. Indices are the shard's own.
        """
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            group = sh.cluster.alive() if among is None else among
            status = {}
            for i in group:
                try:
                    status[i] = self.http.get(sh.cluster.replica_urls[i] + "/v1/cluster", timeout=1.0).json()
                except (httpx.HTTPError, ValueError):
                    break
            else:
                leaders = [i for i, s in status.items() if s["role"] == "leader"]
                if len(leaders) == 1 and all(
                    s["leader"] is not None and s["term"] == status[leaders[0]]["term"] for s in status.values()
                ):
                    return leaders[0]
            time.sleep(0.05)
        raise TimeoutError(f"no leader agreed among replicas {among or 'all'} of {sh.name} within {timeout}s")

    def map_committed(self, timeout: float = 60) -> None:
        """Wait until every replica of every shard serves the shard map: until then a shard admits no node."""
        end = time.monotonic() + timeout
        for url in (u for sh in self.shards for u in sh.cluster.replica_urls):
            while True:
                try:
                    if self.http.get(url + "/v1/shards").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > end:
                    raise TimeoutError(f"{url} did not commit its shard map within {timeout}s")
                time.sleep(0.05)

    def commit_index(self, sh: _Shard, i: int) -> int:
        return int(self.http.get(sh.cluster.replica_urls[i] + "/v1/cluster").json()["commit_index"])

    def all_back(self, shards: list[_Shard] | None = None) -> None:
        """Every replica of `shards` (all by default) running again, and a leader that all of them follow."""
        for sh in self.shards if shards is None else shards:
            for i in range(self.plan.replicas):
                if i not in sh.cluster.alive():
                    sh.cluster.start_replica(i)
                else:
                    sh.cluster.kill(i, signal.SIGCONT)
        for sh in self.shards if shards is None else shards:
            self.leader(sh)

    # -- faults -----------------------------------------------------------------------------

    def inject(self, kind: str, sh: _Shard) -> Fault:
        n, steady, cluster = self.plan.replicas, self.plan.steady_s, sh.cluster
        leader = self.leader(sh)
        others = [i for i in range(n) if i != leader]

        def fault(replicas: list[int], minority: list[int] | None = None) -> Fault:
            """Record the fault, replicas numbered over all shards, from now."""
            glob = [sh.first + i for i in minority or []]
            return self.history.fault(
                Fault(
                    kind,
                    [sh.first + i for i in replicas],
                    time.monotonic(),
                    leader_before=sh.first + leader,
                    minority=glob,
                    shard=sh.index,
                )
            )

        if kind == "kill_leader":
            f = fault([leader])
            cluster.kill(leader)
            self.leader(sh, others)
            f.recovered_s = time.monotonic() - f.t0
            time.sleep(steady)
            cluster.start_replica(leader)
        elif kind == "kill_follower":
            victim = others[0]
            f = fault([victim])
            cluster.kill(victim)
            time.sleep(steady)
            cluster.start_replica(victim)
        elif kind == "pause_leader":
            f = fault([leader])
            cluster.kill(leader, signal.SIGSTOP)
            self.leader(sh, others)
            f.recovered_s = time.monotonic() - f.t0
            time.sleep(steady)
            cluster.kill(leader, signal.SIGCONT)
        elif kind == "pause_follower":
            victim = others[0]
            f = fault([victim])
            cluster.kill(victim, signal.SIGSTOP)
            time.sleep(steady)
            cluster.kill(victim, signal.SIGCONT)
        elif kind in PARTITIONS:
            minority = [leader] if kind == "partition_leader" else [others[0]]
            if n >= 5:
                minority.append(others[-1])
            majority = [i for i in range(n) if i not in minority]
            # Only this shard's links change: another shard may be cut or healed meanwhile.
            self.net.partition([[sh.first + i for i in minority], [sh.first + i for i in majority]], sh.members())
            # The window starts once every route is cut: a write invoked after that cannot commit on the minority.
            f = fault(minority, minority)
            self.leader(sh, majority)
            f.recovered_s = time.monotonic() - f.t0
            # From one election timeout after the cut, the minority has no leader and commits nothing.
            time.sleep(max(0.0, f.t0 + RAFT_MAX_TIMEOUT_S + 0.3 - time.monotonic()))
            settled = {i: self.commit_index(sh, i) for i in minority}
            time.sleep(steady)
            f.minority_commit = {sh.first + i: (settled[i], self.commit_index(sh, i)) for i in minority}
            # The window closes as healing starts: healing takes one `ip route del` per cut link, and a write
            # held by a minority replica commits as soon as its first route to the majority is back.
            f.t1 = time.monotonic()
            self.net.heal(sh.members())
        elif kind == POWER_LOSS:
            # Every machine loses what its disk did not have: the data dirs as of `steady` seconds ago,
            # taken while every replica was stopped (so consistent), are put back after a SIGKILL of all.
            for i in range(n):
                cluster.kill(i, signal.SIGSTOP)
            disk = cluster.data_dir / "disk-at-last-sync"
            for i in range(n):
                shutil.copytree(cluster.data_dir / f"replica{i + 1}", disk / f"replica{i + 1}")
            for i in range(n):
                cluster.kill(i, signal.SIGCONT)
            time.sleep(steady)
            f = fault(list(range(n)))
            for i in range(n):
                cluster.kill(i)
                shutil.rmtree(cluster.data_dir / f"replica{i + 1}")
                shutil.move(disk / f"replica{i + 1}", cluster.data_dir / f"replica{i + 1}")
            cluster.start()
            self.leader(sh)
            f.recovered_s = time.monotonic() - f.t0
        elif kind == "restart_all":
            f = fault(list(range(n)))
            for i in range(n):
                cluster.kill(i)
            cluster.start()
            self.leader(sh)
            f.recovered_s = time.monotonic() - f.t0
        else:
            raise ValueError(f"unknown fault {kind!r}; expected one of {', '.join(FAULTS)} or power_loss")
        f.t1 = f.t1 or time.monotonic()
        self.all_back([sh])
        log.info(
            "fault %s on %s%s: recovered in %s",
            kind,
            f.replicas,
            f" of {sh.name}" if len(self.shards) > 1 else "",
            f"{f.recovered_s:.2f}s" if f.recovered_s else "-",
        )
        return f

    # -- the end -------------------------------------------------------------------------

    def converge(self, timeout: float = 90) -> list[str]:
        """Every replica's digest, over all shards, once those of each shard are equal ("" if it never answered)."""
        end = time.monotonic() + timeout
        out: list[str] = []
        for sh in self.shards:
            digests: list[str] = []
            while True:
                try:
                    digests = [self.http.get(u + "/v1/digest").json()["digest"] for u in sh.cluster.replica_urls]
                except httpx.HTTPError:
                    digests = []
                if (digests and len(set(digests)) == 1) or time.monotonic() > end:
                    break
                time.sleep(0.2)
            out.extend(digests or [""] * self.plan.replicas)
        return out

    def observe(self, digests: list[str]) -> list[checker.Observed]:
        """What each replica of each shard holds, looking up every published sequence (of every shard) on each."""
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
            for sh in self.shards:
                for i, url in enumerate(sh.cluster.replica_urls):
                    g = sh.first + i
                    nodes = {n["node_id"]: n["epoch"] for n in self.http.get(url + "/v1/nodes").json()["nodes"]}
                    found = dict(zip(seqs, pool.map(lambda s, u=url: holders(u, s), seqs)))
                    out.append(checker.Observed(g, nodes, {s: h for s, h in found.items() if h}, digests[g], sh.index))
        return out

    def execute(self) -> dict[str, Any]:
        plan = self.plan
        sharded = len(self.shards) > 1
        if isinstance(self.net, netns.Network):
            self.net.setup()
        for sh in self.shards:
            sh.cluster.start()
        for sh in self.shards:
            self.leader(sh)
        if sharded:
            self.map_committed()
        load = Load(
            [sh.cluster.replica_urls for sh in self.shards],
            self.history,
            home=self.homes.__getitem__,
            nodes=plan.nodes,
            seed=plan.seed,
        )
        load.start()
        deadline = time.monotonic() + plan.minutes * 60

        def drive(sh: _Shard) -> int:
            """Inject this shard's faults in schedule order, cycled until the deadline; returns the rounds run."""
            kinds = [kind for kind, shard in self.schedule if shard in (None, sh.index)]
            rounds = 0
            while kinds:
                for kind in kinds:
                    self.inject(kind, sh)
                    time.sleep(plan.steady_s)
                rounds += 1
                if time.monotonic() >= deadline:
                    break
            return rounds

        try:
            time.sleep(plan.steady_s)
            # The shards are independent Raft groups, and fail independently: one injector each, side by side.
            with ThreadPoolExecutor(len(self.shards), thread_name_prefix="faults") as pool:
                rounds = min(f.result() for f in [pool.submit(drive, sh) for sh in self.shards])
        finally:
            load.stop()
        self.net.heal()
        self.all_back()
        digests = self.converge()
        observed = self.observe(digests)
        ops, faults = self.history.ops, self.history.faults
        homes = self.homes if sharded else None
        final_v, final_stats = checker.check_final(ops, observed, homes)
        read_v, read_stats = checker.check_reads(ops, STALE_BOUND_S, homes)
        minority_v = checker.check_minority(ops, faults)
        epoch_v = checker.check_epochs(ops)
        resume = []
        for f in faults:
            if f.kind in LEADER_LOSS:
                acked = [o.t1 for o in ops if o.kind in WRITES and o.outcome == OK and o.t0 >= f.t0 and o.shard == f.shard]
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
                    **({"shard": self.shards[f.shard].name} if sharded else {}),
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
            **({"shards": self.shard_report(digests)} if sharded else {}),
            "checker": {**final_stats, **read_stats},
            "violations": final_v + read_v + minority_v + epoch_v,
        }

    def shard_report(self, digests: list[str]) -> dict[str, Any]:
        """Per shard: its replicas (as the history numbers them), the nodes it is home to, its load, its digest."""
        return {
            sh.name: {
                "replicas": sh.members(),
                "nodes": sorted(n for n, k in self.homes.items() if k == sh.index),
                "history": self.history.counts(sh.index),
                "digests": sorted({digests[g] for g in sh.members()}),
            }
            for sh in self.shards
        }

    def close(self) -> None:
        for sh in self.shards:
            sh.cluster.stop()
        self.http.close()
        self.net.close()


def run(plan: Plan) -> dict[str, Any]:
    """Run the plan and return its report; every process and namespace it made is gone afterwards."""
    with tempfile.TemporaryDirectory(prefix="kvdir-faults-") as tmp:
        data_dir = plan.data_dir or Path(tmp)
        data_dir.mkdir(parents=True, exist_ok=True)
        r = _Run(plan, data_dir)  # checks the plan: nothing runs yet
        try:
            return r.execute()
        finally:
            r.close()


def format_report(report: dict[str, Any]) -> str:
    h = report["history"]
    shards = report.get("shards", {})
    lines = [
        f"{f'{len(shards)} shards x ' if shards else ''}replicas {report['replicas']}, {report['seconds']}s, {report['rounds']} rounds of the schedule, "
        f"network: {report['network']}",
        f"history: {h['ops']} operations: "
        + ", ".join(f"{k} {v['ok']} ok/{v['fail']} failed/{v['unknown']} unknown" for k, v in h.items() if k != "ops"),
        *(
            f"shard {name}: replicas {s['replicas']}, nodes {s['nodes']}, "
            + ", ".join(f"{k} {s['history'][k]['ok']} ok" for k in ("register", "publish", "lookup"))
            for name, s in shards.items()
        ),
        "faults: " + ", ".join(f"{k} x{v}" for k, v in report["faults"].items()),
        f"writes resume after a leader kill: median {report['writes_resume_after_leader_kill_s']['median']}s, "
        f"max {report['writes_resume_after_leader_kill_s']['max']}s over {report['writes_resume_after_leader_kill_s']['n']}",
        "checker: " + ", ".join(f"{k} {v}" for k, v in report["checker"].items()),
        f"violations: {len(report['violations'])}",
        *(f"  {v}" for v in report["violations"][:50]),
    ]
    return "\n".join(lines)


def main(*, minutes: float, replicas: int, as_json: bool, shards: int = 1) -> int:
    """`kvdir bench soak`: exit status 1 if the checker found any violation. Sharded, every shard cycles the schedule."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:  # two nodes per shard: enough for the map's hash to give every shard one, up to 6 shards
        report = run(Plan(replicas=replicas, minutes=minutes, faults=list(SOAK), shards=shards, nodes=max(4, 2 * shards)))
    except PlanError as exc:
        print(f"kvdir bench soak: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report) if as_json else format_report(report))
    return 1 if report["violations"] else 0
