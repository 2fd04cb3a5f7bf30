"""Engine KV events (docs/protocol.md §5): decoding real vLLM captures and synthesized batches, and hash mapping."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from adapters.config import EventsSettings
from adapters.engine_events import Cleared, DecodeStats, Removed, Stored, decode_event
from adapters.event_wire import END_SEQ, DecodeError, decode_message, decode_payload, decode_replay_reply, encode_seq, parse_seq
from adapters.extra_keys import raw_key
from adapters.hash_mapper import HashMapper, event_identity
from adapters.node_feed import TASKS
from kvproto.hashing import KvIdentity, block_hashes, identity_hashes, multimodal_extra_keys
from kvproto.tasks import TaskFailures, cancel_and_wait
from tests.support.wait import until

ROOT = Path(__file__).resolve().parents[2]
CAPTURES = ROOT / "tests" / "data" / "vllm_kv_events"  # a copy of shared/data/vllm_kv_events (vLLM 0.32 captures)

A0, A1 = 6616113538505953862, 3410895834723361670  # seq 10: the shared 70-token prefix's two full blocks
A2, B2 = 11144390117411643634, 16310062092427750112  # seq 11 and 12: the third block of prompts A and B


def captured(run: str = "") -> list[list[bytes]]:
    folder = CAPTURES / run if run else CAPTURES
    return [
        [(folder / f.name.replace("frame0", f"frame{i}")).read_bytes() for i in range(3)]
        for f in sorted(folder.glob("msg*_frame0.bin"))
    ]


def prompts() -> dict[str, list[int]]:
    return json.loads((CAPTURES / "prompts_sent.json").read_text())


# -- the captured vLLM 0.32 frames ------------------------------------------------


def test_captured_frames_decode_to_the_expected_events() -> None:
    stats = DecodeStats()
    batches = [decode_message(m, stats) for m in captured()]
    assert all(b is not None for b in batches)
    assert [b.seq for b in batches] == list(range(10, 21))
    assert {b.topic for b in batches} == {b"kv"} and {b.dp_rank for b in batches} == {0}
    kinds = [[type(e).__name__ for e in b.events] for b in batches]
    assert kinds[0] == ["Cleared", "Stored"]
    assert kinds[1:8] == [["Stored"]] * 7
    assert kinds[8] == ["Removed"] * 13 + ["Stored"] and kinds[9] == ["Removed"] * 14 + ["Stored"]
    assert kinds[10] == ["Cleared"]
    assert (stats.messages, stats.stored, stats.removed, stats.cleared) == (11, 10, 27, 2)
    assert (stats.garbage_frames, stats.unknown_events, stats.malformed_events, stats.extra_fields) == (0, 0, 0, 0)

    first = batches[0].events[1]
    assert isinstance(first, Stored)
    assert first.engine_hashes == (A0, A1) and first.parent is None
    assert first.token_ids[:5] == (334, 157, 407, 669, 52) and len(first.token_ids) == 64
    assert (first.block_size, first.medium, first.lora_name, first.lora_id, first.extra_keys, first.group_idx) == (
        32,
        "GPU",
        None,
        None,
        None,
        0,
    )
    assert batches[0].ts == pytest.approx(1795936700.4191983)
    second = batches[1].events[0]
    assert second.engine_hashes == (A2,) and second.parent == A1
    assert second.token_ids[:6] == (547, 440, 324, 479, 602, 467)
    assert batches[2].events[0].engine_hashes == (B2,) and batches[2].events[0].parent == A1
    removed = batches[8].events[0]
    assert removed == Removed((A2,), "GPU", 0)
    assert len(batches[4].events[0].engine_hashes) == 14 and len(batches[4].events[0].token_ids) == 448


def test_captured_frames_map_to_our_seq_hashes_through_the_parent_chain() -> None:
    p = prompts()
    batches = [decode_message(m) for m in captured()]
    m = HashMapper(32)
    for b in batches[:4]:
        for ev in b.events:
            m.apply(ev)
    # The shared prefix: our hashes of its first 64 tokens, whichever prompt they came from.
    assert m.ours(A0) + m.ours(A1) == tuple(block_hashes(p["prefix"], 32)[:2]) == tuple(block_hashes(p["A"], 32)[:2])
    # The third block chains from A1 (parent_block_hash): prompt tokens 64..89 plus 6 generated ones.
    a_seq = p["A"][:64] + list(batches[1].events[0].token_ids)
    b_seq = p["B"][:64] + list(batches[2].events[0].token_ids)
    assert a_seq[64:90] == p["A"][64:90] and b_seq[64:95] == p["B"][64:95]
    assert m.ours(A2) == (block_hashes(a_seq, 32)[2],)
    assert m.ours(B2) == (block_hashes(b_seq, 32)[2],)
    assert m.ours(A2) != m.ours(B2)
    text = batches[3].events[0]
    assert m.ours(text.engine_hashes[0]) == tuple(block_hashes(text.token_ids, 32))

    published: set[int] = set()
    for b in batches[4:10]:
        for ev in b.events:
            r = m.apply(ev)
            published |= set(r.publish)
            published -= set(r.remove)
            if isinstance(ev, Stored):  # each long prompt: 14 blocks from the root
                assert [h for e in ev.engine_hashes for h in m.ours(e)] == block_hashes(ev.token_ids, 32)
    # After seq 19: prompt 1 gone, prompt 2's first 6 blocks left, prompts 3-6 whole: 62 blocks.
    assert len(m) == 62 and len(m.snapshot()) == 62
    long_prompts = [b.events[-1].token_ids for b in batches[4:10]]
    expected = set(block_hashes(long_prompts[1], 32)[:6]).union(*(block_hashes(t, 32) for t in long_prompts[2:]))
    assert set(m.snapshot()) == expected
    assert m.stats.missing_parents == m.stats.unknown_removals == m.stats.unsupported == 0
    r = m.apply(batches[10].events[0])  # AllBlocksCleared
    assert len(m) == 0 and set(r.remove) == expected


def test_second_capture_continues_the_first_and_maps_the_same_blocks_the_same_way() -> None:
    assert (CAPTURES / "run2").is_dir()
    first = [decode_message(m) for m in captured()]
    second = [decode_message(m) for m in captured("run2")]
    assert [b.seq for b in second] == list(range(21, 35))  # no gap after run 1's seq 20
    m = HashMapper(32)
    for ev in first[0].events + first[1].events:
        m.apply(ev)
    before = (m.ours(A0), m.ours(A1), m.ours(A2))
    for b in first[2:] + second:
        if b.seq == 24:  # the shared prefix again, after the reset of run 1
            assert m.ours(A0) is None
        for ev in b.events:
            m.apply(ev)
        if b.seq == 25:
            assert (m.ours(A0), m.ours(A1), m.ours(A2)) == before
    assert m.stats.missing_parents == 0 and m.stats.unsupported == 0 and len(m) == 0  # run 2 ends with a reset


# -- synthesized batches: both encodings, int and bytes hashes ---------------------

TOKENS = list(range(100, 164))  # 4 blocks of 16


def _hashes(kind: str, n: int, salt: str = "") -> list:
    digests = [hashlib.sha256(f"{salt}{i}".encode()).digest() for i in range(n)]
    return digests if kind == "bytes" else [int.from_bytes(d[:8], "big") for d in digests]


def _events(encoding: str, hs: list, lone: object) -> list:
    if encoding == "array":
        return [
            ["BlockStored", hs[:2], None, TOKENS[:32], 16, None, "GPU"],
            ["BlockStored", hs[2:], hs[1], TOKENS[32:], 16, None, "GPU", None],
            ["BlockRemoved", [hs[3]], "GPU"],
            ["BlockRemoved", [lone]],
            ["AllBlocksCleared"],
        ]
    return [
        {
            "type": "BlockStored",
            "block_hashes": hs[:2],
            "parent_block_hash": None,
            "token_ids": TOKENS[:32],
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
        },
        {
            "type": "BlockStored",
            "block_hashes": hs[2:],
            "parent_block_hash": hs[1],
            "token_ids": TOKENS[32:],
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        },
        {"type": "BlockRemoved", "block_hashes": [hs[3]], "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [lone]},
        {"type": "AllBlocksCleared"},
    ]


@pytest.mark.parametrize("hash_kind", ["int", "bytes"])
@pytest.mark.parametrize("encoding", ["array", "map"])
@pytest.mark.parametrize("batch_form", ["array3", "array2", "map"])
def test_synthesized_batches_decode_in_every_encoding(encoding: str, hash_kind: str, batch_form: str) -> None:
    hs = _hashes(hash_kind, 4)
    lone = _hashes(hash_kind, 1, "unknown")[0]
    events = _events(encoding, hs, lone)
    batch = {"array3": [1.5, events, 2], "array2": [1.5, events], "map": {"ts": 1.5, "events": events, "attn_dp_rank": 2}}[
        batch_form
    ]
    stats = DecodeStats()
    b = decode_message([b"kv", encode_seq(7), msgspec.msgpack.encode(batch)], stats)
    assert b is not None and b.seq == 7 and b.ts == 1.5 and b.topic == b"kv"
    assert b.dp_rank == (None if batch_form == "array2" else 2)
    s1, s2, r1, r2, c = b.events
    assert s1 == Stored(tuple(hs[:2]), None, tuple(TOKENS[:32]), 16, medium="GPU")
    assert s2.engine_hashes == tuple(hs[2:]) and s2.parent == hs[1] and s2.token_ids == tuple(TOKENS[32:])
    assert r1 == Removed((hs[3],), "GPU") and r2 == Removed((lone,)) and c == Cleared()
    assert (stats.stored, stats.removed, stats.cleared, stats.extra_fields, stats.unknown_events) == (2, 2, 1, 0, 0)

    m = HashMapper(16)
    results = [m.apply(e) for e in b.events]
    ours = block_hashes(TOKENS, 16)
    assert results[0].publish == tuple(ours[:2]) and results[1].publish == tuple(ours[2:])
    assert results[2].remove == (ours[3],)
    assert results[3].remove == () and m.stats.unknown_removals == 1  # an unknown hash is harmless
    assert set(results[4].remove) == set(ours[:3]) and len(m) == 0


def test_sglang_style_signed_hashes_and_positional_events_without_medium() -> None:
    hs = [-5, 2**63 - 1, -(2**63)]
    tokens = list(range(48))
    events = [
        ["BlockStored", hs[:1], None, tokens[:16], 16, None],  # SGLang: one page per event, chained
        ["BlockStored", hs[1:], hs[0], tokens[16:], 16, 3],
        ["BlockRemoved", [hs[2]]],
    ]
    _ts, evs, rank = decode_payload(msgspec.msgpack.encode([2.0, events]))
    assert rank is None and evs[1].lora_id == 3 and evs[1].parent == -5
    m = HashMapper(16)
    m.apply(evs[0])
    r = m.apply(evs[1])
    # lora_id (no name) is the adapter "lora_id=3": its own identity, chained from the plain first block.
    assert event_identity("", lora_id=3) == KvIdentity("", "", "lora_id=3", "")
    assert r.publish[0] != block_hashes(tokens, 16)[1]
    assert r.publish == tuple(
        identity_hashes(tokens[16:], KvIdentity(adapter="lora_id=3"), 16, parent=block_hashes(tokens, 16)[0])
    )
    assert m.apply(evs[2]).remove == (r.publish[1],)


# -- unknown, extra, malformed and garbage -------------------------------------------


def test_unknown_types_and_extra_fields_are_counted_and_skipped() -> None:
    stats = DecodeStats()
    events = [
        ["BlockUpdated", [1], "CPU"],
        {"type": "SomethingNew", "x": 1},
        {
            "type": "BlockStored",
            "block_hashes": [1],
            "parent_block_hash": None,
            "token_ids": list(range(16)),
            "block_size": 16,
            "lora_id": None,
            "brand_new": True,
            "another": [1, 2],
        },
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 0, "locality": "x", "mystery": 0},
        ["BlockRemoved", [1], "GPU", 0, None, None, "one too many", "two"],
        {"type": "AllBlocksCleared", "why": "reset"},
    ]
    _, evs, _ = decode_payload(msgspec.msgpack.encode({"ts": 1.0, "events": events, "extension": 1}), stats)
    assert [type(e).__name__ for e in evs] == ["Stored", "Removed", "Removed", "Cleared"]
    assert stats.unknown_events == 2
    assert stats.extra_fields == 2 + 1 + 2 + 1 + 1  # stored, removed (locality is known), positional, cleared, batch
    assert stats.malformed_events == 0


def test_stores_of_other_cache_groups_are_skipped() -> None:
    stats = DecodeStats()
    ev = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": list(range(16)),
        "block_size": 16,
        "lora_id": None,
        "kv_cache_spec_kind": "sliding_window",
        "group_idx": 1,
    }
    assert decode_event(ev, stats) is None and stats.skipped_groups == 1


@pytest.mark.parametrize(
    "bad",
    [
        {
            "type": "BlockStored",
            "block_hashes": [1, 2],
            "parent_block_hash": None,
            "token_ids": list(range(16)),
            "block_size": 16,
            "lora_id": None,
        },
        {
            "type": "BlockStored",
            "block_hashes": ["x"],
            "parent_block_hash": None,
            "token_ids": list(range(16)),
            "block_size": 16,
            "lora_id": None,
        },
        {
            "type": "BlockStored",
            "block_hashes": [1],
            "parent_block_hash": 1.5,
            "token_ids": list(range(16)),
            "block_size": 16,
            "lora_id": None,
        },
        {
            "type": "BlockStored",
            "block_hashes": [1],
            "parent_block_hash": None,
            "token_ids": [[1, 2]] * 16,
            "block_size": 16,
            "lora_id": None,
        },
        {
            "type": "BlockStored",
            "block_hashes": [1],
            "parent_block_hash": None,
            "token_ids": [-1] * 16,
            "block_size": 16,
            "lora_id": None,
        },
        {
            "type": "BlockStored",
            "block_hashes": [1],
            "parent_block_hash": None,
            "token_ids": list(range(16)),
            "block_size": 0,
            "lora_id": None,
        },
        # Checked in C now (msgspec, strict): a bool is not a token, nor a float, nor a value past uint32.
        {
            "type": "BlockStored",
            "block_hashes": [1],
            "parent_block_hash": None,
            "token_ids": [*range(15), True],
            "block_size": 16,
            "lora_id": None,
        },
        {
            "type": "BlockStored",
            "block_hashes": [1],
            "parent_block_hash": None,
            "token_ids": [*range(15), 2.0],
            "block_size": 16,
            "lora_id": None,
        },
        {
            "type": "BlockStored",
            "block_hashes": [1],
            "parent_block_hash": None,
            "token_ids": [*range(15), 2**32],
            "block_size": 16,
            "lora_id": None,
        },
        {
            "type": "BlockStored",
            "block_hashes": [1, True],
            "parent_block_hash": None,
            "token_ids": list(range(32)),
            "block_size": 16,
            "lora_id": None,
        },
        {"type": "BlockRemoved", "block_hashes": 7},
        ["BlockStored", [1], None],
        [1, 2, 3],
        "BlockStored",
        None,
    ],
)
def test_malformed_events_are_counted_not_fatal(bad: object) -> None:
    stats = DecodeStats()
    good = ["AllBlocksCleared"]
    _, evs, _ = decode_payload(msgspec.msgpack.encode([0.0, [bad, good]]), stats)
    assert evs == (Cleared(),) and stats.malformed_events == 1


GOOD = msgspec.msgpack.encode([1.0, [["AllBlocksCleared"]], 0])


@pytest.mark.parametrize(
    "frames",
    [
        [b"kv", encode_seq(1)],  # too few frames
        [b"kv", encode_seq(1), GOOD, b"more"],  # too many
        [b"kv", b"\x00" * 7, GOOD],  # seq of 7 bytes
        [b"kv", encode_seq(1), b"\xc1"],  # never valid msgpack
        [b"kv", encode_seq(1), GOOD + b"\x00"],  # trailing bytes
        [b"kv", encode_seq(1), b""],
        [b"kv", encode_seq(1), msgspec.msgpack.encode(42)],
        [b"kv", encode_seq(1), msgspec.msgpack.encode([1.0])],
        [b"kv", encode_seq(1), msgspec.msgpack.encode([1.0, [], 0, "x"])],
        [b"kv", encode_seq(1), msgspec.msgpack.encode([1.0, "events"])],
        [b"kv", encode_seq(1), msgspec.msgpack.encode(["ts", []])],
        [b"kv", encode_seq(1), msgspec.msgpack.encode({"ts": 1.0})],
    ],
)
def test_garbage_frames_are_counted_and_skipped(frames: list[bytes]) -> None:
    stats = DecodeStats()
    assert decode_message(frames, stats) is None
    assert stats.garbage_frames == 1 and stats.messages == 0
    b = decode_message([b"kv", encode_seq(2), GOOD], stats)  # the next good one still decodes
    assert b is not None and b.events == (Cleared(),) and stats.garbage_frames == 1


def test_seq_is_big_endian_signed_and_replay_replies_decode() -> None:
    assert parse_seq(b"\xff" * 8) == END_SEQ == -1
    assert parse_seq(encode_seq(2**40 + 3)) == 2**40 + 3 and encode_seq(10) == (10).to_bytes(8, "big")
    with pytest.raises(DecodeError):
        parse_seq(b"\x01")
    assert decode_replay_reply([b"", encode_seq(5), GOOD]) == (5, GOOD)  # vLLM / SGLang, DEALER side
    assert decode_replay_reply([encode_seq(5), GOOD]) == (5, GOOD)  # REQ side
    assert decode_replay_reply([b"", b"kv", encode_seq(5), GOOD]) == (5, GOOD)  # TensorRT-LLM: topic first
    assert decode_replay_reply([b"", encode_seq(-1), b""]) == (END_SEQ, b"")
    with pytest.raises(DecodeError):
        decode_replay_reply([b"", b"", b"", b"", b""])


# -- hash mapping -----------------------------------------------------------------------


def _chain(tokens: list[int], bs: int, hashes: list, parent: object = None, **kw: object) -> Stored:
    return Stored(tuple(hashes), parent, tuple(tokens), bs, **kw)


def test_missing_parent_is_counted_and_publishes_nothing() -> None:
    m = HashMapper(16)
    r = m.store(_chain(list(range(16)), 16, [2], parent=1))
    assert r.missing_parent and r.publish == () and m.stats.missing_parents == 1 and len(m) == 0
    r = m.store(_chain(list(range(16)), 16, [3], parent=2))  # its child cannot be placed either
    assert r.missing_parent and m.stats.missing_parents == 2


def test_lru_bound_evicts_oldest_and_removes_it_from_the_directory() -> None:
    m = HashMapper(4, max_entries=3)
    tokens = list(range(20))
    ours = block_hashes(tokens, 4)
    published, removed = [], []
    for i in range(5):
        r = m.store(_chain(tokens[4 * i : 4 * i + 4], 4, [i], parent=None if i == 0 else i - 1))
        published += r.publish
        removed += r.remove
    assert published == ours and len(m) == 3 and m.stats.evicted == 2
    assert removed == ours[:2]  # evicted: a miss later, never a stale hit
    assert m.ours(0) is None and m.ours(4) == (ours[4],)
    # Using an entry as a parent refreshes it: the oldest is then another one.
    m.store(_chain(list(range(900, 904)), 4, [99], parent=2))
    assert m.ours(2) is not None and m.ours(3) is None
    assert m.store(_chain(tokens[:4], 4, [7], parent=0)).missing_parent


@pytest.mark.parametrize("k", [1, 2, 4])
def test_engine_blocks_split_into_k_of_ours(k: int) -> None:
    ours_bs, eng_bs = 16, 16 * k
    tokens = list(range(1000, 1000 + 3 * eng_bs))
    m = HashMapper(ours_bs)
    r1 = m.store(_chain(tokens[: 2 * eng_bs], eng_bs, [10, 11]))
    r2 = m.store(_chain(tokens[2 * eng_bs :], eng_bs, [12], parent=11))  # chained from the LAST of e1's blocks
    expected = block_hashes(tokens, ours_bs)
    assert list(r1.publish) + list(r2.publish) == expected
    assert m.ours(11) == tuple(expected[k : 2 * k])
    assert m.remove(Removed((11,))).remove == tuple(expected[k : 2 * k])  # all k of them


@pytest.mark.parametrize("eng_bs", [24, 8, 17])
def test_unsupported_engine_block_sizes_are_counted(eng_bs: int) -> None:
    m = HashMapper(16)
    r = m.store(_chain(list(range(eng_bs)), eng_bs, [1]))
    assert r.unsupported and r.publish == () and m.stats.unsupported == 1


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5])
def test_tokens_outside_uint32_in_a_hand_made_store_are_unsupported(bad: object) -> None:
    """Decoding rejects these first; a Stored built in code still never reaches the hashing with them."""
    m = HashMapper(16)
    r = m.store(_chain([*range(15), bad], 16, [1]))  # type: ignore[list-item]
    assert r.unsupported and r.publish == () and m.stats.unsupported == 1 and len(m) == 0


def test_a_removal_keeps_the_block_while_another_holder_is_left_and_its_lru_place() -> None:
    m = HashMapper(16, max_entries=2)
    m.store(_chain(list(range(16)), 16, [1], group_idx=0, medium="GPU"))
    m.store(_chain(list(range(16)), 16, [1], group_idx=0, medium="CPU"))
    m.store(_chain(list(range(16, 32)), 16, [2]))
    assert m.remove(Removed((1,), "GPU", 0)).remove == ()  # the CPU copy holds it, and it stays the oldest
    r = m.store(_chain(list(range(32, 48)), 16, [3]))
    assert 1 not in m and r.remove == tuple(block_hashes(list(range(16)), 16))  # evicted first: its place did not move
    assert m.remove(Removed((1,), "CPU", 0)).remove == () and m.stats.unknown_removals == 1


def test_shared_blocks_are_reference_counted_across_groups_and_media() -> None:
    m = HashMapper(16)
    tokens = list(range(16))
    h = block_hashes(tokens, 16)[0]
    assert m.store(_chain(tokens, 16, [1], group_idx=0, medium="GPU")).publish == (h,)
    assert m.store(_chain(tokens, 16, [2], group_idx=1, medium="GPU")).publish == ()  # a second engine hash, same block
    assert m.store(_chain(tokens, 16, [1], group_idx=0, medium="CPU")).publish == ()  # offloaded copy of the first
    assert m.remove(Removed((1,), "GPU", 0)).remove == ()  # still on CPU
    assert m.remove(Removed((1,), "CPU", 0)).remove == ()  # engine hash 2 still holds it
    assert m.remove(Removed((2,), "GPU", 1)).remove == (h,)
    assert len(m) == 0


def test_event_identity_names_adapter_and_salt() -> None:
    assert event_identity("ns", "m") == KvIdentity("ns", "m")
    assert event_identity("ns", "m", lora_name="sql", lora_id=1) == KvIdentity("ns", "m", "sql")  # the name wins
    assert event_identity("ns", "m", lora_id=2) == KvIdentity("ns", "m", "lora_id=2")
    assert event_identity("ns", "m", cache_salt="s") == KvIdentity("ns", "m", "", "s")
    assert event_identity("ns").key == "ns"  # no model, adapter or salt: the namespace-only hashes of before


# -- KV identity: the mapper's hashes are the gateway's (docs/protocol.md §1.1) ----------------------


def test_plain_blocks_hash_under_the_configured_model() -> None:
    tokens = list(range(48))
    m = HashMapper(16, namespace="tenant-a", model="llama")
    r = m.store(_chain(tokens, 16, [1, 2, 3]))
    assert r.publish == tuple(identity_hashes(tokens, KvIdentity("tenant-a", "llama"), 16))
    assert r.publish != tuple(block_hashes(tokens, 16, "tenant-a"))  # another model's or no model's: never the same
    assert HashMapper(16, namespace="tenant-a").store(_chain(tokens, 16, [1, 2, 3])).publish == tuple(
        block_hashes(tokens, 16, "tenant-a")
    )  # no model: as before


def test_protocol_vector_through_the_mapper() -> None:
    tokens = list(range(1, 41))  # docs/protocol.md §1.1: model "m", tokens 1..40, B = 16
    assert HashMapper(16, model="m").store(_chain(tokens[:32], 16, [1, 2])).publish == (
        17575364930229200160,
        14926259037993209659,
    )


@pytest.mark.parametrize(
    ("lora_name", "key"),
    [
        ("sql", None),  # SGLang, or a vLLM event without extra keys
        ("sql", ("lora", "sql", "/adapters/sql")),  # vLLM 0.32: the name in both
        (None, ("lora", "sql", None)),  # only in the extra keys
        ("sql", "sql"),  # older vLLM: the bare name in the extra keys
    ],
)
def test_a_lora_event_hashes_as_the_gateway_hashes_the_adapter(lora_name: str | None, key: object) -> None:
    tokens = list(range(64))
    m = HashMapper(16, namespace="ns", model="llama")

    def store(hashes: list[int], parent: int | None, toks: list[int]) -> tuple[int, ...]:
        extra = None if key is None else ((key,),) * len(hashes)
        return m.store(_chain(toks, 16, hashes, parent=parent, lora_name=lora_name, lora_id=1, extra_keys=extra)).publish

    published = store([1, 2], None, tokens[:32]) + store([3, 4], 2, tokens[32:])
    gateway = identity_hashes(tokens, KvIdentity("ns", "llama", "sql"), 16)
    assert list(published) == gateway
    assert set(gateway).isdisjoint(identity_hashes(tokens, KvIdentity("ns", "llama"), 16))
    assert m.stats.unmapped_keys == 0


def test_a_lora_key_that_disagrees_with_lora_name_never_matches() -> None:
    tokens = list(range(16))
    m = HashMapper(16, model="llama")
    r = m.store(_chain(tokens, 16, [1], lora_name="sql", extra_keys=((("lora", "chat", None),),)))
    assert r.publish[0] not in {
        *identity_hashes(tokens, KvIdentity("", "llama", "sql"), 16),
        *identity_hashes(tokens, KvIdentity("", "llama", "chat"), 16),
    }


@pytest.mark.parametrize("k", [1, 2])
def test_a_salted_vllm_chain_equals_the_gateways_salted_hashes(k: int) -> None:
    """vLLM puts ("cache_salt", s) in the request's first block only; the blocks after it, in the same event
    and in child events (decoded from msgpack, as the wire carries them), are hashed under the salt too."""
    eb = 16 * k
    tokens = list(range(500, 500 + 5 * eb))
    events = [
        {
            "type": "BlockStored",
            "block_hashes": [11, 12, 13],
            "parent_block_hash": None,
            "token_ids": tokens[: 3 * eb],
            "block_size": eb,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [[["cache_salt", "tenant-9"]], None, None],
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        },
        ["BlockStored", [14, 15], 13, tokens[3 * eb :], eb, None, "GPU", None, [None, None]],
    ]
    _, evs, _ = decode_payload(msgspec.msgpack.encode([1.0, events]))
    m = HashMapper(16, model="llama")
    published = [h for ev in evs for h in m.apply(ev).publish]
    assert published == identity_hashes(tokens, KvIdentity("", "llama", "", "tenant-9"), 16)
    assert set(published).isdisjoint(identity_hashes(tokens, KvIdentity("", "llama"), 16))
    # SGLang sends the salt as a field of each event: the same hashes.
    s = HashMapper(16, model="llama")
    s.store(_chain(tokens[: 3 * eb], eb, [1, 2, 3], cache_salt="tenant-9"))
    assert s.store(_chain(tokens[3 * eb :], eb, [4, 5], parent=3, cache_salt="tenant-9")).publish == tuple(published[3 * k :])
    # The legacy form (the salt as a bare string on the first block) too.
    legacy = HashMapper(16, model="llama").store(_chain(tokens[: 3 * eb], eb, [1, 2, 3], extra_keys=(("tenant-9",), None, None)))
    assert legacy.publish == tuple(published[: 3 * k])


def test_an_mm_block_hashes_as_the_gateways_multimodal_extra_keys() -> None:
    tokens = list(range(1, 41))  # docs/protocol.md §1.1's vector: an input img-1 at tokens 10..19
    m = HashMapper(16, model="m")
    r = m.store(_chain(tokens[:32], 16, [1, 2], extra_keys=((("mm", "img-1", 10),), (("mm", "img-1", -6),))))
    assert r.publish == (9556735729466240224, 8227786132236180889)
    # Two inputs in one block, and the older untagged (identifier, offset) form.
    tokens = list(range(100, 164))
    inputs = [(3, 5, "a"), (10, 30, "b")]  # b covers blocks 0..2
    gateway = identity_hashes(tokens, KvIdentity("", "m"), 16, multimodal_extra_keys(16, 4, inputs))
    keys = ((("mm", "b", 10), ("mm", "a", 3)), (("mm", "b", -6),), (("mm", "b", -22),), None)  # any order of keys
    assert list(HashMapper(16, model="m").store(_chain(tokens, 16, [1, 2, 3, 4], extra_keys=keys)).publish) == gateway
    legacy = ((("a", 3), ("b", 10)), (("b", -6),), (("b", -22),), None)
    assert list(HashMapper(16, model="m").store(_chain(tokens, 16, [1, 2, 3, 4], extra_keys=legacy)).publish) == gateway


def test_an_mm_input_in_larger_engine_blocks_is_split_where_the_event_shows_its_extent() -> None:
    tokens = list(range(100, 228))  # 2 engine blocks of 64 = 8 of ours
    inputs = [(20, 60, "img")]  # tokens 20..79: our blocks 1..4, engine blocks 0 and 1
    gateway = identity_hashes(tokens, KvIdentity("", "m"), 16, multimodal_extra_keys(16, 8, inputs))
    m = HashMapper(16, model="m")
    r = m.store(_chain(tokens, 64, [1, 2], extra_keys=((("mm", "img", 20),), (("mm", "img", -44),))))
    # Engine block 0: the input goes on into engine block 1, so blocks 1..3 of ours are exact; in engine
    # block 1 it starts before and its end is not sent: block 4 is exact, blocks 5.. are misses.
    assert list(r.publish[:5]) == gateway[:5]
    assert set(r.publish[5:]).isdisjoint(gateway)


@pytest.mark.parametrize(
    "key",
    [
        ("prompt_embeds", b"\x01" * 32),
        b"\x02" * 32,  # older vLLM: the embeddings' digest alone
        ("something_new", 1, 2),
        ("mm", "img", 99),  # past the block: never sent by vLLM
        42,
    ],
)
def test_an_unknown_extra_key_never_equals_the_plain_hash(key: object) -> None:
    tokens = list(range(48))
    m = HashMapper(16, model="llama")
    r = m.store(_chain(tokens, 16, [1, 2, 3], extra_keys=(None, (key,), None)))
    plain = identity_hashes(tokens, KvIdentity("", "llama"), 16)
    assert r.publish[0] == plain[0] and r.publish[1] != plain[1] and r.publish[2] != plain[2]
    assert m.stats.unmapped_keys == 1
    assert raw_key(key).startswith("raw:")


def test_unknown_extra_keys_in_decoded_events_are_misses() -> None:
    ev = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": list(range(32)),
        "block_size": 16,
        "lora_id": None,
        "extra_keys": [None, [["prompt_embeds", b"\x00" * 32], {"odd": [1]}]],
    }
    _, (stored,), _ = decode_payload(msgspec.msgpack.encode([0.0, [ev]]))
    r = HashMapper(16).apply(stored)
    assert r.publish[0] == block_hashes(list(range(32)), 16)[0] and r.publish[1] != block_hashes(list(range(32)), 16)[1]


def test_same_engine_hash_stored_twice_is_idempotent_and_reuse_replaces() -> None:
    m = HashMapper(16)
    a, b = list(range(16)), list(range(16, 32))
    ha, hb = block_hashes(a, 16)[0], block_hashes(b, 16)[0]
    assert m.store(_chain(a, 16, [1])).publish == (ha,)
    assert m.store(_chain(a, 16, [1])).publish == ()
    r = m.store(_chain(b, 16, [1]))  # the engine reused hash 1 for other tokens: trust the newest
    assert r.publish == (hb,) and r.remove == (ha,)


def test_random_store_remove_sequences_keep_refcounts_consistent() -> None:
    rng = random.Random(7)
    m = HashMapper(4, max_entries=10_000)
    live: dict[int, tuple[int, ...]] = {}
    directory: set[int] = set()
    next_hash = 0
    for _ in range(400):
        if live and rng.random() < 0.4:
            eh = rng.choice(list(live))
            r = m.remove(Removed((eh,)))
            del live[eh]
        else:
            parent = rng.choice([None, *live]) if live else None
            toks = [rng.randrange(3) for _ in range(4)]  # few distinct blocks: many shared hashes
            r = m.store(_chain(toks, 4, [next_hash], parent=parent))
            live[next_hash] = m.ours(next_hash)
            next_hash += 1
        directory |= set(r.publish)
        directory -= set(r.remove)
        assert directory == {h for v in live.values() for h in v} == set(m.snapshot())


def test_settings_defaults_and_node_id() -> None:
    s = EventsSettings(engine_url="http://10.0.0.7:8000/")
    assert s.node == "10.0.0.7:8000" and s.api_url == "http://10.0.0.7:8000" and s.bind and s.replay is None
    assert s.model is None
    assert EventsSettings(node_id="vllm-a").node == "vllm-a"
    with pytest.raises(ValueError):
        EventsSettings(nonsense=1)
    with pytest.raises(ValueError):
        EventsSettings(metrics="nohost")


# -- the subscriber's ordering and batching, without sockets --------------------------


class FakeDirectory:
    """Records the subscriber's writes; `fail` makes the next write raise."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.fail: Exception | None = None

    def _maybe_fail(self) -> None:
        if self.fail is not None:
            exc, self.fail = self.fail, None
            raise exc

    async def clear(self, node_id: str, epoch: int) -> int:
        self._maybe_fail()
        self.calls.append(("clear", epoch))
        return 0

    async def remove(self, node_id: str, epoch: int, hashes: list[int]) -> int:
        self._maybe_fail()
        self.calls.append(("remove", epoch, frozenset(hashes)))
        return len(hashes)

    async def publish(self, node_id: str, epoch: int, blocks: list[tuple[int, int]], medium: str | None = None) -> int:
        self._maybe_fail()
        assert all(slot == 0 for _, slot in blocks)
        self.calls.append(("publish", epoch, frozenset(h for h, _ in blocks), medium))
        return len(blocks)


def _subscriber(tasks: TaskFailures | None = None):
    from adapters.engine_stream import EventsSubscriber

    fake = FakeDirectory()
    tasks = tasks or TaskFailures("kvdir_events", TASKS, CollectorRegistry())
    sub = EventsSubscriber(EventsSettings(block_size=16, node_id="e"), directory=fake, tasks=tasks)  # type: ignore[arg-type]
    sub.session.epoch, sub.session.need_register = 1, False  # registered already, as epoch 1
    return sub, fake


def _batch(seq: int, *events, ts: float = 1.0):
    from adapters.event_wire import Batch

    return Batch(seq, ts, tuple(events))


def test_subscriber_orders_batches_duplicates_gaps_and_restarts() -> None:
    import asyncio

    sub, _ = _subscriber()
    session = sub.session
    t = list(range(32))
    ours = block_hashes(t, 16)

    async def go() -> None:
        await sub.on_batch(_batch(5, _chain(t[:16], 16, [1])))
        assert sub.last_seq == 5 and session.pending_stores == {ours[0]: None}
        await sub.on_batch(_batch(5, _chain(t[16:], 16, [2], parent=1)))  # same seq, same ts: a duplicate
        assert sub.stats.duplicates == 1 and len(sub.mapper) == 1
        await sub.on_batch(_batch(6, _chain(t[16:], 16, [2], parent=1)))
        assert session.pending_stores == {ours[0]: None, ours[1]: None}
        await sub.on_batch(_batch(7, Removed((2,))))  # stored and removed within one window: only the removal goes out
        assert session.pending_stores == {ours[0]: None} and session.pending_removals == {ours[1]}
        await sub.on_batch(_batch(9, _chain(t[16:], 16, [3], parent=1)))  # a gap, no replay: resync
        assert sub.stats.gaps == sub.stats.resyncs == 1 and session.pending_clear
        assert session.pending_stores == {} and sub.mapper.stats.missing_parents == 1
        inc = session.incarnation
        await sub.on_batch(_batch(0, _chain(t[:16], 16, [1]), ts=2.0))  # seq went back: the engine restarted
        assert sub.stats.restarts == 1 and session.need_register and session.incarnation != inc and not session.pending_clear
        assert session.pending_stores == {ours[0]: None}
        await sub.on_batch(_batch(0, ts=3.0))  # seq 0 again with another ts: restarted again
        assert sub.stats.restarts == 2 and sub.stats.duplicates == 1

    asyncio.run(go())


def test_subscriber_flushes_clear_then_removals_then_stores_and_keeps_failed_rounds() -> None:
    import asyncio

    from kvproto.errors import DirectoryUnavailable

    sub, fake = _subscriber()
    session = sub.session
    t = list(range(48))
    ours = block_hashes(t, 16)

    async def go() -> None:
        await sub.on_batch(_batch(0, _chain(t[:32], 16, [1, 2], medium="GPU")))
        await session.flush()
        assert fake.calls == [("publish", 1, frozenset(ours[:2]), None)]  # vLLM's "GPU" is kvdir's device (None)
        fake.calls.clear()
        await sub.on_batch(_batch(1, Removed((2,), "GPU"), Cleared(), _chain(t[:16], 16, [1], medium="GPU")))
        fake.fail = DirectoryUnavailable("down")
        with pytest.raises(DirectoryUnavailable):
            await session.flush()
        assert session.pending_clear and session.pending_stores == {ours[0]: None}  # kept for the next round
        await sub.on_batch(_batch(2, Removed((1,), "GPU")))  # newer changes win over the kept ones
        assert session.pending_stores == {} and session.pending_removals == {ours[0]}
        await session.flush()
        assert fake.calls == [("clear", 1), ("remove", 1, frozenset({ours[0]}))]

    asyncio.run(go())


def test_an_unexpected_error_in_a_sync_round_is_counted_and_the_round_goes_again() -> None:
    """A bug in a round (not the directory's answer) must show on /metrics, not only in the log: the sync loop
    counts it (`kvdir_events_task_failures_total{task="sync"}`) and keeps the changes for the next round."""
    import asyncio

    registry = CollectorRegistry()
    sub, fake = _subscriber(TaskFailures("kvdir_events", TASKS, registry))
    sub.engine_healthy = True
    ours = block_hashes(list(range(16)), 16)

    def failures() -> float | None:
        return registry.get_sample_value("kvdir_events_task_failures_total", {"task": "sync"})

    async def go() -> None:
        assert failures() == 0  # at zero before any failure
        await sub.on_batch(_batch(0, _chain(list(range(16)), 16, [1])))
        fake.fail = RuntimeError("a bug")
        syncing = asyncio.create_task(sub._sync_loop())
        try:
            await until(lambda: fake.calls, "the next round", timeout=5.0)
        finally:
            await cancel_and_wait(syncing)
        assert failures() == 1
        assert fake.calls == [("publish", 1, frozenset(ours), None)]  # the failed round's change, published by the next

    asyncio.run(go())


def test_a_round_takes_at_most_batch_max_blocks_and_what_it_leaves_goes_next() -> None:
    """Rounds of at most `batch_max_blocks`: removals first, then the oldest stores. A full remainder goes
    out at once (no window), a partial one when the window ends; nothing is lost either way."""
    import asyncio

    sub, fake = _subscriber()
    sub.s = sub.s.model_copy(update={"batch_max_blocks": 4})
    session = sub.session
    t = list(range(16 * 9))
    ours = block_hashes(t, 16)

    async def go() -> None:
        await sub.on_batch(_batch(0, _chain(t, 16, list(range(1, 10)))))
        await sub.on_batch(_batch(1, Removed((9,))))  # 8 stores, 1 removal queued
        assert session.queued == 9 and sub._full.is_set()
        await sub._flush()
        assert fake.calls == [("remove", 1, frozenset({ours[8]})), ("publish", 1, frozenset(ours[:3]), None)]
        assert session.queued == 5 and sub._full.is_set() and sub._wake.is_set()  # a full round left: at once
        left_since = sub._pending_ts  # what it left arrived before the round: the lag counts from then at the latest
        assert left_since is not None and left_since > 1.0
        fake.calls.clear()
        await sub._flush()
        assert fake.calls == [("publish", 1, frozenset(ours[3:7]), None)]
        assert session.queued == 1 and not sub._full.is_set() and sub._wake.is_set()  # the rest: after the window
        fake.calls.clear()
        sub._wake.clear()
        await sub._flush()
        assert fake.calls == [("publish", 1, frozenset(ours[7:8]), None)]
        assert session.queued == 0 and not sub._full.is_set() and not sub._wake.is_set()
        assert sub._pending_ts is None  # nothing left: no lag carried over to changes that come later

    asyncio.run(go())


def test_after_a_409_everything_is_published_again_even_under_the_same_epoch_number() -> None:
    """A directory that lost all its state restarts its epoch counter: re-registering can return the
    very epoch number we had. The 409 already said our entries are gone, so all of them go out again."""
    import asyncio

    from kvproto.errors import StaleEpochError
    from kvproto.schemas import RegisterResponse

    sub, fake = _subscriber()
    session = sub.session
    t = list(range(32))
    ours = block_hashes(t, 16)

    async def register(node_id: str, api_url: str, **kw) -> RegisterResponse:
        fake.calls.append(("register",))
        return RegisterResponse(node_id=node_id, epoch=1, lease_ttl_s=10.0)

    fake.register = register  # type: ignore[attr-defined]

    async def go() -> None:
        await sub.on_batch(_batch(0, _chain(t, 16, [1, 2])))
        await session.flush()
        fake.calls.clear()
        fake.fail = StaleEpochError(409, "unknown_node", "not registered")
        await sub.on_batch(_batch(1, Removed((2,))))
        with pytest.raises(StaleEpochError):
            await session.flush()
        session.lapse()  # what the sync loop does on a 409
        await session.register()
        assert session.epoch == 1 and session.pending_stores == {ours[0]: None} and session.pending_removals == set()
        await session.flush()
        assert fake.calls[-1] == ("publish", 1, frozenset({ours[0]}), None)

    asyncio.run(go())
