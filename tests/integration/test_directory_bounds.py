"""Issue #12, items 4 (api_url), 6 and 7 against real replicas: oversized bodies are refused without
stalling Raft, a node's API URL is an origin only, and re-registrations cannot grow a replica's memory
or disk without bound."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvdir.local_cluster import Cluster
from tests.support.cluster import leader_index

JSON = {"content-type": "application/json"}


def _register(url: str, node_id: str, **extra) -> int:
    r = httpx.post(url + "/v1/nodes", json={"node_id": node_id, "api_url": "http://127.0.0.1:9", **extra}, timeout=30)
    assert r.status_code == 200, r.text[:300]
    return r.json()["epoch"]


def _terms(c: Cluster) -> list[int]:
    return [httpx.get(u + "/v1/cluster", timeout=10).json()["term"] for u in c.replica_urls]


def _oversized(epoch: int) -> list[tuple[str, bytes]]:
    """Bodies under the 8 MiB body limit but far over the count limits (each about 7 MiB)."""
    blocks = b",".join(b'{"hash":%d,"slot":1}' % (1000 + i) for i in range(300_000))
    hashes = b"1234," * 1_500_000 + b"1"
    regions = b'{"rank":0,"base_addr":0,"length":1,"block_bytes":1},' * 140_000 + b"{}"
    load = b",".join(b'"l%d":1' % i for i in range(700_000))
    return [
        ("/v1/blocks", b'{"node_id":"n1","epoch":%d,"blocks":[%s]}' % (epoch, blocks)),
        ("/v1/blocks/remove", b'{"node_id":"n1","epoch":%d,"hashes":[%s]}' % (epoch, hashes)),
        ("/v1/lookup", b'{"hashes":[%s]}' % hashes),
        ("/v1/lookup", b'{"tokens":[%s],"block_size":65536}' % hashes),
        ("/v1/nodes", b'{"node_id":"n2","api_url":"http://127.0.0.1:9","regions":[%s]}' % regions),
        ("/v1/nodes/n1/heartbeat", b'{"epoch":%d,"load":{%s}}' % (epoch, load)),
    ]


def test_oversized_bodies_are_refused_without_an_election(make_cluster) -> None:
    """8 concurrent oversized bodies of each kind to the leader: each a 4xx, no replica's term moves.
    (Before: pydantic validated every element first (3 s of CPU for a 7 MiB publish of 400,000 blocks) holding the GIL,
    and the leader's followers stopped hearing from it.)"""
    c = make_cluster(3, lease_ttl_s=300)
    url = c.replica_urls[leader_index(c)]
    epoch = _register(url, "n1")
    bodies = _oversized(epoch)
    for _, body in bodies:
        assert 6 << 20 < len(body) < 8 << 20
    terms = _terms(c)

    def send(job: tuple[str, bytes]) -> tuple[str, int, str, float]:
        path, body = job
        t0 = time.monotonic()
        r = httpx.post(url + path, content=body, headers=JSON, timeout=120)
        return path, r.status_code, r.text[:200], time.monotonic() - t0

    with ThreadPoolExecutor(8 * len(bodies)) as pool:
        answers = list(pool.map(send, [job for job in bodies for _ in range(8)]))
    for path, status, text, _ in answers:
        assert status == 422 and '"too_many"' in text, (path, status, text)
    # An election started during a stall would already show; watch a whole election timeout more.
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        assert _terms(c) == terms, "an oversized request stalled Raft into an election"
        time.sleep(0.1)
    slowest = max(a[3] for a in answers)
    print(f"\n{len(answers)} oversized bodies refused, slowest answer {slowest:.2f} s, terms {terms} unchanged")


@pytest.fixture(scope="module")
def replica(tmp_path_factory) -> str:
    from kvdir.local_cluster import free_ports

    ports = free_ports(2)
    c = Cluster(
        tmp_path_factory.mktemp("bounds"),
        ports[:1],
        ports[1:],
        lease_ttl_s=300,
        log_level="info",
        extra_args=["--max-regions-per-node", "8", "--max-tokens-per-lookup", "1000"],
    )
    try:
        c.start()
        c.wait_ready(60)
        yield c.replica_urls[0]
    finally:
        c.stop()


BAD_API_URLS = [
    "http://127.0.0.1:47900/internal/admin/action?x=",  # the hijack of issue #12
    "http://127.0.0.1:9/v1",
    "http://127.0.0.1:9//",
    "http://127.0.0.1:9?x=1",
    "http://127.0.0.1:9#f",
    "http://user:pw@127.0.0.1:9",
    "http://evil@127.0.0.1",
    "ftp://127.0.0.1",
    "127.0.0.1:9",
    "x",
    "http://",
    "http://127.0.0.1:99999",
    "http://127.0.0.1:0",
    "http://127.0.0.1:",
    "http://127.0.0.1:9 ",
    "http://a b",
    "http://127.0.0.1:9\n",
    "javascript://x",
    "http://" + "a" * 300,
]


@pytest.mark.parametrize("api_url", BAD_API_URLS)
def test_api_url_is_an_origin_only(replica: str, api_url: str) -> None:
    r = httpx.post(replica + "/v1/nodes", json={"node_id": "hijack", "api_url": api_url}, timeout=10)
    assert r.status_code == 422, (api_url, r.text[:300])
    assert r.json()["error"] == "invalid_request" and "api_url" in r.json()["detail"], r.text[:300]


@pytest.mark.parametrize(
    "api_url,stored",
    [
        ("http://127.0.0.1:9", "http://127.0.0.1:9"),
        ("http://127.0.0.1:9/", "http://127.0.0.1:9"),
        ("https://engine-3.internal", "https://engine-3.internal"),
        ("HTTP://[::1]:8000/", "http://[::1]:8000"),
    ],
)
def test_plain_origins_are_accepted_and_normalised(replica: str, api_url: str, stored: str) -> None:
    _register(replica, "origin", api_url=api_url)
    assert httpx.get(replica + "/v1/nodes/origin", timeout=10).json()["api_url"] == stored


@pytest.mark.parametrize(
    "path,body,status,error",
    [
        (
            "/v1/nodes",
            {
                "node_id": "r",
                "api_url": "http://x",
                "regions": [{"rank": i, "base_addr": 0, "length": 1, "block_bytes": 1} for i in range(9)],
            },
            422,
            "too_many",
        ),
        (
            "/v1/nodes",
            {
                "node_id": "r",
                "api_url": "http://x",
                "regions": [{"rank": 0, "base_addr": 0, "length": 1, "block_bytes": 1, "rkey": "k" * 257}],
            },
            422,
            "invalid_request",
        ),
        (
            "/v1/nodes",
            {"node_id": "r", "api_url": "http://x", "regions": [{"rank": 0, "base_addr": 2**64, "length": 1, "block_bytes": 1}]},
            422,
            "invalid_request",
        ),
        ("/v1/nodes", {"node_id": "n" * 129, "api_url": "http://x"}, 422, "invalid_request"),
        ("/v1/nodes", {"node_id": "n1\n", "api_url": "http://x"}, 422, "invalid_request"),
        ("/v1/nodes", {"node_id": "r", "api_url": "http://x", "incarnation": "i" * 129}, 422, "invalid_request"),
        ("/v1/nodes", {"node_id": "r", "api_url": "http://x", "transfer_url": "t" * 2049}, 422, "invalid_request"),
        ("/v1/nodes/r/heartbeat", {"epoch": 1, "load": {f"l{i}": 1.0 for i in range(65)}}, 422, "too_many"),
        ("/v1/lookup", {"tokens": [1] * 1001, "block_size": 1000}, 422, "too_many"),
        ("/v1/lookup", {"hashes": [2**64]}, 422, "invalid_request"),
        ("/v1/lookup", {"hashes": [1], "tenant": "t\n"}, 422, "invalid_request"),
    ],
)
def test_field_and_count_limits(replica: str, path: str, body: dict, status: int, error: str) -> None:
    r = httpx.post(replica + path, json=body, timeout=10)
    assert r.status_code == status and r.json()["error"] == error, r.text[:300]
    assert r.json()["detail"]


@pytest.mark.parametrize(
    "path,body,status",
    [
        ("/v1/lookup", b'{"hashes": [1' + b"0" * 5000 + b"]}", 422),  # a valid JSON number, out of the u64 range
        ("/v1/nodes/r/heartbeat", b'{"epoch": 1, "load": {"running": 1e999}}', 422),  # decodes to infinity
        ("/v1/nodes/r/heartbeat", b'{"epoch": 1, "load": {"running": NaN}}', 400),  # not JSON
        ("/v1/blocks", b"[1, 2, 3]", 422),
        ("/v1/blocks", b"[1, 2", 400),
        ("/v1/blocks/clear", b"", 400),
    ],
)
def test_raw_bodies(replica: str, path: str, body: bytes, status: int) -> None:
    r = httpx.post(replica + path, content=body, headers=JSON, timeout=10)
    assert r.status_code == status, r.text[:300]


def test_openapi_documents_the_request_bodies(replica: str) -> None:
    spec = httpx.get(replica + "/openapi.json", timeout=10).json()
    body = spec["paths"]["/v1/blocks"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/PublishRequest"}
    blocks = spec["components"]["schemas"]["PublishRequest"]["properties"]["blocks"]
    assert blocks["items"] == {"$ref": "#/components/schemas/BlockRef"}
    assert spec["components"]["schemas"]["BlockRef"]["properties"]["hash"]["maximum"] == 2**64 - 1


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _disk_mib(path: Path) -> float:
    """Allocated size of everything under `path` (what `du` reports: the journal file is sparse)."""
    return sum(os.stat(Path(d) / f).st_blocks * 512 for d, _, files in os.walk(path) for f in files) / 2**20


@pytest.mark.scale  # 77 MB through Raft: 13 s of a replica's CPU, `make test-scale` (run by .ci/run)
def test_reregistrations_keep_memory_and_disk_bounded(make_cluster) -> None:
    """1,000 re-registrations of one node with the most regions allowed (256, each with a distinct
    256-character rkey: ~77 KB a Raft entry, 77 MB in all) leave each replica's RSS and data
    directory bounded: the state holds one registration, and the Raft log is compacted by size.
    (Before: 40 re-registrations with 4,096 regions added 100-115 MB RSS and 46 MB of disk.)"""
    c = make_cluster(3, lease_ttl_s=300)
    url = c.replica_urls[leader_index(c)]
    _register(url, "churn")
    before = [(_rss_mib(p.pid), _disk_mib(c.data_dir / f"replica{i + 1}")) for i, p in enumerate(c.procs) if p is not None]
    with httpx.Client(timeout=30) as http:
        for k in range(1000):
            regions = [
                {
                    "rank": r,
                    "base_addr": r << 32,
                    "length": 1 << 30,
                    "block_bytes": 16384,
                    "rkey": f"{k:04d}-{r:03d}-" + "k" * 247,
                }
                for r in range(256)
            ]
            r = http.post(
                url + "/v1/nodes",
                json={"node_id": "churn", "api_url": "http://127.0.0.1:9", "regions": regions, "incarnation": f"start-{k}"},
            )
            assert r.status_code == 200, r.text[:300]
    nodes = httpx.get(url + "/v1/nodes", timeout=10).json()["nodes"]
    assert [n["node_id"] for n in nodes] == ["churn"] and nodes[0]["regions"][0]["rkey"].startswith("0999-")
    after = [(_rss_mib(p.pid), _disk_mib(c.data_dir / f"replica{i + 1}")) for i, p in enumerate(c.procs) if p is not None]
    growth = [(round(a[0] - b[0]), round(a[1] - b[1])) for a, b in zip(after, before)]
    print(f"\nper replica (RSS MiB, disk MiB) before {before}, after {after}")
    for rss, disk in growth:
        assert rss < 80 and disk < 64, f"re-registrations grew replicas by (RSS MiB, disk MiB) {growth}"
