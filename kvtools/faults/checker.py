"""The checker: decides from a history and the replicas' final state whether anything went wrong.

Pure functions of their inputs, so they can be tested on hand-made histories.
The rules (each violation is one line of the report):

1. Lost write: an acknowledged publish whose node is still at the publish's
   epoch on a replica, and which no remove could have superseded, must be on
   that replica with its slots.
2. Resurrected entry: a sequence whose remove was acknowledged must be gone,
   unless a publish of it has an unknown outcome (it may land later).
3. Stale entry at rest: every entry on a replica carries its node's current
   epoch there (a new epoch, expiry or deregistration dropped the old ones).
4. Divergence: every replica of a shard ends with the same digest.
5. Missed read: a linearizable lookup that starts after a publish was
   acknowledged returns it, unless a registration of the node or a remove
   of the sequence may have happened in between (an unknown write counts as
   pending for `UNKNOWN_HORIZON_S` after it started: replicas drop a write
   at its deadline, 3 s in the harness, and a command in Raft's log then
   commits or is discarded within an election).
   Stale read: a lookup must not return a node's epoch `e` once a
   registration giving that node a newer epoch was acknowledged before the
   lookup started, nor a sequence whose remove was acknowledged before it
   started (bar an unknown publish). Linearizable lookups: never. Local
   lookups: not later than `stale_bound_s` after that acknowledgement.
6. Minority commit: during a partition, the commit index of the minority
   side stays put, and no write sent to it is acknowledged before the heal.
7. Epoch reuse: a registration of a new incarnation, started after an
   earlier one of the same node was acknowledged, gets a greater epoch (else
   a fenced process's writes would become valid again).
8. Wrong shard (a sharded directory, docs/scale-out.md): no replica registers,
   holds or returns on a lookup a node whose home is another shard. Rules 1-5
   judge each node against its home shard's replicas only.

A directory that is not sharded is one shard, index 0: `homes` (node -> its
home shard's index) is then None, and `Observed.shard`, `Op.shard` are 0.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from kvtools.faults.history import FAIL, OK, SEQ_BLOCKS, UNKNOWN, WRITES, Fault, Op


@dataclass(slots=True)
class Observed:
    """What one replica holds at the end: node epochs, the holders of every sequence, its digest."""

    replica: int
    nodes: dict[str, int]
    seqs: dict[int, dict[str, tuple[int, int, tuple[int, ...]]]]  # seq -> node -> (epoch, matched, slots)
    digest: str
    shard: int = 0


def _home(homes: Mapping[str, int] | None, node: str) -> int | None:
    """The node's home shard; None for a node the load never ran (at home nowhere)."""
    return 0 if homes is None else homes.get(node)


def check_final(
    ops: list[Op], observed: list[Observed], homes: Mapping[str, int] | None = None
) -> tuple[list[str], dict[str, int]]:
    """Rules 1-4 and 8 on what the replicas hold."""
    violations: list[str] = []
    acked: dict[tuple[int, str], dict[int, Op]] = defaultdict(dict)  # (seq, node) -> epoch -> publish
    removes: dict[tuple[int, str], list[Op]] = defaultdict(list)
    unknown_publish: set[tuple[int, str]] = set()
    for o in ops:
        if o.kind == "publish" and o.seq is not None:
            if o.outcome == OK:
                acked[(o.seq, o.node)][o.epoch or 0] = o
            elif o.outcome == UNKNOWN:
                unknown_publish.add((o.seq, o.node))
        elif o.kind == "remove" and o.seq is not None and o.outcome != FAIL:
            removes[(o.seq, o.node)].append(o)
    checked = superseded = 0
    for obs in observed:
        for node in obs.nodes:
            if _home(homes, node) != obs.shard:
                violations.append(
                    f"replica {obs.replica} of shard {obs.shard} registers {node}, whose home is shard {_home(homes, node)}"
                )
        for (seq, node), by_epoch in acked.items():
            if _home(homes, node) != obs.shard:
                continue  # rule 8 below: the seq must not be there at all
            rm = removes.get((seq, node), [])
            held = obs.seqs.get(seq, {}).get(node)
            if any(r.outcome == OK for r in rm):
                if held is not None and (seq, node) not in unknown_publish:
                    violations.append(f"replica {obs.replica}: seq {seq} of {node} is back after its remove was acknowledged")
                continue
            if rm:
                continue  # a remove with an unknown outcome may or may not have happened
            epoch = obs.nodes.get(node)
            pub = by_epoch.get(epoch) if epoch is not None else None
            if pub is None:
                superseded += 1  # published under an epoch that is no longer current
                continue
            checked += 1
            if held is None or held[0] != epoch or held[1] != SEQ_BLOCKS or held[2] != pub.slots:
                violations.append(
                    f"replica {obs.replica}: acknowledged publish of seq {seq} by {node} epoch {epoch} is lost (holds {held})"
                )
        for seq, holders in obs.seqs.items():
            for node, (epoch, _, _) in holders.items():
                if _home(homes, node) != obs.shard:
                    violations.append(
                        f"replica {obs.replica} of shard {obs.shard} serves seq {seq} of {node}, "
                        f"whose home is shard {_home(homes, node)}"
                    )
                elif obs.nodes.get(node) != epoch:
                    violations.append(
                        f"replica {obs.replica}: seq {seq} held by {node} with epoch {epoch}, "
                        f"but the node's epoch there is {obs.nodes.get(node)}"
                    )
    shards = sorted({obs.shard for obs in observed})
    for shard in shards:
        group = [o for o in observed if o.shard == shard]
        if len({o.digest for o in group}) > 1:
            where = f"shard {shard}: " if len(shards) > 1 else ""
            violations.append(f"{where}replicas diverged: digests {sorted((o.replica, o.digest) for o in group)}")
    return violations, {"publishes_checked": checked, "publishes_superseded": superseded}


UNKNOWN_HORIZON_S = 10.0


def _may_overlap(o: Op, start: float, end: float) -> bool:
    """Whether write `o` may have taken effect between `start` and `end`."""
    last = o.t1 if o.outcome == OK else o.t0 + UNKNOWN_HORIZON_S
    return o.outcome != FAIL and o.t0 < end and last > start


def check_reads(ops: list[Op], stale_bound_s: float, homes: Mapping[str, int] | None = None) -> tuple[list[str], dict[str, int]]:
    """Rules 5 and 8 on what the lookups returned."""
    violations: list[str] = []
    pubs: dict[tuple[int, str], list[Op]] = defaultdict(list)
    interfering: dict[str, list[Op]] = defaultdict(list)  # node -> its registrations and removes
    for o in ops:
        if o.kind == "publish" and o.outcome == OK and o.seq is not None:
            pubs[(o.seq, o.node)].append(o)
        elif o.kind == "register" or o.kind == "remove":
            interfering[o.node].append(o)
    registered: dict[str, list[tuple[float, int]]] = defaultdict(list)  # node -> (acked at, epoch)
    removed: dict[tuple[int, str], float] = {}
    unknown_publish: set[tuple[int, str]] = set()
    for o in ops:
        if o.kind == "register" and o.outcome == OK and o.epoch is not None:
            registered[o.node].append((o.t1, o.epoch))
        elif o.kind == "remove" and o.outcome == OK and o.seq is not None:
            removed[(o.seq, o.node)] = min(o.t1, removed.get((o.seq, o.node), o.t1))
        elif o.kind == "publish" and o.outcome == UNKNOWN and o.seq is not None:
            unknown_publish.add((o.seq, o.node))
    stats = {"lookups_checked": 0, "local_stale_within_bound": 0, "lookups_must_find": 0}
    if homes is not None:
        stats["lookups_off_home"] = 0  # sent to a shard that is not the looked-up node's home: it must not answer it
    for o in ops:
        if o.kind != "lookup" or o.outcome != OK or o.holders is None:
            continue
        stats["lookups_checked"] += 1
        at_home = _home(homes, o.node) == o.shard
        if not at_home:
            stats["lookups_off_home"] += 1
        if o.consistency == "linearizable" and at_home:
            for p in pubs.get((o.seq, o.node), []):  # type: ignore[arg-type]
                if p.t1 >= o.t0 or any(
                    _may_overlap(w, p.t0, o.t1) for w in interfering[o.node] if w.kind == "register" or w.seq == o.seq
                ):
                    continue
                stats["lookups_must_find"] += 1
                if o.holders.get(o.node, (None, 0, ()))[:3] != (p.epoch, SEQ_BLOCKS, p.slots):
                    violations.append(
                        f"missed read: linearizable lookup of seq {o.seq} on replica {o.replica} "
                        f"{o.t0 - p.t1:.3f}s after its publish by {o.node} epoch {p.epoch} was acknowledged "
                        f"got {o.holders.get(o.node)}"
                    )
                break
        for node, (epoch, _, _) in o.holders.items():
            if _home(homes, node) != o.shard:
                violations.append(
                    f"wrong shard: {o.consistency} lookup of seq {o.seq} on replica {o.replica} (shard {o.shard}) "
                    f"returned {node}, whose home is shard {_home(homes, node)}"
                )
                continue
            newer = [t for t, e in registered.get(node, []) if e > epoch and t < o.t0]
            gone = removed.get((o.seq, node)) if o.seq is not None and (o.seq, node) not in unknown_publish else None
            since = min([*newer, *([gone] if gone is not None and gone < o.t0 else [])], default=None)
            if since is None:
                continue
            lag = o.t0 - since
            if o.consistency == "local" and lag <= stale_bound_s:
                stats["local_stale_within_bound"] += 1
                continue
            what = "a newer epoch" if newer and min(newer) == since else "its remove"
            violations.append(
                f"stale read: {o.consistency} lookup of seq {o.seq} on replica {o.replica} returned {node} "
                f"epoch {epoch}, {lag:.3f}s after {what} was acknowledged"
            )
    return violations, stats


def check_minority(ops: list[Op], faults: list[Fault]) -> list[str]:
    """Rule 6."""
    violations: list[str] = []
    for f in faults:
        if not f.minority:
            continue
        for r, (settled, at_heal) in f.minority_commit.items():
            if at_heal != settled:
                violations.append(f"{f.kind}: minority replica {r} advanced its commit index {settled} -> {at_heal}")
        for o in ops:
            if o.kind in WRITES and o.replica in f.minority and f.t0 <= o.t0 < f.t1 and o.outcome == OK and o.t1 < f.t1:
                violations.append(
                    f"{f.kind}: {o.kind} of {o.node} sent to minority replica {o.replica} "
                    f"was acknowledged {o.t1 - f.t0:.3f}s into the partition"
                )
    return violations


def check_epochs(ops: list[Op]) -> list[str]:
    """Rule 7."""
    violations: list[str] = []
    regs: dict[str, list[Op]] = defaultdict(list)
    for o in ops:
        if o.kind == "register" and o.outcome == OK and o.epoch is not None:
            regs[o.node].append(o)
    for node, rs in regs.items():
        for later in rs:
            for earlier in rs:
                if earlier.t1 < later.t0 and earlier.incarnation != later.incarnation and later.epoch <= earlier.epoch:  # type: ignore[operator]
                    violations.append(
                        f"epoch reuse: {node} incarnation {later.incarnation} got epoch {later.epoch}, "
                        f"not above epoch {earlier.epoch} acknowledged earlier to incarnation {earlier.incarnation}"
                    )
                    break
    return violations
