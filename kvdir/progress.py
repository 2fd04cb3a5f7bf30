"""What `kvdir up` has started so far, said while it starts (a cold start takes up to a minute on a busy machine).

On a terminal one live line is rewritten in place; otherwise (a pipe, a file, CI) every step is one plain
line through the launcher's logger, so logs stay readable and greppable. Both carry the seconds since
the launch began.
"""

from __future__ import annotations

import io
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

log = logging.getLogger("kvdir.up")


@dataclass
class StartState:
    """How far start-up got: counts of processes that answered as the launcher's own."""

    replicas: int
    workers: int
    gateway: bool
    replicas_up: int = 0
    leader: str | None = None  # "replica N" once elected
    leader_url: str | None = None
    workers_up: int = 0
    gateway_ready: bool = False


def stamp(elapsed: float) -> str:
    return f"[{elapsed:5.1f}s]"


def status_line(s: StartState, elapsed: float) -> str:
    """The live line: every stage reached so far, and the one under way."""
    parts = [f"replicas {s.replicas_up}/{s.replicas} up"]
    if s.leader is None:
        parts.append("electing a leader")
    else:
        parts.append(f"leader {s.leader}")
        if s.workers:
            parts.append(f"workers {s.workers_up}/{s.workers} registered")
        if s.gateway and (s.workers_up == s.workers or s.gateway_ready):
            parts.append("gateway ready" if s.gateway_ready else "gateway starting")
    return f"{stamp(elapsed)} " + ", ".join(parts)


def events(before: StartState, after: StartState) -> list[str]:
    """The plain lines for what changed between two states, in start-up order (without the time stamp)."""
    out = []
    if after.replicas_up != before.replicas_up:
        out.append(f"replicas {after.replicas_up}/{after.replicas} up")
    if after.leader != before.leader and after.leader is not None:
        out.append(f"leader elected: {after.leader}" + (f" ({after.leader_url})" if after.leader_url else ""))
    if after.workers_up != before.workers_up:
        out.append(f"workers {after.workers_up}/{after.workers} registered")
    if after.gateway_ready and not before.gateway_ready:
        out.append("gateway ready")
    return out


def _columns(stream: TextIO) -> int:
    """The width of the terminal `stream` writes to (stdout may be a pipe while stderr is the terminal)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, io.UnsupportedOperation):
        return 80


class Progress:
    """Says start-up's progress: `update()` on every poll (cheap when nothing changed), `close()` before other output."""

    def __init__(self, state: StartState, stream: TextIO, *, live: bool, clock: Callable[[], float] = time.monotonic) -> None:
        self.state = state
        self.stream = stream
        self.live = live
        self.clock = clock
        self.t0 = clock()
        self._shown = ""  # the live line on screen, "" when none

    @property
    def elapsed(self) -> float:
        return self.clock() - self.t0

    def update(self, **changes: object) -> None:
        """Apply `changes` to the state (StartState's fields) and say what changed; on a terminal, also tick the clock."""
        before = StartState(**vars(self.state))
        for name, value in changes.items():
            setattr(self.state, name, value)
        if self.live:
            line = status_line(self.state, self.elapsed)
            width = _columns(self.stream) - 1  # a wrapped line cannot be rewritten with \r
            if line[:width] != self._shown:
                self._shown = line[:width]
                self.stream.write("\r" + self._shown + "\x1b[K")
                self.stream.flush()
            return
        for event in events(before, self.state):
            log.info("%s %s", stamp(self.elapsed), event)

    def note(self, text: str) -> None:
        """Say one line (a stage beginning) with its time stamp; on a terminal above the live line, which is redrawn."""
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
        log.info("%s %s", stamp(self.elapsed), text)
        if self._shown:
            self.stream.write(self._shown)
            self.stream.flush()

    def close(self, final: str | None = None) -> None:
        """End the live line (leaving it on screen), then say `final` if given."""
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = ""
        if final is not None:
            log.info("%s %s", stamp(self.elapsed), final)
