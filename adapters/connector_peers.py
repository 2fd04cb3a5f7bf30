"""The directory, as the vLLM connector's halves see it off vLLM's threads: an asyncio loop of their own (`Loop`)
and the pull sources, refreshed in the background (`PeerCache`), so that no engine step waits on the directory."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Protocol

from adapters.config import ConnectorSettings
from adapters.vllm_plan import PullSource, Standing, pull_sources, standing
from kvproto.client import DirectoryClient
from kvproto.errors import DirectoryError
from kvproto.schemas import NodeInfo

log = logging.getLogger("kvdir.vllm")


class Peers(Protocol):
    """Pull sources by (node id, epoch), as the directory last listed them (`PeerCache`; tests give a fixed map)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def get(self, node_id: str, epoch: int) -> PullSource | None: ...

    def known(self) -> dict[tuple[str, int], PullSource]: ...

    def settled(self, since: float) -> bool: ...

    def wait(self, since: float, timeout: float) -> bool: ...


class Loop:
    """An asyncio loop on a daemon thread: the directory client runs there, off vLLM's threads."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name=name, daemon=True).start()

    def run(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


class PeerCache:
    """The directory's nodes as pull sources, refreshed in the background, so that no engine step waits on the
    directory.

    The list is read every `peer_refresh_s` and at once after a miss; while the directory does not answer,
    the last list stays (a source that restarted has a new epoch, so a stale entry is never its memory). A source
    missing from the list may have registered since it was read (a plan names the epoch the gateway saw): the
    source is unknown for sure once a read that started after the miss ended (`settled`, `wait`).
    """

    def __init__(self, s: ConnectorSettings, node_id: str) -> None:
        """`node_id`: the engine's own node, whose registered tenant decides which sources it may read."""
        self.s = s
        self.node_id = node_id
        self._known: dict[tuple[str, int], PullSource] = {}
        self._me: Standing | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._read_started = float("-inf")  # when the last read of the list that ended (answered or not) started
        self._read_ok = True  # whether that read was answered
        self._read_ended = threading.Condition()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvdir-peers", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def get(self, node_id: str, epoch: int) -> PullSource | None:
        """The source if the last list has it at `epoch`; else None, and a refresh is asked for (never waited for)."""
        peer = self._known.get((node_id, epoch))
        if peer is None:
            self._wake.set()
        return peer

    def known(self) -> dict[tuple[str, int], PullSource]:
        """Every source of the last list (a bandwidth probe chooses among them)."""
        return self._known

    def settled(self, since: float) -> bool:
        """Whether a read of the list that started after `since` (`time.monotonic()`) has ended, or the last read
        found the directory down (no fresher list is coming soon: a miss is a miss at once)."""
        return self._read_started > since or not self._read_ok

    def wait(self, since: float, timeout: float) -> bool:
        """Block (a reader thread, never the engine step) until `settled(since)` or `timeout`; whether settled."""
        self._wake.set()
        with self._read_ended:
            return self._read_ended.wait_for(lambda: self.settled(since), timeout)

    def _run(self) -> None:
        asyncio.run(self._loop())

    async def _loop(self) -> None:
        # A read that has no answer within one period ends (the directory is down: the last list stays), so that a
        # miss waits for at most about one period (`settled`).
        async with DirectoryClient(
            self.s.directory_urls, deadline=self.s.peer_refresh_s, token=self.s.directory_token, tenant=self.s.tenant
        ) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                self._wake.clear()  # a miss from now on asks for the read after this one
                try:
                    nodes: list[NodeInfo] = await client.nodes()
                except DirectoryError as exc:
                    log.debug("directory node list unavailable (%s): pull sources as last seen", exc)
                    self._read_ok = False
                else:
                    self._read_ok = True
                    # A list taken while this engine's lease had lapsed (it registers again) lacks it: its standing
                    # (the tenant its token gave it) is kept from the last list that had it.
                    self._me = standing(nodes, self.node_id) or self._me
                    self._known = pull_sources(nodes, self.node_id, self._me)  # replaced whole: readers see one list or the next
                with self._read_ended:
                    self._read_started = started
                    self._read_ended.notify_all()
                await asyncio.to_thread(self._wake.wait, self.s.peer_refresh_s)


def probe_source(
    known: dict[tuple[str, int], PullSource], node_id: str, fingerprint: str | None, tp_size: int, rank: int
) -> tuple[str, int] | None:
    """The source a bandwidth probe of TP rank `rank` reads, (node id, epoch): the first by node id that a pull plan
    could name for this engine (its tenant allows it, the same KV fingerprint and TP size, a session for the rank),
    never this engine itself; None while there is none."""
    if fingerprint is None:  # its KV memory is not registered yet
        return None
    for (node, epoch), src in sorted(known.items()):
        if node == node_id or src.refusal is not None or src.fingerprint != fingerprint:
            continue
        if len(src.layouts) == tp_size and src.sessions[rank] is not None:
            return node, epoch
    return None
