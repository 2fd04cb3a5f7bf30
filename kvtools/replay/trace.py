"""Requests for the replay simulator: Mooncake traces and synthetic workloads.

A request is a `TraceRequest`: arrival time, prompt and output lengths, and its
prompt's blocks as *chained* keys. Block ``i`` covers prompt tokens
``[i * B, (i + 1) * B)`` (the last one may be partial, as in the Mooncake
traces), and its key names the whole prefix up to and including it:

    key[-1] = 0
    key[i]  = XXH3_64(le_u64(key[i-1]) || le_u64(id[i]))      (xxhash.xxh3_64_intdigest)

so equal ids at equal positions after an equal prefix give equal keys, and a
key seen anywhere implies its whole prefix (like the protocol's sequence
hashes, docs/protocol.md §1). The ids are the trace's ``hash_ids`` (docs/protocol.md §6); the
synthetic generators make their own content ids and chain them the same way.

Mooncake format (one JSON object a line): ``timestamp`` (ms, number),
``input_length`` and ``output_length`` (non-negative integers), ``hash_ids``
(unsigned 64-bit integers, one per ``block_tokens`` block of the prompt; at most
``ceil(input_length / block_tokens)`` of them).

Synthetic workloads use 512-token blocks by default, as the Mooncake traces do,
so their figures compare with the trace's; every generator takes
``block_tokens``. All randomness comes from ``random.Random(seed)``: the same
arguments give the same requests on every platform.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import random
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import xxhash

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "TraceRequest",
    "chain_blocks",
    "hot_prefix_burst",
    "load_mooncake",
    "multi_turn",
    "shared_prefix",
    "sort_by_arrival",
    "tight_cache",
]

DEFAULT_BLOCK_TOKENS = 512
_U64 = 1 << 64
_pack2 = struct.Struct("<QQ").pack
_h64 = xxhash.xxh3_64_intdigest


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]  # chained block keys, block i covers prompt tokens [i*B, (i+1)*B)


def chain_blocks(ids: Iterable[int]) -> tuple[int, ...]:
    """Chained keys of per-position ids (each 0 <= id < 2**64): key[i] = XXH3_64(le_u64(key[i-1]) || le_u64(id[i])), key[-1] = 0."""
    out = []
    prev = 0
    for x in ids:
        prev = _h64(_pack2(prev, x))
        out.append(prev)
    return tuple(out)


def _content_id(*parts: int) -> int:
    """A 64-bit id for a block's content described by small non-negative ints."""
    return _h64(struct.pack(f"<{len(parts)}Q", *parts))


# ---------------------------------------------------------------------------
# Mooncake traces


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_row(row: object, block_tokens: int) -> str | None:
    """Why a parsed line is not a valid request, or None."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    for field in ("timestamp", "input_length", "output_length", "hash_ids"):
        if field not in row:
            return f"missing field {field!r}"
    ts = row["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        return f"timestamp must be a finite number (ms), got {ts!r}"
    for field in ("input_length", "output_length"):
        v = row[field]
        if not _is_int(v):
            return f"{field} must be an integer, got {v!r}"
        if v < 0:
            return f"{field} must be >= 0, got {v}"
    ids = row["hash_ids"]
    if not isinstance(ids, list):
        return f"hash_ids must be a list of integers, got {type(ids).__name__}"
    for j, x in enumerate(ids):
        if not _is_int(x) or not 0 <= x < _U64:
            return f"hash_ids[{j}] must be an unsigned 64-bit integer, got {x!r}"
    need = -(-row["input_length"] // block_tokens)
    if len(ids) > need:
        return (
            f"hash_ids has {len(ids)} blocks but input_length {row['input_length']} fills only {need} "
            f"of {block_tokens} tokens (wrong block size?)"
        )
    return None


def _open_text(path: str | Path) -> IO[str]:
    """The trace as text; a ``.gz`` path is decompressed first (the repository bundles its trace gzipped).

    A corrupt or truncated gzip file is a ValueError naming the path, like any other bad input.
    """
    if not str(path).endswith(".gz"):
        return open(path, encoding="utf-8")
    try:
        data = gzip.decompress(Path(path).read_bytes())
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise ValueError(f"{path}: not a valid gzip file ({exc})") from exc
    return io.StringIO(data.decode("utf-8"))


def load_mooncake(
    path: str | Path, block_tokens: int = DEFAULT_BLOCK_TOKENS, strict: bool = False
) -> tuple[list[TraceRequest], list[str]]:
    """Requests of a Mooncake JSONL trace (gzipped if the path ends in ``.gz``), in file order, and one
    message per malformed line.

    A line is malformed when it is not JSON, not an object, lacks a field, has
    a field of the wrong type, a negative length, or more hash_ids than
    ``ceil(input_length / block_tokens)``. Messages read ``"line N: why"``
    (N 1-based). With ``strict`` the first malformed line raises ValueError
    (with that message); otherwise it is skipped. Blank lines are ignored.
    ``arrival_s`` is ``timestamp / 1000``.
    """
    if block_tokens < 1:
        raise ValueError("block_tokens must be >= 1")
    requests: list[TraceRequest] = []
    errors: list[str] = []
    with _open_text(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                why = f"line {n}: not valid JSON ({exc})"
            else:
                bad = _check_row(row, block_tokens)
                if bad is None:
                    requests.append(
                        TraceRequest(
                            row["timestamp"] / 1000.0, row["input_length"], row["output_length"], chain_blocks(row["hash_ids"])
                        )
                    )
                    continue
                why = f"line {n}: {bad}"
            if strict:
                raise ValueError(f"{path}: {why}")
            errors.append(why)
    return requests, errors


# ---------------------------------------------------------------------------
# Synthetic workloads


def _stream_blocks(length: int, block_tokens: int, shared_tokens: int, shared_id: int, own_id: int) -> tuple[int, ...]:
    """Chained keys for a prompt of `length` tokens whose first `shared_tokens` are common content `shared_id`
    and the rest belong to the stream `own_id` (append-only: a full block keeps its id as the stream grows).

    Block j's content id: (1, shared_id, j) if it lies wholly inside the shared part, else
    (2, own_id, j, tokens filled), so a partial block differs from the full block it becomes.
    """
    ids = []
    for j in range(-(-length // block_tokens)):
        end = min((j + 1) * block_tokens, length)
        if (j + 1) * block_tokens <= shared_tokens:
            ids.append(_content_id(1, shared_id, j))
        else:
            ids.append(_content_id(2, own_id, j, end - j * block_tokens))
    return chain_blocks(ids)


def multi_turn(
    sessions: int = 64,
    rounds: int = 5,
    system_tokens: int = 512,
    turn_tokens: int = 750,
    output_tokens: int = 250,
    think_s: float = 10.0,
    seed: int = 0,
    *,
    first_turn_tokens: int = 3500,
    session_rate: float = 1.0,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """Chat sessions whose every round resends the whole conversation so far.

    - One system prompt of `system_tokens`, shared by all sessions.
    - Round 1's user message has `first_turn_tokens` (a pasted document, say);
      later rounds add the previous answer (`output_tokens`) and a new user
      message of `turn_tokens`. Round k's prompt is
      ``system + first_turn + (k-1) * (output_tokens + turn_tokens)`` tokens:
      with the defaults 4,012 tokens in round 1 growing to 8,012 in round 5.
    - Sessions start as a Poisson process of `session_rate` per second; round
      k+1 arrives ``think_s * U(0.5, 1.5)`` after round k's arrival (the time to
      answer and to read the answer).
    - Only full blocks of the history are shared between rounds; a block left
      partial by one round is a new block the next time.
    Returns ``sessions * rounds`` requests sorted by arrival.
    """
    if sessions < 0 or rounds < 1 or min(system_tokens, turn_tokens, output_tokens, first_turn_tokens) < 0:
        raise ValueError("sessions >= 0, rounds >= 1 and token counts >= 0 required")
    if think_s < 0 or session_rate <= 0:
        raise ValueError("think_s >= 0 and session_rate > 0 required")
    rng = random.Random(seed)
    out = []
    start = 0.0
    for s in range(sessions):
        start += rng.expovariate(session_rate)
        t = start
        for k in range(rounds):
            if k:
                t += think_s * rng.uniform(0.5, 1.5)
            length = system_tokens + first_turn_tokens + k * (output_tokens + turn_tokens)
            out.append(TraceRequest(t, length, output_tokens, _stream_blocks(length, block_tokens, system_tokens, 0, s)))
    out.sort(key=lambda r: r.arrival_s)
    return out


def shared_prefix(
    groups: int = 16,
    prompts_per_group: int = 64,
    prefix_tokens: int = 4096,
    suffix_tokens: int = 512,
    rate: float = 8.0,
    seed: int = 0,
    *,
    output_tokens: int = 128,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """Groups of prompts that share a group prefix (few-shot examples, a document) and differ after it.

    ``groups * prompts_per_group`` requests in random order (the group of each
    is a shuffle of the full list), arriving as a Poisson process of `rate` per
    second; each prompt is its group's `prefix_tokens` followed by
    `suffix_tokens` of its own; each asks for `output_tokens`.
    """
    if min(groups, prompts_per_group, prefix_tokens, suffix_tokens, output_tokens) < 0 or rate <= 0:
        raise ValueError("counts and token counts >= 0 and rate > 0 required")
    rng = random.Random(seed)
    order = [g for g in range(groups) for _ in range(prompts_per_group)]
    rng.shuffle(order)
    out = []
    t = 0.0
    length = prefix_tokens + suffix_tokens
    for i, g in enumerate(order):
        t += rng.expovariate(rate)
        out.append(TraceRequest(t, length, output_tokens, _stream_blocks(length, block_tokens, prefix_tokens, g, i)))
    return out


def hot_prefix_burst(
    n: int = 500,
    prefix_tokens: int = 8192,
    burst_rate: float = 25.0,
    seed: int = 0,
    *,
    suffix_tokens: int = 512,
    output_tokens: int = 128,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """A burst on one hot prefix: `n` requests sharing the same `prefix_tokens`, each with `suffix_tokens`
    of its own, arriving as a Poisson process of `burst_rate` per second.

    With the defaults the burst's suffixes alone (25/s * 512 tokens) exceed one
    node's default prefill rate (10,000 tokens/s): a policy that sends the
    whole burst where the prefix lives overloads that node.
    """
    if min(n, prefix_tokens, suffix_tokens, output_tokens) < 0 or burst_rate <= 0:
        raise ValueError("counts and token counts >= 0 and burst_rate > 0 required")
    rng = random.Random(seed)
    out = []
    t = 0.0
    length = prefix_tokens + suffix_tokens
    for i in range(n):
        t += rng.expovariate(burst_rate)
        out.append(TraceRequest(t, length, output_tokens, _stream_blocks(length, block_tokens, prefix_tokens, 0, i)))
    return out


def tight_cache(
    nodes: int = 8,
    capacity_blocks: int = 3000,
    working_set_ratio: float = 3.0,
    seed: int = 0,
    *,
    prefixes: int = 32,
    prefix_tokens: int = 4096,
    first_turn_tokens: int = 8192,
    turn_tokens: int = 1536,
    output_tokens: int = 512,
    rounds: int = 4,
    session_rate: float | None = None,
    think_s: float | None = None,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """Multi-turn sessions on shared documents whose distinct blocks are `working_set_ratio` times the
    aggregate cache (``nodes * capacity_blocks``): caches too small for the workload, where a second copy of
    a prefix pushes out something else that will be needed again.

    - `prefixes` shared prefixes of `prefix_tokens` (system prompt plus a document); each session picks
      one with Zipf(1) popularity (prefix i with weight 1/(i+1)), so a few are hot and the rest lukewarm.
    - Each session adds a private first message of `first_turn_tokens`, then per later round the previous
      answer (`output_tokens`) and a new message of `turn_tokens`, resending the whole conversation
      (as `multi_turn`): with the defaults 12,288 tokens in round 1 growing to 18,432 in round 4.
    - Sessions are added until the workload's distinct blocks reach ``working_set_ratio * nodes *
      capacity_blocks``; they start as a Poisson process of `session_rate` per second (default
      ``nodes / 8``: the same load per node at any size), and round k+1 arrives ``think_s * U(0.5, 1.5)``
      after round k (default: such that the sessions in progress hold about as many private blocks
      as the aggregate cache, 364 s at 8 x 3,000 blocks; a session's history competes with its
      contemporaries' for the space, and LRU keeps about half of the histories).
    Returns the requests sorted by arrival.
    """
    if min(nodes, capacity_blocks, prefixes, rounds, block_tokens) < 1 or working_set_ratio <= 0:
        raise ValueError("nodes, capacity_blocks, prefixes, rounds, block_tokens >= 1 and working_set_ratio > 0 required")
    if min(prefix_tokens, first_turn_tokens, turn_tokens, output_tokens) < 0:
        raise ValueError("token counts >= 0 required")
    rate = nodes / 8 if session_rate is None else session_rate
    if rate <= 0 or (think_s is not None and think_s < 0):
        raise ValueError("session_rate > 0 and think_s >= 0 required")
    first = prefix_tokens + first_turn_tokens
    if think_s is None:  # sessions in progress (Little: rate * (rounds - 1) * think_s) x their mean private blocks
        private = (first_turn_tokens + (rounds - 1) / 2 * (output_tokens + turn_tokens)) / block_tokens
        think_s = nodes * capacity_blocks / (rate * max(rounds - 1, 1) * max(private, 1.0))
    target = working_set_ratio * nodes * capacity_blocks
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(prefixes)]
    seen: set[int] = set()
    out = []
    start = 0.0
    s = 0
    while len(seen) < target:
        start += rng.expovariate(rate)
        doc = rng.choices(range(prefixes), weights)[0]
        t = start
        for k in range(rounds):
            if k:
                t += think_s * rng.uniform(0.5, 1.5)
            length = first + k * (output_tokens + turn_tokens)
            blocks = _stream_blocks(length, block_tokens, prefix_tokens, doc, s)
            seen.update(blocks)
            out.append(TraceRequest(t, length, output_tokens, blocks))
        s += 1
    out.sort(key=lambda r: r.arrival_s)
    return out


def sort_by_arrival(requests: Sequence[TraceRequest]) -> list[TraceRequest]:
    """Stable sort by arrival time (file order among equal timestamps)."""
    return sorted(requests, key=lambda r: r.arrival_s)
