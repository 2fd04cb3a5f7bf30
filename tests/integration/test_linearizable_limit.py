"""Linearizable lookups, which each append a Raft entry, are rate-limited per token (issue #29 item 7f)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

ENGINE, GATEWAY, ADMIN = "engine-tok-9a0b1c2d", "gateway-tok-3e4f5a6b", "admin-tok-7c8d9e0f1a"
TOKENS = f"engine:worker-*:{ENGINE}\ngateway:*:{GATEWAY}\nadmin:*:{ADMIN}\n"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_a_tokens_linearizable_lookups_are_limited_with_429_and_retry_after(make_cluster, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
    tokens.chmod(0o600)
    # 0.2 per second: a burst of one, the next one 5 s later (slow machines cannot refill it by accident).
    args = ("--auth-tokens-file", str(tokens), "--linearizable-lookups-per-s", "0.2")
    c = make_cluster(1, lease_ttl_s=300, extra_args=args, token=ADMIN)
    url = c.replica_urls[0]

    def lookup(token: str, consistency: str) -> httpx.Response:
        return httpx.post(url + "/v1/lookup", json={"hashes": [1], "consistency": consistency}, headers=bearer(token))

    def applied() -> int:
        return int(httpx.get(url + "/v1/digest", headers=bearer(ADMIN)).json()["applied"])

    assert lookup(GATEWAY, "linearizable").status_code == 200
    before = applied()
    r = lookup(GATEWAY, "linearizable")
    assert r.status_code == 429 and r.json()["error"] == "rate_limited", r.text
    assert "--linearizable-lookups-per-s" in r.json()["detail"]
    assert 1 <= int(r.headers["Retry-After"]) <= 5
    assert applied() == before  # refused before anything went through Raft
    for _ in range(5):
        assert lookup(GATEWAY, "local").status_code == 200  # local lookups append nothing: never limited
    assert lookup(ENGINE, "linearizable").status_code == 200  # each token has its own allowance
    assert lookup(ENGINE, "linearizable").status_code == 429
    for _ in range(3):
        assert lookup(ADMIN, "linearizable").status_code == 200  # an admin's are not limited
    metrics = httpx.get(url + "/metrics").text
    assert 'kvdir_directory_requests_rejected_total{error="rate_limited"}' in metrics


def test_the_client_waits_out_a_rate_limit_within_its_deadline(make_cluster, tmp_path: Path) -> None:
    """The compose test's verifier (a burst of linearizable lookups after a leader kill) met the limit as an
    error: a rate limit is no refusal, so the client retries it (another replica, or this one later) until its
    deadline, and only then fails."""
    from kvproto.client import DirectoryClient
    from kvproto.errors import DirectoryUnavailable

    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
    args = ("--auth-tokens-file", str(tokens), "--linearizable-lookups-per-s", "2")
    c = make_cluster(1, lease_ttl_s=300, extra_args=args, token=ADMIN)

    async def run() -> None:
        async with DirectoryClient(c.replica_urls, token=GATEWAY, deadline=10, sharded=False) as client:
            for _ in range(6):  # a burst of 2, then 2 per second: about 2 s of waiting in all
                await client.lookup([1], linearizable=True)
        # A deadline shorter than the refill (0.5 s): the third lookup in a row cannot be answered in time.
        async with DirectoryClient(c.replica_urls, token=ENGINE, deadline=0.3, sharded=False) as client:
            with pytest.raises(DirectoryUnavailable, match="429"):
                for _ in range(3):
                    await client.lookup([1], linearizable=True)

    asyncio.run(run())
