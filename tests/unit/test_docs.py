"""The docs cannot drift from the code: the configuration tables list every setting, and every link resolves.

docs/configuration.md holds the flag tables (they left the README for it); the fenced commands marked
`runnable` are executed by tests/integration/test_docs_commands.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from adapters.config import EventsSettings
from directory.config import DirectorySettings
from gateway.config import GatewaySettings
from kvdir.launcher import UpSettings
from worker_stub.config import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()
# Every Markdown file a reader reaches from the README.
PAGES = [
    ROOT / "README.md",
    ROOT / "BENCHMARKS.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "data" / "traces" / "README.md",
]
LINK = re.compile(r"!?\[[^\]]*\]\(([^()\s]+)\)")


@pytest.mark.parametrize("cls", [DirectorySettings, EventsSettings, GatewaySettings, UpSettings, WorkerSettings])
def test_every_setting_is_documented_with_flag_and_env(cls) -> None:
    for name in cls.model_fields:
        flag = "--" + name.replace("_", "-")
        env = "KVDIR_" + name.upper()
        assert f"| `{flag}` | `{env}` |" in CONFIGURATION, f"{cls.__name__}.{name} is missing from docs/configuration.md"


def test_role_prefixed_variables_are_documented() -> None:
    from kvdir.roles import ROLES

    for role in ROLES.values():
        assert f"`{role.env_prefix}*`" in CONFIGURATION, (
            f"docs/configuration.md does not name {role.env_prefix}* (kvdir {role.name})"
        )


def test_readme_starts_with_the_two_commands() -> None:
    head = README[:600]
    assert "make run" in head and "make test" in head


def test_readme_links_every_docs_page() -> None:
    """Nothing moved out of the README is out of reach: it links every page under docs/."""
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{page.name}" in README, f"README.md does not link docs/{page.name}"


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    fence = None
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        if fence is None and stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
        elif fence is not None and stripped.startswith(fence) and not stripped.strip(fence[0]).strip():
            fence = None
        elif fence is None:
            yield n, line


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-', repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(text):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def test_anchor_slugs_follow_github() -> None:
    text = "# What `make run` shows\n## Directory (`kvdir bench directory --json`)\n## A\n## A\n```\n# not a heading\n```\n"
    assert anchors(text) == {"what-make-run-shows", "directory-kvdir-bench-directory---json", "a", "a-1"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    """Every relative link (files, images, anchors) in the README and the docs points at something that exists."""
    text = page.read_text()
    broken = []
    for n, line in prose_lines(text):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"line {n}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                broken.append(f"line {n}: {target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
