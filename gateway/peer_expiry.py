"""The notes a gateway holds from its peers, by when they expire (gateway.peers)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.engine_registry import EngineState


@dataclass(slots=True)
class Held:
    """A peer's note as folded in: the engine state its tokens were added to, and its place in the expiry heap."""

    key: tuple[str, int]
    engine: EngineState
    node: str
    tokens: float
    expires: float
    pos: int = -1


class Expiry:
    """A min-heap of held notes by expiry in which each note knows its index, so one that ends early (its
    ``done``, dropped for room) is taken out at once: the heap never holds more than the notes held."""

    __slots__ = ("a",)

    def __init__(self) -> None:
        self.a: list[Held] = []

    def __len__(self) -> int:
        return len(self.a)

    def push(self, h: Held) -> None:
        h.pos = len(self.a)
        self.a.append(h)
        self._up(h.pos)

    def first(self) -> Held | None:
        return self.a[0] if self.a else None

    def remove(self, h: Held) -> None:
        a, i = self.a, h.pos
        last = a.pop()
        h.pos = -1
        if last is not h:
            a[i] = last
            last.pos = i
            self._up(i)
            self._down(last.pos)

    def _swap(self, i: int, j: int) -> None:
        a = self.a
        a[i], a[j] = a[j], a[i]
        a[i].pos, a[j].pos = i, j

    def _up(self, i: int) -> None:
        a = self.a
        while i > 0:
            parent = (i - 1) // 2
            if a[parent].expires <= a[i].expires:
                return
            self._swap(i, parent)
            i = parent

    def _down(self, i: int) -> None:
        a, n = self.a, len(self.a)
        while True:
            low, left = i, 2 * i + 1
            if left < n and a[left].expires < a[low].expires:
                low = left
            if left + 1 < n and a[left + 1].expires < a[low].expires:
                low = left + 1
            if low == i:
                return
            self._swap(i, low)
            i = low
