"""Progress of what takes long, said while it runs: `kvdir up`'s start-up (a cold start takes up to a minute on
a busy machine: `Progress`), and a replay's or a benchmark's work (minutes: `Meter`, a bar with an ETA).

On a terminal one live line is rewritten in place; otherwise (a pipe, a file, CI) plain lines, few enough that
logs stay readable and greppable: start-up's through the launcher's logger, one per step; a `Meter`'s on its
stream, one per 10% of the work (or 30 s without), at least 5 s apart. Both carry the time since the work
began, and neither ever writes to stdout, which may carry --json.
"""

from __future__ import annotations

import io
import logging
import os
import sys
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


class _LiveLine:
    """The one line a terminal shows in place, rewritten with \\r: `Progress` and `Meter` both draw theirs here."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.shown = ""  # the line on screen, "" when none

    def draw(self, line: str) -> None:
        """Put `line` in place of the shown one, cut to the terminal's width (a wrapped line cannot be rewritten)."""
        line = line[: _columns(self.stream) - 1]
        if line != self.shown:
            self.shown = line
            self.stream.write("\r" + line + "\x1b[K")
            self.stream.flush()

    def above(self, say: Callable[[], object]) -> None:
        """`say()` a line above the shown one, which is redrawn below it."""
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
        say()
        if self.shown:
            self.stream.write(self.shown)
            self.stream.flush()

    def end(self) -> None:
        """Leave the shown line on screen and go on below it."""
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = ""


class Progress:
    """Says start-up's progress: `update()` on every poll (cheap when nothing changed), `close()` before other output."""

    def __init__(self, state: StartState, stream: TextIO, *, live: bool, clock: Callable[[], float] = time.monotonic) -> None:
        self.state = state
        self.stream = stream
        self.live = live
        self.clock = clock
        self.t0 = clock()
        self._line = _LiveLine(stream)

    @property
    def elapsed(self) -> float:
        return self.clock() - self.t0

    def update(self, **changes: object) -> None:
        """Apply `changes` to the state (StartState's fields) and say what changed; on a terminal, also tick the clock."""
        before = StartState(**vars(self.state))
        for name, value in changes.items():
            setattr(self.state, name, value)
        if self.live:
            self._line.draw(status_line(self.state, self.elapsed))
            return
        for event in events(before, self.state):
            log.info("%s %s", stamp(self.elapsed), event)

    def note(self, text: str) -> None:
        """Say one line (a stage beginning) with its time stamp; on a terminal above the live line, which is redrawn."""
        self._line.above(lambda: log.info("%s %s", stamp(self.elapsed), text))

    def close(self, final: str | None = None) -> None:
        """End the live line (leaving it on screen), then say `final` if given."""
        self._line.end()
        if final is not None:
            log.info("%s %s", stamp(self.elapsed), final)


# -- long work: a bar with an ETA (replays, benchmarks) ------------------------------------------------------


def clock_text(seconds: float) -> str:
    """A duration as people read it at a glance: 4.2s, 42s, 3m05s, 1h02m."""
    s = max(0.0, seconds)
    if s < 10:
        return f"{s:.1f}s"
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def eta_s(done: float, total: float, elapsed: float) -> float | None:
    """Seconds left at the average rate so far; None before any work is done (no rate to go by)."""
    if done <= 0 or elapsed <= 0:
        return None
    return max(0.0, total - done) * elapsed / done


def _eta_text(done: float, total: float, elapsed: float) -> str:
    left = eta_s(done, total, elapsed)
    return "ETA ?" if left is None else f"ETA {clock_text(left)}"


class Meter:
    """Progress of one long piece of work, in stages or not (a replay's policies, a benchmark's load runs).

    `update(done, now)` as the work goes (`done` counted within the current `stage()`, if any), `close(now)` at
    the end. On a terminal (`live`) a bar with the ETA of the whole and of the stage is redrawn in place, at most
    every `redraw_s`; otherwise a plain line when `every_frac` more of the whole is done or `every_s` passed since
    the last line, never closer together than `min_gap_s`, so that the log of a run of minutes stays a few lines.
    The time is always passed in (`now`, seconds on one monotonic clock): nothing here reads a clock, so that the
    output is a function of its inputs.
    """

    def __init__(
        self,
        label: str,
        total: float,
        stream: TextIO,
        *,
        live: bool,
        now: float,
        unit: str = "",
        every_s: float = 30.0,
        every_frac: float = 0.1,
        min_gap_s: float = 5.0,
        redraw_s: float = 0.1,
    ) -> None:
        self.label, self.total, self.stream, self.live, self.unit = label, total, stream, live, unit
        self.every_s, self.every_frac, self.min_gap_s, self.redraw_s = every_s, every_frac, min_gap_s, redraw_s
        self.t0 = self._now = self._said_at = now
        self._said_frac = 0.0
        self._drawn_at = float("-inf")
        self._line = _LiveLine(stream)
        self._base = 0.0  # the whole's work in the stages already ended
        self._stage: tuple[str, float, float] | None = None  # name, total, start
        self._stage_done = 0.0

    @property
    def done(self) -> float:
        """Work done so far, of `total`."""
        return min(self.total, self._base + self._stage_done)

    def stage(self, name: str, total: float, now: float) -> None:
        """Begin the next part of the work (`total` of the whole's units); the previous one, if any, counts as ended."""
        if self._stage is not None:
            self._base += self._stage[1]
        self._stage, self._stage_done = (name, total, now), 0.0
        self.update(0.0, now)

    def update(self, done: float, now: float) -> None:
        """`done` units of the current stage (of the whole when there is none) are done at `now`."""
        self._stage_done = min(done, self._stage[1]) if self._stage is not None else done
        self._now = now
        finished = self.done >= self.total
        if self.live:
            if now - self._drawn_at >= self.redraw_s or finished:
                self._drawn_at = now
                self._line.draw(self.bar_line(now))
            return
        if finished:
            return  # the summary line of `close` says it
        frac = self.done / self.total if self.total else 1.0
        gap = now - self._said_at
        if gap >= self.every_s or (frac - self._said_frac >= self.every_frac and gap >= self.min_gap_s):
            self._said_at, self._said_frac = now, frac
            self.stream.write(self.plain_line(now) + "\n")
            self.stream.flush()

    def note(self, text: str) -> None:
        """Say one line (an event within the work) above the live bar, which is redrawn below it."""
        self._line.above(lambda: self.stream.write(text + "\n"))
        self.stream.flush()

    def close(self, now: float | None = None) -> None:
        """End with one summary line (in place of the live bar); `now` defaults to the last update's."""
        line = self.summary_line(self._now if now is None else now)
        if self.live:
            self._line.draw(line)
            self._line.end()
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def __enter__(self) -> Meter:
        return self

    def __exit__(self, kind: object, *_: object) -> None:
        if kind is None:
            self.close()
        else:  # an error: leave the bar where it got to, and the traceback below it
            self._line.end()

    # -- the lines, pure functions of the state and `now`

    def _counts(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        return f"{self.done:,.0f}/{self.total:,.0f}{unit}"

    def _percent(self) -> str:
        return f"{100 * self.done / self.total if self.total else 100.0:3.0f}%"

    def _stage_text(self, now: float, sep: str) -> str:
        if self._stage is None:
            return ""
        name, total, start = self._stage
        pct = 100 * self._stage_done / total if total else 100.0
        return f"{name} {pct:.0f}%{sep} {_eta_text(self._stage_done, total, now - start)}"

    def bar_line(self, now: float, width: int = 20) -> str:
        """The live line, what matters first (a narrow terminal cuts the end):
        `label [########------------]  42% ETA 17s | stage 50% ETA 3.0s | 420/1,000 units 12s`."""
        frac = self.done / self.total if self.total else 1.0
        filled = min(width, int(frac * width))
        elapsed = now - self.t0
        parts = [
            f"{self.label} [{'#' * filled}{'-' * (width - filled)}] {self._percent()} {_eta_text(self.done, self.total, elapsed)}"
        ]
        if self._stage is not None:
            parts.append(self._stage_text(now, ""))
        parts.append(f"{self._counts()} {clock_text(elapsed)}")
        return " | ".join(parts)

    def plain_line(self, now: float) -> str:
        """A periodic line off a terminal: `label: 42% (420/1,000 units) after 12s, ETA 17s; stage 50%, ETA 3.0s`."""
        elapsed = now - self.t0
        line = f"{self.label}: {self._percent().strip()} ({self._counts()}) after {clock_text(elapsed)}, "
        line += _eta_text(self.done, self.total, elapsed)
        stage = self._stage_text(now, ",")
        return f"{line}; {stage}" if stage else line

    def summary_line(self, now: float) -> str:
        """The last line: `label: 100% (1,000/1,000 units) in 29s`."""
        return f"{self.label}: {self._percent().strip()} ({self._counts()}) in {clock_text(now - self.t0)}"


def clocked(meter: Meter) -> Callable[[float], None]:
    """`meter.update(done, now)` with `now` read from the monotonic clock: the callback that work loops take."""
    return lambda done: meter.update(done, time.monotonic())


def on_terminal(stream: TextIO) -> bool:
    """Whether `stream` is a terminal that can rewrite a line in place."""
    return stream.isatty() and os.environ.get("TERM") != "dumb"


def stderr_meter(label: str, total: float, *, unit: str = "") -> Meter:
    """A `Meter` on stderr (never stdout, which may carry --json), live on a terminal, started now."""
    return Meter(label, total, sys.stderr, live=on_terminal(sys.stderr), now=time.monotonic(), unit=unit)
