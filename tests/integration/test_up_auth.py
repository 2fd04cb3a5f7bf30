"""`kvdir up --auth` end to end: a real launcher process with fresh secrets, every component using its
own token, requests without the right token refused, and no secret on any process's command line."""

from __future__ import annotations

import json
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.launcher import Up
from tests.support.ports import free_base_port, port_free
from tests.support.wait import wait_for

PORTS = (0, 1, 2, 3, 101, 102, 103, 11, 12)  # gateway, replicas' HTTP and Raft, two workers
MESSAGES = [{"role": "system", "content": "Secured clusters still cache. " * 8}, {"role": "user", "content": "Is this cached?"}]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def up(tmp_path: Path) -> Iterator[tuple[Up, int, Path]]:
    base = free_base_port(PORTS)
    data_dir = tmp_path / "up"
    launcher = Up(
        [
            "--auth",
            "--demo",
            "--base-port",
            str(base),
            "--data-dir",
            str(data_dir),
            "--workers",
            "2",
            "--worker-time-scale",
            "0.1",
            "--worker-transfer",
            "tcp",
            "--lease-ttl-s",
            "30",
        ],
        tmp_path / "up.stderr",
    )
    try:
        yield launcher, base, data_dir
    finally:
        launcher.stop()


def test_kvdir_up_with_auth(up: tuple[Up, int, Path], tmp_path: Path) -> None:
    launcher, base, data_dir = up
    stderr = tmp_path / "up.stderr"

    def demo_done() -> bool:
        assert launcher.proc.poll() is None, stderr.read_text()
        return any(line.startswith("demo done") for line in launcher.lines)

    wait_for(demo_done, timeout=150, interval=0.2, what="the demo to finish")
    ready = json.loads(launcher.lines[0])
    assert ready["ready"] is True and ready["gateway"] == f"http://127.0.0.1:{base}"
    # The secrets: fresh files only their owner can read, their paths (never their contents) logged.
    secrets_dir = data_dir / "secrets"
    assert stat.S_IMODE(secrets_dir.stat().st_mode) == 0o700
    files = {p.name: p for p in secrets_dir.iterdir()}
    assert set(files) == {"tokens", "raft_password", "admin.token", "gateway.token", "worker-1.token", "worker-2.token"}
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files.values())
    assert ready["admin_token_file"] == str(files["admin.token"]) and ready["gateway_token_file"] == str(files["gateway.token"])
    token = {name: p.read_text().strip() for name, p in files.items()}
    admin, gateway, engine1 = token["admin.token"], token["gateway.token"], token["worker-1.token"]
    assert len(set(token.values())) == len(token) and all(len(t) >= 40 for t in token.values())
    assert f"engine:worker-1:{engine1}" in token["tokens"].splitlines()  # confined to its own node id
    log = stderr.read_text()
    assert str(files["admin.token"]) in log and str(files["tokens"]) in log
    assert not any(t in log or t in "\n".join(launcher.lines) for t in token.values())

    # The directory refuses requests without a token, and writes with the gateway's or another node's token.
    for url in ready["replicas"]:
        r = httpx.get(url + "/v1/nodes", timeout=5)
        assert r.status_code == 401 and r.json()["error"] == "unauthorized", r.text
    leader = ready["leader"]
    r = httpx.post(leader + "/v1/nodes", json={"node_id": "worker-9", "api_url": "http://127.0.0.1:9"}, headers=bearer(gateway))
    assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
    r = httpx.post(leader + "/v1/nodes", json={"node_id": "worker-2", "api_url": "http://127.0.0.1:9"}, headers=bearer(engine1))
    assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
    nodes = httpx.get(leader + "/v1/nodes", headers=bearer(admin), timeout=5).json()["nodes"]
    assert {n["node_id"] for n in nodes} == {"worker-1", "worker-2"}  # the workers registered with their engine tokens

    # The demo ran with the admin token, and its gateway turns found their cached prefixes.
    out = launcher.lines
    assert any("directory: worker-1 holds all 21 blocks of the prompt" in line for line in out), out
    assert any("gateway, conversation 0 turn 2" in line and ("(affinity)" in line or "(pull)" in line) for line in out), out
    # A chat completion through the gateway; the engine publishes its blocks with its own token.
    r = httpx.post(
        ready["gateway"] + "/v1/chat/completions", json={"model": "kvdir-stub", "messages": MESSAGES, "max_tokens": 4}, timeout=30
    )
    assert r.status_code == 200, r.text
    node, prompt_tokens = r.headers["x-kvdir-node"], r.json()["usage"]["prompt_tokens"]
    tokens = list(
        httpx.post(
            ready["workers"][0] + "/tokenize",
            json={"model": "kvdir-stub", "messages": MESSAGES, "add_generation_prompt": True},
            timeout=5,
        ).json()["tokens"]
    )
    assert len(tokens) == prompt_tokens

    def held() -> dict[str, int]:
        res = httpx.post(
            leader + "/v1/lookup", json={"tokens": tokens, "model": "kvdir-stub"}, headers=bearer(gateway), timeout=5
        ).json()
        return {h["node_id"]: h["matched_blocks"] for h in res["holders"]}

    wait_for(lambda: held().get(node) == prompt_tokens // 16, what=f"{node}'s blocks in the directory")

    # No secret on any command line (`ps` shows those to every user) nor in any environment.
    pids = [launcher.proc.pid, *launcher.children()]
    cmdlines = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0") for pid in pids}
    listening = {
        role: {argv[argv.index("--http") + 1] for argv in cmdlines.values() if role in argv}
        for role in ("directory", "worker", "gateway")
    }  # by address: a forked snapshot writer has its parent's argv
    assert {role: len(addrs) for role, addrs in listening.items()} == {"directory": 3, "worker": 2, "gateway": 1}
    for pid, argv in cmdlines.items():
        blob = "\0".join(argv) + Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        assert not any(t in blob for t in token.values()), argv
        if "directory" in argv:
            assert argv[argv.index("--auth-tokens-file") + 1] == str(files["tokens"])
            assert argv[argv.index("--raft-password-file") + 1] == str(files["raft_password"])
        elif "worker" in argv:
            node_id = argv[argv.index("--node-id") + 1]
            assert argv[argv.index("--directory-token-file") + 1] == str(files[f"{node_id}.token"])
        elif "gateway" in argv:
            assert argv[argv.index("--directory-token-file") + 1] == str(files["gateway.token"])

    # SIGTERM stops everything it started.
    assert launcher.stop() == 0
    assert not any(Path(f"/proc/{pid}").exists() for pid in launcher.started)
    assert all(port_free(base + d) for d in PORTS)
