"""The gateway answers lookups from its mirror of the directory (gateway.mirror) while it is fresh, from a
replica over REST without one, from the stale mirror when REST fails too (within --mirror-stale-lag-s), and
by load past that; it recovers without a restart."""

from __future__ import annotations

import os
import shutil
import signal

import httpx

from tests.support.metrics import mirror_gauges
from tests.support.wait import wait_for

MODEL = "kvdir-stub"
PROMPT = "A shared system prompt about KV caches, long enough to span several blocks of sixteen tokens. " * 4


def _complete(url: str, prompt: str) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def _lookups(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvdir_gateway_lookups_total{"):
            source = line.split('source="', 1)[1].split('"', 1)[0]
            out[source] = float(line.rsplit(" ", 1)[1])
    return out


def _mirror_lag(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvdir_gateway_mirror_lag_seconds "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no kvdir_gateway_mirror_lag_seconds")


def test_lookups_come_from_the_mirror_and_a_stall_falls_back_then_recovers(make_cluster, make_workers, make_gateway) -> None:
    c = make_cluster(3)
    make_workers(c, 2)
    g = make_gateway(c, 2, extra_args=("--mirror-stale-lag-s", "3"))
    wait_for(lambda: _mirror_lag(g.url) <= 0.5, what="a fresh mirror")
    first = _complete(g.url, PROMPT + "one")
    wait_for(
        lambda: _complete(g.url, PROMPT + "two").headers["x-kvdir-decision"] == "affinity",
        what="the prefix published and seen by the mirror",
    )
    counts = _lookups(g.url)
    assert counts.get("mirror", 0) >= 2 and counts.get("rest", 0) == 0 and counts.get("none", 0) == 0, counts
    assert first.headers["x-kvdir-node"]

    pids = [p.pid for p in c.procs if p is not None]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: _mirror_lag(g.url) > 0.5, what="the mirror to turn stale")
        # Every replica is stopped, so REST fails: the mirror, a little behind, still knows the prefix.
        r = _complete(g.url, PROMPT + "three")
        assert r.headers["x-kvdir-decision"] == "affinity"
        counts = _lookups(g.url)
        assert counts.get("mirror_stale", 0) >= 1 and counts.get("none", 0) == 0, counts
        # Past --mirror-stale-lag-s the view is too old to trust: routed by load.
        wait_for(lambda: _mirror_lag(g.url) > 3, what="the mirror past the stale bound")
        r = _complete(g.url, PROMPT + "five")
        assert r.headers["x-kvdir-decision"] == "fallback"
        assert _lookups(g.url).get("none", 0) >= 1
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    wait_for(lambda: _mirror_lag(g.url) <= 0.5, what="the mirror fresh again", timeout=30)
    before = _lookups(g.url).get("mirror", 0)
    assert _complete(g.url, PROMPT + "four").headers["x-kvdir-decision"] == "affinity"
    assert _lookups(g.url)["mirror"] == before + 1


def test_without_the_mirror_lookups_go_to_a_replica(make_cluster, make_workers, make_gateway) -> None:
    c = make_cluster(1)
    make_workers(c, 2)
    g = make_gateway(c, 2, extra_args=("--no-mirror",))  # every lookup over REST: none from a mirror
    _complete(g.url, PROMPT)
    counts = _lookups(g.url)
    assert counts.get("rest", 0) == 1 and counts.get("mirror", 0) == 0, counts
    assert "kvdir_gateway_mirror_lag_seconds" not in httpx.get(g.url + "/metrics").text


def _applied(url: str) -> int:
    """The replica's position once every acknowledged write is applied (a linearizable barrier first)."""
    assert httpx.post(url + "/v1/lookup?consistency=linearizable", json={"hashes": []}, timeout=5).status_code == 200
    return int(httpx.get(url + "/v1/digest", timeout=5).json()["applied"])


def _register_and_publish(url: str, node_id: str, n: int) -> None:
    epoch = httpx.post(url + "/v1/nodes", json={"node_id": node_id, "api_url": "http://127.0.0.1:1"}, timeout=5).json()["epoch"]
    for k in range(n):
        body = {"node_id": node_id, "epoch": epoch, "blocks": [{"hash": 1000 + k, "slot": k}]}
        assert httpx.post(url + "/v1/blocks", json=body, timeout=5).status_code == 200


def test_a_directory_rebuilt_under_a_running_gateway_is_snapshotted_anew(make_cluster, make_gateway) -> None:
    """The directory is stopped, its data dirs wiped and started again on the same addresses: a new group whose
    positions start over. Before, the gateway's mirror resumed from its old position there, ticks called it
    fresh, and it served the dead directory's state (then applied the new one's batches onto it)."""
    c = make_cluster(1)
    url = c.replica_urls[0]
    g = make_gateway(c, 0)
    _register_and_publish(url, "old", 25)
    old = _applied(url)
    wait_for(
        lambda: (m := mirror_gauges(g.url))["position"] == old and m["lag_seconds"] <= 0.5 and m["snapshots_total"] == 1,
        what="the mirror of the old directory",
    )
    c.stop()
    for i in range(len(c.procs)):
        shutil.rmtree(c.data_dir / f"replica{i + 1}")
    c.start()
    c.wait_ready(60)
    _register_and_publish(url, "new", 3)
    new = _applied(url)
    assert new < old
    wait_for(
        lambda: (m := mirror_gauges(g.url))["snapshots_total"] == 2 and m["position"] == new and m["lag_seconds"] <= 0.5,
        timeout=30,
        what="a snapshot of the rebuilt directory",
    )
    _register_and_publish(url, "new", old)  # past the old position: applied onto the new state, no third snapshot
    new = _applied(url)
    assert new > old
    wait_for(lambda: (m := mirror_gauges(g.url))["position"] == new and m["snapshots_total"] == 2, what="the mirror past it")
