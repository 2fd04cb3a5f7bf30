"""The demo `kvdir up --demo` drives: the directory on its own, a cache hit and a pull, chats through the gateway.

What it prints is quoted in README.md ("What `make run` shows"): keep the two in step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from kvproto.client import DirectoryClient
from kvproto.hashing import KvIdentity, block_hashes, identity_hashes

SYSTEM = "You are a helpful assistant for an LLM inference cluster. Answer briefly. " * 4
TURN1 = "User: how does prefix caching cut time to first token?\n"
TURN2 = "Assistant: a node that holds the prompt's KV blocks skips their prefill.\nUser: and across nodes?\n"

# One system prompt per chat, each with its own first 16-token block (the chat template's "<|system|>\n" is
# 11 of them), so no chat starts with another's cached prefix and the gateway is free to spread them.
CHATS = (
    "Bicycle shop support: answer questions about repairs, parts and opening hours. " * 4,
    "Rail travel planner: suggest train connections across Europe with changes and fares. " * 4,
    "Kitchen helper: propose a recipe from whatever the user says is in the fridge. " * 4,
    "Physics tutor: explain one idea at a time to a high-school student, with an example. " * 4,
)
TURNS = 3
STUB = KvIdentity(model="kvdir-stub")  # the worker stubs' model: the KV identity their blocks are hashed under
PUBLISH_WAIT_S = 5.0  # how long to wait for an engine's asynchronous publish before going on without it


def _tokens(text: str) -> list[int]:
    return list(text.encode("utf-8"))


async def run_demo(
    urls: Sequence[str], workers: Sequence[str], gateway: str | None, say: Callable[[str], None], token: str | None = None
) -> None:
    """The directory on its own; a prompt reused locally and pulled by a peer; chats through the gateway.

    `token` is an admin token when the directory has auth on: the demo registers nodes no engine token covers.
    """
    await _directory_demo(urls, say, token)
    if len(workers) >= 2:
        await _worker_demo(urls, workers, say, token)
    if gateway is not None and workers:
        await _gateway_demo(gateway, urls, workers, say, token)
        say(f'demo done: the gateway is {gateway}, its status page {gateway}/ (README.md, "A 5-minute tour")')
    else:
        say("demo done")


async def _directory_demo(urls: Sequence[str], say: Callable[[str], None], token: str | None) -> None:
    """Register two pretend engines, publish what each 'computed', look a prompt up on a follower, restart one."""
    say("-- 1. the directory alone: two pretend engines, demo-a and demo-b, publish the KV blocks they hold")
    async with DirectoryClient(urls, token=token) as d:
        a = await d.register(
            "demo-a",
            "http://127.0.0.1:9001",
            capacity_blocks=1024,
            block_size=16,
            regions=[{"rank": 0, "base_addr": 0x7F0000000000, "length": 1024 * 16384, "rkey": 17, "block_bytes": 16384}],
        )
        b = await d.register("demo-b", "http://127.0.0.1:9002", capacity_blocks=1024, block_size=16)
        say(
            f"registered demo-a (epoch {a.epoch}) and demo-b (epoch {b.epoch}), lease {a.lease_ttl_s}s "
            "(every registration gets a new, larger epoch; a directory's first one is random)"
        )
        conv = block_hashes(_tokens(SYSTEM + TURN1))
        sys_only = block_hashes(_tokens(SYSTEM))
        await d.publish("demo-a", a.epoch, [(h, slot) for slot, h in enumerate(conv)])
        await d.publish("demo-b", b.epoch, [(h, 100 + slot) for slot, h in enumerate(sys_only)])
        say(
            f"demo-a published {len(conv)} blocks (system prompt + turn 1); demo-b published the {len(sys_only)}-block system prompt"
        )
        follower = DirectoryClient(list(urls[1:]) + list(urls[:1]), token=token)
        try:
            res = await follower.lookup(tokens=_tokens(SYSTEM + TURN1 + TURN2), with_slots=True)
        finally:
            await follower.aclose()
        say(f"lookup of turn 2 ({res.num_blocks} blocks) on another replica, longest cached prefix first:")
        for h in res.holders:
            assert h.slots is not None  # asked for with_slots=True: the directory sends every holder's slots
            say(f"  {h.node_id}: {h.matched_blocks} blocks cached, in its slots {h.slots[:4]}...")
        a2 = await d.register("demo-a", "http://127.0.0.1:9001", capacity_blocks=1024, block_size=16)
        res = await d.lookup(tokens=_tokens(SYSTEM + TURN1 + TURN2), linearizable=True)
        say(
            f"demo-a restarted (epoch {a2.epoch}): its old entries are gone; holders now "
            + ", ".join(f"{h.node_id}={h.matched_blocks}" for h in res.holders)
        )
        await d.deregister("demo-a", a2.epoch)
        await d.deregister("demo-b", b.epoch)


async def _worker_demo(urls: Sequence[str], workers: Sequence[str], say: Callable[[str], None], token: str | None) -> None:
    """The same prompt twice on worker-1 (a local cache hit), then on worker-2 with a pull plan from worker-1."""
    say("-- 2. two worker stubs: the same prompt twice on worker-1, then on worker-2, which pulls it from worker-1")
    prompt = SYSTEM + TURN1
    body = {"model": "kvdir-stub", "prompt": prompt, "max_tokens": 8}
    async with httpx.AsyncClient(timeout=60) as http, DirectoryClient(urls, token=token) as d:
        for attempt in ("cold", "warm"):
            r = (await http.post(workers[0] + "/v1/completions", json=body)).json()
            say(
                f"worker-1, {attempt}: {r['usage']['prompt_tokens']} prompt tokens, {r['usage']['prompt_tokens_details']['cached_tokens']} cached, "
                f"time to first token {r['kvdir']['ttft_s'] * 1000:.1f} ms"
            )
        hashes = identity_hashes(_tokens(prompt), STUB)
        for _ in range(100):  # publishing is asynchronous: wait until the directory lists the blocks
            res = await d.lookup(hashes, with_slots=True)
            if res.holders and res.holders[0].matched_blocks == len(hashes):
                break
            await asyncio.sleep(0.02)
        holder = res.holders[0]
        say(f"directory: {holder.node_id} holds all {holder.matched_blocks} blocks of the prompt")
        plan = {"source_node": holder.node_id, "source_epoch": holder.epoch, "slots": holder.slots}
        r = (await http.post(workers[1] + "/v1/completions", json={**body, "kvdir_pull": plan})).json()
        say(
            f"worker-2 pulled {r['kvdir']['pulled_tokens']} tokens of KV from {holder.node_id} in {r['kvdir']['pull_s'] * 1000:.1f} ms "
            f"instead of recomputing them; cached_tokens={r['usage']['prompt_tokens_details']['cached_tokens']}"
        )


async def _gateway_demo(
    gateway: str, urls: Sequence[str], workers: Sequence[str], say: Callable[[str], None], token: str | None
) -> None:
    """One chat per worker (up to four), each with its own system prompt, one turn of every chat sent at once:
    the first turns spread over the workers (nothing is cached anywhere, so the gateway balances by load), each
    later turn goes where its chat's KV is (affinity)."""
    systems = CHATS[: max(1, min(len(CHATS), len(workers)))]
    say(
        f"-- 3. the gateway: {len(systems)} chats with different system prompts; each round sends one turn of "
        "every chat at the same moment"
    )
    chats: list[list[dict[str, str]]] = [[{"role": "system", "content": system}] for system in systems]
    async with httpx.AsyncClient(timeout=60) as http, DirectoryClient(urls, token=token) as d:
        for turn in range(TURNS):
            for i, messages in enumerate(chats):
                messages.append({"role": "user", "content": f"Question {turn + 1} of conversation {i}: what is cached now?"})
            replies = await asyncio.gather(*(_chat(http, gateway, messages) for messages in chats))
            for i, (node, decision, predicted, cached, prompt_tokens, answer) in enumerate(replies):
                say(
                    f"gateway, conversation {i} turn {turn + 1}: -> {node} ({decision}), "
                    f"predicted {predicted} cached, engine reports {cached} of {prompt_tokens}"
                )
                chats[i].append({"role": "assistant", "content": answer})
            if turn + 1 < TURNS:  # the next turn is routed by what the directory lists: let this round's publishes land
                await _published(http, d, workers[0], chats, [reply[0] for reply in replies])


async def _chat(http: httpx.AsyncClient, gateway: str, messages: list[dict[str, str]]) -> tuple[str, str, str, int, int, str]:
    """One chat completion through the gateway: its routing headers, the engine's usage, the answer."""
    r = await http.post(gateway + "/v1/chat/completions", json={"model": "kvdir-stub", "messages": messages, "max_tokens": 8})
    r.raise_for_status()
    body: dict[str, Any] = r.json()
    usage = body["usage"]
    return (
        r.headers["x-kvdir-node"],
        r.headers["x-kvdir-decision"],
        r.headers["x-kvdir-predicted-cached-tokens"],
        usage["prompt_tokens_details"]["cached_tokens"],
        usage["prompt_tokens"],
        body["choices"][0]["message"]["content"],
    )


async def _published(
    http: httpx.AsyncClient, d: DirectoryClient, engine: str, chats: list[list[dict[str, str]]], nodes: list[str]
) -> None:
    """Wait (at most PUBLISH_WAIT_S) until the directory lists each chat's prompt so far on the node that served it,
    as a user's think time would; the chats' prompts are tokenized by an engine, with its chat template."""
    prompts = []
    for messages in chats:
        # The prompt just served: everything but the answer appended to it.
        r = await http.post(
            engine + "/tokenize", json={"model": "kvdir-stub", "messages": messages[:-1], "add_generation_prompt": True}
        )
        r.raise_for_status()
        prompts.append(identity_hashes(list(r.json()["tokens"]), STUB))
    deadline = time.monotonic() + PUBLISH_WAIT_S
    while time.monotonic() < deadline:
        found = [await d.lookup(hashes) for hashes in prompts]
        if all(
            any(h.node_id == node and h.matched_blocks == len(hashes) for h in res.holders)
            for res, hashes, node in zip(found, prompts, nodes)
        ):
            return
        await asyncio.sleep(0.02)
