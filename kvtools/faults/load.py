"""Client load for the fault harness: simulated engines that write, and a reader that checks.

Each simulated node runs in its own thread as a worker would: register,
then publish fresh sequences, remove some, heartbeat, and now and then
restart (a new incarnation, so a new epoch that drops its old entries). It
talks to one replica of its home shard per request (a directory that is not
sharded is one shard), picked at random, and records every attempt in the
history; an attempt without a definite answer is retried on another replica
(writes are idempotent), a 409 makes it register again. The reader looks up
sequences the writers published on every shard, as a client merging the
shards' answers does, alternating local and linearizable lookups, so the
checker can look for stale answers and for shards serving nodes homed elsewhere.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, cast

import httpx

from kvtools.faults.history import FAIL, OK, SEQ_BLOCKS, UNKNOWN, History, Op, seq_hashes

CAPACITY = 4096


def node_ids(n: int) -> list[str]:
    """The simulated nodes' ids: what a sharded run places on its shards before the load starts."""
    return [f"sim-{i}" for i in range(n)]


class _Seqs:
    """Sequence numbers handed out to writers, and the ones published, for the reader to pick from."""

    def __init__(self) -> None:
        self._next = 0
        self._lock = threading.Lock()
        self.published: list[tuple[int, str]] = []

    def take(self) -> int:
        with self._lock:
            self._next += 1
            return self._next

    def done(self, seq: int, node: str) -> None:
        with self._lock:
            self.published.append((seq, node))
            del self.published[:-256]

    def pick(self, rng: random.Random) -> tuple[int, str] | None:
        with self._lock:
            return rng.choice(self.published) if self.published else None


class Load:
    """`nodes` writer threads and one reader thread against the replica URLs of each shard; `stop()` joins them.

    Replica indices in the history run over all shards, shard by shard; `home(node)` is a node's shard index.
    """

    def __init__(
        self,
        shards: Sequence[Sequence[str]],
        history: History,
        *,
        home: Callable[[str], int] = lambda node: 0,
        nodes: int = 4,
        seed: int = 0,
        timeout: float = 3.0,
        pace_s: float = 0.02,
    ) -> None:
        self.shards = [list(urls) for urls in shards]
        self.first = [sum(len(urls) for urls in self.shards[:i]) for i in range(len(self.shards))]
        self.home = home
        self.history = history
        self.timeout = timeout
        self.pace_s = pace_s
        self.seqs = _Seqs()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._writer, args=(node, seed * 1000 + i), daemon=True)
            for i, node in enumerate(node_ids(nodes))
        ]
        self._threads.append(threading.Thread(target=self._reader, args=(seed * 1000 + 999,), daemon=True))

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout + 5)

    # -- one request -----------------------------------------------------------------

    def _call(
        self, http: httpx.Client, rng: random.Random, op: Op, method: str, path: str, body: dict[str, object]
    ) -> dict[str, object] | None:
        """Send to a random replica of shard `op.shard`."""
        urls = self.shards[op.shard]
        local = rng.randrange(len(urls))
        op.replica = self.first[op.shard] + local
        op.t0 = time.monotonic()
        try:
            r = http.request(method, urls[local] + path, json=body)
        except httpx.HTTPError:
            r = None
        op.t1 = time.monotonic()
        op.status = r.status_code if r is not None else None
        if r is not None and r.status_code < 300:
            op.outcome = OK
        elif r is not None and 400 <= r.status_code < 500:
            op.outcome = FAIL
        else:
            op.outcome = UNKNOWN
        self.history.add(op)
        if op.outcome != OK:
            return None
        data: dict[str, object] = r.json()  # type: ignore[union-attr]
        return data

    def _until_definite(
        self, http: httpx.Client, rng: random.Random, make: Callable[[], Op], method: str, path: str, body: dict[str, object]
    ) -> tuple[Op, dict[str, object] | None]:
        """Retry on other replicas until the write is acknowledged or refused (or the run stops)."""
        while True:
            op = make()
            data = self._call(http, rng, op, method, path, body)
            if op.outcome != UNKNOWN or self._stop.is_set():
                return op, data
            self._stop.wait(0.05)

    # -- the threads ---------------------------------------------------------------------

    def _writer(self, node: str, seed: int) -> None:
        rng = random.Random(seed)
        shard = self.home(node)
        with httpx.Client(timeout=self.timeout, trust_env=False) as http:
            epoch: int | None = None
            live: list[int] = []
            while not self._stop.is_set():
                if epoch is None:
                    inc = uuid.uuid4().hex
                    body = {"node_id": node, "api_url": f"http://{node}.invalid", "incarnation": inc, "capacity_blocks": CAPACITY}
                    op, data = self._until_definite(
                        http, rng, lambda: Op("register", node, 0, 0.0, incarnation=inc, shard=shard), "POST", "/v1/nodes", body
                    )
                    if data is not None:
                        epoch = op.epoch = int(cast(int, data["epoch"]))
                        live = []
                    continue
                x = rng.random()
                if x < 0.6 or not live:
                    seq = self.seqs.take()
                    slots = tuple(rng.sample(range(CAPACITY), SEQ_BLOCKS))
                    body = {
                        "node_id": node,
                        "epoch": epoch,
                        "blocks": [{"hash": h, "slot": s} for h, s in zip(seq_hashes(seq), slots)],
                    }
                    op, data = self._until_definite(
                        http,
                        rng,
                        lambda: Op("publish", node, 0, 0.0, epoch=epoch, seq=seq, slots=slots, shard=shard),
                        "POST",
                        "/v1/blocks",
                        body,
                    )
                    if op.outcome == OK:
                        live.append(seq)
                        self.seqs.done(seq, node)
                elif x < 0.75:
                    seq = live.pop(rng.randrange(len(live)))
                    body = {"node_id": node, "epoch": epoch, "hashes": seq_hashes(seq)}
                    op, _ = self._until_definite(
                        http,
                        rng,
                        lambda: Op("remove", node, 0, 0.0, epoch=epoch, seq=seq, shard=shard),
                        "POST",
                        "/v1/blocks/remove",
                        body,
                    )
                elif x < 0.755:
                    epoch = None  # a restart: the next registration is a new incarnation
                    continue
                else:
                    op, _ = self._until_definite(
                        http,
                        rng,
                        lambda: Op("heartbeat", node, 0, 0.0, epoch=epoch, shard=shard),
                        "POST",
                        f"/v1/nodes/{node}/heartbeat",
                        {"epoch": epoch},
                    )
                if op.outcome == FAIL and op.status == 409:
                    epoch = None  # fenced or forgotten: register again, as a worker does
                self._stop.wait(self.pace_s)

    def _reader(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=self.timeout, trust_env=False) as http:
            n = 0
            while not self._stop.is_set():
                picked = self.seqs.pick(rng)
                if picked is None:
                    self._stop.wait(0.05)
                    continue
                seq, node = picked
                n += 1
                consistency = "linearizable" if n % 2 else "local"
                for shard in range(len(self.shards)):  # the node's home must hold it, every other shard must not
                    op = Op("lookup", node, 0, 0.0, seq=seq, consistency=consistency, shard=shard)
                    data = self._call(
                        http,
                        rng,
                        op,
                        "POST",
                        "/v1/lookup",
                        {"hashes": seq_hashes(seq), "with_slots": True, "consistency": consistency},
                    )
                    if data is not None:
                        op.holders = {
                            h["node_id"]: (h["epoch"], h["matched_blocks"], tuple(h["slots"]))
                            for h in cast("list[dict[str, Any]]", data["holders"])
                        }
                self._stop.wait(self.pace_s)
