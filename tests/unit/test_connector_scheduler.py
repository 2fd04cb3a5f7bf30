"""The vLLM connector's scheduler half (adapters/connector_scheduler.py) without vLLM: requests, blocks and the
block pool as stand-ins with the attributes it reads, the pull sources as a fixed map. What it must do: a plan it
can serve is an asynchronous load; one it cannot is refused before vLLM counts a token; a request whose next block
a pull here is bringing waits for that pull; pulled blocks are published only once every rank validated them and
vLLM cached them; an aborted pull publishes nothing."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from adapters.config import ConnectorSettings
from adapters.connector_meta import WorkerReport
from adapters.connector_scheduler import SchedulerHalf
from adapters.vllm_plan import KvLayout, LayerRegion, PullSource
from kvproto.schemas import PULL_PLAN_FIELD
from tests.support.fakes import FixedPeers

BS = 16
LAYOUT = KvLayout((LayerRegion(0x1000, 256, 64),), 0x100000)


def _half(tp_size: int = 1) -> SchedulerHalf:
    s = ConnectorSettings(node_id="me", api_url="http://127.0.0.1:9", transfer_timeout_s=1.0)
    source = PullSource(["src:1"] * tp_size, [LAYOUT] * tp_size, "fp", None, None)
    peers = FixedPeers(
        {("src", 7): source, ("tenant-src", 1): source._replace(refusal="another tenant's engine")}, blocking=False
    )
    half = SchedulerHalf(
        s, node_id="me", block_size=BS, tp_size=tp_size, dp_rank=None, model_name="m", fingerprint_of=lambda _: "fp", peers=peers
    )
    half.fingerprint = "fp"  # as registering sets it
    half.bind_pool(SimpleNamespace(blocks=[SimpleNamespace(block_hash=None) for _ in range(64)]))
    return half


def _request(rid: str, tokens: int = 5 * BS + 3, plan: dict[str, Any] | None = None) -> Any:
    params = {PULL_PLAN_FIELD: plan} if plan is not None else None
    return SimpleNamespace(
        request_id=rid,
        num_prompt_tokens=tokens,
        all_token_ids=list(range(1000, 1000 + tokens)),
        kv_transfer_params=params,
        lora_request=None,
        cache_salt=None,
        mm_features=None,
    )


def _plan(node: str = "src", epoch: int = 7, fingerprint: str | None = "fp") -> dict[str, Any]:
    return {"source_node": node, "source_epoch": epoch, "slots": [10, 11, 12, 13, 14], "fingerprint": fingerprint}


def _blocks(ids: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def _no_step() -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
    )


def _plans(half: SchedulerHalf) -> dict[str, float]:
    return {o: half.metrics.plans.labels(o)._value.get() for o in ("pull", "joined", "refused", "fingerprint", "own")}


@pytest.fixture
def half() -> Iterator[SchedulerHalf]:
    h = _half()
    yield h
    h.shutdown()


def test_a_plan_it_can_serve_is_an_asynchronous_load(half) -> None:
    req = _request("a", plan=_plan())
    assert half.get_num_new_matched_tokens(req, 0) == (5 * BS, True)
    half.update_state_after_alloc(req, _blocks([20, 21, 22, 23, 24, 25]), 5 * BS)
    plan = half.build_connector_meta(_no_step(), None)
    (load,) = plan.loads
    assert (load.req_id, load.dst_blocks, load.src_slots) == ("a", [20, 21, 22, 23, 24], [10, 11, 12, 13, 14])
    assert set(load.dst_blocks) <= set(plan.written)  # invalidated now ...
    assert not plan.complete  # ... and never marked complete by the step: the worker sets their tags when they land
    assert _plans(half)["pull"] == 1


@pytest.mark.parametrize(
    ("plan", "outcome"),
    [
        (_plan(epoch=8), "refused"),  # the source restarted: its slots may hold anything
        (_plan(node="tenant-src", epoch=1), "refused"),  # a tenant this engine may not read
        (_plan(fingerprint="other"), "fingerprint"),  # another model's KV
        (_plan(node="me"), "own"),
    ],
)
def test_a_plan_it_cannot_serve_is_refused_before_any_token_counts(half, plan, outcome) -> None:
    req = _request("a", plan=plan)
    if plan["source_epoch"] == 8:  # not in the list read: asked again until a read started since has ended
        assert half.get_num_new_matched_tokens(req, 0) == (None, False)
        half._peers.read()  # type: ignore[attr-defined]
    assert half.get_num_new_matched_tokens(req, 0) == (0, False)
    assert _plans(half)[outcome] == 1 and _plans(half)["pull"] == 0


def test_a_source_registered_since_the_last_list_is_pulled_once_a_list_names_it(half) -> None:
    req = _request("a", plan=_plan(epoch=9))
    assert half.get_num_new_matched_tokens(req, 0) == (None, False)
    half._peers.sources[("src", 9)] = half._peers.sources[("src", 7)]  # type: ignore[attr-defined]
    half._peers.read()  # type: ignore[attr-defined]
    assert half.get_num_new_matched_tokens(req, 0) == (5 * BS, True)


def test_a_source_of_another_tp_size_is_refused() -> None:
    half = _half(tp_size=2)
    half._peers = FixedPeers({("src", 7): PullSource(["src:1"], [LAYOUT], "fp", None, None)}, blocking=False)
    try:
        assert half.get_num_new_matched_tokens(_request("a", plan=_plan()), 0) == (0, False)
    finally:
        half.shutdown()


def test_a_request_for_blocks_a_pull_is_bringing_waits_for_it_then_finds_them_cached(half) -> None:
    a, b = _request("a", plan=_plan()), _request("b", plan=_plan())
    assert half.get_num_new_matched_tokens(a, 0) == (5 * BS, True)
    half.update_state_after_alloc(a, _blocks([20, 21, 22, 23, 24, 25]), 5 * BS)
    # b (the gateway sent it here to wait for the prefix in flight) neither reads nor computes it: "ask again".
    assert half.get_num_new_matched_tokens(b, 0) == (None, False)
    assert half.get_num_new_matched_tokens(b, 0) == (None, False)
    assert _plans(half)["joined"] == 1  # counted once, however often vLLM asks
    # A request with no plan for the same prompt waits too; one for other blocks does not.
    assert half.get_num_new_matched_tokens(_request("c"), 0) == (None, False)
    other = _request("d")
    other.all_token_ids = [7] * other.num_prompt_tokens
    assert half.get_num_new_matched_tokens(other, 0) == (0, False)
    # a's pull lands; vLLM takes a out of WAITING_FOR_REMOTE_KVS and caches its blocks: b finds them locally.
    half.update_connector_output(WorkerReport(pulled=[("a", 20 + i, h) for i, h in enumerate(half._hashes["a"][:5])]))
    half.update_state_after_alloc(a, _blocks([20, 21, 22, 23, 24, 25]), 0)
    assert half.get_num_new_matched_tokens(b, 5 * BS) == (0, False)


def test_pulled_blocks_are_published_once_every_rank_validated_them_and_vllm_cached_them() -> None:
    half = _half(tp_size=2)
    try:
        a = _request("a", plan=_plan())
        half.get_num_new_matched_tokens(a, 0)
        half.update_state_after_alloc(a, _blocks([20, 21, 22, 23, 24, 25]), 5 * BS)
        hashes = half._hashes["a"][:5]
        half.update_connector_output(WorkerReport(pulled=[("a", 20 + i, h) for i, h in enumerate(hashes)]))  # rank 0
        half.update_connector_output(WorkerReport(pulled=[("a", 20 + i, h) for i, h in enumerate(hashes[:3])]))  # rank 1
        for b in range(20, 23):  # vLLM cached only the blocks before the first failed one
            half._pool.blocks[b].block_hash = ("vllm", b)
        assert list(half._holdings()) == []  # not before vLLM took the request out of WAITING_FOR_REMOTE_KVS
        half.update_state_after_alloc(a, _blocks([20, 21, 22, 23, 24, 25]), 0)
        assert sorted(list(half._holdings())) == sorted((h, 20 + i, None) for i, h in enumerate(hashes[:3]))
        # Counted once, when the pull ended, over both ranks (whose reads ended in different steps): a block one
        # rank did not validate is a failed block.
        pulled, failed = half.metrics.pulled._value.get(), half.metrics.failed._value.get()
        assert (pulled, failed, half.metrics.failed_pulls._value.get()) == (3, 2, 1)
        assert half.get_num_new_matched_tokens(_request("b", plan=_plan()), 3 * BS) == (2 * BS, True)  # no more waiting
    finally:
        half.shutdown()


def test_a_pull_whose_request_was_aborted_publishes_nothing_and_blocks_no_one(half) -> None:
    a = _request("a", plan=_plan())
    half.get_num_new_matched_tokens(a, 0)
    half.update_state_after_alloc(a, _blocks([20, 21, 22, 23, 24, 25]), 5 * BS)
    half.update_connector_output(WorkerReport(pulled=[("a", 20 + i, h) for i, h in enumerate(half._hashes["a"][:5])]))
    half.request_finished(a)
    assert list(half._holdings()) == []
    assert half.get_num_new_matched_tokens(_request("b", plan=_plan()), 0) == (5 * BS, True)


def test_labelled_counters_exist_at_zero(half) -> None:
    text = "".join(f"{s.name}{s.labels}{s.value}\n" for metric in half.metrics.registry.collect() for s in metric.samples)
    assert "kvdir_connector_plans_total{'outcome': 'joined'}0.0" in text
    assert "kvdir_connector_pull_rank_page_bytes_total{'rank': '0'}0.0" in text


def test_a_request_back_after_its_pull_failed_is_computed_not_pulled_again(half) -> None:
    """vLLM asks again for a request whose pull failed from its first block (it freed the blocks): answering with
    another asynchronous load would leave it waiting for a pull nobody starts."""
    a = _request("a", plan=_plan())
    assert half.get_num_new_matched_tokens(a, 0) == (5 * BS, True)
    half.update_state_after_alloc(a, _blocks([20, 21, 22, 23, 24, 25]), 5 * BS)
    half.build_connector_meta(_no_step(), None)
    assert half.get_num_new_matched_tokens(a, 0) == (0, False)
    half.update_state_after_alloc(a, _blocks([30, 31, 32, 33, 34, 35]), 0)
    assert half.build_connector_meta(_no_step(), None).loads == []
    assert half.get_num_new_matched_tokens(_request("b", plan=_plan()), 0) == (5 * BS, True)  # nothing left waiting


def _step(*scheduled: str) -> Any:
    """A step that schedules `scheduled` (their blocks not looked at: no request here computes a block)."""
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={rid: 1 for rid in scheduled},
        total_num_scheduled_tokens=len(scheduled),
    )


def _running_waiting(half: SchedulerHalf) -> tuple[float, float]:
    load = half._load()
    return load["running"], load["waiting"]


def test_heartbeats_report_what_the_last_step_ran_and_what_asked_and_waits(half) -> None:
    a, b, c = _request("a"), _request("b"), _request("c")
    for req in (a, b, c):
        assert half.get_num_new_matched_tokens(req, 0) == (0, False)
    half.build_connector_meta(_step("a"), None)  # b and c asked but did not fit the step
    assert _running_waiting(half) == (1, 2)
    half.build_connector_meta(_step("a", "b"), None)
    assert _running_waiting(half) == (2, 1)
    half.request_finished(a)  # finished after the step: not running, not lingering until the next one
    assert _running_waiting(half) == (1, 1)
    half.build_connector_meta(_step("c"), None)  # b preempted: back in the queue
    assert _running_waiting(half) == (1, 1)
    half.request_finished(b)  # aborted while queued
    half.request_finished(c)
    assert _running_waiting(half) == (0, 0)
