"""The demo `kvdir up --demo` drives: two nodes, a shared system prompt, lookups, a restart."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import httpx

from directory.client import DirectoryClient
from directory.hashing import block_hashes

SYSTEM = "You are a helpful assistant for an LLM inference cluster. Answer briefly. " * 4
TURN1 = "User: how does prefix caching cut time to first token?\n"
TURN2 = "Assistant: a node that holds the prompt's KV blocks skips their prefill.\nUser: and across nodes?\n"


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
    if gateway is not None:
        await _gateway_demo(gateway, say)


async def _gateway_demo(gateway: str, say: Callable[[str], None]) -> None:
    """Three conversations of three turns through the gateway: each turn goes where the last one's KV is."""
    async with httpx.AsyncClient(timeout=60) as http:
        for conv in range(3):
            messages = [{"role": "system", "content": f"Conversation {conv}. " + SYSTEM}]
            for turn in range(3):
                messages.append({"role": "user", "content": f"Question {turn} of conversation {conv}: what is cached now?"})
                r = await http.post(
                    gateway + "/v1/chat/completions", json={"model": "kvdir-stub", "messages": messages, "max_tokens": 8}
                )
                body = r.json()
                say(
                    f"gateway, conversation {conv} turn {turn + 1}: -> {r.headers['x-kvdir-node']} ({r.headers['x-kvdir-decision']}), "
                    f"predicted {r.headers['x-kvdir-predicted-cached-tokens']} cached, engine reports "
                    f"{body['usage']['prompt_tokens_details']['cached_tokens']} of {body['usage']['prompt_tokens']}"
                )
                messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
                await asyncio.sleep(0.05)  # let the engine's asynchronous publish land, as a user's think time would


async def _worker_demo(urls: Sequence[str], workers: Sequence[str], say: Callable[[str], None], token: str | None) -> None:
    prompt = SYSTEM + TURN1
    body = {"model": "kvdir-stub", "prompt": prompt, "max_tokens": 8}
    async with httpx.AsyncClient(timeout=60) as http, DirectoryClient(urls, token=token) as d:
        for attempt in ("cold", "warm"):
            r = (await http.post(workers[0] + "/v1/completions", json=body)).json()
            say(
                f"worker-1, {attempt}: {r['usage']['prompt_tokens']} prompt tokens, {r['usage']['prompt_tokens_details']['cached_tokens']} cached, "
                f"time to first token {r['kvdir']['ttft_s'] * 1000:.1f} ms"
            )
        hashes = block_hashes(_tokens(prompt))
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


async def _directory_demo(urls: Sequence[str], say: Callable[[str], None], token: str | None) -> None:
    """Register two nodes, publish what each 'computed', look prompts up through a follower, restart one."""
    async with DirectoryClient(urls, token=token) as d:
        a = await d.register(
            "demo-a",
            "http://127.0.0.1:9001",
            capacity_blocks=1024,
            block_size=16,
            regions=[{"rank": 0, "base_addr": 0x7F0000000000, "length": 1024 * 16384, "rkey": 17, "block_bytes": 16384}],
        )
        b = await d.register("demo-b", "http://127.0.0.1:9002", capacity_blocks=1024, block_size=16)
        say(f"registered demo-a (epoch {a.epoch}) and demo-b (epoch {b.epoch}), lease {a.lease_ttl_s}s")
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
        say(f"lookup of turn 2 ({res.num_blocks} blocks) on another replica:")
        for h in res.holders:
            assert h.slots is not None  # asked for with_slots=True: the directory sends every holder's slots
            say(f"  {h.node_id} epoch {h.epoch}: {h.matched_blocks} blocks cached, slots {h.slots[:4]}...")
        a2 = await d.register("demo-a", "http://127.0.0.1:9001", capacity_blocks=1024, block_size=16)
        res = await d.lookup(tokens=_tokens(SYSTEM + TURN1 + TURN2), linearizable=True)
        say(
            f"demo-a restarted (epoch {a2.epoch}): its old entries are gone; holders now "
            + ", ".join(f"{h.node_id}={h.matched_blocks}" for h in res.holders)
        )
        for n in await d.nodes():
            say(f"  node {n.node_id} epoch {n.epoch} holds {n.blocks} blocks")
        await d.deregister("demo-a")
        await d.deregister("demo-b")
        say("demo done: both nodes deregistered")
