"""The sending half of decision sharing (the design: gateway.peers): a bounded queue and one sender task per peer,
so that routing never waits on a peer and a slow or dead one costs one bounded queue."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import httpx
import msgspec
from pydantic import SecretStr

from gateway.peer_wire import MAX_BATCH, NOTES_PATH, Note, NoteBatch
from kvproto.schemas import Origin
from kvproto.tasks import cancel_and_wait

log = logging.getLogger("kvdir.gateway.peers")

SENT = ("sent", "dropped", "send_failures")
"""What the sender counts, by name (`PeerSender.stats`)."""


class PeerSender:
    """Notes of this gateway's routing, queued for every peer and posted in batches, one POST at a time per peer
    (so a peer gets them in order). Event loop only."""

    def __init__(
        self, me: str, peers: Sequence[Origin], token: SecretStr | None, ttl_s: float, queue_size: int, timeout_s: float
    ) -> None:
        if queue_size < 1 or timeout_s <= 0:
            raise ValueError("queue_size must be >= 1 and timeout_s > 0")
        self.me, self.peers, self.token, self.ttl_s, self.timeout_s = me, list(peers), token, ttl_s, timeout_s
        self.queues: list[asyncio.Queue[Note | int]] = [asyncio.Queue(queue_size) for _ in self.peers]
        self._next = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._http: httpx.AsyncClient | None = None
        self.stats = dict.fromkeys(SENT, 0)

    def routed(self, node_id: str, epoch: int, tokens: float) -> int:
        """This gateway sent a request with `tokens` to compute to `node_id`@`epoch`: a note for each peer.

        Its id for `prefilled`; -1 (nothing sent) without peers or tokens.
        """
        if not self.queues or tokens <= 0:
            return -1
        key = self._next
        self._next += 1
        self._put(Note(key, node_id, epoch, float(tokens), self.ttl_s))
        return key

    def prefilled(self, key: int) -> None:
        """The request noted as `key` got its first byte or failed: the peers take its tokens off."""
        if key >= 0:
            self._put(key)

    def _put(self, item: Note | int) -> None:
        for q in self.queues:
            try:
                q.put_nowait(item)
            except asyncio.QueueFull:
                self.stats["dropped"] += 1

    async def _send_loop(self, origin: Origin, q: asyncio.Queue[Note | int]) -> None:
        assert self._http is not None
        url = origin.url(NOTES_PATH)
        headers = {"content-type": "application/json"}
        if self.token is not None:
            headers["authorization"] = f"Bearer {self.token.get_secret_value()}"
        warned = False
        while True:
            notes: list[Note] = []
            done: list[int] = []
            item = await q.get()
            while True:
                if isinstance(item, Note):
                    notes.append(item)
                else:
                    done.append(item)
                if len(notes) >= MAX_BATCH or len(done) >= MAX_BATCH or q.empty():
                    break
                item = q.get_nowait()
            body = msgspec.json.encode(NoteBatch(self.me, notes, done))
            try:
                r = await self._http.post(url, content=body, headers=headers)
                ok, why = r.status_code == 204, f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                ok, why = False, f"{type(exc).__name__}: {exc}"
            if ok:
                self.stats["sent"] += len(notes) + len(done)
                warned = False
            else:
                self.stats["send_failures"] += 1
                if not warned:  # once per outage, not once per batch
                    log.warning("peer gateway %s did not take %d notes (%s)", origin, len(notes) + len(done), why)
                    warned = True

    def start(self) -> None:
        """A sender task per peer (none without peers)."""
        if not self.queues:
            return
        self._http = httpx.AsyncClient(
            timeout=self.timeout_s, limits=httpx.Limits(max_connections=len(self.peers) + 1), trust_env=False
        )
        for origin, q in zip(self.peers, self.queues, strict=True):
            self._tasks.append(asyncio.create_task(self._send_loop(origin, q), name=f"peer {origin}"))

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks)
        self._tasks.clear()
        if self._http is not None:
            await self._http.aclose()
            self._http = None
