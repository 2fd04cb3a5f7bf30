"""The attacks of `kvdir bench attacks` that need tokens and tenants: one replica with a tokens file that confines
engine and gateway tokens to tenants `acme` and `bravo`, a wildcard engine token and an admin token.

- *origin hijack*: acme's worker stub serves at its origin; bravo's confined engine token lists the nodes,
  registers a node of its own at acme's origin with an idle load, and bravo's gateway is sent completions.
  Reported: how many of acme's nodes bravo's token sees, the hijacking registration's status, the engines
  bravo's gateway routes to, and how many of bravo's requests acme's engine served;
- *registration flood*: the wildcard engine token registers nodes of 2,048 ranks, each rank with its own
  2,000-character transfer URL and a 256-character rkey (about 5 MB each). Reported: the statuses, what the
  replica holds for them and its memory growth; then what one poll of `GET /v1/nodes` costs with 20 of the
  largest registrations an engine makes (an 80-layer model at TP 8 with a host tier: 1,296 regions, 8
  sessions), first and unchanged (sent with the first answer's ETag, where there is one).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvdir.local_cluster import Cluster, Gateway, Workers, free_ports
from kvtools.bench.proc import cpu_s, rss_mib

_TOKENS = {
    "acme_engine": ("engine@acme", "worker-*"),
    "bravo_engine": ("engine@bravo", "bravo-*"),
    "bravo_gateway": ("gateway@bravo", "*"),
    "wildcard_engine": ("engine", "flood-*"),
    "admin": ("admin", "*"),
}


@dataclass(frozen=True)
class Tenanted:
    """A replica with confined tokens, and each token's file."""

    cluster: Cluster
    tmp: Path
    files: dict[str, Path]

    @property
    def url(self) -> str:
        return self.cluster.replica_urls[0]

    def headers(self, who: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.files[who].read_text().strip()}"}


@contextmanager
def tenanted(tmp: Path) -> Iterator[Tenanted]:
    """One replica with the tokens above and a tenant secret; stopped at exit."""
    files = {name: tmp / f"{name}.token" for name in _TOKENS}
    lines = []
    for name, (role, pattern) in _TOKENS.items():
        token = f"bench-{name.replace('_', '-')}-token"
        files[name].write_text(token + "\n")
        lines.append(f"{role}:{pattern}:{token}")
    (tmp / "tokens").write_text("\n".join(lines) + "\n")
    (tmp / "tenant_secret").write_text("bench-attacks-tenant-secret\n")
    (tmp / "replica").mkdir()
    http, raft = free_ports(2)
    c = Cluster(
        tmp / "replica",
        [http],
        [raft],
        lease_ttl_s=300,
        token=files["admin"].read_text().strip(),
        extra_args=("--auth-tokens-file", str(tmp / "tokens"), "--tenant-secret-file", str(tmp / "tenant_secret")),
    )
    try:
        c.start()
        c.wait_ready(60)
        yield Tenanted(c, tmp, files)
    finally:
        c.stop()


def _served(worker_url: str) -> float:
    """Completions a worker stub has served, from its /metrics."""
    total = 0.0
    for line in httpx.get(worker_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvdir_worker_requests_total{") and "completions" in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def origin_hijack(t: Tenanted, requests: int = 10, wait_s: float = 10.0) -> dict[str, Any]:
    ports = free_ports(2)
    (t.tmp / "acme-worker").mkdir()
    acme = Workers(t.tmp / "acme-worker", ports[:1], [t.url], token_files={"worker-1": t.files["acme_engine"]})
    gateway: Gateway | None = None
    out: dict[str, Any] = {}
    try:
        acme.start()
        acme.wait_ready(60)
        target = acme.urls[0]
        with httpx.Client(timeout=10) as http:
            listed = http.get(t.url + "/v1/nodes", headers=t.headers("bravo_engine"))
            nodes = listed.json().get("nodes", []) if listed.status_code == 200 else []
            out["acme_nodes_bravo_sees"] = sum(n.get("tenant") == "acme" for n in nodes)
            out["acme_origins_bravo_sees"] = sum(n.get("tenant") == "acme" and bool(n.get("api_url")) for n in nodes)
            # The attacker needs only the origin, which it may know or guess whether or not the list shows it.
            reg = http.post(
                t.url + "/v1/nodes",
                json={"node_id": "bravo-1", "api_url": target, "models": ["kvdir-stub"]},
                headers=t.headers("bravo_engine"),
            )
            out["hijack_registration_status"] = reg.status_code
            if reg.status_code == 200:
                beat = {"epoch": reg.json()["epoch"], "load": {"running": 0.0, "waiting": 0.0}}
                http.post(t.url + "/v1/nodes/bravo-1/heartbeat", json=beat, headers=t.headers("bravo_engine"))
            (t.tmp / "bravo-gateway").mkdir()
            gateway = Gateway(
                t.tmp / "bravo-gateway",
                ports[1],
                [t.url],
                token_file=t.files["bravo_gateway"],
                extra_args=("--tenant", "bravo"),
            )
            # Bravo's gateway routes only to engines of its tenant: with the hijack refused it knows none, so the
            # wait is bounded rather than a readiness check.
            engines, end = -1, time.monotonic() + wait_s
            while time.monotonic() < end:
                try:
                    engines = http.get(gateway.url + "/health", timeout=1).json().get("engines", -1)
                except (httpx.HTTPError, ValueError):
                    engines = -1
                if engines >= 1:
                    break
                time.sleep(0.1)
            out["bravo_gateway_engines"] = engines
            before = _served(target)
            statuses: dict[str, int] = {}
            for i in range(requests):
                body = {"model": "kvdir-stub", "prompt": f"bravo's private prompt number {i}", "max_tokens": 4}
                code = str(http.post(gateway.url + "/v1/completions", json=body, timeout=30).status_code)
                statuses[code] = statuses.get(code, 0) + 1
            out.update(
                bravo_requests=requests,
                bravo_statuses=statuses,
                bravo_requests_acme_engine_served=_served(target) - before,
            )
        return out
    finally:
        if gateway is not None:
            gateway.stop()
        acme.stop()


def _big_registration(node_id: str, ranks: int, url_chars: int, rkey_chars: int) -> dict[str, Any]:
    regions = [
        {
            "rank": r,
            "base_addr": 1 << 32,
            "length": 1 << 30,
            "block_bytes": 1 << 16,
            "rkey": f"{r:0{rkey_chars}d}",
            "transfer_url": f"tcp://127.0.0.1:{20000 + r}/" + "x" * (url_chars - 27),
        }
        for r in range(ranks)
    ]
    return {"node_id": node_id, "api_url": "http://127.0.0.1:9", "transfer_url": "tcp://127.0.0.1:9", "regions": regions}


def registration_flood(t: Tenanted, nodes: int = 4, ranks: int = 2048) -> dict[str, Any]:
    pid = t.cluster.procs[0].pid  # type: ignore[union-attr]
    headers = t.headers("wildcard_engine")
    bodies = [json.dumps(_big_registration(f"flood-{i}", ranks, 2000, 256)).encode() for i in range(nodes)]
    rss, cpu = rss_mib(pid), cpu_s(pid)
    statuses: dict[str, int] = {}
    with httpx.Client(timeout=120) as http:
        started = time.monotonic()
        for body in bodies:
            r = http.post(t.url + "/v1/nodes", content=body, headers={**headers, "content-type": "application/json"})
            statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1
        took = time.monotonic() - started
        listed = http.get(t.url + "/v1/nodes", headers=headers)
        held = [n for n in listed.json()["nodes"] if n["node_id"].startswith("flood-")]
        out: dict[str, Any] = {
            "registrations": nodes,
            "registration_mib": len(bodies[0]) / 2**20,
            "statuses": statuses,
            "registering_s": took,
            "nodes_held": len(held),
            "regions_held": sum(len(n["regions"]) for n in held),
            "replica_rss_growth_mib": rss_mib(pid) - rss,
            "replica_cpu_s": cpu_s(pid) - cpu,
        }
        for i in range(nodes):
            http.delete(t.url + f"/v1/nodes/flood-{i}", headers=t.headers("admin"))
        out.update(_node_list_polls(t, http, headers))
    return out


def _engine_sized(node_id: str, port: int) -> dict[str, Any]:
    """A registration as the vLLM connector makes for an 80-layer model at TP 8 with a host tier: per rank, a page
    region and a tag region per layer on the device and one host region, each rank behind its own session."""
    regions = [
        {
            "rank": r,
            "layer": layer,
            "base_addr": (1 << 40) + (r << 34) + (layer << 26) + (tag << 25),
            "length": 1 << 24,
            "block_bytes": 1 << 12,
            "rkey": f"{r:08x}{layer:04x}{tag}",
            "transfer_url": f"tcp://127.0.0.1:{port + r}",
        }
        for r in range(8)
        for layer in range(80)
        for tag in (0, 1)
    ]
    regions += [
        {
            "rank": r,
            "base_addr": 1 << 50,
            "length": 1 << 30,
            "block_bytes": 1 << 16,
            "medium": "host",
            "transfer_url": f"tcp://127.0.0.1:{port + r}",
        }
        for r in range(8)
    ]
    return {
        "node_id": node_id,
        "api_url": f"http://127.0.0.1:{port}",
        "transfer_url": f"tcp://127.0.0.1:{port}",
        "regions": regions,
    }


def _node_list_polls(t: Tenanted, http: httpx.Client, headers: dict[str, str], nodes: int = 20) -> dict[str, Any]:
    """What polling the node list costs with `nodes` engine-sized registrations: the least of 5 full answers and
    their size, and an unchanged poll naming the ETag."""
    bodies = [_engine_sized(f"flood-engine-{i}", 21000 + 10 * i) for i in range(nodes)]
    statuses = [http.post(t.url + "/v1/nodes", json=b, headers=headers).status_code for b in bodies]
    polls = []
    for _ in range(5):
        started = time.monotonic()
        r = http.get(t.url + "/v1/nodes", headers=headers)
        polls.append((time.monotonic() - started, len(r.content)))
    out: dict[str, Any] = {
        "engine_sized_nodes": nodes,
        "engine_sized_statuses": sorted(set(statuses)),
        "engine_sized_registration_kib": len(json.dumps(bodies[0])) / 1024,
        "node_list_poll_s": min(p[0] for p in polls),
        "node_list_mib": polls[0][1] / 2**20,
    }
    etag = r.headers.get("etag")
    out["node_list_etag"] = etag is not None
    if etag is not None:
        started = time.monotonic()
        again = http.get(t.url + "/v1/nodes", headers={**headers, "if-none-match": etag})
        out.update(
            unchanged_poll_status=again.status_code,
            unchanged_poll_s=time.monotonic() - started,
            unchanged_poll_bytes=len(again.content),
        )
    for b in bodies:
        http.delete(t.url + f"/v1/nodes/{b['node_id']}", headers=t.headers("admin"))
    return out
