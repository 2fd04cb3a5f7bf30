"""The replay routes through the gateway's own `gateway.router.Router` (kvtools.replay.views), so a change to the
gateway's routing step changes the simulation too: every arrival is one `Router.route` call, and what the router
reads of a simulated engine is that engine's state."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.router import Router
from kvtools.replay.cluster import ClusterSim
from kvtools.replay.sim import SimParams, simulate
from kvtools.replay.trace import multi_turn


@pytest.mark.parametrize("policy", ["kvdir", "dynamo", "round_robin"])
def test_every_arrival_is_routed_by_the_gateways_router(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    requests = multi_turn(seed=1, block_tokens=512)[:80]
    routed: list[tuple[int, str]] = []
    route = Router.route

    def spy(self: Router, req: Any, engines: Any, holders: Any, **kw: Any) -> Any:
        out = route(self, req, engines, holders, **kw)
        routed.append((req.prompt_tokens, out.decision.node_id))
        return out

    monkeypatch.setattr(Router, "route", spy)
    figures = simulate(requests, policy, SimParams(nodes=4, gateways=2))
    assert len(routed) == len(requests) == figures["requests"]
    assert sorted(p for p, _ in routed) == sorted(r.input_tokens for r in requests)


def test_a_router_that_always_picks_one_engine_sends_everything_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulation acts on the router's decision, whatever it is: the gateway's code decides, not a copy of it."""
    route = Router.route

    def first_only(self: Router, req: Any, engines: Any, holders: Any, **kw: Any) -> Any:
        return route(self, req, [e for e in engines if e.node_id == "n0"], holders, **kw)

    monkeypatch.setattr(Router, "route", first_only)
    requests = multi_turn(seed=2, block_tokens=512)[:40]
    sim = ClusterSim(sorted(requests, key=lambda r: r.arrival_s), "least_loaded", SimParams(nodes=4))
    sim.run()
    assert sim.nodes[0].busy > 0 and all(nd.busy == 0 for nd in sim.nodes[1:])


def test_the_views_read_the_simulated_engines_live_state() -> None:
    sim = ClusterSim([], "kvdir", SimParams(nodes=2, gateways=2, capacity_blocks=10, block_tokens=16))
    nd, view = sim.nodes[1], sim.views[1][1]
    nd.running, nd.inflight[1], nd.pending[1] = 5, 2, 300.0
    nd.cache.store([11, 12, 13])
    assert (view.node_id, view.running, view.inflight, view.blocks, view.capacity_blocks) == ("n1", 5, 2, 3, 10)
    assert view.pending_prefill_tokens == 300.0 and sim.views[0][1].pending_prefill_tokens == 0.0
