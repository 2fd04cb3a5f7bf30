"""The vLLM connector's host-tier bookkeeping (adapters/host_slots.py): a save is reserved, then confirmed or failed;
slots are reused least recently used first; a request loads back only the leading run of blocks held."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.host_slots import HostSlots


def test_a_save_is_usable_only_once_every_rank_confirmed_it() -> None:
    hs = HostSlots(2)
    slot, evicted = hs.reserve(11) or (None, None)
    assert slot is not None and evicted is None
    assert 11 not in hs and hs.run([11]) == []  # reserved, not usable
    assert hs.reserve(11) is None  # a second save of the same block while one is under way
    assert hs.confirm(11, slot) and 11 in hs and hs.run([11]) == [slot]
    assert not hs.confirm(11, slot)  # only the save under way can be confirmed


def test_a_failed_save_frees_its_slot() -> None:
    hs = HostSlots(1)
    slot, _ = hs.reserve(11) or (None, None)
    assert hs.reserve(12) is None  # the only slot is being saved into
    hs.fail(11, slot)
    assert 11 not in hs and hs.reserve(12) is not None


def test_slots_are_reused_least_recently_used_first() -> None:
    hs = HostSlots(2)
    for h in (11, 12):
        slot, _ = hs.reserve(h) or (None, None)
        hs.confirm(h, slot)
    hs.run([11])  # 11 loaded back: now the most recently used
    slot, evicted = hs.reserve(13) or (None, None)
    assert evicted == 12 and slot == hs.slot_of(11) ^ 1
    assert hs.reserve(11) is None and hs.slot_of(11) is not None  # held already: only touched


def test_run_stops_at_the_first_block_not_held() -> None:
    hs = HostSlots(4)
    for h in (1, 2, 4):
        slot, _ = hs.reserve(h) or (None, None)
        hs.confirm(h, slot)
    assert len(hs.run([1, 2, 3, 4])) == 2


def test_a_capacity_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        HostSlots(0)


@given(st.lists(st.tuples(st.sampled_from(["save", "fail", "run"]), st.integers(0, 9)), max_size=60))
def test_no_slot_is_ever_given_to_two_blocks(ops: list[tuple[str, int]]) -> None:
    hs = HostSlots(3)
    saving: dict[int, int] = {}
    for op, h in ops:
        if op == "save":
            got = hs.reserve(h)
            if got is not None:
                saving[h] = got[0]
                if h % 2:  # odd blocks are confirmed at once, even ones wait for a "fail"
                    hs.confirm(h, saving.pop(h))
        elif op == "fail" and h in saving:
            hs.fail(h, saving.pop(h))
        else:
            hs.run([h])
        used = [slot for _, slot in hs.items()] + list(saving.values())
        assert len(used) == len(set(used)) and all(0 <= s < 3 for s in used)
