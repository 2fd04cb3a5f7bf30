"""tests/conftest.py's SERIAL list names real files and tests: a typo would quietly run a timing-sensitive
test next to another worker's clusters."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import SERIAL

ROOT = Path(__file__).resolve().parents[2]


def test_every_serial_entry_names_a_test_file_or_a_test_in_it() -> None:
    for entry in SERIAL:
        path, _, name = entry.partition("::")
        file = ROOT / path
        assert file.is_file(), entry
        if name:
            tree = ast.parse(file.read_text())
            assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, entry
