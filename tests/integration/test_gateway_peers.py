"""Two gateway processes sharing routing decisions (gateway.peers): A's in-flight prefill is visible to B."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.support.wait import wait_for

MODEL = "kvdir-stub"


def _complete(url: str, prompt: str) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def test_a_peers_in_flight_prefill_counts_in_the_other_gateway(tmp_path, make_cluster, make_workers, make_gateway) -> None:
    c = make_cluster(1)
    # 500 tokens/s of real time: A's 1,000-token prompt stays in prefill for 2 s.
    make_workers(c, 2, ("--time-scale", "1", "--prefill-tokens-per-s", "500"))
    token = tmp_path / "peer-token"
    token.write_text("s3cret-peer-token\n")
    auth = ("--peer-token-file", str(token), "--peer-note-ttl-s", "60")  # 60 s: only a done can end the note here
    b = make_gateway(c, 2, auth)
    a = make_gateway(c, 2, ("--peers", b.url, *auth))

    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(_complete, a.url, "".join(chr(97 + i % 26) for i in range(1000)))
        seen = wait_for(lambda: (s := httpx.get(b.url + "/v1/peers").json())["pending_tokens"] and s, what="A's note at B")
        assert seen["notes"] == 1 and seen["received"] == 1 and seen["done"] == 0
        ((node, tokens),) = seen["pending_tokens"].items()
        assert tokens == 1000.0
        # B folds it into its policy's view: an idle engine beats the one with 2 s of A's prefill queued.
        quick = _complete(b.url, "another prompt, short and not cached anywhere " * 2)
        assert quick.headers["x-kvdir-node"] != node
        first = slow.result()
    assert first.headers["x-kvdir-node"] == node
    after = wait_for(lambda: (s := httpx.get(b.url + "/v1/peers").json())["done"] == 1 and s, what="A's done at B")
    assert after["notes"] == 0 and after["pending_tokens"] == {} and after["expired"] == 0
    sent = httpx.get(a.url + "/v1/peers").json()
    assert sent["sent"] == 2 and sent["dropped"] == 0 and sent["send_failures"] == 0 and sent["peers"] == [b.url]
    assert "kvdir_gateway_peer_sent_total 2.0" in httpx.get(a.url + "/metrics").text

    # The notes route wants the shared token, and well-formed notes.
    note = {"sender": "x", "notes": [{"id": 0, "node": node, "epoch": 1, "tokens": 5, "ttl_s": 1}]}
    assert httpx.post(b.url + "/v1/peers/notes", json=note).status_code == 401
    bad = httpx.post(
        b.url + "/v1/peers/notes",
        json={"sender": "x", "notes": [{"id": -1}]},
        headers={"authorization": "Bearer s3cret-peer-token"},
    )
    assert bad.status_code == 400 and "notes are invalid" in bad.json()["error"]["message"]
    assert httpx.get(b.url + "/v1/peers").json()["received"] == 1
