"""A discrete-event simulation of a routed cluster, driven by the gateway's own policies.

`simulate(requests, policy_name, params)` replays requests (from
`kvdir.replay.trace`) through one policy of `gateway.policy.POLICIES` and
returns its figures; `oracle_hit_rate(requests)` is the ceiling any policy can
reach. No wall clock, no sockets: a heap of events in simulated seconds, and
all randomness from ``random.Random(params.seed)``.

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

What is cached is decided at routing time: the chosen node's real leading run
of the request's blocks (pinned from then on), plus what the pull plan can
really read: blocks ``[local, min(plan, source's real run))``; blocks the
source no longer holds are recomputed.

Directory: a node's newly stored blocks (at its prefill end) and its evictions
become visible to the router ``publish_lag_s`` later, in order. The router's
`Candidate` for a node is built as gateway/app.py builds it: ``cached_blocks``
= the leading run of the request's blocks the directory (lagged) lists for the
node, ``slots`` = the block indices (dummies), ``inflight`` = requests the
gateway sent there and not finished, ``running = max(0, engine running -
inflight)`` and ``waiting`` = engine waiting (engine loads read without lag),
``pending_prefill_tokens`` = the gateway's sum of ``prompt -
predicted_cached_tokens`` over requests sent there without a first token yet.
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
"""

from __future__ import annotations

import heapq
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import numpy as np

from gateway.policy import POLICIES, Candidate, CostModel, RouteRequest, make_policy
from kvdir.replay.trace import TraceRequest

__all__ = ["SimParams", "oracle_hit_rate", "simulate"]

# Default KV block: 512 tokens of a Llama-3-8B-like model in bf16
# (32 layers * 8 KV heads * 128 dims * 2 (K, V) * 2 bytes = 128 KiB per token).
DEFAULT_BLOCK_BYTES = 512 * 32 * 8 * 128 * 2 * 2


@dataclass(frozen=True, slots=True)
class SimParams:
    nodes: int = 8
    capacity_blocks: int = 3000  # per node
    block_tokens: int = 512
    prefill_tokens_per_s: float = 10_000.0  # per node, one prefill at a time
    decode_tokens_per_s: float = 80.0  # per request
    max_running: int = 32  # per node
    block_bytes: int = DEFAULT_BLOCK_BYTES  # KV bytes of one block on a node (all TP ranks)
    link_bytes_per_s: float = 12.5e9  # one pull's bandwidth (100 Gb/s)
    pull_setup_s: float = 0.002
    publish_lag_s: float = 0.05  # node stores/evicts -> the router sees it
    seed: int = 0
    timeline_buckets: int = 200
    policy_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # keyword options per policy name, for make_policy

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.capacity_blocks < 1 or self.block_tokens < 1 or self.max_running < 1:
            raise ValueError("nodes, capacity_blocks, block_tokens and max_running must be >= 1")
        if min(self.prefill_tokens_per_s, self.decode_tokens_per_s, self.link_bytes_per_s) <= 0:
            raise ValueError("rates must be > 0")
        if self.block_bytes < 0 or self.pull_setup_s < 0 or self.publish_lag_s < 0:
            raise ValueError("block_bytes, pull_setup_s and publish_lag_s must be >= 0")
        if self.timeline_buckets < 1:
            raise ValueError("timeline_buckets must be >= 1")

    def cost_model(self) -> CostModel:
        """The policies' cost model, with this simulation's parameters."""
        return CostModel(
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            block_bytes=self.block_bytes,
            link_bytes_per_s=self.link_bytes_per_s,
            pull_setup_s=self.pull_setup_s,
            max_running=self.max_running,
            decode_tokens_per_s=self.decode_tokens_per_s,
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sorted(requests: Sequence[TraceRequest]) -> list[TraceRequest]:
    if all(requests[i].arrival_s <= requests[i + 1].arrival_s for i in range(len(requests) - 1)):
        return list(requests)
    return sorted(requests, key=lambda r: r.arrival_s)


def _tokens_of_blocks(k: int, prompt: int, bs: int) -> int:
    t = k * bs
    return t if t < prompt else prompt


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


def _runs(blocks: tuple[int, ...], masks: dict[int, int], full: int, n: int) -> tuple[list[int], int]:
    """Leading run of `blocks` each node holds per `masks` (block -> bitmask of nodes), and the longest."""
    res = [0] * n
    alive = full
    i = 0
    get = masks.get
    for b in blocks:
        m = get(b, 0) & alive
        if m != alive:
            gone = alive ^ m
            while gone:
                low = gone & -gone
                res[low.bit_length() - 1] = i
                gone ^= low
            alive = m
            if not alive:
                return res, i
        i += 1
    j = 0
    while alive:
        if alive & 1:
            res[j] = i
        alive >>= 1
        j += 1
    return res, i


# event kinds (ordered: at equal times, earlier-scheduled events go first via the sequence number)
_PULL_DONE, _PREFILL_DONE, _DECODE_DONE, _PUBLISH = 0, 1, 2, 3


def simulate(
    requests: Sequence[TraceRequest],
    policy_name: str,
    params: SimParams | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Replay `requests` through the policy `policy_name` on the cluster `params`; the figures as a dict.

    See the module docstring for the model and the figures. `progress(done,
    total)` is called about every 1% of requests.
    """
    p = params or SimParams()
    if policy_name not in POLICIES:
        raise ValueError(f"unknown policy {policy_name!r}; valid: {', '.join(sorted(POLICIES))}")
    wall0 = time.perf_counter()
    reqs = _sorted(requests)
    total = len(reqs)
    cost = p.cost_model()
    policy = make_policy(policy_name, cost, **p.policy_options.get(policy_name, {}))
    rng = random.Random(p.seed)
    choose, on_routed = policy.choose, policy.on_routed

    N = p.nodes
    width = len(str(N - 1))
    ids = [f"n{j:0{width}d}" for j in range(N)]
    index = {nid: j for j, nid in enumerate(ids)}
    full = (1 << N) - 1
    bs = p.block_tokens
    cap = p.capacity_blocks
    rate = p.prefill_tokens_per_s
    drate = p.decode_tokens_per_s
    max_running = p.max_running
    lag = p.publish_lag_s
    per_block_s = p.block_bytes / p.link_bytes_per_s
    setup_s = p.pull_setup_s
    block_bytes = p.block_bytes

    # real cache state
    lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(N)]  # held, not in use (cold first)
    pins: list[dict[int, int]] = [{} for _ in range(N)]  # held, in use: block -> users
    real: dict[int, int] = {}  # block -> bitmask of nodes holding it
    vis: dict[int, int] = {}  # block -> bitmask of nodes the directory lists (lagged)
    # load state
    running = [0] * N
    inflight = [0] * N
    pending = [0.0] * N
    waitq: list[deque[int]] = [deque() for _ in range(N)]
    prefill_free = [0.0] * N
    link_in_free = [0.0] * N
    link_out_free = [0.0] * N
    busy = [0.0] * N
    spans: list[list[tuple[float, float]]] = [[] for _ in range(N)]
    # per request
    r_node = [0] * total
    r_local = [0] * total  # blocks found locally (pinned at arrival)
    r_uncached = [0] * total
    r_pred_unc = [0.0] * total
    r_pull_src = [-1] * total
    r_pull_n = [0] * total
    r_pull_pending = [False] * total
    r_admitted = [False] * total
    ttft = np.zeros(total)
    evictions = [0]

    last_end = [0.0]  # the latest decode end
    heap: list[tuple[float, int, int, object]] = []
    push = heapq.heappush
    pop = heapq.heappop
    seq = 0
    slot_cache: list[tuple[int, ...]] = [()]

    def slots_of(k: int) -> tuple[int, ...]:
        while len(slot_cache) <= k:
            slot_cache.append(tuple(range(len(slot_cache))))
        return slot_cache[k]

    def publish(node: int, adds: list[int], removes: list[int]) -> None:
        bit = 1 << node
        for b in removes:
            m = vis.get(b, 0) & ~bit
            if m:
                vis[b] = m
            else:
                vis.pop(b, None)
        for b in adds:
            vis[b] = vis.get(b, 0) | bit

    def settle(n: int, now: float, adds: list[int]) -> None:
        """Evict node n's coldest unused blocks down to capacity; publish the change (after the lag)."""
        nonlocal seq
        cold = lru[n]
        over = len(cold) + len(pins[n]) - cap
        removes = []
        if over > 0:
            keep = ~(1 << n)
            while over > 0 and cold:
                b = cold.popitem(last=False)[0]
                m = real[b] & keep
                if m:
                    real[b] = m
                else:
                    del real[b]
                removes.append(b)
                over -= 1
            evictions[0] += len(removes)
        if adds or removes:
            if lag > 0:
                seq += 1
                push(heap, (now + lag, seq, _PUBLISH, (n, adds, removes)))
            else:
                publish(n, adds, removes)

    def start_prefill(i: int, now: float) -> None:
        nonlocal seq
        n = r_node[i]
        s = prefill_free[n]
        if s < now:
            s = now
        e = s + r_uncached[i] / rate
        prefill_free[n] = e
        if e > s:
            busy[n] += e - s
            spans[n].append((s, e))
        seq += 1
        push(heap, (e, seq, _PREFILL_DONE, i))

    def admit(i: int, now: float) -> None:
        running[r_node[i]] += 1
        r_admitted[i] = True
        if not r_pull_pending[i]:
            start_prefill(i, now)

    def handle(t: float, kind: int, x: object) -> None:
        nonlocal seq
        if kind == _PULL_DONE:
            i = cast(int, x)  # the payload of the three request events is the request index
            src = r_pull_src[i]
            sp = pins[src]
            slru = lru[src]
            b0 = r_local[i]
            blocks = reqs[i].blocks
            for b in reversed(blocks[b0 : b0 + r_pull_n[i]]):
                c: int | None = sp[b] - 1  # int | None: the name is reused for pin.get() below
                if c:
                    sp[b] = c
                else:
                    del sp[b]
                    slru[b] = None
            if len(slru) + len(sp) > cap:
                settle(src, t, [])
            r_pull_pending[i] = False
            if r_admitted[i]:
                start_prefill(i, t)
        elif kind == _PREFILL_DONE:
            i = cast(int, x)
            n = r_node[i]
            r = reqs[i]
            ttft[i] = t - r.arrival_s
            pending[n] -= r_pred_unc[i]
            bit = 1 << n
            pin = pins[n]
            cold = lru[n]
            adds: list[int] = []
            for b in r.blocks[r_local[i] :]:
                c = pin.get(b)
                if c is not None:
                    pin[b] = c + 1
                else:
                    if b in cold:
                        del cold[b]
                    else:
                        real[b] = real.get(b, 0) | bit
                        adds.append(b)
                    pin[b] = 1
            settle(n, t, adds)
            seq += 1
            push(heap, (t + r.output_tokens / drate, seq, _DECODE_DONE, i))
        elif kind == _DECODE_DONE:
            i = cast(int, x)
            n = r_node[i]
            pin = pins[n]
            cold = lru[n]
            for b in reversed(reqs[i].blocks):
                c = pin[b] - 1
                if c:
                    pin[b] = c
                else:
                    del pin[b]
                    cold[b] = None
            if len(cold) + len(pin) > cap:
                settle(n, t, [])
            running[n] -= 1
            inflight[n] -= 1
            last_end[0] = t
            q = waitq[n]
            if q and running[n] < max_running:
                admit(q.popleft(), t)
        else:  # _PUBLISH
            n, adds, removes = cast("tuple[int, list[int], list[int]]", x)
            publish(n, adds, removes)

    prompt_total = 0
    blocks_total = 0
    hit_tokens = pulled_tokens = 0
    hit_blocks = 0
    redundant = 0
    pred_err = 0
    pred_exact = 0
    pulls = pulls_short = pull_blocks = 0
    reasons: dict[str, int] = {}
    step = max(1, total // 100)
    Cand = Candidate
    RReq = RouteRequest

    for i, r in enumerate(reqs):
        t = r.arrival_s
        while heap and heap[0][0] <= t:
            et, _, kind, x = pop(heap)
            handle(et, kind, x)
        blocks = r.blocks
        nb = len(blocks)
        prompt = r.input_tokens
        view, _ = _runs(blocks, vis, full, N)
        cands = [
            Cand(ids[j], 1, view[j], slots_of(view[j]), max(0, running[j] - inflight[j]), len(waitq[j]), pending[j], inflight[j])
            for j in range(N)
        ]
        rreq = RReq(prompt, blocks, bs, r.output_tokens)
        d = choose(rreq, cands, rng)
        on_routed(rreq, d)
        reasons[d.reason] = reasons.get(d.reason, 0) + 1
        n = index[d.node_id]

        have, longest = _runs(blocks, real, full, N)
        local = have[n]
        got = local
        if local:
            pin = pins[n]
            cold = lru[n]
            for b in blocks[:local]:
                c = pin.get(b)
                if c is None:
                    del cold[b]
                    pin[b] = 1
                else:
                    pin[b] = c + 1
        if d.pull_from is not None and d.pull_from != d.node_id:
            src = index[d.pull_from]
            plan = len(d.pull_slots)
            reach = have[src] if have[src] < plan else plan
            if reach < plan:
                pulls_short += 1
            npull = reach - local
            if npull > 0:
                sp = pins[src]
                slru = lru[src]
                for b in blocks[local:reach]:
                    c = sp.get(b)
                    if c is None:
                        del slru[b]
                        sp[b] = 1
                    else:
                        sp[b] = c + 1
                start = t
                if link_in_free[n] > start:
                    start = link_in_free[n]
                if link_out_free[src] > start:
                    start = link_out_free[src]
                done = start + setup_s + npull * per_block_s
                link_in_free[n] = link_out_free[src] = done
                r_pull_src[i] = src
                r_pull_n[i] = npull
                r_pull_pending[i] = True
                seq += 1
                push(heap, (done, seq, _PULL_DONE, i))
                pulls += 1
                pull_blocks += npull
                got = reach
        cached = _tokens_of_blocks(got, prompt, bs)
        pulled_tokens += cached - _tokens_of_blocks(local, prompt, bs)
        hit_tokens += cached
        hit_blocks += got
        held = _tokens_of_blocks(longest, prompt, bs)
        if held > cached:
            redundant += held - cached
        prompt_total += prompt
        blocks_total += nb
        pc = d.predicted_cached_tokens
        diff = pc - cached
        if diff:
            pred_err += diff if diff > 0 else -diff
        else:
            pred_exact += 1

        r_node[i] = n
        r_local[i] = local
        r_uncached[i] = prompt - cached
        unc = prompt - pc
        r_pred_unc[i] = unc if unc > 0 else 0
        pending[n] += r_pred_unc[i]
        inflight[n] += 1
        if running[n] < max_running:
            admit(i, t)
        else:
            waitq[n].append(i)
        if progress is not None and (i + 1) % step == 0 and i + 1 < total:
            progress(i + 1, total)

    while heap:
        et, _, kind, x = pop(heap)
        handle(et, kind, x)
    if progress is not None:
        progress(total, total)

    # Bookkeeping checks (cheap): everything finished and released, and the directory caught up with the caches.
    if any(pins) or any(running) or any(inflight) or any(waitq) or any(abs(x) > 1e-6 for x in pending):
        raise AssertionError("replay bookkeeping leak: requests or pins left at the end")
    if vis != real or sum(len(lru[j]) for j in range(N)) != sum(m.bit_count() for m in real.values()):
        raise AssertionError("replay bookkeeping: the directory view or the block index disagrees with the caches")
    if any(len(lru[j]) > cap for j in range(N)):
        raise AssertionError("replay bookkeeping: a cache holds more than its capacity at rest")

    first = reqs[0].arrival_s if reqs else 0.0
    end = max(last_end[0], first)
    span = end - first
    mean_busy = sum(busy) / N
    if total:
        p50, p90, p99 = (float(x) for x in np.percentile(ttft, [50, 90, 99]))
        mean_ttft = float(ttft.mean())
    else:
        p50 = p90 = p99 = mean_ttft = 0.0
    out = {
        "policy": policy_name,
        "requests": total,
        "prompt_tokens": prompt_total,
        "hit_rate": hit_tokens / prompt_total if prompt_total else 0.0,
        "local_hit_rate": (hit_tokens - pulled_tokens) / prompt_total if prompt_total else 0.0,
        "pulled_hit_rate": pulled_tokens / prompt_total if prompt_total else 0.0,
        "block_hit_rate": hit_blocks / blocks_total if blocks_total else 0.0,
        "redundant_prefill": redundant / prompt_total if prompt_total else 0.0,
        "ttft_p50_s": p50,
        "ttft_p90_s": p90,
        "ttft_p99_s": p99,
        "ttft_mean_s": mean_ttft,
        "throughput_rps": total / span if span > 0 else 0.0,
        "span_s": span,
        "imbalance": max(busy) / mean_busy if mean_busy > 0 else 1.0,
        "busy_s": busy,
        "pulls": pulls,
        "pulls_short": pulls_short,
        "pull_blocks": pull_blocks,
        "bytes_moved": pull_blocks * block_bytes,
        "evictions": evictions[0],
        "prediction_error": pred_err / prompt_total if prompt_total else 0.0,
        "prediction_exact": pred_exact / total if total else 1.0,
        "reasons": dict(sorted(reasons.items())),
        "load_timeline": _timeline(spans, first, end, p.timeline_buckets),
        "wall_s": time.perf_counter() - wall0,
    }
    return out


def _timeline(spans: list[list[tuple[float, float]]], t0: float, t1: float, buckets: int) -> dict[str, Any]:
    """Prefill-busy fraction per node in `buckets` equal buckets over [t0, t1]."""
    if t1 <= t0:
        return {"t0_s": t0, "bucket_s": 0.0, "busy": [[0.0] * buckets for _ in spans]}
    edges = np.linspace(t0, t1, buckets + 1)
    width = (t1 - t0) / buckets
    rows = []
    for sp in spans:
        if not sp:
            rows.append([0.0] * buckets)
            continue
        a = np.array(sp)
        s, e = a[:, 0], a[:, 1]  # FIFO server: sorted and disjoint
        cum = np.concatenate(([0.0], np.cumsum(e - s)))
        k = np.searchsorted(e, edges, side="right")  # intervals wholly ended by each edge
        part = np.zeros_like(edges)
        inside = k < len(s)
        kk = k[inside]
        part[inside] = np.clip(edges[inside] - s[kk], 0.0, None)
        b = cum[k] + part  # busy seconds up to each edge
        rows.append([float(x) for x in np.clip(np.diff(b) / width, 0.0, 1.0)])
    return {"t0_s": t0, "bucket_s": width, "busy": rows}


def describe_params(p: SimParams) -> str:
    """One line with the parameters that matter, for tables."""
    return (
        f"{p.nodes} nodes x {p.capacity_blocks} blocks of {p.block_tokens} tokens, prefill "
        f"{p.prefill_tokens_per_s:g} tok/s, decode {p.decode_tokens_per_s:g} tok/s, max_running {p.max_running}, "
        f"block {p.block_bytes / 2**20:.4g} MiB, link {p.link_bytes_per_s / 1e9:g} GB/s + {p.pull_setup_s * 1e3:g} ms, "
        f"publish lag {p.publish_lag_s * 1e3:g} ms"
    )
