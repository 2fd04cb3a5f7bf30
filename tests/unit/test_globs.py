"""Whether two node patterns match a common node id: exact, checked against brute force over short ids, and
what the tokens file refuses with it (engine tokens of different tenants whose patterns overlap)."""

from __future__ import annotations

import itertools
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from directory.auth import load_tokens
from directory.globs import ALPHABET, overlap


def brute(a: str, b: str, chars: str, max_len: int) -> bool:
    return any(
        fnmatchcase(s, a) and fnmatchcase(s, b)
        for n in range(1, max_len + 1)
        for s in map("".join, itertools.product(chars, repeat=n))
    )


@pytest.mark.parametrize(
    "a,b,expected",
    [
        ("worker-*", "worker-*", True),
        ("acme-*", "bravo-*", False),
        ("*", "x", True),
        ("worker-1", "worker-[0-9]", True),
        ("worker-1", "worker-[!1]", False),
        ("worker-[13579]", "worker-[02468]", False),
        ("*-a", "b-*", True),  # "b-a"
        ("a*", "*b", True),
        ("a*a", "b*", False),
        ("?", "??", False),
        ("*?*?*", "?", False),
        ("[]]", "*", False),  # "]" is no node-id character
        ("[!]", "*", False),  # an unclosed set: the literal "[!]"
        ("a[", "a*", False),  # "[" is literal, and no node-id character
        ("[z-a]", "*", False),  # an empty range
        ("[/-:]x", "9x", True),  # a range over the alphabet's punctuation and digits
        ("", "*", False),  # node ids are not empty
        ("a b", "*", False),  # nor hold spaces
        ("*" + "a" * 129, "*", False),  # nor exceed 128 characters
        ("*" + "a" * 128, "*a", True),
    ],
)
def test_overlap(a: str, b: str, expected: bool) -> None:
    assert overlap(a, b) is expected
    assert overlap(b, a) is expected


PATTERN_CHARS = "ab*?[]!-"


def _stand_ins(pattern_chars: str) -> str:
    """The node-id characters that the patterns name, and one of the others between each two of them in code
    order: a pattern over `pattern_chars` cannot tell apart two characters of one such gap (a range such as
    "?-[" matches "@" and the capitals, and "@" stands for them all)."""
    cuts = sorted(set(pattern_chars))
    gaps: dict[object, str] = {}
    for c in sorted(ALPHABET):
        gaps.setdefault(c if c in cuts else sum(c > x for x in cuts), c)
    return "".join(gaps.values())


STAND_INS = _stand_ins(PATTERN_CHARS)


@settings(max_examples=300, deadline=None)
@given(hs.text(PATTERN_CHARS, max_size=6), hs.text(PATTERN_CHARS, max_size=6))
def test_overlap_is_exact_on_short_ids(a: str, b: str) -> None:
    """Over ids of at most 4 characters, against every id from `STAND_INS`."""
    assert overlap(a, b, max_len=4) == brute(a, b, STAND_INS, 4), (a, b)


def test_a_range_over_at_overlaps_itself() -> None:
    """Found by the test above when its stand-ins were "ab-.7": "[?-[]" matches "@"."""
    assert overlap("[?-[]", "[?-[]") and "@" in STAND_INS


@settings(max_examples=60, deadline=None)
@given(hs.text("a[!-]*?", max_size=5), hs.text("a[!-]*?", max_size=5))
def test_overlap_is_exact_over_the_whole_alphabet(a: str, b: str) -> None:
    assert overlap(a, b, max_len=2) == brute(a, b, "".join(sorted(ALPHABET)), 2), (a, b)


def _tokens(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "tokens"
    p.write_text(text)
    return p


def test_tokens_file_refuses_overlapping_patterns_of_different_tenants(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tokens:2 and .*tokens:4: engine tokens of tenants 'acme' and 'bravo'"):
        load_tokens(_tokens(tmp_path, "admin:*:a\nengine@acme:worker-*:e1\nengine:*:e0\nengine@bravo:worker-1?:e2\n"))
    with pytest.raises(ValueError, match="match common node ids"):
        load_tokens(_tokens(tmp_path, "engine@acme:*-eu:e1\nengine@bravo:acme-*:e2\n"))


def test_tokens_file_accepts_what_cannot_collide(tmp_path: Path) -> None:
    table = load_tokens(
        _tokens(
            tmp_path,
            "engine@acme:acme-*:e1\n"
            "engine@acme:worker-*:e2\n"  # one tenant's tokens may overlap
            "engine@bravo:bravo-*:e3\n"
            "engine@carol:worker[!-]*:e4\n"  # "workerX...", never "worker-..."
            "engine:*:e5\n"  # an unconfined token may write any node
            "gateway@dave:*:g1\n",  # gateways write no node
        ),
    )
    assert len(table) == 6
