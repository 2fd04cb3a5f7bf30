"""The adapters' side of KV identity (adapters/kv_identity.py): the name requests are hashed under, the multimodal
extra keys, and the engine fingerprint that gates pulls (docs/protocol.md §1.1, §2.1)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from adapters.kv_identity import engine_fingerprint, mm_extra, request_identity, served_name, weights_digest
from kvproto.hashing import KvIdentity, identity_hashes, multimodal_extra_keys

BASE = {"model": "/models/m", "revision": None, "dtype": "bfloat16", "kv_cache_dtype": "auto", "block_size": 32}


def fp(**over: object) -> str:
    args = {**BASE, "page_bytes": [4096, 4096], **over}
    return engine_fingerprint(**args)  # type: ignore[arg-type]


def test_served_name_is_the_first_served_name_else_the_model() -> None:
    assert served_name("alpha", "/models/m") == "alpha"
    assert served_name(["alpha", "a2"], "/models/m") == "alpha"
    assert served_name(None, "/models/m") == "/models/m"
    assert served_name([], "org/m") == "org/m"


def test_a_request_identity_names_adapter_and_salt() -> None:
    assert request_identity("ns", "m", None, None) == KvIdentity("ns", "m")
    assert request_identity("ns", "m", "sql", "s1") == KvIdentity("ns", "m", "sql", "s1")


@pytest.mark.parametrize(
    "change",
    [
        {"model": "/models/other"},
        {"revision": "r2"},
        {"dtype": "float16"},
        {"kv_cache_dtype": "fp8"},
        {"block_size": 16},
        {"page_bytes": [4096, 8192]},
        {"page_bytes": [4096, 4096, 4096]},
    ],
)
def test_every_part_of_what_makes_kv_compatible_changes_the_fingerprint(change: dict[str, object]) -> None:
    assert fp() == fp() and fp(**change) != fp()


def test_replacing_a_local_models_weights_changes_its_fingerprint(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert weights_digest(str(model)) is None  # no weight files: nothing to tell versions apart by
    weights = model / "model.safetensors"
    weights.write_bytes(b"v1")
    os.utime(weights, ns=(1, 1_000_000_000))
    first = fp(model=str(model))
    assert weights_digest(str(model)) is not None and fp(model=str(model)) == first
    weights.write_bytes(b"v2")  # the same size, written again: the model was upgraded in place
    os.utime(weights, ns=(1, 2_000_000_000))
    assert fp(model=str(model)) != first
    assert weights_digest("org/hub-model") is None


def test_mm_extra_follows_vllms_features() -> None:
    feature = SimpleNamespace(identifier="img-1", mm_position=SimpleNamespace(offset=10, length=40))
    extra = mm_extra(16, 4, [feature])
    assert extra == multimodal_extra_keys(16, 4, [(10, 40, "img-1")]) and sorted(extra) == [0, 1, 2, 3]
    tokens = list(range(64))
    assert identity_hashes(tokens, KvIdentity(model="m"), 16, extra) != identity_hashes(tokens, KvIdentity(model="m"), 16)
    with pytest.raises(ValueError):
        mm_extra(16, 4, [SimpleNamespace(identifier=None, mm_position=feature.mm_position)])
