"""The commands the README and docs/ mark as runnable run as written, from the repository's root.

A fenced block whose info string has the word `runnable` (```` ```sh runnable ````) is executed with bash
(`-euo pipefail`: every line must succeed), with the running interpreter's bin directory first on PATH so a
bare `kvdir` is this checkout's. Keep such blocks to a second or two each: they run in `make test`. Long
commands (`make run`, a full replay) stay unmarked. This lives under tests/integration because it starts
processes, which tests/unit never does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 60


class Block(NamedTuple):
    page: Path
    line: int  # of the opening fence, 1-based
    info: list[str]
    body: str


def fenced_blocks(page: Path) -> list[Block]:
    """Every fenced code block of a Markdown page, with its info string's words."""
    blocks: list[Block] = []
    fence: str | None = None
    info: list[str] = []
    start = 0
    body: list[str] = []
    for n, line in enumerate(page.read_text().splitlines(), 1):
        stripped = line.lstrip()
        if fence is None:
            if stripped.startswith(("```", "~~~")):
                fence, info, start, body = stripped[:3], stripped[3:].split(), n, []
        elif stripped.startswith(fence) and not stripped.strip(fence[0]).strip():
            blocks.append(Block(page, start, info, "\n".join(body) + "\n"))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"{page}: the fence opened at line {start} is never closed"
    return blocks


RUNNABLE = [b for page in PAGES for b in fenced_blocks(page) if "runnable" in b.info]


def test_the_docs_mark_commands_runnable() -> None:
    """The README's tour and the docs each keep at least one checked command, so this test cannot go vacuous."""
    pages = {b.page.relative_to(ROOT).as_posix() for b in RUNNABLE}
    assert {"README.md", "docs/configuration.md", "docs/replay.md"} <= pages, pages
    assert all(b.info[0] in ("sh", "bash", "console") for b in RUNNABLE), "runnable blocks are shell"


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: f"{b.page.relative_to(ROOT).as_posix()}:{b.line}")
def test_a_runnable_block_runs(block: Block) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.body],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    where = f"{block.page.relative_to(ROOT)} line {block.line}"
    assert out.returncode == 0, f"{where} exited {out.returncode}:\n{block.body}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    assert "Traceback" not in out.stderr, f"{where}:\n{out.stderr[-2000:]}"
