"""The kvdir connector's host tier in real vLLM engines (issue #32, docs/engines.md): engine A has a small device
cache (`--num-gpu-blocks-override 40`, `--max-model-len 1024`) and a 256-block host tier. Prompts that need the
device evict the prompt's blocks from vLLM's prefix cache; the directory then lists them in A's host tier, A
serves the prompt again from there, and B pulls it from there: each time with the output of recomputing it.

This module's engines are its own (the conftest runs it before the session's two: at most two engines at a time).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvdir.local_cluster import Cluster
from kvproto import media
from kvproto.hashing import KvIdentity, identity_hashes
from kvtools.vllm_launcher import running
from tests.support.wait import wait_for
from tests.vllm.conftest import BLOCK, MODEL, PROMPT, Engine, running_directory, vllm_venv
from tests.vllm.test_connector import FAILED, PULL, _holder, _plan, _recomputed

HOST_LOADED = "kvdir_connector_host_loaded_blocks_total"
HOST_FAILED = "kvdir_connector_host_load_failed_blocks_total"
HOST_SAVED = "kvdir_connector_host_saved_blocks_total"
SMALL = ("--max-model-len", "1024")  # after the launcher's 4096: vLLM takes the last


class Pair:
    def __init__(self, model: Path, directory: Cluster, logs: Path) -> None:
        self.directory = directory
        self.a = Engine(
            "host-a",
            vllm_venv(),
            model,
            directory.replica_urls,
            logs,
            num_blocks=40,
            connector={"host_blocks": 256},
            extra_args=SMALL,
        )
        self.b = Engine("host-b", vllm_venv(), model, directory.replica_urls, logs)


@pytest.fixture(scope="module")
def pair(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    with running_directory(tmp_path_factory.mktemp("host-directory")) as directory:
        p = Pair(model, directory, tmp_path_factory.mktemp("host-engines"))
        with running([p.a, p.b]):
            yield p


def _hashes(engine: Engine) -> list[int]:
    return identity_hashes(engine.tokenize(PROMPT), KvIdentity(model=MODEL), BLOCK)


def _evict(engine: Engine) -> None:
    """Three prompts of 18 blocks each (the device has 39): every block of an earlier prompt is evicted."""
    for i in range(3):
        tokens = engine.tokenize(f"filler {i} keeps the device busy with other text " * 64)[: 18 * BLOCK]
        engine.complete(tokens, max_tokens=1)


def _in_host_tier(p: Pair, hashes: list[int]) -> dict[str, Any]:
    """A's entry for the prompt once the directory lists every block of it in A's host tier."""
    return wait_for(
        lambda: (
            h
            if (h := _holder(p.directory, hashes, p.a.name)) is not None
            and h["matched_blocks"] == len(hashes)
            and {media.medium_name(loc) for loc in h["slots"]} == {"host"}
            else None
        ),
        what="the prompt's blocks listed in A's host tier",
        timeout=30,
    )


def test_an_evicted_prefix_comes_back_from_the_host_tier_and_a_peer_pulls_it_from_there(pair: Pair) -> None:
    a, b = pair.a, pair.b
    expected = _recomputed(b)["choices"][0]["text"]
    hashes = _hashes(a)
    a.complete(PROMPT)
    assert a.metric(HOST_SAVED) >= len(hashes)  # every block it completed, copied to its host tier
    _evict(a)
    _in_host_tier(pair, hashes)

    # A serves it again: vLLM's own cache has none of it; the connector loads it back from the host tier.
    loaded, failed = a.metric(HOST_LOADED), a.metric(HOST_FAILED)
    out = a.complete(PROMPT)
    n = (out["usage"]["prompt_tokens"] - 1) // BLOCK  # never the block with the last token
    assert (a.metric(HOST_LOADED) - loaded, a.metric(HOST_FAILED) - failed) == (n, 0), a.log_lines("host-tier")
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= n * BLOCK
    assert out["choices"][0]["text"] == expected
    # Back on A's device, the directory lists device blocks again (the device wins)...
    wait_for(
        lambda: (h := _holder(pair.directory, hashes, a.name)) is not None and max(h["slots"][:n]) <= media.SLOT_MASK,
        what="A's device blocks listed again",
        timeout=30,
    )

    # ... until evicted again: then B pulls the prefix from A's host tier.
    _evict(a)
    holder = _in_host_tier(pair, hashes)
    b.reset_cache()
    pulled, b_failed = b.metric(PULL), b.metric(FAILED)
    out = b.complete(PROMPT, kv_transfer_params=_plan(holder))
    assert (b.metric(PULL) - pulled, b.metric(FAILED) - b_failed) == (n, 0), b.log_lines("pull of")
    assert out["choices"][0]["text"] == expected
