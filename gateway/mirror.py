"""The gateway's mirror of the directory: the replicas' own state machine, fed by `GET /v1/watch`.

A lookup is the gateway's hottest path: an HTTP round trip to a replica per request cost more than
the rest of routing together and, under a loaded cluster, timed out into load-only routing. The
mirror holds a `DirectoryState` (the same code the replicas run, read-only here: only the stream's
commands change it) and answers lookups in-process. It follows one replica at a time and fails
over to the next on any error, resuming from its log position (positions are the same on every
replica); a position no longer kept (410) or a stream it cannot apply makes it re-snapshot.

Freshness: the stream's ticks say whether the sending replica is caught up with a leader. The
mirror is fresh while its last such tick, received after everything before it was applied, is at
most `max_lag_s` old; otherwise the gateway asks a replica over REST (gateway.proxy), and a source
silent or stale for that long is dropped for the next replica.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import httpx
import numpy as np
from pydantic import SecretStr

from directory.schemas import Holder
from directory.state import DirectoryState
from directory.watch_codec import FrameReader, WireError, decode_command, state_from

log = logging.getLogger("kvdir.gateway")

RETRY_S = (0.05, 2.0)  # wait before trying the next replica: first, and at most (doubling while all fail)
SNAPSHOT_WAIT_S = 60.0  # longest wait for a stream's first frame (a snapshot of a big state takes a while)
MIN_WAIT_S = 0.3  # shortest silence taken for a lost source: 3 ticks


class MirrorRefused(RuntimeError):
    """The directory will not stream to this gateway's token (403): lookups stay on REST."""


class Mirror:
    """A read-only copy of the directory's state, and how fresh it is."""

    def __init__(self, urls: list[str], token: SecretStr | None, max_lag_s: float, connect_timeout_s: float = 2.0) -> None:
        self.urls = urls
        self.max_lag_s = max_lag_s
        self._silence_s = max(max_lag_s, MIN_WAIT_S)  # a source silent this long is lost
        headers = {"Authorization": f"Bearer {token.get_secret_value()}"} if token else {}
        # How long reads may wait is decided per chunk (`_follow`); this only bounds the connection.
        self._http = httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(connect_timeout_s, read=SNAPSHOT_WAIT_S), trust_env=False
        )
        self.state: DirectoryState | None = None
        self.position = -1
        self.fresh_at = float("-inf")  # monotonic time of the last fresh tick, everything before it applied
        self.snapshots = 0
        self.failovers = 0
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        # Batches are applied on a thread, under this lock, so that an index merge never stalls the event loop
        # (the gateway's requests); a lookup that finds the lock taken waits for it on a thread (`lookup`).
        self._lock = threading.Lock()

    # -- reads ---------------------------------------------------------------------------------

    def lag_s(self) -> float:
        """Seconds since the mirror was last known caught up with a fresh replica (inf: never)."""
        return time.monotonic() - self.fresh_at

    def fresh(self) -> bool:
        return self.state is not None and self.lag_s() <= self.max_lag_s

    async def lookup(self, hashes: list[int]) -> list[Holder] | None:
        """Holders of the longest prefixes of `hashes`, with slots (what `POST /v1/lookup` answers); None if
        the mirror holds no state (it is re-snapshotting).

        As a replica's reads do: right here while no batch is being applied (nearly always), else on a
        thread that waits for the batch (an index merge takes up to seconds at millions of entries), so
        the event loop never waits for the lock.
        """
        if self._lock.acquire(blocking=False):
            try:
                return self._lookup(hashes)
            finally:
                self._lock.release()
        return await asyncio.to_thread(self._lookup_waiting, hashes)

    def _lookup_waiting(self, hashes: list[int]) -> list[Holder] | None:
        with self._lock:
            return self._lookup(hashes)

    def _lookup(self, hashes: list[int]) -> list[Holder] | None:
        if self.state is None:
            return None
        found = self.state.lookup(np.asarray(hashes, dtype=np.uint64), with_slots=True)
        return [Holder.model_construct(node_id=h.node_id, epoch=h.epoch, matched_blocks=h.matched, slots=h.slots) for h in found]

    # -- following -----------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            # Python 3.11's wait_for can swallow a cancellation that arrives as its inner await completes
            # (gh-86296): cancel until the task has ended (`_run` also checks `_stopping`).
            while not self._task.done():
                self._task.cancel()
                await asyncio.wait({self._task}, timeout=0.1)
        await self._http.aclose()

    async def _run(self) -> None:
        delay = RETRY_S[0]
        i = 0
        while not self._stopping:
            url = self.urls[i % len(self.urls)]
            applied_before = self.position
            try:
                await self._follow(url)
            except MirrorRefused as exc:
                log.warning("directory mirror off (lookups go to the directory over REST): %s", exc)
                return
            except (httpx.HTTPError, WireError, OSError) as exc:
                log.info("mirror: stream from %s ended (%s: %s); trying the next replica", url, type(exc).__name__, exc)
            self.failovers += 1
            i += 1
            delay = RETRY_S[0] if self.position != applied_before else min(delay * 2, RETRY_S[1])
            await asyncio.sleep(delay)

    async def _follow(self, url: str) -> None:
        params = {"from": str(self.position)} if self.state is not None else {}
        request = self._http.build_request("GET", f"{url}/v1/watch", params=params)
        # The headers come at once from a live replica (a snapshot is encoded after them): a replica that
        # accepts the connection but does not answer (stalled, half-partitioned) is given up within the bound.
        try:
            r = await asyncio.wait_for(self._http.send(request, stream=True), self._silence_s)
        except TimeoutError:
            raise WireError(f"{url} did not answer within {self._silence_s:g} s") from None
        try:
            await self._read(url, r, snapshot=not params)
        finally:
            await r.aclose()

    async def _read(self, url: str, r: httpx.Response, snapshot: bool) -> None:
        if r.status_code == 410:
            log.info("mirror: position %d is no longer kept at %s: taking a snapshot", self.position, url)
            self.state, self.position = None, -1  # REST lookups until the snapshot is in
            return
        if r.status_code in (401, 403):
            detail = (await r.aread()).decode(errors="replace")[:300]
            raise MirrorRefused(f"{url} answered {r.status_code}: {detail}")
        r.raise_for_status()
        reader = FrameReader()
        chunks = r.aiter_raw()
        # A replica sends a tick at least every 0.1 s once its first frame is out: a source silent for
        # longer than the lag bound is lost (stalled, partitioned). A first frame that is a snapshot of
        # millions of entries takes the replica a while to encode: that wait is longer.
        wait_s = SNAPSHOT_WAIT_S if snapshot else self._silence_s
        settled = time.monotonic()  # since when the source has had time to prove it is fresh
        while not self._stopping:
            try:
                chunk = await asyncio.wait_for(anext(chunks), wait_s)
            except StopAsyncIteration:
                raise WireError(f"{url} ended the stream") from None
            except TimeoutError:
                raise WireError(f"{url} sent nothing for {wait_s:g} s") from None
            for f in reader.feed(chunk):
                if f["k"] == "tick":
                    self._apply(f)
                else:  # building or changing the index takes a while (a 5M-entry snapshot: 1.6 s): not on the loop
                    await asyncio.to_thread(self._apply_locked, f)
                    if f["k"] == "snapshot":
                        settled = time.monotonic()
                wait_s = self._silence_s
            if self.lag_s() > self.max_lag_s and time.monotonic() - settled > self.max_lag_s:
                raise WireError(f"{url} has not been caught up with a leader for {self.lag_s():.2f} s")

    def _apply_locked(self, f: dict[str, Any]) -> None:
        if f["k"] == "snapshot":
            f["state"] = state_from(f["state"])  # outside the lock: lookups go on from the old state meanwhile
        with self._lock:
            self._apply(f)

    def _apply(self, f: dict[str, Any]) -> None:
        kind = f["k"]
        if kind == "snapshot":
            state: DirectoryState = f["state"]  # built by `_apply_locked`, off the lock
            if state.applied != f["position"]:
                raise WireError(f"a snapshot at position {f['position']} of a state at {state.applied}")
            if self.state is None:
                log.info(
                    "mirror: snapshot at position %d, %d nodes, %d entries", state.applied, len(state.nodes), len(state.index)
                )
            self.state, self.position = state, state.applied
            self.snapshots += 1
        elif kind == "batch":
            if self.state is None:
                raise WireError("a batch before any snapshot")
            for c in f["commands"]:
                self.state.apply(decode_command(c))
            if self.state.applied != f["position"]:
                why = f"a batch to position {f['position']} left the mirror at {self.state.applied}"
                self.state, self.position = None, -1  # diverged: start again from a snapshot
                raise WireError(why)
            self.position = f["position"]
        elif kind == "tick":
            if f["fresh"] and f["position"] == self.position:
                self.fresh_at = time.monotonic()
