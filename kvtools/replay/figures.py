"""The replay simulator's figures: the per-request counters (`Tally`) and the per-node load timeline.

Apart from the event loop (`kvtools.replay.cluster`) because they are pure
arithmetic over what the loop records; the figures themselves are described
in `kvtools.replay.sim`'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Tally", "load_timeline", "tokens_of_blocks"]


def tokens_of_blocks(k: int, prompt: int, bs: int) -> int:
    """Prompt tokens in the first `k` blocks (the last block may be partial)."""
    t = k * bs
    return t if t < prompt else prompt


@dataclass(slots=True)
class Tally:
    """The per-request counters behind the figures."""

    prompt_tokens: int = 0
    blocks: int = 0
    hit_tokens: int = 0
    pulled_tokens: int = 0
    host_tokens: int = 0  # of the local hits, those loaded from the node's host tier
    hit_blocks: int = 0
    redundant: int = 0
    pred_err: int = 0
    pred_exact: int = 0
    pulls: int = 0
    pulls_short: int = 0
    pull_blocks: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def count(self, prompt: int, nb: int, local: int, got: int, longest: int, predicted: int, bs: int) -> int:
        """Count one routed request (`got` blocks cached of which `local` local, `longest` held anywhere); its cached tokens."""
        cached = tokens_of_blocks(got, prompt, bs)
        self.pulled_tokens += cached - tokens_of_blocks(local, prompt, bs)
        self.hit_tokens += cached
        self.hit_blocks += got
        held = tokens_of_blocks(longest, prompt, bs)
        if held > cached:
            self.redundant += held - cached
        self.prompt_tokens += prompt
        self.blocks += nb
        diff = predicted - cached
        if diff:
            self.pred_err += diff if diff > 0 else -diff
        else:
            self.pred_exact += 1
        return cached


def load_timeline(spans: list[list[tuple[float, float]]], t0: float, t1: float, buckets: int) -> dict[str, Any]:
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
