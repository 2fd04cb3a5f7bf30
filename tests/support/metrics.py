"""Read a live component's /metrics the way tests assert on it."""

from __future__ import annotations

import httpx


def mirror_gauges(url: str) -> dict[str, float]:
    """The gateway's unlabelled `kvdir_gateway_mirror_*` samples, by the rest of their name (`position`, `lag_seconds`...)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvdir_gateway_mirror_") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name.removeprefix("kvdir_gateway_mirror_")] = float(value)
    return out
