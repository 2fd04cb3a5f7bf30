"""`kvdir bench gateway`'s HTTP-stack floor runs end to end: real peers in processes of their own, every figure
printed, and nothing left listening afterwards (figures are reported, never asserted: a bench, not a timing test)."""

from __future__ import annotations

import math
import subprocess
import sys

import httpx

from kvtools.bench import http_stack
from tests.support.ports import port_free


def test_the_http_stack_floor_measures_each_side_and_stops_its_peers(monkeypatch) -> None:
    picked: list[int] = []
    free_ports = http_stack.free_ports
    monkeypatch.setattr(http_stack, "free_ports", lambda n: picked.extend(free_ports(n)) or picked[-n:])
    out = http_stack.bench_http_stack(quick=True)
    for key in (
        "upstream_forward_us",
        "httpcore_forward_us",
        "httpx_forward_us",
        "asyncio_forward_us",
        "fastapi_inbound_us",
        "http_stack_floor_us",
    ):
        assert math.isfinite(out[key]) and out[key] > 0, (key, out)
    assert out["http_stack_floor_us"] == out["upstream_forward_us"] + out["fastapi_inbound_us"]
    assert len(picked) == 2 and all(port_free(p) for p in picked)


def test_the_floor_proxy_forwards_to_its_upstream_and_stops() -> None:
    """`kvdir bench gateway` measures this proxy next to the gateway: it must relay the upstream's answer."""
    upstream_port, proxy_port = http_stack.free_ports(2)
    upstream = subprocess.Popen([sys.executable, "-c", http_stack._SERVER, str(upstream_port)])
    try:
        with http_stack.floor_proxy(f"http://127.0.0.1:{upstream_port}", proxy_port) as (url, pid):
            r = httpx.post(url + http_stack.PATH, content=http_stack.BODY, headers={"content-type": "application/json"})
            assert (r.status_code, r.content) == (200, http_stack.ANSWER)
            assert pid > 0
        assert port_free(proxy_port)
    finally:
        upstream.kill()
        upstream.wait()
