"""The gateway against what a compromised replica or engine may answer over REST: malformed answers are refused where
they are decoded (kvproto.schemas) and handled as no answer, the consumers survive them anyway, reported loads are
clamped, and the registry remembers only the other tenants' engines the directory still lists.

The directory and the engines are httpx mock transports: no sockets."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from gateway.cost import Decision, RouteRequest
from gateway.engine_registry import EngineRegistry
from gateway.lookup import HolderLookup
from gateway.router import make_candidate
from gateway.sglang_policy import SGLangPolicy
from kvproto import media
from kvproto.client import DirectoryClient
from kvproto.errors import MalformedAnswer
from kvproto.schemas import LookupResponse, NodeInfo, RegionInfo

NO_MEDIUM = len(media.MEDIA) << media.SHIFT  # the first location whose top bits name no medium


def _region(block_bytes: int, medium: str | None = None) -> dict[str, Any]:
    return {"rank": 0, "base_addr": 0, "length": 1 << 20, "block_bytes": block_bytes, "medium": medium}


def _node(node_id: str, port: int, **over: Any) -> dict[str, Any]:
    node = {"node_id": node_id, "epoch": 1, "alive": True, "api_url": f"http://127.0.0.1:{port}", "blocks": 0}
    return {**node, **over}


def _directory(answer: Callable[[httpx.Request], Any]) -> DirectoryClient:
    """A client of one replica that answers `answer(request)` as JSON (the shard map as an unsharded replica's)."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/shards":
            return httpx.Response(200, json={"version": 0, "shard": None, "shards": {}, "nodes": {}})
        return httpx.Response(200, json=answer(request))

    return DirectoryClient("http://127.0.0.1:1", transport=httpx.MockTransport(handle), timeout=0.2, deadline=0.5, binary=False)


def _engines() -> httpx.AsyncClient:
    """The engines' side: every /v1/models lists nothing."""
    return httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200, json={"data": []})))


# -- refused where decoded -------------------------------------------------------------------------------------


def test_answers_the_directory_cannot_give_are_refused_where_they_are_decoded() -> None:
    holder = {"node_id": "a", "epoch": 1, "matched_blocks": 2}
    assert LookupResponse.model_validate({"num_blocks": 2, "holders": [{**holder, "slots": [5, NO_MEDIUM - 1]}]})
    for bad in ({**holder, "slots": [5, NO_MEDIUM]}, {**holder, "slots": [-1]}, {**holder, "matched_blocks": -1}):
        with pytest.raises(ValidationError):
            LookupResponse.model_validate({"num_blocks": 2, "holders": [bad]})
    assert RegionInfo.model_validate(_region(1)).block_bytes == 1
    with pytest.raises(ValidationError):
        NodeInfo.model_validate(_node("a", 9000, regions=[_region(0)]))


def test_a_malformed_lookup_answer_is_a_failed_lookup() -> None:
    """Routed as with an unreachable replica (by load, or by the stale mirror): never a 500."""
    answer = {"num_blocks": 2, "holders": [{"node_id": "a", "epoch": 1, "matched_blocks": 2, "slots": [1, NO_MEDIUM]}]}

    async def main() -> Any:
        directory = _directory(lambda r: answer)
        try:
            return await HolderLookup(directory, 1.0, None, 60.0)([1, 2])
        finally:
            await directory.aclose()

    found = asyncio.run(main())
    assert (found.holders, found.source, found.cause) == ((), "none", "error")
    assert found.failure.startswith("MalformedAnswer: a replica's lookup does not follow the protocol: holders.0.slots.1:")


def test_the_client_raises_a_malformed_answer_as_a_directory_error() -> None:
    """So every caller (gateway, worker stub, connector) handles it as any other replica failure."""
    bad_nodes = {"nodes": [_node("a", 9000, regions=[_region(0)])]}

    async def main() -> None:
        for answer, call in (
            (bad_nodes, lambda d: d.nodes()),
            ({"nodes": "not a list"}, lambda d: d.nodes()),
            ({"num_blocks": 1, "holders": [{"node_id": "a", "epoch": 1, "matched_blocks": -1}]}, lambda d: d.lookup([1])),
        ):
            directory = _directory(lambda r, a=answer: a)
            try:
                with pytest.raises(MalformedAnswer, match="does not follow the protocol"):
                    await call(directory)
            finally:
                await directory.aclose()

    asyncio.run(main())


def test_a_malformed_node_list_keeps_the_engines_as_last_seen(caplog: pytest.LogCaptureFixture) -> None:
    """A region of 0 bytes per block: the directory is taken as unreachable (engines kept, one warning), the refresh
    itself does not fail (a failing one freezes the list and backs off)."""
    answers = iter([[_node("a", 9001, regions=[_region(4096)])], [_node("a", 9001, regions=[_region(0, "host")])]])

    async def main() -> tuple[list[str], bool]:
        directory = _directory(lambda r: {"nodes": next(answers)})
        async with _engines() as http:
            reg = EngineRegistry(directory, http, [], refresh_s=1.0, unhealthy_s=1.0)
            try:
                await reg.refresh()
                await reg.refresh()  # returns: a refresh that raised would be counted a failure of the refresh task
                return sorted(reg.engines), reg.directory_ok
            finally:
                await reg.stop()
                await directory.aclose()

    with caplog.at_level(logging.WARNING, logger="kvdir.gateway"):
        assert asyncio.run(main()) == (["a"], False)
    warned = [r.getMessage() for r in caplog.records if "directory unreachable" in r.getMessage()]
    assert len(warned) == 1 and "node list does not follow the protocol: regions.0.block_bytes" in warned[0], warned


# -- the consumers survive them anyway ------------------------------------------------------------------------


def test_a_candidate_holds_only_the_blocks_before_a_location_in_no_medium() -> None:
    host = media.location(7, media.HOST)
    c = make_candidate("a", 1, reported_running=0, waiting=0, inflight=0, pending_prefill_tokens=0, cached_blocks=4,
                       slots=[1, host, NO_MEDIUM | 3, 2])  # fmt: skip
    assert (c.cached_blocks, c.slots, c.host_blocks) == (2, (1, host), 1)


def test_a_host_region_of_no_bytes_per_block_is_not_counted() -> None:
    async def main() -> int | None:
        async with _engines() as http:
            reg = EngineRegistry(DirectoryClient("http://127.0.0.1:1"), http, [], refresh_s=1.0, unhealthy_s=1.0)
            node = NodeInfo.model_construct(**NodeInfo.model_validate(_node("a", 9001, capacity_blocks=8)).__dict__)
            node.regions = [RegionInfo.model_construct(**_region(0, "host"))]  # past validation, as a bug might hand it
            await reg._update([node])
            return reg.engines["a"].capacity_blocks

    assert asyncio.run(main()) == 8


# -- reported loads ----------------------------------------------------------------------------------------------


def test_negative_and_non_finite_loads_count_as_none() -> None:
    """An engine reporting a negative queue would look idler than idle and draw every request."""

    async def main() -> dict[str, tuple[float, float, float]]:
        async with _engines() as http:
            reg = EngineRegistry(DirectoryClient("http://127.0.0.1:1"), http, [], refresh_s=1.0, unhealthy_s=1.0)
            loads = {
                "neg": {"running": -5.0, "waiting": -1000.0, "pull_gbps": -1.0},
                "nan": {"running": math.nan, "waiting": math.nan, "pull_gbps": math.nan},
                "inf": {"running": math.inf, "waiting": math.inf, "pull_gbps": math.inf},
                "ok": {"running": 2.0, "waiting": 3.0, "pull_gbps": 1.5},
            }
            await reg._update([NodeInfo.model_validate(_node(n, 9000 + i, load=ld)) for i, (n, ld) in enumerate(loads.items())])
            return {k: (e.running, e.waiting, e.pull_gbps) for k, e in reg.engines.items()}

    assert asyncio.run(main()) == {
        "neg": (0.0, 0.0, 0.0),
        "nan": (0.0, 0.0, 0.0),
        "inf": (0.0, 0.0, 0.0),
        "ok": (2.0, 3.0, 1.5),
    }
    c = make_candidate("a", 1, reported_running=0, waiting=-1000, inflight=0, pending_prefill_tokens=0)
    assert c.waiting == 0


# -- other tenants' engines ----------------------------------------------------------------------------------------


def test_the_registry_remembers_only_the_engines_the_directory_still_lists(caplog: pytest.LogCaptureFixture) -> None:
    """Another tenant's engines churning through node ids (a wildcard token) grow nothing: the ids remembered (to
    log each once) are those listed; an engine warned of for its block size is forgotten once it leaves."""
    rounds = [
        [_node("ours", 9000, block_size=32), _node("ours-2", 9001, block_size=16, blocks=5)]
        + [_node(f"theirs-{i}", 9100 + i, tenant="bravo") for i in range(50)],
        [_node("ours", 9000, block_size=32), _node("ours-2", 9001, block_size=16, blocks=5)]
        + [_node(f"theirs-{i}", 9100 + i, tenant="bravo") for i in range(50, 100)],
        [],
    ]

    async def main() -> list[tuple[int, list[str]]]:
        seen: list[tuple[int, list[str]]] = []
        directory = _directory(lambda r: {"nodes": current[0]})
        async with _engines() as http:
            reg = EngineRegistry(directory, http, [], refresh_s=1.0, unhealthy_s=1.0, block_size=16)
            try:
                for nodes in rounds:
                    current[0] = nodes
                    await reg.refresh()
                    seen.append((len(reg._foreign), sorted(reg._mismatched)))
            finally:
                await reg.stop()
                await directory.aclose()
        return seen

    current: list[list[dict[str, Any]]] = [[]]
    with caplog.at_level(logging.INFO, logger="kvdir.gateway"):
        assert asyncio.run(main()) == [(50, ["ours"]), (50, ["ours"]), (0, [])]
    logged = [r for r in caplog.records if "belongs to tenant 'bravo'" in r.getMessage()]
    assert len(logged) == 100  # one line per engine, not one per refresh


def test_an_engine_that_left_is_forgotten_by_the_policy() -> None:
    """SGLang's modeled tree drops what it routed to an engine once the directory no longer lists it: a restarted
    engine (a new registration, an empty cache) is not credited with its old prefixes."""
    pol = SGLangPolicy()
    req = RouteRequest(hashes=tuple(range(1, 9)), prompt_tokens=128, block_size=16)
    pol.on_routed(req, Decision("a", "balance", 0))

    async def main() -> int:
        async with _engines() as http:
            reg = EngineRegistry(DirectoryClient("http://127.0.0.1:1"), http, [], refresh_s=1.0, unhealthy_s=1.0)
            reg.on_gone = pol.on_engine_gone
            await reg._update([NodeInfo.model_validate(_node("a", 9001)), NodeInfo.model_validate(_node("b", 9002))])
            assert pol.tree_size("a") == 8
            await reg._update([NodeInfo.model_validate(_node("b", 9002))])
            return pol.tree_size("a")

    assert asyncio.run(main()) == 0
