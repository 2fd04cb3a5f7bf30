"""Tenants on real replicas: lookups see only the caller's tenant, tokens confined to a tenant cannot
name another, and a worker and a gateway of one tenant still route by cached prefix."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvdir.local_cluster import Cluster, Workers, free_ports, write_raft_password
from kvproto.client import DirectoryClient
from kvproto.codec import Frame, FrameReader, SnapshotFrame
from kvproto.errors import AuthError
from kvproto.hashing import block_hashes
from tests.support.cluster import deregister_all
from tests.support.wait import wait_for

ENGINE, ENGINE_ACME, ENGINE_BRAVO = "engine-any-0c1d2e3f", "engine-acme-9a8b7c6d", "engine-bravo-1f2e3d4c"
GATEWAY, GATEWAY_BRAVO, ADMIN = "gateway-any-55aa66bb", "gateway-bravo-77cc88dd", "admin-tok-0a0b0c0d"
TOKENS = f"""\
engine:worker-*:{ENGINE}
engine@acme:worker-1:{ENGINE_ACME}
engine@bravo:worker-[!1]*:{ENGINE_BRAVO}
gateway:*:{GATEWAY}
gateway@bravo:*:{GATEWAY_BRAVO}
admin:*:{ADMIN}
"""
# Engine tokens of different tenants never match a common node id (the replicas refuse such a file).
TOKENS_BRAVO_ON_WORKER_1 = TOKENS.replace("engine@acme:worker-1:", "engine@acme:worker-[!1]*:").replace(
    "engine@bravo:worker-[!1]*:", "engine@bravo:worker-1:"
)
MODEL = "kvdir-stub"
PROMPT = "Acme's system prompt is nobody else's business, and their cache is theirs alone. " * 3
TOKENS_40 = list(range(1, 41))
HASHES = block_hashes(TOKENS_40)


Tenanted = tuple[Cluster, dict[str, Path]]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def _tenanted_cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenanted]:
    """A 3-replica cluster with confined tokens (TOKENS, or the test's indirect parameter) and a tenant secret, and
    one file per client token: started once per file and token table (see `tenanted`)."""
    d = tmp_path_factory.mktemp("tenanted")
    tokens, secret = d / "tokens", d / "tenant-secret"
    tokens.write_text(getattr(request, "param", TOKENS))
    secret.write_text("a-secret-only-the-replicas-know\n")
    files = {}
    for name, token in (("engine_acme", ENGINE_ACME), ("gateway", GATEWAY), ("gateway_bravo", GATEWAY_BRAVO)):
        files[name] = d / f"{name}.token"
        files[name].write_text(token + "\n")
    ports = free_ports(6)
    c = Cluster(
        d / "cluster",
        ports[:3],
        ports[3:],
        lease_ttl_s=300,
        log_level="info",
        extra_args=("--auth-tokens-file", str(tokens), "--tenant-secret-file", str(secret)),
        token=ADMIN,
        raft_password_file=write_raft_password(d / "secrets"),
    )
    try:
        (d / "cluster").mkdir()
        c.start()
        c.wait_ready(60)
        yield c, files
    finally:
        c.stop()


@pytest.fixture
def tenanted(_tenanted_cluster: Tenanted) -> Iterator[Tenanted]:
    """The file's tenanted cluster, with no node registered when a test starts: the nodes a test registered
    (in any tenant) are deregistered after it, so that their endpoints and entries are gone for the next."""
    c, files = _tenanted_cluster
    leader = c.wait_ready(30)
    yield c, dict(files)
    deregister_all(leader, ADMIN)


def _holders(url: str, token: str, **body: object) -> dict[str, int]:
    r = httpx.post(
        url + "/v1/lookup?consistency=linearizable", json={"hashes": HASHES, **body}, headers=bearer(token), timeout=10
    )
    assert r.status_code == 200, r.text
    return {h["node_id"]: h["matched_blocks"] for h in r.json()["holders"]}


def _forbidden(r: httpx.Response) -> None:
    assert r.status_code == 403, (r.request.url, r.status_code, r.text)
    body = r.json()
    assert body["error"] == "forbidden" and "tenant" in body["detail"], body


def _register(url: str, node_id: str, token: str) -> int:
    r = httpx.post(
        url + "/v1/nodes", json={"node_id": node_id, "api_url": f"http://{node_id}:9"}, headers=bearer(token), timeout=10
    )
    assert r.status_code == 200, r.text
    return r.json()["epoch"]


def test_lookups_see_only_the_callers_tenant(tenanted) -> None:
    c, _ = tenanted
    leader = c.wait_ready(30)
    follower = next(u for u in c.replica_urls if u != leader)
    blocks = [{"hash": h, "slot": i} for i, h in enumerate(HASHES)]
    e1, e2 = _register(leader, "worker-1", ENGINE_ACME), _register(leader, "worker-2", ENGINE)
    # A token confined to acme publishes without naming a tenant: its entries land in acme.
    r = httpx.post(
        follower + "/v1/blocks", json={"node_id": "worker-1", "epoch": e1, "blocks": blocks}, headers=bearer(ENGINE_ACME)
    )
    assert r.status_code == 200 and r.json()["stored"] == 2, r.text
    for url in (leader, follower):
        assert _holders(url, GATEWAY, tenant="acme") == {"worker-1": 2}
        assert _holders(url, ADMIN, tenant="acme") == {"worker-1": 2}
        assert _holders(url, ENGINE_ACME) == {"worker-1": 2}  # its own tenant by default
        # The same raw hashes in any other tenant find nothing: the shared one, bravo, a look-alike.
        for tenant in ("", "bravo", "Acme", "acme-"):
            assert _holders(url, GATEWAY, tenant=tenant) == {}, tenant
        assert _holders(url, GATEWAY) == {}
        assert _holders(url, GATEWAY_BRAVO) == {}
        # By tokens (hashed by the replica) the same holds.
        assert _holders(url, GATEWAY, hashes=None, tokens=TOKENS_40, tenant="acme") == {"worker-1": 2}
        assert _holders(url, GATEWAY, hashes=None, tokens=TOKENS_40) == {}
    # An unconfined engine token writes the same raw hashes into bravo for worker-2: the tenants stay apart.
    r = httpx.post(
        leader + "/v1/blocks",
        json={"node_id": "worker-2", "epoch": e2, "blocks": blocks[:1], "tenant": "bravo"},
        headers=bearer(ENGINE),
    )
    assert r.status_code == 200, r.text
    assert _holders(follower, GATEWAY_BRAVO) == {"worker-2": 1} == _holders(follower, GATEWAY, tenant="bravo")
    assert _holders(follower, GATEWAY, tenant="acme") == {"worker-1": 2}
    # Removing in acme leaves bravo's entry of the same hash alone.
    r = httpx.post(
        leader + "/v1/blocks/remove",
        json={"node_id": "worker-2", "epoch": e2, "hashes": HASHES[:1], "tenant": "acme"},
        headers=bearer(ENGINE),
    )
    assert r.status_code == 200 and r.json()["removed"] == 0, r.text
    assert _holders(follower, GATEWAY_BRAVO) == {"worker-2": 1}


def test_confined_tokens_cannot_name_another_tenant(tenanted) -> None:
    c, _ = tenanted
    leader = c.wait_ready(30)
    epoch = _register(leader, "worker-2", ENGINE)
    blocks = [{"hash": h, "slot": i} for i, h in enumerate(HASHES)]
    r = httpx.post(
        leader + "/v1/blocks",
        json={"node_id": "worker-2", "epoch": epoch, "blocks": blocks, "tenant": "acme"},
        headers=bearer(ENGINE),
    )
    assert r.status_code == 200, r.text
    for url in c.replica_urls:
        # Probing acme with a token confined to bravo, or the shared tenant: refused, whatever the body holds.
        for tenant in ("acme", ""):
            _forbidden(httpx.post(url + "/v1/lookup", json={"hashes": HASHES, "tenant": tenant}, headers=bearer(GATEWAY_BRAVO)))
            _forbidden(
                httpx.post(url + "/v1/lookup", json={"tokens": TOKENS_40, "tenant": tenant}, headers=bearer(GATEWAY_BRAVO))
            )
            # Poisoning or erasing acme's entries with an engine token confined to bravo: refused too.
            _forbidden(
                httpx.post(
                    url + "/v1/blocks",
                    json={"node_id": "worker-2", "epoch": epoch, "blocks": blocks, "tenant": tenant},
                    headers=bearer(ENGINE_BRAVO),
                )
            )
            _forbidden(
                httpx.post(
                    url + "/v1/blocks/remove",
                    json={"node_id": "worker-2", "epoch": epoch, "hashes": HASHES, "tenant": tenant},
                    headers=bearer(ENGINE_BRAVO),
                )
            )
        # Bad tenant names are 422 for everyone.
        for bad in ("a b", "a:b", "a@b", "t" * 65, 7):
            r = httpx.post(url + "/v1/lookup", json={"hashes": HASHES, "tenant": bad}, headers=bearer(ADMIN))
            assert r.status_code == 422 and r.json()["error"] == "invalid_request", (bad, r.text)
    assert _holders(leader, ADMIN, tenant="acme") == {"worker-2": 2}  # nothing changed
    metrics = httpx.get(leader + "/metrics").text
    assert 'kvdir_directory_requests_rejected_total{error="forbidden"}' in metrics

    async def client() -> None:
        async with DirectoryClient(c.replica_urls, token=GATEWAY_BRAVO, tenant="acme", deadline=10) as d:
            with pytest.raises(AuthError) as e:
                await d.lookup(HASHES)
            assert e.value.status == 403
        async with DirectoryClient(c.replica_urls, token=GATEWAY, tenant="acme", deadline=10) as d:
            assert [h.node_id for h in (await d.lookup(HASHES)).holders] == ["worker-2"]
        async with DirectoryClient(c.replica_urls, token=ENGINE_BRAVO, deadline=10) as d:  # its own tenant, its own node
            own = (await d.register("worker-3", "http://127.0.0.1:10")).epoch
            assert await d.publish("worker-3", own, [(HASHES[0], 7)]) == 1
            assert (await d.lookup(HASHES, with_slots=True)).holders[0].slots == [7]
            assert await d.remove("worker-3", own, HASHES) == 1

    asyncio.run(client())


def test_tenants_without_auth(file_directory) -> None:
    c = file_directory
    url = c.wait_ready(30)
    epoch = _register(url, "worker-1", "none")
    blocks = [{"hash": h, "slot": i} for i, h in enumerate(HASHES)]
    assert (
        httpx.post(
            url + "/v1/blocks", json={"node_id": "worker-1", "epoch": epoch, "blocks": blocks, "tenant": "acme"}
        ).status_code
        == 200
    )
    assert _holders(url, "none", tenant="acme") == {"worker-1": 2}
    assert _holders(url, "none") == {} == _holders(url, "none", tenant="bravo")


def test_worker_and_gateway_of_one_tenant_share_their_cache(tenanted, make_workers, make_gateway) -> None:
    c, files = tenanted
    # The worker's token is confined to acme, so it publishes there without --tenant.
    w = make_workers(c, 1, ("--directory-token-file", str(files["engine_acme"]), "--transfer", "tcp"))
    acme = make_gateway(c, 1, ("--directory-token-file", str(files["gateway"]), "--tenant", "acme"))
    r = httpx.post(w.urls[0] + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    n_blocks = len(PROMPT.encode()) // 16

    def holders(**body: object) -> dict[str, int]:
        res = httpx.post(
            c.replica_urls[0] + "/v1/lookup",
            json={"tokens": list(PROMPT.encode()), "model": MODEL, **body},
            headers=bearer(GATEWAY),
            timeout=5,
        ).json()
        return {h["node_id"]: h["matched_blocks"] for h in res["holders"]}

    wait_for(lambda: holders(tenant="acme") == {"worker-1": n_blocks}, what="worker-1's blocks in tenant acme")
    assert holders() == {}
    r = httpx.post(acme.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT + "more", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.headers["x-kvdir-decision"] == "affinity", (r.headers, r.text)
    assert int(r.headers["x-kvdir-predicted-cached-tokens"]) == n_blocks * 16
    # A tenant's gateway keeps no mirror (it would carry every tenant's entries): it looked up over REST.
    metrics = httpx.get(acme.url + "/metrics").text
    assert 'kvdir_gateway_lookups_total{source="rest"} 1.0' in metrics, metrics
    assert 'kvdir_gateway_lookups_total{source="mirror"} 0.0' in metrics, metrics  # listed at zero, never counted


def test_a_tenants_gateway_routes_only_to_its_tenants_engines_and_shared_ones(tenanted, make_gateway, tmp_path) -> None:
    """An engine token confined to bravo registers an idle engine (the least loaded, so the most attractive):
    acme's gateway never sends it a prompt, bravo's never sends one to acme's engine; an engine an unconfined
    token registered as shared serves both."""
    c, files = tenanted
    for name, token in (("engine_bravo", ENGINE_BRAVO), ("engine_any", ENGINE)):
        files[name] = tmp_path / f"{name}.token"
        files[name].write_text(token + "\n")
    roles = {"worker-1": "engine_acme", "worker-2": "engine_bravo", "worker-3": "engine_any"}
    data = tmp_path / "tenant-workers"
    data.mkdir()
    w = Workers(
        data,
        free_ports(3),
        c.replica_urls,
        log_level="info",
        extra_args=("--time-scale", "0.05", "--heartbeat-interval-s", "0.3", "--transfer", "tcp"),
        token_files={node: files[role] for node, role in roles.items()},
    )
    try:
        w.start_worker(0)
        w.start_worker(1)
        w.start_worker(2, "--shared")
        w.wait_ready(60)
        nodes = {n["node_id"]: n for n in httpx.get(c.replica_urls[0] + "/v1/nodes", headers=bearer(ADMIN)).json()["nodes"]}
        assert {k: (n["tenant"], n["shared"]) for k, n in nodes.items()} == {
            "worker-1": ("acme", False),
            "worker-2": ("bravo", False),
            "worker-3": ("", True),
        }
        acme = make_gateway(c, 2, ("--directory-token-file", str(files["gateway"]), "--tenant", "acme"))
        bravo = make_gateway(c, 2, ("--directory-token-file", str(files["gateway_bravo"]), "--tenant", "bravo"))
        sent: Counter[tuple[str, str]] = Counter()  # (tenant, node) -> requests its gateway sent there
        for i in range(12):
            for tenant, g in (("acme", acme), ("bravo", bravo)):
                body = {"model": MODEL, "prompt": f"{tenant}'s request {i}: " + PROMPT, "max_tokens": 1}
                r = httpx.post(g.url + "/v1/completions", json=body, timeout=30)
                assert r.status_code == 200, r.text
                sent[tenant, r.headers["x-kvdir-node"]] += 1
        assert sent["acme", "worker-2"] == 0 == sent["bravo", "worker-1"], sent
        # Each confined engine served exactly what its own tenant's gateway sent it, nothing else.
        for i, tenant in ((0, "acme"), (1, "bravo")):
            metrics = httpx.get(w.urls[i] + "/metrics").text
            counted = [float(x.rsplit(" ", 1)[1]) for x in metrics.splitlines() if x.startswith("kvdir_worker_requests_total{")]
            assert sum(counted) == sent[tenant, w.node_ids[i]], (tenant, counted, sent)
        # A token confined to a tenant may not register a shared engine.
        r = httpx.post(
            c.replica_urls[0] + "/v1/nodes",
            json={"node_id": "worker-9", "api_url": "http://127.0.0.1:9", "shared": True},
            headers=bearer(ENGINE_BRAVO),
        )
        assert r.status_code == 403 and "shared" in r.json()["detail"], r.text
    finally:
        w.stop()


def test_the_watch_stream_refuses_tokens_confined_to_a_tenant(tenanted) -> None:
    c, _ = tenanted
    url = c.replica_urls[0] + "/v1/watch"
    r = httpx.get(url, headers=bearer(GATEWAY_BRAVO), timeout=5)
    assert r.status_code == 403 and "confined to tenant 'bravo'" in r.json()["detail"], r.text
    assert httpx.get(url, timeout=5).status_code == 401
    with httpx.stream("GET", url, headers=bearer(GATEWAY), timeout=5) as r:
        assert r.status_code == 200
        reader = FrameReader()
        frames: list[Frame] = []
        for chunk in r.iter_raw():
            frames += reader.feed(chunk)
            if frames:
                break
    assert isinstance(frames[0], SnapshotFrame)


@pytest.mark.parametrize("_tenanted_cluster", [TOKENS_BRAVO_ON_WORKER_1], indirect=True)
def test_a_shared_engine_never_pulls_from_a_tenants_engine(tenanted, make_gateway, tmp_path) -> None:
    """Tenant bravo's engine holds two prompts and reports itself overloaded (with bravo's engine token, as a
    node of its own could): bravo's gateway, whose candidates are bravo's engines and shared ones, recomputes the
    prompt on the shared engine rather than plan a pull into it from bravo's, whose pages (tags included) are
    whatever bravo serves and would then serve every tenant; and the shared engine refuses such a plan handed to it
    directly: counted, recomputed, the same answer."""
    c, files = tenanted
    for name, token in (("engine_bravo", ENGINE_BRAVO), ("engine_any", ENGINE)):
        files[name] = tmp_path / f"{name}.token"
        files[name].write_text(token + "\n")
    data = tmp_path / "shared-workers"
    data.mkdir()
    w = Workers(
        data,
        free_ports(2),
        c.replica_urls,
        log_level="info",
        extra_args=("--time-scale", "0.05", "--transfer", "tcp"),
        token_files={"worker-1": files["engine_bravo"], "worker-2": files["engine_any"]},
    )
    try:
        w.start_worker(0, "--heartbeat-interval-s", "120")  # its load is what the test heartbeats below
        w.start_worker(1, "--shared", "--heartbeat-interval-s", "0.3")
        epoch = w.wait_ready(60)[0]
        prompts = [f"{kind}: " + PROMPT for kind in ("handed", "planned")]
        n_blocks = len(prompts[0].encode()) // 16
        answers = []
        for prompt in prompts:
            r = httpx.post(w.urls[0] + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}, timeout=30)
            assert r.status_code == 200, r.text
            answers.append(r.json())

        def holding(prompt: str) -> list[dict[str, object]]:
            body = {"tokens": list(prompt.encode()), "model": MODEL, "with_slots": True}
            r = httpx.post(c.replica_urls[0] + "/v1/lookup", json=body, headers=bearer(GATEWAY_BRAVO), timeout=5)
            return [h for h in r.json()["holders"] if h["matched_blocks"] == n_blocks]

        held = [wait_for(lambda p=p: holding(p), what="worker-1's blocks in tenant bravo") for p in prompts]

        # A plan handed to the shared engine, naming bravo's engine: refused, counted, recomputed.
        plan = {"source_node": "worker-1", "source_epoch": epoch, "slots": held[0][0]["slots"]}
        body = {"model": MODEL, "prompt": prompts[0], "max_tokens": 2, "kvdir_pull": plan}
        r = httpx.post(w.urls[1] + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["kvdir"]["pull_failures"] == [
            "source worker-1 is of tenant 'bravo' and not shared: a shared engine reads only from shared ones"
        ]
        assert out["kvdir"]["pulled_tokens"] == 0 == out["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert (out["choices"][0]["text"], out["usage"]) == (answers[0]["choices"][0]["text"], answers[0]["usage"])
        metrics = httpx.get(w.urls[1] + "/metrics").text
        assert "kvdir_worker_pull_refused_total 1.0" in metrics and "kvdir_worker_pulled_blocks_total 0.0" in metrics

        # Bravo's engine, overloaded: its gateway recomputes the prompt on the shared engine, planning no pull.
        r = httpx.post(
            f"{c.replica_urls[0]}/v1/nodes/worker-1/heartbeat",
            json={"epoch": epoch, "load": {"running": 1000.0, "waiting": 1000.0}},
            headers=bearer(ENGINE_BRAVO),
            timeout=5,
        )
        assert r.status_code == 200, r.text
        # Routed on the heartbeats' load (the test's above), not on what the engine's /metrics says.
        bravo_args = ("--directory-token-file", str(files["gateway_bravo"]), "--tenant", "bravo", "--load-scrape-s", "0")
        bravo = make_gateway(c, 2, bravo_args)

        def overloaded() -> bool:
            engines = httpx.get(bravo.url + "/v1/status", timeout=5).json()["engines"]
            return any(e["node_id"] == "worker-1" and e["running"] == 1000.0 for e in engines)

        wait_for(overloaded, what="bravo's gateway seeing worker-1 overloaded")
        r = httpx.post(bravo.url + "/v1/completions", json={"model": MODEL, "prompt": prompts[1], "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        assert (r.headers["x-kvdir-node"], r.headers["x-kvdir-decision"]) == ("worker-2", "recompute"), r.headers
        out = r.json()
        assert out["kvdir"]["pull_failures"] == [] and out["kvdir"]["pulled_tokens"] == 0  # no plan reached it
        assert (out["choices"][0]["text"], out["usage"]) == (answers[1]["choices"][0]["text"], answers[1]["usage"])
    finally:
        w.stop()
