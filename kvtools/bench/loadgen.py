"""A lean HTTP load generator for the benchmarks, run in processes of its own.

On a 2-core machine the client competes with the servers for CPU, and httpx
costs about as much per request as the server does. So this speaks minimal
HTTP/1.1 over asyncio streams: one keep-alive connection per coroutine, each
sending its next request when the last is answered, for `duration` seconds.
Publishes go as JSON or as binary batches (`encoding`, docs/protocol.md §3.1).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict
from urllib.parse import urlsplit

import msgspec
import numpy as np


@dataclass
class LoadSpec:
    urls: list[str]
    mode: str  # "publish", "lookup" or "complete"
    duration: float
    concurrency: int
    seed: int
    node_ids: list[str]
    epochs: list[int]
    blocks_per_request: int = 64
    encoding: str = "json"  # of publishes: "json" or "msgpack"
    lookup_queries: list[list[int]] | None = None
    rate: float | None = None  # requests/s over all connections (open loop); None: as fast as answers come


class LoadResult(TypedDict):
    """What a load process returns."""

    latencies: list[float]  # seconds, one per request answered
    errors: int
    items: int


def run_load(spec: LoadSpec) -> LoadResult:
    """Entry point for a load process; returns counts and latencies (seconds)."""
    return asyncio.run(_run(spec))


def load_in_process(spec: LoadSpec, progress: Callable[[float], None] | None = None) -> LoadResult:
    """`run_load(spec)` in a process of its own (spawned: the client must not share this one's CPU or state);
    `progress(seconds since the start)` about twice a second while it runs, for the benches' bars."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        pending = pool.apply_async(run_load, (spec,))
        start = time.monotonic()
        while not pending.ready():
            pending.wait(0.5)
            if progress is not None:
                progress(time.monotonic() - start)
        return pending.get()


class Conn:
    """One keep-alive HTTP/1.1 connection over asyncio streams: POST a body, read the status and the body."""

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes, content_type: str = "application/json") -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        data = await self.reader.readexactly(length)
        return int(status_line.split()[1]), data

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _run(spec: LoadSpec) -> LoadResult:
    rng = random.Random(spec.seed)
    latencies: list[float] = []
    errors = 0
    items = 0
    end = time.monotonic() + spec.duration

    async def one(k: int) -> None:
        nonlocal errors, items
        conn = Conn(spec.urls[k % len(spec.urls)])
        node = k % max(1, len(spec.node_ids))
        slot = k * 1_000_000
        interval = spec.concurrency / spec.rate if spec.rate else 0.0
        next_at = time.monotonic() + interval * k / spec.concurrency
        try:
            while time.monotonic() < end:
                if interval:
                    await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                    next_at += interval
                content_type = "application/json"
                if spec.mode == "publish":
                    n = spec.blocks_per_request
                    path, fields = "/v1/blocks", {"node_id": spec.node_ids[node], "epoch": spec.epochs[node]}
                    if spec.encoding == "msgpack":
                        slots = (np.arange(slot, slot + n, dtype=np.uint64) % 2**32).astype("<u4")
                        payload = msgspec.msgpack.encode({**fields, "hashes": rng.randbytes(8 * n), "slots": slots.tobytes()})
                        content_type = "application/msgpack"
                    else:
                        blocks = [{"hash": rng.getrandbits(64), "slot": (slot + i) % (2**32)} for i in range(n)]
                        payload = json.dumps({**fields, "blocks": blocks}).encode()
                    slot += n
                elif spec.mode == "complete":
                    n = 1
                    prompt = f"request {rng.getrandbits(64)}: " + "x" * 48
                    path = "/v1/completions"
                    payload = json.dumps({"model": "kvdir-stub", "prompt": prompt, "max_tokens": 1}).encode()
                else:
                    assert spec.lookup_queries is not None
                    n = 1
                    path = "/v1/lookup"
                    payload = json.dumps({"hashes": spec.lookup_queries[rng.randrange(len(spec.lookup_queries))]}).encode()
                t0 = time.perf_counter()
                try:
                    status, _ = await conn.post(path, payload, content_type)
                except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                    errors += 1
                    conn.close()
                    conn = Conn(spec.urls[k % len(spec.urls)])
                    continue
                if status == 200:
                    latencies.append(time.perf_counter() - t0)
                    items += n
                else:
                    errors += 1
        finally:
            conn.close()

    await asyncio.gather(*(one(k) for k in range(spec.concurrency)))
    return {"latencies": latencies, "errors": errors, "items": items}
