"""docker-compose.yml and the Dockerfile, checked statically.

Docker itself is not available on the CI machines, so nothing here builds or
runs a container: the checks are strict instead. Every kvdir service's command
and environment go through `kvdir check-config` (the same settings classes the
processes read), and the topology must be consistent and match `kvdir up`.
"""

from __future__ import annotations

import tomllib
from urllib.parse import urlsplit

import pytest
import yaml

from kvdir.check_config import check, compose_auth_problems, compose_services, interpolate
from kvdir.launcher import UpSettings
from kvproto.addresses import parse_hostport
from tests.support.deployment import COMPOSE, ROOT, stand_in_services


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    return stand_in_services(tmp_path_factory.mktemp("secrets"))


@pytest.fixture(scope="module")
def doc():
    return yaml.safe_load(COMPOSE.read_text())


def test_check_config_catches_mistakes(services, tmp_path) -> None:
    role, args, env = services["dir1"]
    assert any("KVDIR_HTTP" in p or "http" in p for p in check(role, args, {**env, "KVDIR_HTTP": "no-port"}))
    assert any("KVDIR_TYPO" in p for p in check(role, args, {**env, "KVDIR_TYPO": "1"}))
    assert any("--nope" in p for p in check(role, [*args, "--nope"], env))
    assert check("nonsense", [], {})
    # A secret the service does not mount is read for real, and is missing here.
    broken = yaml.safe_load(COMPOSE.read_text())
    del broken["services"]["dir2"]["secrets"]
    path = tmp_path / "compose.yml"
    path.write_text(yaml.safe_dump(broken))
    stand_in = tmp_path / "s"
    stand_in.write_text("x")
    role, args, env = compose_services(path, stand_in)["dir2"]
    assert any("password" in p.lower() for p in check(role, args, env))


def test_topology_is_consistent_and_matches_kvdir_up(services, doc) -> None:
    by_role: dict[str, list[str]] = {}
    for name, (role, _, _) in services.items():
        by_role.setdefault(role, []).append(name)
    up = UpSettings()
    assert len(by_role["directory"]) == up.replicas
    assert len(by_role["worker"]) == up.workers
    assert len(by_role["gateway"]) == 1 and up.gateway
    directory_urls = set()
    raft = {}
    for name in by_role["directory"]:
        env = services[name][2]
        svc = doc["services"][name]
        assert urlsplit(env["KVDIR_ADVERTISE_URL"]).hostname == name == svc["hostname"]
        host, _ = parse_hostport(env["KVDIR_RAFT"])
        assert host == name
        raft[name] = env["KVDIR_RAFT"]
        directory_urls.add(env["KVDIR_ADVERTISE_URL"])
        # State survives container restarts: the data dir is a named volume.
        volume, mount = svc["volumes"][0].split(":")
        assert mount == env["KVDIR_DATA_DIR"] and volume in doc["volumes"]
    for name in by_role["directory"]:
        peers = set(services[name][2]["KVDIR_PEERS"].split(","))
        assert peers == {a for n, a in raft.items() if n != name}
    for name in by_role["worker"] + by_role["gateway"]:
        env = services[name][2]
        assert set(env["KVDIR_DIRECTORY"].split(",")) == directory_urls
    node_ids = [services[n][2]["KVDIR_NODE_ID"] for n in by_role["worker"]]
    assert len(set(node_ids)) == len(node_ids)
    for name in by_role["worker"]:
        env = services[name][2]
        assert urlsplit(env["KVDIR_ADVERTISE_URL"]).hostname == name == doc["services"][name]["hostname"]
    for role, _, env in services.values():
        # Each health check probes the service's own port, and the directory's readiness.
        _, port = parse_hostport(env["KVDIR_HTTP"])
        url = urlsplit(env["KVDIR_HEALTH_URL"])
        assert url.port == port
        assert url.path == ("/readyz" if role == "directory" else "/health")
    # Published on 8000 unless KVDIR_GATEWAY_PUBLISH says otherwise (tests/compose: a free loopback port).
    assert [interpolate(p, {}) for p in doc["services"]["gateway"]["ports"]] == ["8000:8000"]
    assert [interpolate(p, {"KVDIR_GATEWAY_PUBLISH": "127.0.0.1:9"}) for p in doc["services"]["gateway"]["ports"]] == [
        "127.0.0.1:9:8000"
    ]
    published = [n for n, s in doc["services"].items() if s.get("ports")]
    assert published == ["gateway"]  # nothing else is reachable from outside


def _networks(svc: dict) -> dict[str, dict]:
    """A service's networks as name -> settings, from either compose form (list or mapping)."""
    nets = svc.get("networks") or {}
    return {n: {} for n in nets} if isinstance(nets, list) else {n: cfg or {} for n, cfg in nets.items()}


def test_transfer_traffic_stays_on_a_private_network_between_workers(services, doc) -> None:
    """Whoever reaches a transfer port can read and overwrite KV memory: only workers may reach them (issue #12, item 3).

    Each worker's transfer host is an alias it has on one internal network that only workers join; nothing
    resolves that name on the network the gateway and the replicas share. (Mooncake binds all interfaces;
    the worker confines its ports to connections addressed to the transfer host, so this is what decides
    who can connect.)
    """
    workers = sorted(n for n, (role, _, _) in services.items() if role == "worker")
    hosts = {n: services[n][2]["KVDIR_TRANSFER_HOST"] for n in workers}
    assert len(set(hosts.values())) == len(workers)
    on = {n: _networks(svc) for n, svc in doc["services"].items()}
    homes = {net for n in workers for net, cfg in on[n].items() if hosts[n] in cfg.get("aliases", [])}
    assert len(homes) == 1, homes  # every worker's transfer host names it on the same network, and on one only
    private = homes.pop()
    assert doc["networks"][private].get("internal") is True
    assert {n for n, nets in on.items() if private in nets} == set(workers)
    names_elsewhere = (
        set(doc["services"])
        | {svc.get("hostname") for svc in doc["services"].values()}
        | {alias for nets in on.values() for net, cfg in nets.items() if net != private for alias in cfg.get("aliases", [])}
    )
    assert not names_elsewhere & set(hosts.values())
    gateway = [n for n, (role, _, _) in services.items() if role == "gateway"]
    assert gateway and all(private not in on[n] for n in gateway)
    assert all(not doc["services"][n].get("ports") for n in workers)  # no transfer (or API) port is published


def test_dockerfile_essentials() -> None:
    text = (ROOT / "Dockerfile").read_text()
    # The Mooncake transfer engine's libraries (without libnuma1 and libcurl4 every worker crash-looped), and the
    # build-time ldd check that fails on any other missing one (make test-compose proves the image runs).
    assert all(lib in text for lib in ("libibverbs1", "libnuma1", "libcurl4")) and "not found" in text
    assert "\nUSER kvdir" in text and "useradd" in text
    assert "HEALTHCHECK" in text and '"kvdir", "health"' in text
    assert 'ENTRYPOINT ["kvdir"]' in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
    # make test-vllm's environment (3.6 GB) once went to the Docker daemon with every service's build.
    assert ".venv-*" in ignored and (ROOT / "Makefile").read_text().count(".venv-vllm") >= 1
    # Every package the project installs is copied into the image (kvtransfer/ once was not: every worker
    # crashed at import, and only make test-compose noticed).
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = sorted(p.rstrip("*") for p in include)
    assert [p for p in packages if f"\nCOPY {p} /src/{p}\n" not in text] == []


def test_vllm_override_adapters_pass_check_config(tmp_path) -> None:
    stand_in = tmp_path / "s"
    stand_in.write_text("x")
    services = compose_services(ROOT / "deploy" / "docker-compose.vllm.yml", stand_in)
    assert {role for role, _, _ in services.values()} == {"events"}
    for name, (role, args, env) in services.items():
        assert check(role, args, env) == [], name
        assert env["KVDIR_BIND"] == "true"  # vLLM connects its PUB socket to a non-wildcard endpoint
        assert env["KVDIR_BLOCK_SIZE"] == "16"
    # vLLM's CPU build needs block size 32: one variable sets it for the engine and its adapter, which registers
    # it; the gateway learns it from the registration, and reads the model's own tokenizer files and template.
    cpu = compose_services(ROOT / "deploy" / "docker-compose.vllm.yml", stand_in, {"KVDIR_VLLM_BLOCK_SIZE": "32"})
    assert cpu["vllm1-events"][2]["KVDIR_BLOCK_SIZE"] == "32"
    doc = yaml.safe_load((ROOT / "deploy" / "docker-compose.vllm.yml").read_text())
    gateway = doc["services"]["gateway"]["environment"]
    assert "KVDIR_BLOCK_SIZE" not in gateway
    assert interpolate(gateway["KVDIR_TOKENIZER"], {"KVDIR_VLLM_MODEL": "m"}) == "/models/m"
    sizes = {
        "engine": doc["services"]["vllm1"]["command"].split("--block-size ")[1].split()[0],
        "adapter": doc["services"]["vllm1-events"]["environment"]["KVDIR_BLOCK_SIZE"],
    }
    assert {k: interpolate(v, {"KVDIR_VLLM_BLOCK_SIZE": "32"}) for k, v in sizes.items()} == dict.fromkeys(sizes, "32")
    assert "deploy" not in doc["services"]["vllm1"]  # the GPU reservation lives in deploy/docker-compose.gpu.yml
    # The adapter hashes under the model name requests use (the KV identity, docs/protocol.md §1.1): vLLM's served name.
    served = doc["services"]["vllm1"]["command"].split("--served-model-name ")[1].split()[0]
    model = doc["services"]["vllm1-events"]["environment"]["KVDIR_MODEL"]
    assert interpolate(served, {"KVDIR_VLLM_MODEL": "m"}) == interpolate(model, {"KVDIR_VLLM_MODEL": "m"}) == "m"


def test_compose_interpolation_as_compose_does_it() -> None:
    env = {"SET": "v", "EMPTY": ""}
    assert interpolate("${SET}|${UNSET}|${UNSET:-d}|${EMPTY:-d}|${EMPTY-d}|${UNSET-d}|$$SET", env) == "v||d|d||d|$SET"


def _mounted_secret(doc: dict, name: str, variable: str) -> str:
    """The compose secret a service's setting names, checked to be declared and mounted by that service."""
    svc = doc["services"][name]
    secret = svc["environment"][variable].removeprefix("/run/secrets/")
    assert secret in doc["secrets"] and secret in svc.get("secrets", []), (name, variable)
    return secret


def test_secrets_are_wired(services, doc) -> None:
    """Auth is on in compose: every replica reads the tokens file, every client its own token file."""
    files = {}
    for name, (role, _, _env) in services.items():
        if role == "directory":
            assert _mounted_secret(doc, name, "KVDIR_AUTH_TOKENS_FILE") == "auth_tokens"
            assert _mounted_secret(doc, name, "KVDIR_RAFT_PASSWORD_FILE") == "raft_password"
        else:
            secret = _mounted_secret(doc, name, "KVDIR_DIRECTORY_TOKEN_FILE")
            files[name] = doc["secrets"][secret]["file"]
    # One token file per worker, named after its node id (generate.sh writes engine:NODE_ID:TOKEN for each).
    for name, (role, _, env) in services.items():
        if role == "worker":
            assert files[name] == f"./deploy/secrets/{env['KVDIR_NODE_ID']}.token"
    assert files["gateway"] == "./deploy/secrets/gateway.token"
    assert len(set(files.values())) == len(files)
    # Every secret file has an example beside it, and the real ones are git-ignored.
    ignored = (ROOT / ".gitignore").read_text().split()
    for secret in doc["secrets"].values():
        path = ROOT / secret["file"]
        assert path.with_name(path.name + ".example").exists(), path
        assert f"deploy/secrets/{path.name}" in ignored or "deploy/secrets/*" + path.suffix in ignored, path
    assert compose_auth_problems(services) == []


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]"])
def test_kvdir_up_refuses_a_wildcard_host(host: str) -> None:
    from pydantic import ValidationError

    from kvdir.launcher import UpSettings

    with pytest.raises(ValidationError, match="not the wildcard"):
        UpSettings(host=host)
