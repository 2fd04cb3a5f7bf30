"""A discrete-event simulation of a routed cluster, driven by the gateway's own policies.

`simulate(requests, policy_name, params)` replays requests (from
`kvtools.replay.trace`) through one policy of `gateway.policy.POLICIES` and
returns its figures; `oracle_hit_rate(requests)` is the ceiling any policy can
reach, `ttft_floor(requests, params)` the TTFT no policy can beat, and
`pooled_lru(requests, params)` what an ideal router over LRU engines gets.
No wall clock, no sockets: a heap of events in simulated seconds, and all
randomness from ``random.Random(params.seed)``.

The model
---------
Cluster: ``nodes`` engines, ids ``n0``.. (zero padded so that they sort in
order), all healthy, epoch 1, one gateway (the simulated one) that sends them
all their traffic.

Cache: each node holds at most ``capacity_blocks`` blocks of ``block_tokens``
tokens. A block is *in use* while a request needs it: from the request's
arrival (the prefix it finds locally) or its prefill end (the rest) until its
decode ends, and on a pull's source for the duration of the pull. Blocks in
use are never evicted; the others form an LRU list, and storing new blocks
evicts from its cold end down to capacity (when everything is in use the node
briefly holds more than its capacity). A finished request returns its blocks
deepest first, so a prefix outlives the blocks that hang from it (as vLLM's
free-block queue does). A request stores all its prompt blocks, the partial
last one included (the trace's ids cover it, and the oracle counts it).

Time, per node:
- Admission: at most ``max_running`` requests run (prefill or decode); the
  others wait FIFO for one to finish.
- Pull: at routing time, a request with a pull plan reads the blocks its node
  lacks from the source over the network: ``pull_setup_s + n * block_bytes /
  link_bytes_per_s``. Pulls are FIFO on the destination's inbound link and on
  the source's outbound link (each link moves one pull at a time). A request's
  prefill cannot start before its pull has finished.
- Prefill: a single server per node, FIFO in the order requests become ready
  (admitted and pulled), one at a time at the full ``prefill_tokens_per_s``,
  over the prompt tokens not cached (held locally or pulled). This is the
  shared resource: "busy" below means prefilling.
- Decode: after the prefill, ``output_tokens / decode_tokens_per_s`` seconds,
  in parallel with everything else (it only holds a running place).
- TTFT = prefill end - arrival (admission wait + pull + prefill queue + prefill).
- With ``params.calibration`` (kvtools.replay.calibration: an engine measured by
  ``kvdir bench vllm --calibration-out``) the engines follow the measurements
  instead: a prefill starts no sooner than the engine's ``overhead_s`` after its
  arrival, then joins the prefills under way, which share the engine's
  aggregate rate at their number (``rate(n) / n`` each, as vLLM's chunked
  prefill batches them, not FIFO); after the first token, its ``output - 1``
  tokens decode at the calibrated time per token for the number decoding, that
  times ``prefill_slowdown`` while any prefill runs there. Rates change at every
  start and end (a fluid model: each change reschedules the node's next end).

What is cached is decided at routing time: the chosen node's real leading run
of the request's blocks (pinned from then on), plus what the pull plan can
really read: blocks ``[local, min(plan, source's real run))``; blocks the
source no longer holds are recomputed.

Directory: a node's newly stored blocks (at its prefill end) and its evictions
become visible to the router ``publish_lag_s`` later, in order. Each arrival is
routed by the gateway's own `gateway.router.Router` over views of the simulated
engines (kvtools.replay.views), so its `Candidate` for a node is the gateway's: ``cached_blocks``
= the leading run of the request's blocks the directory (lagged) lists for the
node, ``slots`` = the block indices (dummies), ``inflight`` = requests the
gateway sent there and not finished, ``running = max(0, engine running -
inflight)`` and ``waiting`` = engine waiting (engine loads read without lag),
``pending_prefill_tokens`` = the gateway's sum of ``prompt -
predicted_cached_tokens`` over requests sent there without a first token yet,
plus (kvdir, ``gateways > 1``) the same sum over the other gateways' requests
as their notes (gateway.peers) told it, ``replica_sync_s`` after each decision
and each first token.
The request is ``RouteRequest(input_tokens, blocks, block_tokens,
max_tokens=output_tokens)`` (the gateway knows max_tokens, not the real
output length: here they are equal). The policy gets a `CostModel` made from
the same parameters (`SimParams.cost_model`).

Figures (token counts: a block counts ``min(B, tokens of the prompt in it)``)
- ``hit_rate``: cached prompt tokens (local + pulled) / prompt tokens;
  ``local_hit_rate``, ``pulled_hit_rate`` split it; ``block_hit_rate`` counts blocks.
- ``redundant_prefill``: prompt tokens recomputed although some node really
  held them as part of a leading run at routing time, / prompt tokens.
- ``ttft_p50_s``, ``ttft_p90_s``, ``ttft_p99_s``, ``ttft_mean_s``.
- ``throughput_rps``: requests / (last decode end - first arrival).
- ``imbalance``: max / mean prefill-busy seconds over nodes (1.0 = even).
- ``pulls`` (pulls that moved data), ``pull_blocks``, ``bytes_moved``,
  ``pulls_short`` (the source had lost part of the planned blocks).
- ``prediction_error``: sum |predicted - actual cached tokens| / prompt tokens,
  ``prediction_exact``: fraction of requests with predicted == actual
  (predicted: the decision's ``predicted_cached_tokens``; actual: local + pulled).
- ``load_timeline``: prefill-busy fraction per node in equal time buckets.

The code
--------
This module is the API (`simulate`, `oracle_hit_rate`, `ttft_floor`, `pooled_lru`, and `SimParams` /
`describe_params` re-exported from `kvtools.replay.params`). The simulation
itself is `kvtools.replay.cluster.ClusterSim` (the state as objects, events
dispatched through a table of handler methods), over the caches of
`kvtools.replay.cache` (`NodeCache`: pin / unpin / store / settle, and the
directory's lagged `DirectoryView`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gateway.policy import POLICIES
from kvtools.replay.cluster import ClusterSim
from kvtools.replay.figures import tokens_of_blocks
from kvtools.replay.params import DEFAULT_BLOCK_BYTES, SimParams, describe_params
from kvtools.replay.trace import TraceRequest

__all__ = ["DEFAULT_BLOCK_BYTES", "SimParams", "describe_params", "oracle_hit_rate", "pooled_lru", "simulate", "ttft_floor"]


def _sorted(requests: Sequence[TraceRequest]) -> list[TraceRequest]:
    """`requests` by arrival (stable: equal arrivals keep their order); no sort when already in order."""
    if all(requests[i].arrival_s <= requests[i + 1].arrival_s for i in range(len(requests) - 1)):
        return list(requests)
    return sorted(requests, key=lambda r: r.arrival_s)


def oracle_hit_rate(requests: Sequence[TraceRequest], *, by: str = "blocks", block_tokens: int = 512) -> float:
    """Hit rate of one infinite cache shared by all nodes: blocks seen before (in arrival order) / all blocks.

    ``by="tokens"`` weighs each block by its tokens (``min(block_tokens, tokens
    left in the prompt)``) and divides by prompt tokens, as ``hit_rate`` does.
    0.0 for no blocks.
    """
    if by not in ("blocks", "tokens"):
        raise ValueError("by must be 'blocks' or 'tokens'")
    seen: set[int] = set()
    hit = total = 0
    for r in _sorted(requests):
        blocks = r.blocks
        if by == "blocks":
            total += len(blocks)
            for b in blocks:
                if b in seen:
                    hit += 1
                else:
                    seen.add(b)
        else:
            total += r.input_tokens
            left = r.input_tokens
            for b in blocks:
                w = block_tokens if block_tokens < left else left
                if w <= 0:
                    w = 0
                left -= block_tokens
                if b in seen:
                    hit += w
                else:
                    seen.add(b)
    return hit / total if total else 0.0


def _fastest(p: SimParams) -> tuple[float, float]:
    """The fastest one request is prefilled (tokens/s) and the engines' fixed overhead (s): a calibrated engine's
    best share of its batch's rate, else the static rate with none."""
    c = p.calibration
    if c is None:
        return p.prefill_tokens_per_s, 0.0
    return max(r / n for n, r in zip(c.prefill_running, c.prefill_tokens_per_s, strict=True)), c.overhead_s


def ttft_floor(requests: Sequence[TraceRequest], params: SimParams | None = None) -> np.ndarray:
    """Per request (in arrival order), a TTFT that no policy reaches below in this simulation.

    The cluster without its limits: no admission or prefill queue, instant pulls, an infinite cache, and
    every block usable anywhere from the moment the first request that computes it ends its prefill (the
    model's in-flight reuse waits for the end of the prefill too). A request may reuse the blocks earlier
    arrivals compute (reuse is decided at routing, on arrival): for each leading run of them it can wait
    for, its prefill ends at max(arrival, when the run is ready) + its other tokens / the prefill rate; the
    floor is the earliest of these ends. By induction over arrivals, a real run's prefill of every request
    ends no earlier, whatever the routing; so where 0.9x the best policy's p90 is below this floor's p90,
    no policy can be 0.9x faster.
    """
    p = params or SimParams()
    rate, overhead = _fastest(p)
    bt = p.block_tokens
    ready_at: dict[int, float] = {}  # block -> the earliest prefill end of a request holding it
    out = np.empty(len(requests))
    for i, r in enumerate(_sorted(requests)):
        a, prompt, blocks = r.arrival_s + overhead, r.input_tokens, r.blocks
        best = a + prompt / rate
        ready = a
        for m, b in enumerate(blocks, 1):
            e = ready_at.get(b)
            if e is None:
                break  # chained hashes: nothing after an unseen block was computed either
            if e > ready:
                ready = e
            end = ready + (prompt - tokens_of_blocks(m, prompt, bt)) / rate
            if end < best:
                best = end
        out[i] = best - r.arrival_s
        for b in blocks:
            if b not in ready_at or ready_at[b] > best:
                ready_at[b] = best
    return out


def pooled_lru(requests: Sequence[TraceRequest], params: SimParams | None = None) -> tuple[float, np.ndarray]:
    """Hit rate and per-request TTFTs (arrival order) of one LRU cache of the cluster's aggregate capacity.

    What a router that could place every block perfectly would get from engines that evict LRU, as vLLM
    does: no block held twice, every cached block usable by every request (free pulls), no queues. A
    reference for workloads whose working set outgrows the cache (`tight_cache`), where the floor's
    infinite cache says nothing: a policy near it loses requests to eviction, which routing cannot undo.
    Not a strict bound (per-node LRU with pinning can keep a different set), but a close one.
    """
    p = params or SimParams()
    rate, overhead = _fastest(p)
    bt, cap = p.block_tokens, p.engines * p.capacity_blocks
    lru: OrderedDict[int, None] = OrderedDict()
    ttft = np.empty(len(requests))
    hit = total = 0
    for i, r in enumerate(_sorted(requests)):
        m = 0
        for b in r.blocks:
            if b not in lru:
                break
            m += 1
        cached = tokens_of_blocks(m, r.input_tokens, bt)
        hit += cached
        total += r.input_tokens
        ttft[i] = overhead + (r.input_tokens - cached) / rate
        for b in r.blocks:
            lru[b] = None
            lru.move_to_end(b)
        while len(lru) > cap:
            lru.popitem(last=False)
    return (hit / total if total else 0.0), ttft


def simulate(
    requests: Sequence[TraceRequest],
    policy_name: str,
    params: SimParams | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Replay `requests` through the policy `policy_name` on the cluster `params`; the figures as a dict.

    See the module docstring for the model and the figures. `progress(done,
    total)` is called about every 1% of requests. ``wall_s`` (the last key) is
    the wall-clock time the run took.
    """
    p = params or SimParams()
    if policy_name not in POLICIES:
        raise ValueError(f"unknown policy {policy_name!r}; valid: {', '.join(sorted(POLICIES))}")
    wall0 = time.perf_counter()
    sim = ClusterSim(_sorted(requests), policy_name, p)
    sim.run(progress)
    out = sim.figures()
    out["wall_s"] = time.perf_counter() - wall0
    return out
