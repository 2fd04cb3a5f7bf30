"""Closed-loop chat sessions through `/v1/chat/completions`: what a chat user does, and what `vllm bench serve`
(open-loop: it sends each request at its scheduled time, answered or not) cannot do.

A session sends turn k+1 only once turn k's answer has arrived and a think time has passed (exponential, drawn
from the session's own seeded generator, so the same seed gives the same pauses whatever the interleaving), with
the answer the engine actually gave appended to the history: the prompt a router sees next is the one a real
client would send, including text no dataset could know in advance. A load is a number of sessions open at once;
a session that ends hands its place to the next one. TTFT is measured per turn, from sending the request to the
first streamed chunk that carries content (a role-only chunk is not an answer).

Sessions are built over documents: most share one long document in their first user message (the prefix a
cache-aware router should keep on one engine), a few have a long document of their own and a few none.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from tokenizers import Tokenizer

DOCUMENTS = ("shared", "own", "none")


@dataclass(frozen=True)
class ChatShape:
    """A chat dataset's shape: sizes in tokens of the model's tokenizer (words of its vocabulary, about one each)."""

    sessions: int
    turns: int
    document: int  # a long document's tokens
    question: int  # each user message's own tokens
    answer: int  # max_tokens of every turn
    own: int  # sessions with a document of their own
    bare: int  # sessions with no document; the others share one


@dataclass(frozen=True)
class Session:
    """One user's conversation: the user messages turn by turn (the first carries the document) and which
    document it has (one of `DOCUMENTS`)."""

    index: int
    document: str
    questions: tuple[str, ...]
    max_tokens: int


@dataclass(frozen=True)
class Turn:
    """What one request of a session measured: `ttft_s` is None when it failed (`error` says how) or was never
    sent because an earlier turn of its session failed."""

    session: int
    turn: int
    ttft_s: float | None
    error: str | None = None


def vocabulary(tokenizer: Path) -> list[str]:
    """The whole words of a byte-level BPE tokenizer's vocabulary: text made of them is about a token a word."""
    vocab = Tokenizer.from_file(str(tokenizer)).get_vocab()
    return sorted({w.lstrip("Ġ") for w in vocab if w.startswith("Ġ") and w[1:].isalpha()})


def make_sessions(shape: ChatShape, words: Sequence[str], seed: int = 0) -> list[Session]:
    """`shape.sessions` sessions drawn with `seed` (the same seed, the same sessions): which ones have their own
    document or none is shuffled among the rest, which share one."""
    if shape.own + shape.bare > shape.sessions:
        raise ValueError(f"{shape.own} own + {shape.bare} bare documents exceed {shape.sessions} sessions")
    rng = random.Random(seed)

    def text(tokens: int) -> str:
        return " ".join(rng.choice(words) for _ in range(tokens))

    shared = text(shape.document)
    kinds = ["own"] * shape.own + ["none"] * shape.bare + ["shared"] * (shape.sessions - shape.own - shape.bare)
    rng.shuffle(kinds)
    sessions = []
    for i, kind in enumerate(kinds):
        document = {"shared": shared, "own": text(shape.document), "none": ""}[kind]
        questions = [text(shape.question) for _ in range(shape.turns)]
        if document:
            questions[0] = f"Read this document, then answer.\n\n{document}\n\n{questions[0]}"
        sessions.append(Session(i, kind, tuple(questions), shape.answer))
    return sessions


async def _turn(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> tuple[float, str]:
    """Send one streamed chat request; its TTFT (to the first chunk with content) and the whole answer."""
    start = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            data = line.removeprefix("data:").strip()
            if not line.startswith("data:") or data == "[DONE]":
                continue
            choices = json.loads(data).get("choices") or [{}]
            content = (choices[0].get("delta") or {}).get("content")
            if content:
                ttft = time.perf_counter() - start if ttft is None else ttft
                parts.append(content)
    if ttft is None:
        raise RuntimeError("the stream ended without content")
    return ttft, "".join(parts)


async def _session(client: httpx.AsyncClient, url: str, model: str, session: Session, think_s: float, seed: int) -> list[Turn]:
    rng = random.Random(f"{seed}/{session.index}")
    messages: list[dict[str, str]] = []
    turns: list[Turn] = []
    for k, question in enumerate(session.questions):
        if k and think_s > 0:
            await asyncio.sleep(rng.expovariate(1 / think_s))  # the user reads the answer and types
        messages.append({"role": "user", "content": question})
        body = {"model": model, "messages": messages, "max_tokens": session.max_tokens, "stream": True, "ignore_eos": True}
        try:
            ttft, answer = await _turn(client, url, body)
        except (httpx.HTTPError, RuntimeError, ValueError) as e:
            turns.append(Turn(session.index, k, None, f"{type(e).__name__}: {e}"))
            unsent = range(k + 1, len(session.questions))  # no answer to build the next prompt on
            return turns + [Turn(session.index, j, None, "not sent: an earlier turn failed") for j in unsent]
        turns.append(Turn(session.index, k, ttft))
        messages.append({"role": "assistant", "content": answer})
    return turns


async def run_sessions(
    url: str,
    model: str,
    sessions: Sequence[Session],
    concurrency: int,
    think_s: float = 1.0,
    seed: int = 0,
    timeout_s: float = 300.0,
) -> list[Turn]:
    """Run every session against `url`, at most `concurrency` open at once, in order of their index; every turn's
    result (completed or failed), session by session."""
    queue = list(reversed(sessions))
    results: list[Turn] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def user() -> None:
            while queue:
                results.extend(await _session(client, url, model, queue.pop(), think_s, seed))

        await asyncio.gather(*(user() for _ in range(concurrency)))
    return sorted(results, key=lambda t: (t.session, t.turn))


def summarize(turns: Sequence[Turn]) -> dict[str, float]:
    """TTFT p50/p90/p99 in ms over all completed turns and over first turns apart (a first turn has no history of
    its own to find cached, only a shared document), and the counts of completed and failed turns."""
    out: dict[str, float] = {}
    for label, subset in (("", turns), ("first turns ", [t for t in turns if t.turn == 0])):
        ttfts = [t.ttft_s * 1000 for t in subset if t.ttft_s is not None]
        for p in (50, 90, 99):
            out[f"{label}p{p} ttft ms"] = float(np.percentile(ttfts, p)) if ttfts else float("nan")
    out["completed"] = sum(t.ttft_s is not None for t in turns)
    out["failed"] = sum(t.ttft_s is None for t in turns)
    return out
