"""Whether two tokens' node patterns (`fnmatch` globs, case-sensitive) can match a common node id.

Exact, not a heuristic: each pattern is split into the pieces `fnmatch` translates one by one (`*`, and
single characters: `?`, a literal, a `[...]` or `[!...]` set, whose characters are found by asking
`fnmatchcase` itself over the node-id alphabet), and a breadth-first search over the pairs of positions
of the two patterns, one node-id character at a time, finds whether both can end together on an id of
1 to NODE_ID_MAX_LEN characters.
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase

from kvproto.schemas import NODE_ID_MAX_LEN, NODE_ID_PATTERN

ALPHABET = frozenset(c for c in map(chr, range(32, 127)) if re.fullmatch(NODE_ID_PATTERN, c))
"""The characters a node id may hold."""

STAR = None
"""A `*` piece: any run of characters."""

Piece = frozenset[str] | None  # one character of these, or STAR


def pieces(pattern: str) -> list[Piece]:
    """`pattern` as fnmatch reads it: STAR, or the node-id characters one position may hold."""
    out: list[Piece] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        i += 1
        if c == "*":
            if not out or out[-1] is not STAR:
                out.append(STAR)
            continue
        text = c
        if c == "[":  # fnmatch.translate's reading of a set: a "]" right after "[" or "[!" belongs to it
            j = i
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j < n:
                text, i = pattern[i - 1 : j + 1], j + 1
        out.append(frozenset(a for a in ALPHABET if fnmatchcase(a, text)))
    return out


def _closure(p: list[Piece], i: int) -> list[int]:
    """Position `i` and those a STAR there lets the pattern reach without reading a character."""
    out = [i]
    while i < len(p) and p[i] is STAR:
        i += 1
        out.append(i)
    return out


def _steps(p: list[Piece], i: int) -> list[tuple[frozenset[str], int]]:
    """From position `i` (not an end): the characters one step may read, and where it leads."""
    piece = p[i]
    return [(ALPHABET, i)] if piece is STAR else [(piece, i + 1)]


def overlap(a: str, b: str, max_len: int = NODE_ID_MAX_LEN) -> bool:
    """Whether some node id of 1..`max_len` characters matches both patterns."""
    pa, pb = pieces(a), pieces(b)
    frontier = {(i, j) for i in _closure(pa, 0) for j in _closure(pb, 0)}
    for _ in range(max_len):
        moved: set[tuple[int, int]] = set()
        for i, j in frontier:
            if i == len(pa) or j == len(pb):
                continue
            for chars_a, ni in _steps(pa, i):
                for chars_b, nj in _steps(pb, j):
                    if chars_a & chars_b:
                        moved.update((x, y) for x in _closure(pa, ni) for y in _closure(pb, nj))
        if (len(pa), len(pb)) in moved:
            return True
        if not moved or moved == frontier:  # nothing new can follow
            return False
        frontier = moved
    return False
