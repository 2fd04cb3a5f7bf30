"""`kvdir bench gateway`'s HTTP-stack floor runs end to end: real peers in processes of their own, every figure
printed, and nothing left listening afterwards (figures are reported, never asserted: a bench, not a timing test)."""

from __future__ import annotations

import math

from kvdir.bench import http_stack
from tests.support.ports import port_free


def test_the_http_stack_floor_measures_each_side_and_stops_its_peers(monkeypatch) -> None:
    picked: list[int] = []
    free_ports = http_stack.free_ports
    monkeypatch.setattr(http_stack, "free_ports", lambda n: picked.extend(free_ports(n)) or picked[-n:])
    out = http_stack.bench_http_stack(quick=True)
    for key in ("httpx_forward_us", "asyncio_forward_us", "fastapi_inbound_us", "http_stack_floor_us"):
        assert math.isfinite(out[key]) and out[key] > 0, (key, out)
    assert out["http_stack_floor_us"] == out["httpx_forward_us"] + out["fastapi_inbound_us"]
    assert len(picked) == 2 and all(port_free(p) for p in picked)
