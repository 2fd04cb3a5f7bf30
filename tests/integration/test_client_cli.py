"""The async client's failover and errors, and the `kvdir` command line, against real processes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys

import pytest

from kvdir.local_cluster import free_ports
from kvproto.client import DirectoryClient
from kvproto.errors import DirectoryUnavailable, InvalidRequestError, StaleEpochError
from tests.support.ports import free_base_port, port_free


def test_client_fails_over_past_dead_replicas(make_cluster) -> None:
    c = make_cluster(3, lease_ttl_s=300)
    dead = f"http://127.0.0.1:{free_ports(1)[0]}"  # nothing listens there

    async def main() -> None:
        async with DirectoryClient([dead, *c.replica_urls], timeout=1.0, deadline=10) as d:
            reg = await d.register("n1", "http://127.0.0.1:9", incarnation="a")
            assert await d.publish("n1", reg.epoch, [(11, 0), (12, 1)]) == 2
            res = await d.lookup([11, 12, 13], with_slots=True)
            assert [(h.node_id, h.matched_blocks, h.slots) for h in res.holders] == [("n1", 2, [0, 1])]
            again = await d.register("n1", "http://127.0.0.1:9", incarnation="b")
            with pytest.raises(StaleEpochError) as info:
                await d.publish("n1", reg.epoch, [(13, 2)])
            assert info.value.status == 409 and info.value.error == "stale_epoch"
            with pytest.raises(InvalidRequestError):
                await d.lookup([2**64])
            assert [n.epoch for n in await d.nodes()] == [again.epoch]
        async with DirectoryClient([dead], timeout=0.2, deadline=0.5) as d:
            with pytest.raises(DirectoryUnavailable):
                await d.nodes()

    asyncio.run(main())


PORTS = (0, 1, 2, 3, 101, 102, 103, 11, 12)  # offsets of the gateway's, the replicas' HTTP and Raft ports and two workers'


def test_kvdir_up_demo_and_exit(tmp_path) -> None:
    base = free_base_port(PORTS)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvdir",
            "up",
            "--demo-and-exit",
            "--base-port",
            str(base),
            "--data-dir",
            str(tmp_path),
            "--workers",
            "2",
            "--worker-time-scale",
            "0.1",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    ready = json.loads(lines[0])
    assert ready["ready"] is True
    assert ready["replicas"] == [f"http://127.0.0.1:{base + i}" for i in (1, 2, 3)]
    assert ready["leader"] in ready["replicas"]
    assert any("21 blocks cached" in line for line in lines), out.stdout
    assert any("its old entries are gone" in line for line in lines), out.stdout
    assert ready["workers"] == [f"http://127.0.0.1:{base + 11}", f"http://127.0.0.1:{base + 12}"]
    assert any("worker-2 pulled 336 tokens of KV from worker-1" in line for line in lines), out.stdout
    # The gateway part: the chats' first turns, with nothing cached anywhere, land on different workers; every
    # later turn reuses its chat's cached prefix, in place or pulled, as predicted. "demo done" ends the output.
    pattern = r"conversation (\d) turn (\d): -> (\S+) \((\w+)\), predicted (\d+) cached, engine reports (\d+) of"
    routed = {(conv, turn): (node, why, int(p), int(r)) for conv, turn, node, why, p, r in re.findall(pattern, out.stdout)}
    assert len(routed) == 6 and routed["0", "1"][0] != routed["1", "1"][0], out.stdout
    assert all(routed[c, "1"][1:] == ("balance", 0, 0) for c in "01"), out.stdout
    later = [routed[c, t] for c in "01" for t in "23"]
    # "inflight" when the gateway's mirror had not applied the last turn's publish yet (the demo waits on a replica)
    # while the gateway still remembered sending that turn there: the same node and prefix, predicted exactly.
    assert all(why in ("affinity", "pull", "inflight") and 0 < p == r for _, why, p, r in later), out.stdout
    assert lines[-1].startswith("demo done"), out.stdout
    # Everything it started is gone: the ports are free again, and the data dir holds each replica's journal.
    assert all(port_free(base + d) for d in PORTS)
    assert all((tmp_path / f"replica{i}" / "raft.journal").exists() for i in (1, 2, 3))


@pytest.mark.parametrize(
    "args,env,message",
    [
        (["directory", "--http", "nonsense"], {}, "--http"),
        (["directory", "--lease-ttl-s", "0"], {}, "--lease-ttl-s"),
        (["directory"], {"KVDIR_PEERS": "a:b"}, "--peers"),
        (["up", "--replicas", "0"], {}, "--replicas"),
    ],
)
def test_bad_settings_exit_2_with_a_message(args, env, message) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvdir", *args], capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )
    assert out.returncode == 2
    assert message in out.stderr


def test_a_role_parses_its_flags_without_importing_the_other_roles() -> None:
    """Every replica, gateway and worker is a `kvdir ROLE` process: what its command line imports is start-up CPU."""
    code = (
        "import sys\n"
        "from kvdir.cli import _parser\n"
        "args = _parser('directory').parse_args(['directory', '--lease-ttl-s', '7'])\n"
        "others = ('gateway', 'worker_stub', 'kvtools', 'kvdir.launcher', 'adapters.subscriber')\n"
        "print(args.lease_ttl_s, sorted(m for m in sys.modules if m.startswith(others)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split(maxsplit=1) == ["7", "[]\n"], out
