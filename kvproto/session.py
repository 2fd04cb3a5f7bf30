"""One node's session with the directory: what every publisher of KV blocks shares.

Used by the worker stub (`worker_stub.publisher`), the engine events adapter
(`adapters.subscriber`) and the vLLM connector to come, so that the rules below
are written once:

* **Register by incarnation.** One incarnation per process (or engine) start:
  a retried registration gets the same epoch, a restart (`restart()`) a new one.
* **Pending net change.** `stored()` and `removed()` keep one pending set each;
  a removal cancels a pending store of the same hash and vice versa, so while
  the directory is unreachable the sets hold the net change, never a history.
  `clear()` drops what is pending and sends one clear of the node first.
* **Flush in chunks** through the typed `DirectoryClient` (binary batches unless
  it was built with `binary=False`): the clear, then removals, then stores
  grouped by medium, `CHUNK` entries per request. A round takes the pending
  sets; what it could not send goes back under any newer change (newer
  changes win), unless a clear or a new epoch came since.
* **409 = the directory holds none of our entries** (stale epoch, the lease
  ran out, or the directory lost its state and may even hand out the same
  epoch number again): register again, then republish what `holdings()` says
  the node holds now.
* **Other 4xx = retrying cannot help** (a limit, a wrong token, a bug): the
  round's changes are dropped and counted, and the next round backs off like
  after an unreachable directory, so a misconfiguration does not flood the log.

Not thread-safe: use it from one event loop. It never imports the server.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice

from kvproto.client import DirectoryClient
from kvproto.errors import DirectoryError, RequestRejected, StaleEpochError, WrongShardError
from kvproto.schemas import Region
from kvproto.tasks import cancel_and_wait, every

CHUNK = 4096  # entries per publish/remove request (the directory accepts 16384 by default)

Holdings = Callable[[], Iterable[tuple[int, int, str | None]]]
"""Every (hash, slot, medium) the node holds now: what to republish after a 409 or under a new epoch."""


@dataclass(slots=True)
class SessionStats:
    registrations: int = 0
    published_blocks: int = 0
    removed_blocks: int = 0
    directory_clears: int = 0
    rejected: int = 0  # changes the directory refused (4xx other than 409): dropped


@dataclass(slots=True)
class _Store:
    slot: int
    medium: str | None
    when: float  # time.monotonic() when it became pending: the publish lag


class Backoff:
    """Delays after consecutive failures: `first`, doubling up to `cap`; `reset()` after a success."""

    def __init__(self, first: float, cap: float) -> None:
        self.first, self.cap = first, cap
        self._next = first

    def failed(self) -> float:
        delay, self._next = self._next, min(self._next * 2, self.cap)
        return delay

    def reset(self) -> None:
        self._next = self.first


class NodeSession:
    """Registration, heartbeats and the pending changes of one node; see the module docstring."""

    def __init__(
        self,
        client: DirectoryClient,
        node_id: str,
        api_url: str,
        *,
        holdings: Holdings,
        transfer_url: str | None = None,
        regions: Iterable[Region] = (),
        capacity_blocks: int | None = None,
        block_size: int | None = None,
        models: Iterable[str] = (),
        fingerprint: str | None = None,
        shared: bool = False,
        dp_rank: int | None = None,
        load: Callable[[], Mapping[str, float]] | None = None,
        collect: Callable[[], None] | None = None,
        on_published: Callable[[int, float], None] | None = None,
        on_registered: Callable[[int], None] | None = None,
        retry_first_s: float = 0.05,
        retry_max_s: float = 1.0,
        logger: logging.Logger | None = None,
    ) -> None:
        """`collect` moves the node's latest changes into the pending sets before each flush;
        `on_published(n, lag_s)` runs per chunk stored; `on_registered(epoch)` after each registration."""
        self.client = client
        self.node_id = node_id
        self.api_url = api_url
        self.transfer_url = transfer_url
        self.regions = list(regions)
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.models = list(models)
        self.fingerprint = fingerprint
        self.shared = shared
        self.dp_rank = dp_rank
        self.holdings = holdings
        self.load = load
        self.collect = collect
        self.on_published = on_published
        self.on_registered = on_registered
        self.retry = Backoff(retry_first_s, retry_max_s)
        self.log = logger or logging.getLogger("kvdir.session")
        self.stats = SessionStats()
        self.incarnation = uuid.uuid4().hex
        self.epoch: int | None = None
        self.need_register = True
        self.entries_lost = False  # set by a 409: the directory holds none of this node's entries
        self._store: dict[int, _Store] = {}
        self._remove: set[int] = set()
        self._clear = False
        self._in_flight: tuple[dict[int, _Store], set[int]] = ({}, set())
        self.generation = 0  # bumped when pending changes stop following from earlier ones (clear, restart, new epoch)
        self._registered = asyncio.Event()

    # -- pending changes ------------------------------------------------------------

    def stored(self, blocks: Iterable[tuple[int, int]], medium: str | None = None) -> None:
        """The node now holds these (hash, slot): cancels a pending removal of each."""
        now = time.monotonic()
        for h, slot in blocks:
            self._remove.discard(h)
            self._store[h] = _Store(slot, medium, now)

    def stored_in(self, slot: int, hashes: Sequence[int], medium: str | None = None) -> None:
        """`stored()` for hashes that share one slot (an engine adapter's): bulk updates, no object per hash."""
        entry = _Store(slot, medium, time.monotonic())
        if self._remove:
            self._remove.difference_update(hashes)
        self._store.update(dict.fromkeys(hashes, entry))

    def removed(self, hashes: Iterable[int]) -> None:
        """The node no longer holds these hashes: cancels a pending store of each."""
        for h in hashes:
            self._store.pop(h, None)
            self._remove.add(h)

    def clear(self) -> None:
        """The node dropped everything: forget what is pending and clear its entries first thing."""
        self._store.clear()
        self._remove.clear()
        self._clear = True
        self.generation += 1

    def restart(self) -> None:
        """The node is a new process: a new incarnation (so a new epoch at the next registration), nothing pending."""
        self._store.clear()
        self._remove.clear()
        self._clear = False
        self.generation += 1
        self.incarnation = uuid.uuid4().hex
        self.lapse()

    def lapse(self) -> None:
        """The directory dropped this node (a 409): register again and republish."""
        self.need_register = True
        self.entries_lost = True
        self._registered.clear()

    @property
    def pending(self) -> int:
        """Changes not yet acknowledged by the directory (including a round in flight)."""
        return len(self._store) + len(self._remove) + len(self._in_flight[0]) + len(self._in_flight[1])

    @property
    def queued(self) -> int:
        """Changes waiting for a round (not counting one in flight)."""
        return len(self._store) + len(self._remove)

    @property
    def has_pending(self) -> bool:
        return bool(self._store or self._remove or self._clear)

    @property
    def pending_stores(self) -> dict[int, str | None]:
        """Pending stores, hash -> medium (a copy)."""
        return {h: e.medium for h, e in self._store.items()}

    @property
    def pending_removals(self) -> set[int]:
        return self._remove

    @property
    def pending_clear(self) -> bool:
        return self._clear

    @property
    def registered(self) -> bool:
        return self.epoch is not None and not self.need_register

    async def wait_registered(self, timeout: float) -> None:
        await asyncio.wait_for(self._registered.wait(), timeout)

    # -- directory --------------------------------------------------------------------

    async def register(self) -> int:
        """Register (the same incarnation: the same epoch); a new epoch or lost entries: republish `holdings()`."""
        reg = await self.client.register(
            self.node_id,
            self.api_url,
            incarnation=self.incarnation,
            transfer_url=self.transfer_url,
            regions=self.regions,
            capacity_blocks=self.capacity_blocks,
            block_size=self.block_size,
            models=self.models,
            fingerprint=self.fingerprint,
            shared=self.shared,
            dp_rank=self.dp_rank,
        )
        if reg.epoch != self.epoch:
            for warning in reg.warnings:
                self.log.warning("node %s registration: %s", self.node_id, warning)
        if reg.epoch != self.epoch or self.entries_lost:
            # Everything pending is superseded by what the node holds now; a clear is moot under a fresh epoch.
            self.entries_lost = False
            self.generation += 1
            now = time.monotonic()
            self._store = {h: _Store(slot, medium, now) for h, slot, medium in self.holdings()}
            self._remove = set()
            self._clear = False
        self.epoch = reg.epoch
        self.need_register = False
        self.stats.registrations += 1
        self._registered.set()
        self.log.info("node %s registered, epoch %d (%d blocks to publish)", self.node_id, reg.epoch, len(self._store))
        if self.on_registered is not None:
            self.on_registered(reg.epoch)
        return reg.epoch

    async def flush(self, limit: int | None = None) -> None:
        """Send what is pending: the clear, removals, then stores; raises what the client raised.

        With `limit`, a round takes at most that many changes (removals first, then the
        oldest stores) and leaves the rest queued: a batcher's rounds stay the size it
        asked for, and what is left can make up the next full round at once.
        """
        epoch, gen = self.epoch, self.generation
        assert epoch is not None, "flush before register"
        if limit is None or self.queued <= limit:
            store, remove = self._store, self._remove
            self._store, self._remove = {}, set()
        else:
            remove = set(islice(self._remove, limit))
            self._remove -= remove
            store = {h: self._store.pop(h) for h in list(islice(self._store, limit - len(remove)))}
        clear, self._clear = self._clear, False
        self._in_flight = (store, remove)
        try:
            if clear:
                await self.client.clear(self.node_id, epoch)
                self.stats.directory_clears += 1
                clear = False
            todo = list(remove)
            for i in range(0, len(todo), CHUNK):
                part = todo[i : i + CHUNK]
                await self.client.remove(self.node_id, epoch, part)
                remove.difference_update(part)
                self.stats.removed_blocks += len(part)
            by_medium: dict[str | None, list[int]] = {}
            for h, e in store.items():
                by_medium.setdefault(e.medium, []).append(h)
            for medium, hashes in by_medium.items():
                for i in range(0, len(hashes), CHUNK):
                    part = hashes[i : i + CHUNK]
                    await self.client.publish(self.node_id, epoch, [(h, store[h].slot) for h in part], medium=medium)
                    oldest = min(store[h].when for h in part)
                    for h in part:
                        del store[h]
                    self.stats.published_blocks += len(part)
                    if self.on_published is not None:
                        self.on_published(len(part), time.monotonic() - oldest)
        except StaleEpochError:
            self._merge_back(gen, store, remove, clear)
            raise
        except RequestRejected:
            self.stats.rejected += len(store) + len(remove)
            raise
        except BaseException:
            self._merge_back(gen, store, remove, clear)
            raise
        finally:
            self._in_flight = ({}, set())

    def _merge_back(self, gen: int, store: dict[int, _Store], remove: set[int], clear: bool) -> None:
        """Put back what a failed round did not send, under what changed since (newer changes win)."""
        if gen != self.generation:
            return  # a clear, restart or new epoch since: the old changes mean nothing now
        for h in remove:
            if h not in self._store:
                self._remove.add(h)
        for h, e in store.items():
            if h not in self._remove and h not in self._store:
                self._store[h] = e
        self._clear = self._clear or clear

    async def sync(self, flush: Callable[[], Awaitable[None]] | None = None) -> float | None:
        """One round: register if needed, `collect`, flush (`flush` wraps `self.flush` for a caller's bookkeeping).

        Returns None after a success, else the seconds to wait before the next
        round: 0 after a 409 (register again at once), the back-off after an
        unreachable directory or a rejection.
        """
        try:
            if self.need_register:
                await self.register()
            if self.collect is not None:
                self.collect()
            if self.has_pending:
                await (flush or self.flush)()
        except WrongShardError as exc:
            # A shard map change half applied (the new home has not committed it yet): wait, do not spin.
            self.log.warning("%s is between shards (%s): registering again after a back-off", self.node_id, exc)
            self.lapse()
            return self.retry.failed()
        except StaleEpochError:
            self.log.warning("directory answered 409 for %s epoch %s: registering again", self.node_id, self.epoch)
            self.lapse()
            return 0.0
        except RequestRejected as exc:
            # Dropping the round: the same request would be refused again.
            self.log.error("directory refused the changes of %s (%s); dropped, %d pending", self.node_id, exc, self.pending)
            return self.retry.failed()
        except DirectoryError as exc:
            self.log.info("directory unavailable (%s); %d changes pending", exc, self.pending)
            return self.retry.failed()
        self.retry.reset()
        return None

    async def heartbeat(self, *, deadline: float | None = None) -> bool:
        """Renew the lease (with `load()`) if registered; False when the directory answered 409 (see `lapse`)."""
        if not self.registered:
            return True
        assert self.epoch is not None
        try:
            await self.client.heartbeat(self.node_id, self.epoch, self.load() if self.load else None, deadline=deadline)
        except StaleEpochError:
            self.log.warning("heartbeat of %s epoch %s refused (expired?): registering again", self.node_id, self.epoch)
            self.lapse()
            return False
        except DirectoryError as exc:
            self.log.info("heartbeat of %s failed: %s", self.node_id, exc)
        return True

    async def run(self, interval: float, heartbeat_interval: float, failed: Callable[[], object]) -> None:
        """Sync every `interval` (sooner after a 409, later while failing) and heartbeat, until cancelled. A round or
        a heartbeat that raises what `sync` and `heartbeat` do not expect (a bug, a `collect` that failed) is logged
        with its traceback, counted (`failed`) and retried after the back-off: the node never goes silent for good."""

        beat = every(
            heartbeat_interval, self.heartbeat, what=f"heartbeat of {self.node_id}", log=self.log, failed=failed, first_now=False
        )
        beats = asyncio.create_task(beat, name=f"heartbeat-{self.node_id}")
        try:
            while True:
                try:
                    delay = await self.sync()
                except Exception:
                    failed()
                    delay = self.retry.failed()
                    self.log.exception("publishing of %s failed: trying again in %.1fs", self.node_id, delay)
                await asyncio.sleep(interval if delay is None else delay)
        finally:
            await cancel_and_wait(beats)

    async def close(self, deadline: float = 2.0) -> None:
        """Deregister if ever registered, so the node's entries go at once, not when the lease ends."""
        if self.epoch is None:
            return
        try:
            await self.client.deregister(self.node_id, self.epoch, deadline=deadline)
        except DirectoryError as exc:
            self.log.info("could not deregister %s on shutdown: %s", self.node_id, exc)
