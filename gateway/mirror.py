"""The gateway's mirror of the directory: the replicas' own state machine, fed by `GET /v1/watch`.

A lookup is the gateway's hottest path: an HTTP round trip to a replica per request cost more than
the rest of routing together and, under a loaded cluster, timed out into load-only routing. The
mirror holds a `DirectoryState` per Raft group (the same code the replicas run, read-only here: only
the stream's commands change it) and answers lookups in-process.

A `Feed` follows one group: one replica at a time, failing over to the next of that group on any
error and resuming from its log position (positions are the same on every replica of a group) and the
group's identity (codec.group_of: a rebuilt directory, or a reused shard name, is another group);
a position the replica will not resume (410: no longer kept, another group's, or a future one) makes
it re-snapshot. The stream is not trusted: every frame is checked as it is decoded (codec), and a
frame that fails, or a batch that does not bring the state to the position it names, drops the state
and that source: the feed re-snapshots from the next replica. The feed's task is supervised: any other
failure is logged with its traceback and counted (`restarts`), and the feed starts again from a
snapshot of the next replica after a backoff. A `Mirror` keeps one
feed for an unsharded directory and one per shard for a sharded one (docs/scale-out.md §6): it reads
the shard map with the gateway's `DirectoryClient`, runs a lookup on every shard's state and merges
the holders (a node lives in one shard, its home), and follows the map when a shard commits a newer one.

Freshness: the stream's ticks say whether the sending replica is caught up with a leader. A feed is
fresh while its last such tick, received after everything before it was applied, is at most
`max_lag_s` old. The mirror is fresh only while every feed is (a stale shard would hide its holders);
otherwise the gateway asks a replica over REST (gateway.proxy).

Failover: a source silent for `max_lag_s` (stalled, partitioned) is dropped for the group's next
replica. A source whose ticks have said "not caught up" for `max_lag_s` is dropped only for a replica
shown to be fresher: the feed asks the others for their stream from its position, and switches to
the first whose tick says it is caught up. Dropping it at once cost a failover per election (every
replica is stale then) and per index merge (the mirror's own, which delays its reads: that is no
fault of the source), ~100 in a 10-minute bench with 3 leader kills.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping, Sequence

import httpx
import numpy as np
from pydantic import SecretStr

from kvproto.client import DirectoryClient
from kvproto.codec import BatchFrame, Frame, FrameReader, SnapshotFrame, TickFrame, WireError, group_of, state_from
from kvproto.errors import AuthError, DirectoryError
from kvproto.index import warm_up
from kvproto.schemas import Holder
from kvproto.shardmap import ShardMap
from kvproto.state import DirectoryState
from kvproto.tasks import cancel_and_wait, supervise

log = logging.getLogger("kvdir.gateway")

RETRY_S = (0.05, 2.0)  # wait before trying the next replica: first, and at most (doubling while all fail)
SNAPSHOT_WAIT_S = 60.0  # longest wait for a stream's first frame (a snapshot of a big state takes a while)
MIN_WAIT_S = 0.3  # shortest silence taken for a lost source: 3 ticks
MAP_CHECK_S = 0.5  # how often the mirror looks for a shard map newer than the one its feeds follow
STABLE_S = 10.0  # a supervised task that ran this long before failing starts again at the first backoff


class SourceLost(WireError):
    """The source stopped answering or ended the stream: what was applied from it still stands."""


class Fresher(WireError):
    """Another replica is caught up with a leader while the source has not been for a while: follow it."""

    def __init__(self, url: str, why: str) -> None:
        super().__init__(why)
        self.url = url


class MirrorRefused(RuntimeError):
    """The directory will not stream to this gateway's token (403): lookups stay on REST."""


class Feed:
    """A read-only copy of one Raft group's state (a whole unsharded directory, or one shard), and how fresh it is."""

    def __init__(self, urls: Sequence[str], token: SecretStr | None, max_lag_s: float, connect_timeout_s: float = 2.0) -> None:
        self.urls = list(urls)
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
        self.rejected = 0  # streams dropped for a frame that failed its checks
        self.restarts = 0  # times the feed's task failed and was started again (`_supervise`)
        self._source = 0  # the index in `urls` of the replica followed (or tried next)
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        # Batches are applied on a thread, under this lock, so that an index merge never stalls the event loop
        # (the gateway's requests); a lookup that finds the lock taken waits for it on a thread (`lookup`).
        self._lock = threading.Lock()

    # -- reads ---------------------------------------------------------------------------------

    def lag_s(self) -> float:
        """Seconds since the feed was last known caught up with a fresh replica (inf: never)."""
        return time.monotonic() - self.fresh_at

    def fresh(self) -> bool:
        return self.state is not None and self.lag_s() <= self.max_lag_s

    @property
    def source(self) -> int:
        """The index in `urls` of the replica followed (or tried next): the status page names it by that, not by address."""
        return self._source % len(self.urls) if self.urls else -1

    def map_version(self) -> int:
        """The version of the shard map this group has committed (0: none, an unsharded directory)."""
        state = self.state
        return 0 if state is None or state.shard_map is None else state.shard_map.version

    async def lookup(self, keys: np.ndarray) -> list[Holder] | None:
        """Holders of the longest prefixes of `keys` (uint64), with slots (what `POST /v1/lookup` answers); None
        if the feed holds no state (it is re-snapshotting).

        As a replica's reads do: right here while no batch is being applied (nearly always), else on a
        thread that waits for the batch (an index merge takes up to seconds at millions of entries), so
        the event loop never waits for the lock.
        """
        if self._lock.acquire(blocking=False):
            try:
                return self._lookup(keys)
            finally:
                self._lock.release()
        return await asyncio.to_thread(self._lookup_waiting, keys)

    def _lookup_waiting(self, keys: np.ndarray) -> list[Holder] | None:
        with self._lock:
            return self._lookup(keys)

    def _lookup(self, keys: np.ndarray) -> list[Holder] | None:
        state = self.state  # read once: a failure on the loop may drop it meanwhile
        if state is None:
            return None
        return state.lookup(keys, with_slots=True)

    # -- following -----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise())

    async def stop(self) -> None:
        self._stopping = True
        await cancel_and_wait(self._task)  # `_run` also checks `_stopping`
        await self._http.aclose()

    def _drop(self) -> None:
        """Forget the state (lookups go over REST until the next snapshot is in)."""
        self.state, self.position = None, -1

    async def _supervise(self) -> None:
        """`_run`, started again whatever ends it but a refusal or `stop` (kvproto.tasks.supervise): a failure is
        counted and followed by a snapshot from the next replica."""

        async def run() -> None:
            # Loading the index's compiled kernels takes ~0.3 s (seconds where they must be compiled): left to the
            # first batches, it held their application, and the mirror's lag, as long.
            await asyncio.to_thread(warm_up)
            await self._run()

        def failed() -> str:
            self.restarts += 1
            self.failovers += 1
            url = self.urls[self._source % len(self.urls)] if self.urls else None
            self._drop()
            self._source += 1
            return f"mirror: the feed from {url} failed (restart {self.restarts}); re-snapshotting from the next replica"

        await supervise(run, failed, stopping=lambda: self._stopping, retry_s=RETRY_S, stable_s=STABLE_S, log=log)

    async def _run(self) -> None:
        delay = RETRY_S[0]
        while not self._stopping:
            url = self.urls[self._source % len(self.urls)]
            before = (self.position, self.snapshots)  # no progress while every source fails: back off
            try:
                await self._follow(url)
            except MirrorRefused as exc:
                log.warning("directory mirror off (lookups go to the directory over REST): %s", exc)
                return
            except Fresher as exc:
                log.info("mirror: leaving %s (%s) for %s", url, exc, exc.url)
                self.failovers += 1
                self._source = self.urls.index(exc.url) if exc.url in self.urls else self._source + 1
                delay = RETRY_S[0]
                continue  # it answered just now: no wait
            except (httpx.HTTPError, SourceLost, OSError) as exc:
                log.info("mirror: stream from %s ended (%s: %s); trying the next replica", url, type(exc).__name__, exc)
            except WireError as exc:  # a frame that failed its checks: nothing from this stream is trusted
                self.rejected += 1
                log.warning("mirror: %s sent %s; dropping the state for a snapshot from the next replica", url, exc)
                self._drop()
            self.failovers += 1
            self._source += 1
            delay = RETRY_S[0] if (self.position, self.snapshots) != before else min(delay * 2, RETRY_S[1])
            await asyncio.sleep(delay)

    def _resume_params(self) -> dict[str, str]:
        """The query that resumes this feed where it is, in the group it followed; none (a snapshot) if it holds
        no state, or one of a group with no identity yet (no node registered: a snapshot is small)."""
        state = self.state
        group = None if state is None else group_of(state)
        return {} if group is None else {"from": str(self.position), "group": str(group)}

    async def _follow(self, url: str) -> None:
        params = self._resume_params()
        request = self._http.build_request("GET", f"{url}/v1/watch", params=params)
        # The headers come at once from a live replica (a snapshot is encoded after them): a replica that
        # accepts the connection but does not answer (stalled, half-partitioned) is given up within the bound.
        try:
            r = await asyncio.wait_for(self._http.send(request, stream=True), self._silence_s)
        except TimeoutError:
            raise SourceLost(f"{url} did not answer within {self._silence_s:g} s") from None
        try:
            await self._read(url, r, snapshot=not params)
        finally:
            await r.aclose()

    async def _read(self, url: str, r: httpx.Response, snapshot: bool) -> None:
        if r.status_code == 410:  # no longer kept, another group's, or a future position
            detail = (await r.aread()).decode(errors="replace")[:300]
            log.info("mirror: %s will not resume position %d (%s): taking a snapshot", url, self.position, detail)
            self._drop()  # REST lookups until the snapshot is in
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
        stale_since: float | None = None  # when the source's ticks began to say it is not caught up
        probe: asyncio.Task[str | None] | None = None
        try:
            while not self._stopping:
                try:
                    chunk = await asyncio.wait_for(anext(chunks), wait_s)
                except StopAsyncIteration:
                    raise SourceLost(f"{url} ended the stream") from None
                except TimeoutError:
                    raise SourceLost(f"{url} sent nothing for {wait_s:g} s") from None
                for f in reader.feed(chunk):
                    if isinstance(f, TickFrame):
                        self._apply(f)
                        if f.fresh:
                            stale_since = None
                        elif stale_since is None:
                            stale_since = time.monotonic()
                    else:  # building or changing the index takes a while (a 5M-entry snapshot: 1.6 s): not on the loop
                        await asyncio.to_thread(self._apply_locked, f)
                    wait_s = self._silence_s
                if stale_since is None or time.monotonic() - stale_since <= self.max_lag_s:
                    continue
                if probe is not None and probe.done():
                    fresher = probe.result()
                    if fresher is not None:
                        raise Fresher(fresher, f"not caught up with a leader for {time.monotonic() - stale_since:.2f} s")
                    probe = None
                if probe is None:
                    probe = asyncio.create_task(self._find_fresher(url))
        finally:
            if probe is not None:
                probe.cancel()

    async def _find_fresher(self, source: str) -> str | None:
        """The first other replica whose stream, from this feed's position, ticks "caught up"; None if none
        does within the silence bound (all stale, as in an election: the source is kept)."""
        started = time.monotonic()
        for url in self.urls:
            if url == source:
                continue
            try:
                async with asyncio.timeout(self._silence_s):
                    if await self._ticks_fresh(url):
                        return url
            except (httpx.HTTPError, WireError, OSError, TimeoutError) as exc:
                log.debug("mirror: %s cannot stand in (%s: %s)", url, type(exc).__name__, exc)
        # At most one round per silence bound, however fast the others answer.
        await asyncio.sleep(max(0.0, self._silence_s - (time.monotonic() - started)))
        return None

    async def _ticks_fresh(self, url: str) -> bool:
        """Whether `url`'s first tick after this feed's position says it is caught up (its batches are skipped:
        the stream followed after a switch sends them again)."""
        async with self._http.stream("GET", f"{url}/v1/watch", params=self._resume_params()) as r:
            if r.status_code != 200:
                return False
            reader = FrameReader()
            async for chunk in r.aiter_raw():
                for f in reader.feed(chunk):
                    if isinstance(f, TickFrame):
                        return f.fresh
        return False

    def _apply_locked(self, f: Frame) -> None:
        # A snapshot's state is decoded and checked outside the lock (lookups go on from the old state meanwhile);
        # a batch's commands were, with the frame, so a malformed command never leaves a batch half applied.
        state = state_from(f.state) if isinstance(f, SnapshotFrame) else None
        with self._lock:
            self._apply(f, state)

    def _apply(self, f: Frame, state: DirectoryState | None = None) -> None:
        """Apply a frame that FrameReader decoded (a snapshot's with its `state` decoded by `_apply_locked`);
        WireError if it does not follow from what the feed holds."""
        if isinstance(f, SnapshotFrame):
            assert state is not None
            if state.applied != f.position:
                raise WireError(f"a snapshot at position {f.position} of a state at {state.applied}")
            if f.group != group_of(state):
                raise WireError(f"a snapshot of group {f.group} of a state of group {group_of(state)}")
            if self.state is None:
                log.info(
                    "mirror: snapshot at position %d, %d nodes, %d entries", state.applied, len(state.nodes), len(state.index)
                )
            self.state, self.position = state, state.applied
            self.snapshots += 1
        elif isinstance(f, BatchFrame):
            if self.state is None:
                raise WireError("a batch before any snapshot")
            if f.position != self.state.applied + len(f.commands):
                raise WireError(
                    f"a batch of {len(f.commands)} commands to position {f.position} after position {self.state.applied}"
                )
            for c in f.commands:
                self.state.apply(c)
            self.position = f.position
        else:
            if self.state is not None and f.group != group_of(self.state):
                raise WireError(f"a tick of group {f.group} to a mirror of group {group_of(self.state)}")
            if f.fresh and f.position == self.position:
                self.fresh_at = time.monotonic()


class Mirror:
    """The directory as the gateway sees it: one `Feed` per shard (one in all for an unsharded directory).

    Given `directory`, the mirror reads the shard map with it when started, retrying while the directory
    does not answer (lookups go over REST meanwhile), and follows `urls` as one group if the directory is
    not sharded. Without it, `urls` is followed as one group at once.
    """

    def __init__(
        self,
        urls: Sequence[str],
        token: SecretStr | None,
        max_lag_s: float,
        connect_timeout_s: float = 2.0,
        *,
        directory: DirectoryClient | None = None,
    ) -> None:
        self.urls = list(urls)
        self.max_lag_s = max_lag_s
        self._token, self._connect_timeout_s = token, connect_timeout_s
        self._directory = directory
        self.map_version = 0  # the shard map the feeds follow (0: the directory is not sharded)
        # Replaced, never changed in place: a lookup iterating over the feeds is not disturbed by a map change.
        self.feeds: Mapping[str, Feed] = {} if directory is not None else {"": self._feed(self.urls)}
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._restarts = 0

    def _feed(self, urls: Sequence[str]) -> Feed:
        return Feed(urls, self._token, self.max_lag_s, self._connect_timeout_s)

    # -- reads ---------------------------------------------------------------------------------

    def lag_s(self) -> float:
        """The most stale feed's lag (inf: some feed never was fresh, or a shard committed a map the mirror does not follow yet)."""
        feeds = self.feeds.values()
        if not feeds or self.newer_map() > self.map_version:
            return float("inf")
        return max(f.lag_s() for f in feeds)

    def fresh(self) -> bool:
        """Every shard's feed holds a state that is fresh: a stale one would hide its shard's holders."""
        return bool(self.feeds) and self.newer_map() <= self.map_version and all(f.fresh() for f in self.feeds.values())

    def newer_map(self) -> int:
        """The newest shard map version any feed's group has committed (0 for an unsharded directory)."""
        return max((f.map_version() for f in self.feeds.values()), default=0)

    @property
    def position(self) -> int:
        """Commands applied, over every shard (each shard numbers its own log); -1 before any feed exists."""
        feeds = self.feeds.values()
        return sum(f.position for f in feeds) if feeds else -1

    @position.setter
    def position(self, value: int) -> None:
        self._only().position = value

    @property
    def state(self) -> DirectoryState | None:
        """The state of an unsharded mirror's one group (a sharded mirror has one per feed)."""
        return self._only().state if self.feeds else None

    @state.setter
    def state(self, value: DirectoryState | None) -> None:
        self._only().state = value

    def _only(self) -> Feed:
        if len(self.feeds) != 1:
            raise TypeError(f"a mirror of {len(self.feeds)} shards has one state per shard: see `feeds`")
        return next(iter(self.feeds.values()))

    @property
    def snapshots(self) -> int:
        return sum(f.snapshots for f in self.feeds.values())

    @property
    def failovers(self) -> int:
        return sum(f.failovers for f in self.feeds.values())

    @property
    def rejected(self) -> int:
        """Streams dropped, over every feed, for a frame that failed its checks."""
        return sum(f.rejected for f in self.feeds.values())

    @property
    def restarts(self) -> int:
        """Times a task of the mirror failed and was started again: the feeds' and the shard map's."""
        return self._restarts + sum(f.restarts for f in self.feeds.values())

    async def lookup(self, hashes: list[int]) -> list[Holder] | None:
        """Holders of the longest prefixes of `hashes`, with slots, longest match first, over every shard;
        None if some feed holds no state (it is re-snapshotting: the caller asks REST).

        A node's entries live in its home shard only. While a node moves, a lagging feed may still show it
        at its old home: the holder from the shard with the newer map wins.
        """
        feeds = list(self.feeds.values())
        if not feeds:
            return None
        keys = np.asarray(hashes, dtype=np.uint64)
        if len(feeds) == 1:
            return await feeds[0].lookup(keys)
        best: dict[str, tuple[int, Holder]] = {}
        for feed in feeds:
            found = await feed.lookup(keys)
            if found is None:
                return None
            version = feed.map_version()
            for h in found:
                seen = best.get(h.node_id)
                if seen is None or version > seen[0]:
                    best[h.node_id] = (version, h)
        return sorted((h for _, h in best.values()), key=lambda h: -h.matched_blocks)

    # -- following -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._directory is None:
            for f in self.feeds.values():
                f.start()
        else:
            self._task = asyncio.create_task(self._supervise(self._directory))

    async def stop(self) -> None:
        self._stopping = True
        await cancel_and_wait(self._task)
        for f in self.feeds.values():
            await f.stop()

    async def _supervise(self, directory: DirectoryClient) -> None:
        """`_run`, started again (counted, after a backoff) whatever but a refusal or `stop` ends it."""

        def failed() -> str:
            self._restarts += 1
            return f"mirror: following the shard map failed (restart {self._restarts})"

        await supervise(
            lambda: self._run(directory), failed, stopping=lambda: self._stopping, retry_s=RETRY_S, stable_s=STABLE_S, log=log
        )

    async def _run(self, directory: DirectoryClient) -> None:
        """Read the shard map and follow it; read it again whenever a shard has committed a newer one."""
        delay = RETRY_S[0]
        refresh = False
        while not self._stopping:
            if refresh or not self.feeds:
                try:
                    m = await directory.shard_map(refresh=refresh)
                except AuthError as exc:
                    log.warning("directory mirror off (lookups go to the directory over REST): %s", exc)
                    return
                except (DirectoryError, ValueError) as exc:
                    log.info("mirror: cannot read the shard map (%s: %s); retrying", type(exc).__name__, exc)
                    delay = min(delay * 2, RETRY_S[1])
                    await asyncio.sleep(delay)
                    continue
                delay = RETRY_S[0]
                await self._follow_map(m)
            await asyncio.sleep(MAP_CHECK_S)
            refresh = self.newer_map() > self.map_version

    async def _follow_map(self, m: ShardMap | None) -> None:
        """One feed per shard of `m` (one on `urls` for None); feeds of shards that keep their name carry on."""
        if self.feeds and (m is None or m.version <= self.map_version):
            return  # not newer: a replica that has not committed the new map yet answered; asked again later
        if m is None:
            feeds = {"": self.feeds.get("") or self._feed(self.urls)}
        else:
            feeds = {}
            for name in m.names:
                feed = self.feeds.get(name)
                if feed is None:
                    feed = self._feed(m.urls(name))
                else:
                    feed.urls = m.urls(name)  # read by the feed on its next failover
                feeds[name] = feed
            log.info("mirror: following shard map version %d: %s", m.version, ", ".join(m.names))
        gone = [f for name, f in self.feeds.items() if name not in feeds]
        started = [f for name, f in feeds.items() if name not in self.feeds]
        self.feeds, self.map_version = feeds, 0 if m is None else m.version
        for f in started:
            f.start()
        for f in gone:
            await f.stop()
