"""What an engine adapter needs to name its KV as the gateway does: request identities and the engine's fingerprint.

Pure (no vLLM import), so the rules are unit-tested here and shared by the vLLM connector and any other
adapter. docs/protocol.md §1.1 defines the identity a block is hashed under, §2.1 the fingerprint a
registration carries.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import xxhash

from kvproto.hashing import KvIdentity, multimodal_extra_keys

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def served_name(served_model_name: str | Sequence[str] | None, model: str) -> str:
    """The name a base-model request is hashed under: the first served name (vLLM's `--served-model-name`),
    else the model's path or hub id, as vLLM's own /v1/models names it."""
    if isinstance(served_model_name, str) and served_model_name:
        return served_model_name
    if served_model_name and not isinstance(served_model_name, str):
        return str(next(iter(served_model_name)))
    return model


def request_identity(namespace: str, model: str, lora_name: str | None, cache_salt: str | None) -> KvIdentity:
    """The identity of one request's blocks: the engine's model, the request's LoRA adapter and cache salt."""
    return KvIdentity(namespace, model, lora_name or "", cache_salt or "")


def mm_extra(block_size: int, n_blocks: int, features: Iterable[Any]) -> dict[int, bytes]:
    """Per-block extra keys of a request's multimodal inputs (vLLM's `mm_features`: `identifier`, and
    `mm_position` with `offset` and `length`); an input without an identifier makes its blocks unnamed
    (a ValueError: the caller publishes nothing it cannot name)."""
    inputs = []
    for f in features:
        ident = getattr(f, "identifier", None)
        pos = getattr(f, "mm_position", None)
        if not ident or pos is None:
            raise ValueError("a multimodal input without an identifier or position")
        inputs.append((int(pos.offset), int(pos.length), str(ident)))
    return multimodal_extra_keys(block_size, n_blocks, inputs)


def weights_digest(model: str) -> str | None:
    """A digest of a local model directory's weight files (names, sizes, modification times); None for a hub
    id or a path without weight files. Cheap (no file is read), and changes when the weights are replaced
    in place, which a name and revision alone would not show."""
    path = Path(model)
    if not path.is_dir():
        return None
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        return None
    h = xxhash.xxh3_128()
    for p in files:
        st = os.stat(p)
        h.update(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()


def engine_fingerprint(
    *,
    model: str,
    revision: str | None,
    dtype: str,
    kv_cache_dtype: str,
    block_size: int,
    page_bytes: Sequence[int],
    tp_size: int = 1,
) -> str:
    """The KV fingerprint of an engine (docs/protocol.md §2.1): equal only where KV computed by one is valid
    in the other. It covers the model (path or hub id, revision, and the weight files' digest where local),
    the dtypes, the block size and the KV layout (each layer's page bytes on one rank, and the TP rank count
    that slices the heads; not how many blocks it has). TP 1 leaves the digest as it was before ranks."""
    parts: list[Any] = [model, revision, weights_digest(model), dtype, kv_cache_dtype, block_size, list(page_bytes)]
    if tp_size != 1:
        parts.append(tp_size)
    return "vllm-" + xxhash.xxh3_128_hexdigest(json.dumps(parts, separators=(",", ":")).encode())
