"""The fault checker over a sharded directory: each node is judged on its home shard, and only there."""

from __future__ import annotations

from kvtools.faults.checker import Observed, check_final, check_reads
from kvtools.faults.history import OK, SEQ_BLOCKS, Op

SLOTS = tuple(range(SEQ_BLOCKS))
HOMES = {"a": 0, "b": 1}  # node -> its home shard's index


def held(seqs: dict[int, dict[str, int]]) -> dict[int, dict[str, tuple[int, int, tuple[int, ...]]]]:
    return {s: {n: (e, SEQ_BLOCKS, SLOTS) for n, e in h.items()} for s, h in seqs.items()}


def shard_obs(replica: int, shard: int, nodes: dict[str, int], seqs: dict[int, dict[str, int]], digest: str) -> Observed:
    return Observed(replica, nodes, held(seqs), digest, shard)


def history() -> list[Op]:
    return [
        Op("register", "a", 0, 0.4, 0.5, OK, 200, 5, shard=0),
        Op("publish", "a", 1, 1.0, 1.01, OK, 200, 5, 1, SLOTS, shard=0),
        Op("register", "b", 3, 0.4, 0.5, OK, 200, 7, shard=1),
        Op("publish", "b", 4, 1.0, 1.01, OK, 200, 7, 2, SLOTS, shard=1),
    ]


def clean() -> list[Observed]:
    """Shard 0 (replicas 0-1) holds a and its seq 1, shard 1 (replicas 2-3) b and its seq 2: digests differ by shard."""
    return [shard_obs(r, 0, {"a": 5}, {1: {"a": 5}}, "d0") for r in (0, 1)] + [
        shard_obs(r, 1, {"b": 7}, {2: {"b": 7}}, "d1") for r in (2, 3)
    ]


def test_each_node_is_checked_on_its_home_shard_only_and_digests_per_shard() -> None:
    v, stats = check_final(history(), clean(), HOMES)
    assert v == [] and stats["publishes_checked"] == 4  # each publish on its own shard's 2 replicas, not the other's


def test_a_publish_missing_from_its_home_shard_is_lost() -> None:
    observed = clean()
    observed[3] = shard_obs(3, 1, {"b": 7}, {}, "d1")
    v, _ = check_final(history(), observed, HOMES)
    assert len(v) == 1 and "replica 3" in v[0] and "lost" in v[0]


def test_a_shard_registering_or_serving_a_node_homed_elsewhere_is_flagged() -> None:
    observed = clean()
    observed[0] = shard_obs(0, 0, {"a": 5, "b": 7}, {1: {"a": 5}, 2: {"b": 7}}, "d0")
    v, _ = check_final(history(), observed, HOMES)
    assert any("replica 0 of shard 0 registers b, whose home is shard 1" in x for x in v)
    assert any("replica 0 of shard 0 serves seq 2 of b" in x for x in v)


def test_divergence_is_judged_within_a_shard() -> None:
    observed = clean()
    observed[2] = shard_obs(2, 1, {"b": 7}, {2: {"b": 7}}, "other")
    v, _ = check_final(history(), observed, HOMES)
    assert v == ["shard 1: replicas diverged: digests [(2, 'other'), (3, 'd1')]"]


def lookup(shard: int, holders: dict[str, int], node: str = "a") -> Op:
    return Op(
        "lookup",
        node,
        2 * shard,
        2.0,
        2.01,
        OK,
        200,
        seq=1,
        consistency="linearizable",
        holders={n: (e, SEQ_BLOCKS, SLOTS) for n, e in holders.items()},
        shard=shard,
    )


def test_the_other_shard_must_not_answer_and_its_empty_answer_is_no_missed_read() -> None:
    ops = [*history(), lookup(0, {"a": 5}), lookup(1, {})]
    v, stats = check_reads(ops, 1.0, HOMES)
    assert v == [] and stats["lookups_must_find"] == 1 and stats["lookups_off_home"] == 1
    v, _ = check_reads([*history(), lookup(1, {"a": 5})], 1.0, HOMES)
    assert len(v) == 1 and v[0].startswith("wrong shard:") and "returned a, whose home is shard 0" in v[0]
    v, _ = check_reads([*history(), lookup(0, {})], 1.0, HOMES)  # the home shard missing it is still a missed read
    assert len(v) == 1 and v[0].startswith("missed read")
