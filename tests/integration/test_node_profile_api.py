"""Node profiles (docs/protocol.md §2.1) on real replicas: registered through DirectoryClient, listed by
GET /v1/nodes on every replica, warned about when missing, their tenant decided by the token, `shared` only
for a token not confined to a tenant, and kept across a leader change, a replica restart and a snapshot."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvdir.local_cluster import Cluster
from kvproto.client import DirectoryClient
from kvproto.errors import AuthError
from kvproto.schemas import NodeInfo, RegisterResponse
from tests.support.cluster import leader_index
from tests.support.wait import wait_for

ENGINE, ENGINE_ACME, ENGINE_BRAVO = "engine-any-3a4b5c6d", "engine-acme-7e8f9a0b", "engine-bravo-1c2d3e4f"
ADMIN = "admin-tok-5f6e7d8c"
TOKENS = f"""\
engine:worker-*:{ENGINE}
engine@acme:worker-[!6]:{ENGINE_ACME}
engine@bravo:worker-6:{ENGINE_BRAVO}
admin:*:{ADMIN}
"""
MODELS = ["Qwen/Qwen3-8B", "Qwen/Qwen3-8B:lora-sql"]
FINGERPRINT = "sha256:0f1e2d3c4b5a69788796a5b4c3d2e1f0"
NO_MODELS = "no models: gateways learn what the engine serves from its /v1/models"
NO_FINGERPRINT = "no fingerprint: the engine is never a pull source nor a pull destination"


def _profiles(url: str, token: str | None = None) -> dict[str, tuple[list[str], str | None, str, bool]]:
    headers = {"Authorization": f"Bearer {token}"} if token else None
    r = httpx.get(url + "/v1/nodes", headers=headers, timeout=5)
    assert r.status_code == 200, r.text
    out = {}
    for n in r.json()["nodes"]:
        info = NodeInfo.model_validate(n)  # the listing is what the client's schema reads
        out[info.node_id] = (info.models, info.fingerprint, info.tenant, info.shared)
    return out


def _everywhere(c: Cluster, expected: dict[str, Any], token: str | None = None, among: list[int] | None = None) -> None:
    """Wait until every replica (or those `among`) lists exactly these profiles."""
    for i in range(len(c.replica_urls)) if among is None else among:
        url = c.replica_urls[i]
        wait_for(lambda: _profiles(url, token) == expected, timeout=30, what=f"the profiles {expected} on {url}")


def _run(coro_fn: Callable[[], Any]) -> Any:
    return asyncio.run(coro_fn())


def test_profiles_are_registered_listed_and_kept_across_a_leader_change_and_a_restart(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(3, lease_ttl_s=300)

    async def register() -> tuple[RegisterResponse, RegisterResponse, RegisterResponse]:
        async with DirectoryClient(c.replica_urls, deadline=20) as d:
            full = await d.register(
                "worker-1", "http://127.0.0.1:9", incarnation="inc-1", models=[*MODELS, MODELS[0]], fingerprint=FINGERPRINT
            )
            bare = await d.register("worker-2", "http://127.0.0.1:10")
            # A retry of worker-1's registration (the same incarnation) with another profile changes nothing.
            retry = await d.register("worker-1", "http://127.0.0.1:9", incarnation="inc-1", models=["other"], shared=True)
            return full, bare, retry

    full, bare, retry = _run(register)
    assert full.warnings == []
    assert bare.warnings == [NO_MODELS, NO_FINGERPRINT]
    assert retry.epoch == full.epoch
    expected = {
        "worker-1": (MODELS, FINGERPRINT, "", False),  # the duplicate name listed once, in order
        "worker-2": ([], None, "", False),
    }
    _everywhere(c, expected)
    # Without auth, a tenant is whatever the registration names, and `shared` is anyone's to set.
    r = httpx.post(
        c.replica_urls[0] + "/v1/nodes",
        json={"node_id": "worker-3", "api_url": "http://127.0.0.1:11", "models": ["m"], "tenant": "acme", "shared": True},
        timeout=10,
    )
    assert r.status_code == 200 and r.json()["warnings"] == [NO_FINGERPRINT], r.text
    expected["worker-3"] = (["m"], None, "acme", True)
    _everywhere(c, expected)
    # The leader dies: the survivors elect another, which lists the same profiles.
    lead = leader_index(c)
    c.kill(lead)
    survivors = [i for i in range(3) if i != lead]
    dead = c.replica_urls[lead]

    def elected() -> str | None:
        url = c.wait_ready(30, among=survivors)  # the survivors' agreed leader: the dead one until they notice
        return url if url != dead else None

    new_leader = wait_for(elected, timeout=60, what="a new leader among the survivors")
    _everywhere(c, expected, among=survivors)
    # A new registration commits under the new leader; the killed replica restarts from its data dir (its
    # journal's entries decoded) and catches up with it.
    r = httpx.post(
        new_leader + "/v1/nodes",
        json={"node_id": "worker-4", "api_url": "http://127.0.0.1:12", "models": ["m2"], "fingerprint": "fp-2"},
        timeout=10,
    )
    assert r.status_code == 200 and r.json()["warnings"] == [], r.text
    expected["worker-4"] = (["m2"], "fp-2", "", False)
    c.start_replica(lead)
    c.wait_caught_up(lead, 60)
    _everywhere(c, expected)


INVALID = [
    ("fingerprint", ""),
    ("fingerprint", "f" * 129),
    ("fingerprint", 7),
    ("models", [""]),
    ("models", ["m" * 257]),
    ("models", [f"m{i}" for i in range(257)]),
    ("models", "m"),
    ("models", [7]),
    ("shared", "yes"),
]


def test_invalid_profiles_are_422_and_the_longest_valid_one_is_accepted(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster(1, lease_ttl_s=300)
    url = c.replica_urls[0]
    for field, value in INVALID:
        body = {"node_id": "worker-1", "api_url": "http://127.0.0.1:9", field: value}
        r = httpx.post(url + "/v1/nodes", json=body, timeout=10)
        assert r.status_code == 422 and r.json()["error"] == "invalid_request", (field, value, r.text)
    assert _profiles(url) == {}  # nothing registered
    models = [f"{i:03d}" + "m" * 253 for i in range(256)]
    body = {"node_id": "worker-1", "api_url": "http://127.0.0.1:9", "models": models, "fingerprint": "f" * 128}
    r = httpx.post(url + "/v1/nodes", json=body, timeout=10)
    assert r.status_code == 200 and r.json()["warnings"] == [], r.text
    assert _profiles(url) == {"worker-1": (models, "f" * 128, "", False)}


# -- tenants --------------------------------------------------------------------------------------


@pytest.fixture
def tenanted(make_cluster: Callable[..., Cluster], tmp_path: Path) -> Cluster:
    """A 3-replica cluster with confined tokens and a tenant secret (as in test_tenants.py)."""
    tokens, secret = tmp_path / "tokens", tmp_path / "tenant-secret"
    tokens.write_text(TOKENS)
    secret.write_text("a-secret-only-the-replicas-know\n")
    c: Cluster = make_cluster(
        3, lease_ttl_s=300, token=ADMIN, extra_args=("--auth-tokens-file", str(tokens), "--tenant-secret-file", str(secret))
    )
    return c


def test_the_token_decides_the_tenant_and_only_an_unconfined_one_registers_shared(tenanted: Cluster) -> None:
    c = tenanted

    async def scenario() -> dict[str, AuthError]:
        refused: dict[str, AuthError] = {}
        async with DirectoryClient(c.replica_urls, token=ENGINE_ACME, deadline=20) as acme:
            # Confined to acme, naming no tenant: the node is acme's.
            reg = await acme.register("worker-1", "http://127.0.0.1:9", models=["m"], fingerprint="fp")
            assert reg.warnings == []
            # Confined to acme, asking for a shared engine: refused.
            with pytest.raises(AuthError) as e:
                await acme.register("worker-2", "http://127.0.0.1:10", models=["m"], fingerprint="fp", shared=True)
            refused["acme shared"] = e.value
        async with DirectoryClient(c.replica_urls, token=ENGINE_ACME, tenant="acme", deadline=20) as acme:
            await acme.register("worker-3", "http://127.0.0.1:11", models=["m"])  # naming its own tenant is fine
            with pytest.raises(AuthError) as e:
                await acme.register("worker-4", "http://127.0.0.1:12", shared=True)
            refused["acme shared, naming acme"] = e.value
        async with DirectoryClient(c.replica_urls, token=ENGINE_ACME, tenant="bravo", deadline=20) as wrong:
            with pytest.raises(AuthError) as e:
                await wrong.register("worker-5", "http://127.0.0.1:13", models=["m"])
            refused["acme naming bravo"] = e.value
        async with DirectoryClient(c.replica_urls, token=ENGINE_BRAVO, deadline=20) as bravo:
            await bravo.register("worker-6", "http://127.0.0.1:14", fingerprint="fp")
        async with DirectoryClient(c.replica_urls, token=ENGINE, deadline=20) as anyone:
            # Not confined: a shared engine, and a node of a tenant it names.
            reg = await anyone.register("worker-7", "http://127.0.0.1:15", models=["m"], fingerprint="fp", shared=True)
            assert reg.warnings == []
        async with DirectoryClient(c.replica_urls, token=ENGINE, tenant="bravo", deadline=20) as anyone:
            await anyone.register("worker-8", "http://127.0.0.1:16", models=["m"], fingerprint="fp")
        return refused

    refused = _run(scenario)
    for what, err in refused.items():
        assert err.status == 403 and err.error == "forbidden", (what, err)
    assert "shared" in str(refused["acme shared"].detail)
    assert "shared" in str(refused["acme shared, naming acme"].detail)
    assert "'bravo'" in str(refused["acme naming bravo"].detail) and "acme" in str(refused["acme naming bravo"].detail)
    # Over plain HTTP too, with the body naming bravo and shared at once.
    r = httpx.post(
        c.replica_urls[1] + "/v1/nodes",
        json={"node_id": "worker-9", "api_url": "http://127.0.0.1:17", "tenant": "bravo", "shared": True},
        headers={"Authorization": f"Bearer {ENGINE_ACME}"},
        timeout=10,
    )
    assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
    # Refused registrations left nothing behind; the others are listed with their tokens' tenants.
    _everywhere(
        c,
        {
            "worker-1": (["m"], "fp", "acme", False),
            "worker-3": (["m"], None, "acme", False),
            "worker-6": ([], "fp", "bravo", False),
            "worker-7": (["m"], "fp", "", True),
            "worker-8": (["m"], "fp", "bravo", False),
        },
        token=ADMIN,
    )
