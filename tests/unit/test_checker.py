"""The fault harness's checker on hand-made histories: each rule passes clean ones and flags broken ones."""

from __future__ import annotations

from kvtools.faults.checker import Observed, check_epochs, check_final, check_minority, check_reads
from kvtools.faults.history import FAIL, OK, SEQ_BLOCKS, UNKNOWN, Fault, Op, seq_hashes

SLOTS = tuple(range(SEQ_BLOCKS))


def reg(node: str, epoch: int, t1: float, outcome: str = OK) -> Op:
    return Op("register", node, 0, t1 - 0.01, t1, outcome, 200, epoch)


def pub(node: str, epoch: int, seq: int, t0: float = 1.0, outcome: str = OK, replica: int = 0) -> Op:
    return Op("publish", node, replica, t0, t0 + 0.01, outcome, 200 if outcome == OK else None, epoch, seq, SLOTS)


def rm(node: str, epoch: int, seq: int, t0: float = 2.0, outcome: str = OK) -> Op:
    return Op("remove", node, 0, t0, t0 + 0.01, outcome, 200 if outcome == OK else None, epoch, seq)


def look(seq: int, holders: dict[str, int], t0: float, consistency: str = "linearizable") -> Op:
    return Op(
        "lookup",
        "x",
        1,
        t0,
        t0 + 0.01,
        OK,
        200,
        seq=seq,
        consistency=consistency,
        holders={n: (e, SEQ_BLOCKS, SLOTS) for n, e in holders.items()},
    )


def obs(nodes: dict[str, int], seqs: dict[int, dict[str, int]], replica: int = 0, digest: str = "d") -> Observed:
    return Observed(replica, nodes, {s: {n: (e, SEQ_BLOCKS, SLOTS) for n, e in h.items()} for s, h in seqs.items()}, digest)


def test_seq_hashes_are_distinct_across_sequences() -> None:
    seen = [h for s in range(2000) for h in seq_hashes(s)]
    assert len(set(seen)) == len(seen) and all(0 <= h < 2**64 for h in seen)


def test_an_acknowledged_publish_present_everywhere_passes() -> None:
    ops = [reg("a", 5, 0.5), pub("a", 5, 1)]
    v, stats = check_final(ops, [obs({"a": 5}, {1: {"a": 5}}, r) for r in range(3)])
    assert v == [] and stats["publishes_checked"] == 3


def test_a_lost_acknowledged_publish_is_flagged_on_the_replica_missing_it() -> None:
    ops = [reg("a", 5, 0.5), pub("a", 5, 1)]
    v, _ = check_final(ops, [obs({"a": 5}, {1: {"a": 5}}, 0), obs({"a": 5}, {}, 1)])
    assert len(v) == 1 and "replica 1" in v[0] and "lost" in v[0]


def test_wrong_slots_count_as_lost() -> None:
    ops = [pub("a", 5, 1)]
    bad = Observed(0, {"a": 5}, {1: {"a": (5, SEQ_BLOCKS, tuple(reversed(SLOTS)))}}, "d")
    assert len(check_final(ops, [bad])[0]) == 1


def test_a_publish_superseded_by_a_new_epoch_may_be_gone_but_not_linger() -> None:
    ops = [pub("a", 5, 1), reg("a", 9, 3.0)]
    assert check_final(ops, [obs({"a": 9}, {})])[0] == []
    v, _ = check_final(ops, [obs({"a": 9}, {1: {"a": 5}})])
    assert len(v) == 1 and "epoch 5" in v[0]


def test_removes_acknowledged_must_stick_unless_a_publish_is_unknown() -> None:
    ops = [pub("a", 5, 1), rm("a", 5, 1)]
    assert check_final(ops, [obs({"a": 5}, {})])[0] == []
    assert len(check_final(ops, [obs({"a": 5}, {1: {"a": 5}})])[0]) == 1
    retried = [pub("a", 5, 1, outcome=UNKNOWN), *ops]
    assert check_final(retried, [obs({"a": 5}, {1: {"a": 5}})])[0] == []


def test_an_unknown_remove_excuses_either_outcome() -> None:
    ops = [pub("a", 5, 1), rm("a", 5, 1, outcome=UNKNOWN)]
    assert check_final(ops, [obs({"a": 5}, {})])[0] == []
    assert check_final(ops, [obs({"a": 5}, {1: {"a": 5}})])[0] == []
    refused = [pub("a", 5, 1), rm("a", 5, 1, outcome=FAIL)]
    assert len(check_final(refused, [obs({"a": 5}, {})])[0]) == 1


def test_diverged_digests_are_flagged() -> None:
    v, _ = check_final([], [obs({}, {}, 0, "x"), obs({}, {}, 1, "y")])
    assert len(v) == 1 and "diverged" in v[0]


def test_linearizable_lookup_after_a_new_epoch_must_not_return_the_old_one() -> None:
    ops = [reg("a", 5, 0.5), pub("a", 5, 1), reg("a", 9, 3.0)]
    assert check_reads([*ops, look(1, {"a": 5}, 2.9)], 1.0)[0] == []  # started before the new epoch's ack
    v, _ = check_reads([*ops, look(1, {"a": 5}, 3.1)], 1.0)
    assert len(v) == 1 and "newer epoch" in v[0]


def test_local_lookups_may_lag_only_within_the_bound() -> None:
    ops = [reg("a", 5, 0.5), pub("a", 5, 1), reg("a", 9, 3.0)]
    v, stats = check_reads([*ops, look(1, {"a": 5}, 3.5, "local")], 1.0)
    assert v == [] and stats["local_stale_within_bound"] == 1
    assert len(check_reads([*ops, look(1, {"a": 5}, 4.5, "local")], 1.0)[0]) == 1


def test_lookup_after_an_acknowledged_remove_must_not_return_it() -> None:
    ops = [pub("a", 5, 1), rm("a", 5, 1, t0=2.0)]
    v, _ = check_reads([*ops, look(1, {"a": 5}, 2.5)], 1.0)
    assert len(v) == 1 and "remove" in v[0]
    assert check_reads([pub("a", 5, 1, outcome=UNKNOWN), *ops, look(1, {"a": 5}, 2.5)], 1.0)[0] == []


def test_minority_rules() -> None:
    f = Fault("partition_leader", [2], 10.0, 14.0, minority=[2], minority_commit={2: (100, 100)})
    to_minority = Op("publish", "a", 2, 11.0, 11.5, OK, 200, 5, 1, SLOTS)
    after_heal = Op("publish", "a", 2, 11.0, 14.2, OK, 200, 5, 2, SLOTS)
    to_majority = Op("publish", "a", 0, 11.0, 11.1, OK, 200, 5, 3, SLOTS)
    assert check_minority([after_heal, to_majority], [f]) == []
    v = check_minority([to_minority], [f])
    assert len(v) == 1 and "minority replica 2" in v[0]
    moved = Fault("partition_leader", [2], 10.0, 14.0, minority=[2], minority_commit={2: (100, 101)})
    assert len(check_minority([], [moved])) == 1


def test_epochs_of_new_incarnations_must_grow() -> None:
    first = Op("register", "a", 0, 1.0, 1.1, OK, 200, 7, incarnation="i1")
    retry = Op("register", "a", 0, 1.2, 1.3, OK, 200, 7, incarnation="i1")  # the same process retrying
    assert check_epochs([first, retry]) == []
    again = Op("register", "a", 0, 2.0, 2.1, OK, 200, 7, incarnation="i2")
    v = check_epochs([first, again])
    assert len(v) == 1 and "epoch reuse" in v[0]
    assert check_epochs([first, Op("register", "a", 0, 2.0, 2.1, OK, 200, 8, incarnation="i2")]) == []


def test_linearizable_lookup_after_an_acknowledged_publish_must_find_it() -> None:
    ops = [reg("a", 5, 0.5), pub("a", 5, 1, t0=1.0)]
    found = look(1, {"a": 5}, 2.0)
    found.node = "a"
    v, stats = check_reads([*ops, found], 1.0)
    assert v == [] and stats["lookups_must_find"] == 1
    missed = look(1, {}, 2.0)
    missed.node = "a"
    v, _ = check_reads([*ops, missed], 1.0)
    assert len(v) == 1 and "missed read" in v[0]
    # A registration or a remove that may have happened in between excuses the miss.
    for w in (reg("a", 9, 1.5), rm("a", 5, 1, t0=1.5, outcome=UNKNOWN)):
        assert check_reads([*ops, w, missed], 1.0)[0] == []
    # A local lookup may miss it (it may lag).
    local = look(1, {}, 2.0, "local")
    local.node = "a"
    assert check_reads([*ops, local], 1.0)[0] == []
