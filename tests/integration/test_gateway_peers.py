"""Gateway processes sharing routing decisions (gateway.peers): A's in-flight prefill is visible to B; the notes
route exists only with --peers, wants the peer token off loopback, and bounds what hostile notes can do (issue #29)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvdir.local_cluster import Cluster, Gateway, free_ports
from tests.support.wait import wait_for

MODEL = "kvdir-stub"
TOKEN = "s3cret-peer-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _complete(url: str, prompt: str, http: httpx.Client | None = None) -> httpx.Response:
    r = (http or httpx).post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
    return r


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    """One client for a test's requests: each `httpx.get` makes a client of its own, and with it an SSL context
    (~20 ms of CPU), on every poll of a wait."""
    with httpx.Client(timeout=5) as client:
        yield client


@pytest.fixture
def peer_gateways(tmp_path: Path) -> Iterator[Callable[..., list[Gateway]]]:
    """Gateways that are each other's --peers (ports chosen first, so each can name the others)."""
    started: list[Gateway] = []

    def make(cluster: Cluster, engines: int, n: int, extra_args: tuple[str, ...] = ()) -> list[Gateway]:
        ports = free_ports(n)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        gateways = []
        for i, port in enumerate(ports):
            data_dir = tmp_path / f"peer-gateway{len(started)}"
            data_dir.mkdir()
            peers = ",".join(u for j, u in enumerate(urls) if j != i)
            g = Gateway(
                data_dir,
                port,
                cluster.replica_urls,
                log_level="info",
                extra_args=("--refresh-s", "0.1", "--peers", peers, *extra_args),
            )
            started.append(g)
            gateways.append(g)
        for g in gateways:
            g.wait_ready(60, engines=engines)
        return gateways

    yield make
    for g in started:
        g.stop()


def _token_file(tmp_path: Path) -> Path:
    token = tmp_path / "peer-token"
    token.write_text(TOKEN + "\n")
    return token


def test_a_peers_in_flight_prefill_counts_in_the_other_gateway(
    tmp_path, file_directory, make_workers, peer_gateways, http
) -> None:
    c = file_directory
    # 500 tokens/s of real time: A's 1,000-token prompt stays in prefill for 2 s.
    make_workers(c, 2, ("--time-scale", "1", "--prefill-tokens-per-s", "500"))
    auth = ("--peer-token-file", str(_token_file(tmp_path)), "--peer-note-ttl-s", "60")  # 60 s: only a done ends it
    a, b = peer_gateways(c, 2, 2, auth)

    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(_complete, a.url, "".join(chr(97 + i % 26) for i in range(1000)))  # a client of its own
        seen = wait_for(lambda: (s := http.get(b.url + "/v1/peers").json())["pending_tokens"] and s, what="A's note at B")
        assert seen["notes"] == 1 and seen["received"] == 1 and seen["done"] == 0
        ((node, tokens),) = seen["pending_tokens"].items()
        assert tokens == 1000.0
        # B folds it into its policy's view: an idle engine beats the one with 2 s of A's prefill queued.
        quick = _complete(b.url, "another prompt, short and not cached anywhere " * 2, http)
        assert quick.headers["x-kvdir-node"] != node
        first = slow.result()
    assert first.headers["x-kvdir-node"] == node
    after = wait_for(lambda: (s := http.get(b.url + "/v1/peers").json())["done"] == 1 and s, what="A's done at B")
    assert after["notes"] == 0 and after["pending_tokens"] == {} and after["expired"] == 0
    sent = http.get(a.url + "/v1/peers").json()
    assert sent["sent"] == 2 and sent["dropped"] == 0 and sent["send_failures"] == 0 and sent["peers"] == [b.url]
    assert "kvdir_gateway_peer_sent_total 2.0" in http.get(a.url + "/metrics").text

    # The notes route wants the shared token, and well-formed notes.
    note = {"sender": "x", "notes": [{"id": 0, "node": node, "epoch": 1, "tokens": 5, "ttl_s": 1}]}
    assert http.post(b.url + "/v1/peers/notes", json=note).status_code == 401
    bad = http.post(b.url + "/v1/peers/notes", json={"sender": "x", "notes": [{"id": -1}]}, headers=AUTH)
    assert bad.status_code == 400 and "notes are invalid" in bad.json()["error"]["message"]
    assert http.get(b.url + "/v1/peers").json()["received"] == 1


def test_without_peers_there_is_no_notes_route_and_a_flood_steers_for_one_ttl_at_most(
    tmp_path, file_directory, make_workers, make_gateway, http
) -> None:
    c = file_directory
    w = make_workers(c, 2)
    plain = make_gateway(c, 2)  # no --peers: no notes route at all
    flood = {"sender": "evil", "notes": [{"id": i, "node": "x", "epoch": 1, "tokens": 1e9, "ttl_s": 600} for i in range(512)]}
    assert http.post(plain.url + "/v1/peers/notes", json=flood).status_code == 404
    assert http.get(plain.url + "/v1/peers").status_code == 404

    (dead,) = free_ports(1)  # its peer never answers: only what the test posts reaches the gateway
    # From the first flood to the check after the 70 senders below takes 0.1-0.3 s (the latter on 2 cores beside two
    # busy processes): the one note that counts is still alive then, and its end within the TTL is waited for.
    ttl = 2.5
    g = make_gateway(
        c,
        2,
        ("--peers", f"http://127.0.0.1:{dead}", "--peer-token-file", str(_token_file(tmp_path)), "--peer-note-ttl-s", str(ttl)),
    )
    prompt = "a long shared prefix, cached where it was first computed; " * 40
    node = _complete(g.url, prompt, http).headers["x-kvdir-node"]
    # Once its blocks are in the directory, the prompt goes back to the engine that holds them.
    wait_for(
        lambda: (
            (r := _complete(g.url, prompt, http)).headers["x-kvdir-node"] == node
            and int(r.headers["x-kvdir-predicted-cached-tokens"]) > 0
        ),
        what="the prompt routed to its cache",
    )
    epoch = http.get(w.urls[w.node_ids.index(node)] + "/health").json()["epoch"]

    # One POST of 512 notes of 1e9 tokens for 600 s (5.1e11 tokens for 10 minutes before): one note counts, cut to
    # the engine's bound (--prefill-tokens-per-s 10,000 x the TTL), for the TTL; the rest are refused.
    flood = {
        "sender": "evil",
        "notes": [{"id": i, "node": node, "epoch": epoch, "tokens": 1e9, "ttl_s": 600} for i in range(512)],
    }
    started = time.monotonic()
    assert http.post(g.url + "/v1/peers/notes", json=flood, headers=AUTH).status_code == 204
    s = http.get(g.url + "/v1/peers").json()
    assert s["pending_tokens"] == {node: 10_000 * ttl} and s["notes"] == 1 and s["refused"] == 511 and s["clamped"] == 1
    # Replayed, and again after its done: refused.
    assert http.post(g.url + "/v1/peers/notes", json=flood, headers=AUTH).status_code == 204
    done = {"sender": "evil", "done": [0]}
    assert http.post(g.url + "/v1/peers/notes", json=done, headers=AUTH).status_code == 204
    assert http.post(g.url + "/v1/peers/notes", json=flood, headers=AUTH).status_code == 204
    s = http.get(g.url + "/v1/peers").json()
    assert s["replayed"] == 1024 and s["notes"] == 0 and s["pending_tokens"] == {}
    # Invented senders: the engine's bound holds whatever the names, and past 64 senders new ones are refused.
    statuses = []
    for k in range(70):
        r = http.post(g.url + "/v1/peers/notes", json={**flood, "sender": f"evil{k}"}, headers=AUTH, timeout=10)
        statuses.append(r.status_code)
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "rate_limit_exceeded" and "peer senders" in r.json()["error"]["message"]
    s = http.get(g.url + "/v1/peers").json()
    assert set(statuses) == {204, 429} and s["senders"] == 64
    if time.monotonic() - started < ttl:  # else the first senders, silent for a TTL and holding nothing, made room
        assert statuses.count(204) == 63
    assert s["pending_tokens"] == {node: 10_000 * ttl} and s["notes"] == 1

    # The steering ends with the TTL the gateway allows (not the 600 s asked for): then the prompt is back at its cache.
    wait_for(lambda: http.get(g.url + "/v1/peers").json()["notes"] == 0, timeout=ttl + 10, what="the notes' expiry")
    assert time.monotonic() - started < ttl + 10
    r = _complete(g.url, prompt, http)
    assert r.headers["x-kvdir-node"] == node and int(r.headers["x-kvdir-predicted-cached-tokens"]) > 0
    assert "kvdir_gateway_peer_refused_total" in http.get(g.url + "/metrics").text


@pytest.mark.parametrize("host", ["0.0.0.0", "[::]"])
def test_peers_off_loopback_without_a_token_refuse_to_start(host: str) -> None:
    (port,) = free_ports(1)
    cmd = [sys.executable, "-m", "kvdir", "gateway", "--http", f"{host}:{port}", "--directory", "http://127.0.0.1:1"]
    r = subprocess.run(
        [*cmd, "--peers", "http://127.0.0.1:2"], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
    )
    assert r.returncode != 0
    assert "not on loopback, but there is no peer token" in r.stderr and "--peer-token-file" in r.stderr
