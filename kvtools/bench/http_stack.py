"""The CPU the gateway's HTTP stack costs per request before any routing work: its floor.

The gateway receives each request through uvicorn and forwards it with its own keep-alive client
(gateway.upstream). Each side is measured alone against a bare asyncio peer in another process (which
answers or sends fixed bytes and costs its side next to nothing), as CPU per request of the measured
process:

* ``upstream_forward_us``: a POST of a 90-byte body, read whole, over one pooled keep-alive
  connection of the gateway's `Upstream`: its forward;
* ``httpcore_forward_us``: the same through an ``httpcore.AsyncConnectionPool`` with the limits the gateway
  used it with, and ``httpx_forward_us`` through an ``httpx.AsyncClient``, the two clients the gateway's forward
  was measured against, for comparison;
* ``asyncio_forward_us``: the same exchange with the benches' own minimal HTTP/1.1 client on
  asyncio streams (`kvtools.bench.loadgen.Conn`), about the least any client in Python costs;
* ``fastapi_inbound_us``: uvicorn (uvloop, httptools) + a FastAPI route that reads the body,
  parses it and answers 200 bytes: the gateway's inbound side, minus its own work.

``http_stack_floor_us``, the sum of the gateway's forward and a FastAPI route's inbound side, is what a
gateway built that way spends per request on this machine, whatever it does in between.

`floor_proxy` is the old floor in latency, kept as the fixed yardstick of `kvdir bench gateway`'s
figures (BENCHMARKS.md compares against it throughout): a proxy that does nothing but receive through uvicorn +
FastAPI and forward through httpcore, measured next to the gateway against the same worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpcore
import httpx

from gateway.upstream import Timeouts, Upstream
from kvdir.local_cluster import free_ports
from kvproto.schemas import parse_origin
from kvtools.bench.loadgen import Conn
from kvtools.bench.proc import cpu_s

PATH = "/v1/completions"
BODY = b'{"model":"m","prompt":"' + b"a" * 64 + b'","max_tokens":1}'
ANSWER = b"x" * 200
RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER)

# The inbound side: a route shaped like the gateway's (read the body, parse it, answer with headers of its own).
_APP = """
import json
from fastapi import FastAPI, Request
from fastapi.responses import Response
app = FastAPI()
@app.post("/v1/completions")
async def completions(request: Request) -> Response:
    json.loads(await request.body())
    return Response(b"x" * 200, media_type="application/json", headers={"x-kvdir-node": "w", "x-kvdir-decision": "d"})
"""

# The latency floor: the inbound route above plus the gateway's forward (httpcore, its limits, a response read whole).
_PROXY_APP = """
import json, os
import httpcore
from fastapi import FastAPI, Request
from fastapi.responses import Response
UPSTREAM = httpcore.URL(os.environ["KVDIR_BENCH_UPSTREAM"] + "/v1/completions")
HOST = UPSTREAM.host + b":%d" % UPSTREAM.port
TIMEOUT = {"timeout": {"connect": 2.0, "read": 600.0, "write": 600.0, "pool": 600.0}}
app = FastAPI()
pool = httpcore.AsyncConnectionPool(max_connections=512, max_keepalive_connections=32)
@app.post("/v1/completions")
async def completions(request: Request) -> Response:
    body = await request.body()
    json.loads(body)
    headers = [(b"host", HOST), (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    upstream = await pool.handle_async_request(httpcore.Request(b"POST", UPSTREAM, headers=headers, content=body, extensions=TIMEOUT))
    content = await upstream.aread()
    await upstream.aclose()
    return Response(content, status_code=upstream.status, media_type="application/json", headers={"x-kvdir-node": "w"})
"""

# The lean floor: what the gateway's completion routes run on (uvicorn, an ASGI callable ahead of any framework,
# the gateway's own forward client), doing nothing but forward.
_LEAN_PROXY_APP = """
import json, os
from gateway.upstream import Timeouts, Upstream
from kvproto.schemas import parse_origin
ORIGIN = parse_origin(os.environ["KVDIR_BENCH_UPSTREAM"])
TIMEOUTS = Timeouts(connect_s=2.0, read_s=600.0)
upstream = Upstream()
async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await upstream.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    json.loads(body)
    answer = await upstream.post(ORIGIN, "/v1/completions", [(b"content-type", b"application/json")], body, TIMEOUTS)
    content = await answer.aread()
    await answer.aclose()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(content)), (b"x-kvdir-node", b"w")]
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": content})
"""

_SERVER = (
    f"RESPONSE = {RESPONSE!r}\n"
    + """
import asyncio, sys, uvloop
async def handle(r, w):
    try:
        while True:
            head = await r.readuntil(b"\\r\\n\\r\\n")
            n = next((int(x.split(b":")[1]) for x in head.split(b"\\r\\n") if x.lower().startswith(b"content-length:")), 0)
            await r.readexactly(n)
            w.write(RESPONSE)
    except (asyncio.IncompleteReadError, ConnectionError):
        w.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    async with server:
        await server.serve_forever()
uvloop.run(main())
"""
)


def _cpu_self() -> float:
    """This process's CPU seconds, to the microsecond (/proc counts in 10 ms ticks: too coarse for the asyncio loop)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _wait_listening(port: int, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while True:
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return
        except OSError:
            if time.monotonic() > end:
                raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {deadline_s:.0f} s") from None
            await asyncio.sleep(0.05)


async def _per_request_us(exchange: Callable[[], Awaitable[object]], n: int, cpu: Callable[[], float] = _cpu_self) -> float:
    """CPU µs per `exchange` (of this process, or of the process `cpu` reads), after n/10 to warm the connection
    and the code paths."""
    for _ in range(n // 10):
        await exchange()
    c0 = cpu()
    for _ in range(n):
        await exchange()
    return (cpu() - c0) / n * 1e6


async def _clients(port: int, n: int) -> dict[str, float]:
    """CPU per request of this process as the gateway's client, an httpcore, an httpx and a bare asyncio client."""
    await _wait_listening(port)
    url = f"http://127.0.0.1:{port}"
    out: dict[str, float] = {}
    upstream, origin, timeouts = Upstream(), parse_origin(url), Timeouts(connect_s=2.0, read_s=600.0)

    async def with_upstream() -> None:
        response = await upstream.post(origin, PATH, [(b"content-type", b"application/json")], BODY, timeouts)
        await response.aread()
        await response.aclose()

    try:
        out["upstream_forward_us"] = await _per_request_us(with_upstream, n)
    finally:
        await upstream.aclose()
    async with httpcore.AsyncConnectionPool(max_connections=512, max_keepalive_connections=32) as pool:  # the gateway's
        target = httpcore.URL(url + PATH)
        headers = [
            (b"host", b"127.0.0.1:%d" % port),
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(BODY)),
        ]

        async def with_httpcore() -> None:
            response = await pool.handle_async_request(httpcore.Request(b"POST", target, headers=headers, content=BODY))
            await response.aread()
            await response.aclose()

        out["httpcore_forward_us"] = await _per_request_us(with_httpcore, n)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=512, max_keepalive_connections=32)) as http:

        async def with_httpx() -> None:
            request = http.build_request("POST", url + PATH, content=BODY, headers={"content-type": "application/json"})
            response = await http.send(request, stream=True)
            await response.aread()
            await response.aclose()

        out["httpx_forward_us"] = await _per_request_us(with_httpx, n)
    conn = Conn(url)
    try:
        out["asyncio_forward_us"] = await _per_request_us(lambda: conn.post(PATH, BODY), n)
    finally:
        conn.close()
    return out


async def _inbound(port: int, pid: int, n: int) -> float:
    """CPU per request of the uvicorn + FastAPI process `pid`, driven by a bare asyncio client."""
    await _wait_listening(port)
    conn = Conn(f"http://127.0.0.1:{port}")
    try:
        return await _per_request_us(lambda: conn.post(PATH, BODY), n, lambda: cpu_s(pid))
    finally:
        conn.close()


def _uvicorn(app_dir: str, module: str, port: int, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`module:app` served the way the gateway serves itself (uvloop, httptools, no access log)."""
    return subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--app-dir", app_dir, f"{module}:app", "--port", str(port)]
        + ["--host", "127.0.0.1", "--loop", "uvloop", "--http", "httptools", "--no-access-log", "--log-level", "warning"],
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **(env or {})},
    )


@contextlib.contextmanager
def floor_proxy(upstream: str, port: int, lean: bool = False) -> Iterator[tuple[str, int]]:
    """(URL, pid) of a do-nothing proxy to `upstream`, listening until the block ends: on the old stack (uvicorn,
    FastAPI, httpcore), or `lean`, on the gateway's completion path's (uvicorn, bare ASGI, gateway.upstream)."""
    with tempfile.TemporaryDirectory(prefix="kvdir-bench-proxy-") as tmp:
        (Path(tmp) / "bench_proxy.py").write_text(_LEAN_PROXY_APP if lean else _PROXY_APP)
        proc = _uvicorn(tmp, "bench_proxy", port, {"KVDIR_BENCH_UPSTREAM": upstream})
        try:
            asyncio.run(_wait_listening(port))
            yield f"http://127.0.0.1:{port}", proc.pid
        finally:
            proc.kill()
            proc.wait()


def bench_http_stack(quick: bool) -> dict[str, Any]:
    """The figures in the module docstring; each peer runs in a process of its own, stopped on the way out."""
    n = 1000 if quick else 5000
    server_port, app_port = free_ports(2)
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="kvdir-bench-http-") as tmp:
        (Path(tmp) / "bench_app.py").write_text(_APP)
        try:
            procs.append(subprocess.Popen([sys.executable, "-c", _SERVER, str(server_port)]))
            out = asyncio.run(_clients(server_port, n))
            app = _uvicorn(tmp, "bench_app", app_port)
            procs.append(app)
            out["fastapi_inbound_us"] = asyncio.run(_inbound(app_port, app.pid, n))
        finally:
            for p in procs:
                p.kill()
                p.wait()
    out["http_stack_floor_us"] = out["upstream_forward_us"] + out["fastapi_inbound_us"]
    return out
