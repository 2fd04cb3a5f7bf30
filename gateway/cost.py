"""kvdir's time-to-first-token (TTFT) model: the routing inputs and one evaluation function.

Everything a policy needs to compare engines lives here, with no I/O, no clock
and no randomness, so the gateway (gateway.router) and the offline replay
simulator (kvtools.replay) score the same candidate identically.

The model, per healthy candidate ``c`` and request ``req``:

- ``slot_interval_s = T_req / max_running`` with
  ``T_req = output_tokens / decode_tokens_per_s`` (``output_tokens`` is
  ``CostModel.mean_output_tokens`` when set, else the request's ``max_tokens``):
  a request that finds all ``max_running`` places taken waits for one to free;
  the running requests spend most of their life decoding (their prefill is
  counted separately, below), so places free at ``max_running / T_req`` per
  second and every request ahead in line adds ``T_req / max_running``.
- ``queue_s = pending_prefill_tokens / prefill_tokens_per_s
  + (max(0, running + inflight - max_running + 1) + waiting) * slot_interval_s``
- ``cached_tokens = min(min(cached_blocks, len(hashes)) * block_size, prompt_tokens)``
- ``load_s = (host_blocks * block_bytes) / host_copy_bytes_per_s + (disk_blocks * block_bytes) /
  disk_read_bytes_per_s``: the candidate's own cached blocks that lie in a lower tier (docs/protocol.md
  §2.3) are copied to the device first; device blocks are free. Where the pull source's blocks lie does not
  change a pull's price (the link is the bottleneck).
- ``compute_s = (prompt_tokens - cached_tokens) / prefill_tokens_per_s``
- ``pull_s(n) = pull_setup_s + n * (block_bytes / link)``, ``link`` being the pull bandwidth the candidate
  reported (``c.link_bytes_per_s``: what its reads measured) or else the configured ``link_bytes_per_s``
- recompute: ``ttft = queue_s + load_s + compute_s``; pull up to block ``P`` (the longest
  holder's servable prefix): ``ttft = queue_s + load_s + pull_s(P - c.blocks) +
  (prompt_tokens - P.cached_tokens) / prefill_tokens_per_s``, taken only when
  ``pull_s < (P.cached_tokens - c.cached_tokens) / prefill_tokens_per_s``
  (strictly: at the break-even the node recomputes; no network, no dependency
  on the holder).
- ``prefill_tokens_per_s`` is the candidate's own where the gateway learned it from the TTFTs it observed
  (``Candidate.prefill_tokens_per_s``, gateway.ttft_learner: the rate at its present load), else the configured
  one; the estimate adds the candidate's learned fixed time per request (``overhead_s``, 0 unless learned).
- displacement (capacity-aware routing): whatever a candidate does not hold
  locally it stores (pulled or computed), and a full cache makes room by
  evicting: ``displace_s = displace_weight * max(0, (prompt_tokens -
  c.cached_tokens) - c.free_tokens) / prefill_tokens_per_s``, the recompute
  time of what it would push out, weighted by the chance that it is needed
  again. Not part of the TTFT (``total_s``): it is a cost to later requests,
  added to the score a policy minimises (``score_s``). A second copy of a
  prefix on a full node is what it prices; ``free_tokens=None`` (unknown)
  prices nothing.
- in-flight prefixes: blocks another request sent to ``c`` is computing now
  (``c.inflight_blocks``, from gateway.inflight) count as held: the engine
  reuses them once computed, and the wait for them is already in ``queue_s``
  (that request's uncached tokens are in ``pending_prefill_tokens``). A
  follower of a hot prefix thus queues behind it where it is being computed,
  unless another node is faster even after computing it again.
- predicted cached tokens are in the engine's units: a match ending inside an
  engine block counts up to the engine block's start (``engine_tokens``).

`evaluate` is that model, written once: it returns the `TTFTBreakdown` of the
option a candidate would take, which both decides (its `total_s`) and explains
(its parts) a kvdir decision. The arithmetic is fixed term by term (the order of
additions included) because replayed traces compare decisions bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = [
    "DEFAULT_COST",
    "REASONS",
    "Candidate",
    "CostModel",
    "Decision",
    "RouteRequest",
    "TTFTBreakdown",
    "blocks_held",
    "blocks_ready",
    "displace_seconds",
    "engine_tokens",
    "estimate_ttft",
    "evaluate",
    "link_rate",
    "load_seconds",
    "prefill_rate",
    "pull_seconds",
    "queue_seconds",
    "queued_ahead",
    "slot_interval_seconds",
    "ttft_breakdown",
]

REASONS = frozenset({"affinity", "pull", "recompute", "balance", "fallback", "inflight", "unhashed"})


@dataclass(frozen=True, slots=True)
class Candidate:
    node_id: str
    epoch: int
    cached_blocks: int  # leading blocks of this prompt the node holds (from the directory lookup)
    slots: tuple[int, ...] = ()  # the node's slots for blocks [0, cached_blocks); passed through into a pull plan
    running: int = 0  # load the node reported (heartbeat)
    waiting: int = 0
    pending_prefill_tokens: float = 0.0  # uncached prompt tokens sent there that have not produced a first token yet
    inflight: int = 0  # requests the gateway has sent there and not finished
    healthy: bool = True
    can_pull: bool = True  # the node can read a pull plan's blocks from a peer (else kvdir never plans a pull to it)
    free_tokens: int | None = None  # tokens it can store without evicting (None: unknown, no displacement priced)
    engine_block_size: int = 0  # the engine's KV block in tokens, from its registration (0: the gateway's block size)
    # Leading blocks of this prompt that requests already sent there are computing now (gateway.inflight): the
    # engine reuses them once computed, so they count as held; the wait for them is in pending_prefill_tokens.
    inflight_blocks: int = 0
    # Pull bandwidth the node measured on its own reads (its pull_gbps load label), in bytes/s; 0: unknown, pulls
    # to it are priced with CostModel.link_bytes_per_s.
    link_bytes_per_s: float = 0.0
    # Its registered KV fingerprint (docs/protocol.md §2.1): a pull is planned only from a holder whose
    # fingerprint equals it (the router leaves `can_pull` off for a node that registered none).
    kv_fingerprint: str | None = None
    # Its tensor-parallel rank count (docs/protocol.md §2.2): rank r's pages hold r's share of the KV heads, so a
    # pull is planned only from a holder with as many ranks.
    tp_size: int = 1
    # Of its cached_blocks, those in its host tier and on its disk (docs/protocol.md §2.3): copied to the device
    # before they serve (load_s), where device blocks are free.
    host_blocks: int = 0
    disk_blocks: int = 0
    # Its registered tenant and whether it is shared (docs/security.md, Tenants): a pull is planned only from a
    # holder it may read by kvproto.pull_tenancy (a shared engine only from shared ones).
    tenant: str = ""
    shared: bool = False
    # What the gateway learned of it from the TTFTs it observed (gateway.ttft_learner): its prefill rate at its
    # present load, tokens/s (0: not learned, CostModel.prefill_tokens_per_s), and its fixed per-request time.
    prefill_tokens_per_s: float = 0.0
    overhead_s: float = 0.0


@dataclass(frozen=True, slots=True)
class RouteRequest:
    prompt_tokens: int
    hashes: tuple[int, ...]  # the prompt's full-block sequence hashes (docs/protocol.md §1)
    block_size: int = 16
    max_tokens: int = 16
    # Requests the gateway has in flight that compute or reuse this prompt's in-flight prefix (the leading blocks
    # some node is computing: gateway.inflight.InflightPrefixes.sharing); 0 when none or unknown.
    inflight_requests: int = 0
    # Output length of the requests ahead, as observed for this request's model (gateway.ttft_learner); None:
    # `max_tokens` (what the replay's traces give), unless CostModel.mean_output_tokens is set.
    output_tokens: float | None = None


@dataclass(frozen=True, slots=True)
class CostModel:
    prefill_tokens_per_s: float = 10_000.0
    block_bytes: int = 16_384 * 1  # KV bytes of one block summed over a node's TP ranks
    link_bytes_per_s: float = 2e9  # pull bandwidth between nodes, for a candidate that reported none
    pull_setup_s: float = 0.002  # per pull (handshake/lookup)
    max_running: int = 32  # engine concurrency; above it requests queue
    decode_tokens_per_s: float = 80.0  # per running request (the gateway's --decode-tokens-per-s)
    # Output length of a typical running request, for the queueing term; None: the request's max_tokens.
    mean_output_tokens: float | None = None
    # Weight of the recompute time of what a full node evicts to store a request's uncached blocks (0: ignored).
    displace_weight: float = 8.0
    host_copy_bytes_per_s: float = 20e9  # a node's host-to-device copy rate, all ranks together (PCIe 4.0/5.0 x16)
    disk_read_bytes_per_s: float = 2e9  # a node's disk-to-device rate, all ranks together (an NVMe SSD)


DEFAULT_COST = CostModel()


@dataclass(frozen=True, slots=True)
class Decision:
    node_id: str
    reason: str  # one of REASONS
    predicted_cached_tokens: int
    pull_from: str | None = None
    pull_epoch: int | None = None
    pull_slots: tuple[int, ...] = ()  # the holder's slots for blocks [0, n)
    estimated_ttft_s: float = 0.0
    why: str | Callable[[], str] = field(default="", compare=False, repr=False)
    """The formula with its values, for debug logs, or what builds it: built only when asked (`detail`), since a
    request that logs nothing has no use for it (derived from the other fields' inputs: not compared)."""

    @property
    def detail(self) -> str:
        return self.why() if callable(self.why) else self.why


class TTFTBreakdown(NamedTuple):
    queue_s: float
    pull_s: float
    compute_s: float
    cached_tokens: int  # prompt tokens not recomputed (held locally or pulled)
    pulled_blocks: int = 0  # blocks read from a peer first (0: the option recomputes what it lacks)
    displace_s: float = 0.0  # weighted recompute time of what storing this request evicts (not in the TTFT)
    load_s: float = 0.0  # copying the candidate's own host- and disk-tier blocks to the device
    overhead_s: float = 0.0  # the candidate's learned fixed time per request (Candidate.overhead_s)

    @property
    def total_s(self) -> float:
        """The estimated TTFT."""
        return self.queue_s + self.load_s + self.pull_s + self.compute_s + self.overhead_s

    @property
    def score_s(self) -> float:
        """What kvdir minimises: the TTFT plus the price of what the option displaces."""
        return self.queue_s + self.load_s + self.pull_s + self.compute_s + self.overhead_s + self.displace_s


def blocks_held(cand: Candidate, n_hashes: int) -> int:
    """The candidate's cached blocks that count for this prompt: clamped to [0, n_hashes]."""
    b = cand.cached_blocks
    return 0 if b < 0 else (n_hashes if b > n_hashes else b)


def blocks_ready(cand: Candidate, n_hashes: int) -> int:
    """Blocks the candidate will hold when this prompt's prefill starts: cached, or being computed there now."""
    b = cand.cached_blocks if cand.cached_blocks > cand.inflight_blocks else cand.inflight_blocks
    return 0 if b < 0 else (n_hashes if b > n_hashes else b)


def engine_tokens(cached_tokens: int, cand: Candidate) -> int:
    """`cached_tokens` rounded down to the candidate engine's block size: what the engine will report as cached.

    An engine caches whole blocks of its own size; a gateway hashing smaller
    blocks can match into the middle of one, which the engine recomputes.
    """
    ebs = cand.engine_block_size
    if ebs <= 1:
        return cached_tokens
    return cached_tokens - cached_tokens % ebs


def displace_seconds(stored_tokens: int, cand: Candidate, cost: CostModel = DEFAULT_COST) -> float:
    """displace_weight * max(0, stored_tokens - free_tokens) / prefill rate (0 when free_tokens is unknown)."""
    free = cand.free_tokens
    if free is None or cost.displace_weight <= 0.0:
        return 0.0
    over = stored_tokens - free
    return cost.displace_weight * over / cost.prefill_tokens_per_s if over > 0 else 0.0


def slot_interval_seconds(req: RouteRequest, cost: CostModel = DEFAULT_COST) -> float:
    """Mean wait added by each request ahead in an engine's queue: T_req / max_running.

    T_req = output_tokens / decode_tokens_per_s is how long a running request
    holds its place (its prefill is in `pending_prefill_tokens`); with
    `max_running` places a place frees every T_req / max_running on average.
    """
    out = cost.mean_output_tokens
    if out is None:
        out = req.output_tokens if req.output_tokens is not None else req.max_tokens
    return out / cost.decode_tokens_per_s / cost.max_running


def queued_ahead(cand: Candidate, cost: CostModel = DEFAULT_COST) -> int:
    """Running requests beyond the free places: max(0, running + inflight - max_running + 1) (waiting not included)."""
    return max(0, cand.running + cand.inflight - cost.max_running + 1)


def queue_seconds(req: RouteRequest, cand: Candidate, cost: CostModel = DEFAULT_COST) -> float:
    """pending_prefill_tokens / prefill_rate + (max(0, running + inflight - max_running + 1) + waiting) * slot_interval."""
    ahead = queued_ahead(cand, cost) + cand.waiting
    return cand.pending_prefill_tokens / prefill_rate(cand, cost) + ahead * slot_interval_seconds(req, cost)


def prefill_rate(cand: Candidate, cost: CostModel = DEFAULT_COST) -> float:
    """Tokens/s the candidate prefills at: what the gateway learned of it, else the configured rate."""
    return cand.prefill_tokens_per_s if cand.prefill_tokens_per_s > 0 else cost.prefill_tokens_per_s


def link_rate(cand: Candidate, cost: CostModel = DEFAULT_COST) -> float:
    """The bandwidth pulls to `cand` are priced with: what it reported measuring, else the configured one."""
    return cand.link_bytes_per_s if cand.link_bytes_per_s > 0 else cost.link_bytes_per_s


def pull_seconds(n_blocks: int, cost: CostModel = DEFAULT_COST, link_bytes_per_s: float | None = None) -> float:
    """pull_setup_s + n_blocks * (block_bytes / link) (0 for no blocks); link: `link_bytes_per_s` (a
    candidate's `link_rate`), or the cost model's."""
    if n_blocks <= 0:
        return 0.0
    link = cost.link_bytes_per_s if link_bytes_per_s is None else link_bytes_per_s
    return cost.pull_setup_s + n_blocks * (cost.block_bytes / link)


def load_seconds(cand: Candidate, cost: CostModel = DEFAULT_COST) -> float:
    """Copying the candidate's cached blocks that lie in its host tier or on its disk to the device (0 for none)."""
    s = 0.0
    if cand.host_blocks > 0:
        s += cand.host_blocks * cost.block_bytes / cost.host_copy_bytes_per_s
    if cand.disk_blocks > 0:
        s += cand.disk_blocks * cost.block_bytes / cost.disk_read_bytes_per_s
    return s


def evaluate(
    req: RouteRequest, cand: Candidate, cost: CostModel = DEFAULT_COST, *, pull_to_blocks: int = 0, force_pull: bool = False
) -> TTFTBreakdown:
    """kvdir's TTFT estimate for serving `req` on `cand`: the one place the model is computed.

    `pull_to_blocks` is how far a peer could serve this prompt (the longest
    holder's blocks it has slots for). Above what `cand` holds, and when `cand`
    can pull, the pull option is taken only if reading the missing blocks is
    strictly faster than computing them (the break-even rule); `force_pull`
    prices the pull regardless (a what-if: `ttft_breakdown`). Otherwise the
    candidate recomputes what it lacks. `pulled_blocks` says which option it is.
    Either way the candidate stores what it does not hold: `displace_s` prices
    the evictions that makes on a full node (the same for both options), and
    copies its own lower-tier blocks to the device first (`load_s`).
    """
    nh = len(req.hashes)
    have = blocks_ready(cand, nh)
    bs = req.block_size
    prompt = req.prompt_tokens
    rate = prefill_rate(cand, cost)
    over = cand.overhead_s
    queue_s = queue_seconds(req, cand, cost)
    cached = have * bs
    if cached > prompt:
        cached = prompt
    displace_s = displace_seconds(prompt - cached, cand, cost)
    load_s = load_seconds(cand, cost)
    target = min(max(pull_to_blocks, 0), nh)
    if target > have and (force_pull or cand.can_pull):
        pull_s = pull_seconds(target - have, cost, link_rate(cand, cost))
        pulled = target * bs
        if pulled > prompt:
            pulled = prompt
        if force_pull or pull_s < (pulled - cached) / rate:
            return TTFTBreakdown(queue_s, pull_s, (prompt - pulled) / rate, pulled, target - have, displace_s, load_s, over)
    return TTFTBreakdown(queue_s, 0.0, (prompt - cached) / rate, cached, 0, displace_s, load_s, over)


def ttft_breakdown(
    req: RouteRequest, cand: Candidate, cost: CostModel = DEFAULT_COST, *, pull_to_blocks: int = 0
) -> TTFTBreakdown:
    """The estimate of one given option: `pull_to_blocks` > the candidate's cached blocks means pull blocks
    [cached_blocks, pull_to_blocks) from a peer first (whatever it costs), then compute the rest."""
    return evaluate(req, cand, cost, pull_to_blocks=pull_to_blocks, force_pull=True)


def estimate_ttft(req: RouteRequest, cand: Candidate, cost: CostModel = DEFAULT_COST, *, pull_to_blocks: int = 0) -> float:
    """queue_s + pull_s + compute_s of `ttft_breakdown` (seconds)."""
    return ttft_breakdown(req, cand, cost, pull_to_blocks=pull_to_blocks).total_s
