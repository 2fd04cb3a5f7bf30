"""The replay's trace loader reads gzipped traces, and the trace bundled in data/traces is the one docs/replay.md
measured (the docs' commands name it)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvtools.replay.cli import main as replay_main
from kvtools.replay.sim import oracle_hit_rate
from kvtools.replay.trace import load_mooncake

BUNDLED = Path(__file__).resolve().parents[2] / "data" / "traces" / "mooncake_conversation_trace.jsonl.gz"
ROWS = [
    {"timestamp": 0, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]},
    "{not json",
    {"timestamp": 250.5, "input_length": 600, "output_length": 3, "hash_ids": [0, 4]},
]


def _text(rows: list[object]) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def test_a_gzipped_trace_loads_as_the_plain_one(tmp_path: Path) -> None:
    plain, packed = tmp_path / "t.jsonl", tmp_path / "t.jsonl.gz"
    plain.write_text(_text(ROWS))
    packed.write_bytes(gzip.compress(_text(ROWS).encode()))
    requests, errors = load_mooncake(packed)
    assert (requests, errors) == load_mooncake(plain)
    assert len(requests) == 2 and [e.split(":")[0] for e in errors] == ["line 2"]


@pytest.mark.parametrize("damage", ["truncated", "not gzip"])
def test_a_damaged_gz_is_a_clear_error(tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]) -> None:
    data = gzip.compress(_text(ROWS * 50).encode())
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"plain text, no gzip header\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl\.gz: not a valid gzip file"):
        load_mooncake(bad)
    assert replay_main(["--trace", str(bad)]) == 2  # the command says so and exits 2, no traceback
    assert "not a valid gzip file" in capsys.readouterr().err


def test_the_bundled_trace_is_the_one_the_docs_measured() -> None:
    requests, errors = load_mooncake(BUNDLED)
    assert errors == [] and len(requests) == 12_031  # data/traces/README.md, docs/replay.md
    assert round(oracle_hit_rate(requests, by="tokens", block_tokens=512), 3) == 0.374
    assert round(oracle_hit_rate(requests), 3) == 0.366
