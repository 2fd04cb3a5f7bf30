"""An engine's KV memory as the vLLM connector's worker half reads and writes it: `KvMemory`, and its CPU form.

The worker half needs four things of the memory vLLM allocated: where each layer's pages are (to register them
with the transfer engine and describe them to the directory), writing pulled bytes into blocks, and copying
blocks to and from a host tier. Everything else (tags, staging, host pools) is host memory of its own. On CPU the
KV *is* host memory and all four are plain copies (`HostKvMemory`); a GPU implementation copies between the
staging buffers and device memory on a copy stream of its own, so that a landing pull overlaps the forward pass.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from adapters.vllm_plan import LayerRegion


class KvMemory(Protocol):
    """The engine's KV pages: one region per layer, block `b` of layer `l` at `layers[l].base + b * page_bytes`."""

    @property
    def layers(self) -> tuple[LayerRegion, ...]: ...

    def spans(self) -> list[tuple[int, int]]:
        """The address ranges (start, length) the layers occupy, merged, to register with a transfer engine."""
        ...

    def write(self, dst: Sequence[int], src: Sequence[int], lengths: Sequence[int]) -> None:
        """Copy host bytes at src[i] .. +lengths[i] to KV addresses dst[i] (a pull landing)."""
        ...

    def to_host(self, blocks: Sequence[int], host_pages: Sequence[np.ndarray], slots: Sequence[int]) -> None:
        """Copy every layer's page of each block into `host_pages[layer][slot]`."""
        ...

    def from_host(self, host_pages: Sequence[np.ndarray], slots: Sequence[int], blocks: Sequence[int]) -> None:
        """Copy every layer's `host_pages[layer][slot]` into the page of each block."""
        ...


class HostKvMemory:
    """KV memory the CPU addresses directly (vLLM's CPU backend): each layer as a (blocks, page bytes) byte view."""

    def __init__(self, pages: Sequence[np.ndarray]) -> None:
        """`pages`: per layer, a C-contiguous uint8 array of shape (num_blocks, page_bytes) over the layer's KV."""
        for i, p in enumerate(pages):
            if p.dtype != np.uint8 or p.ndim != 2 or not p.flags.c_contiguous:
                raise ValueError(f"layer {i}: expected a C-contiguous (blocks, page bytes) uint8 view, got {p.dtype} {p.shape}")
        self._pages = list(pages)
        self._layers = tuple(LayerRegion(p.ctypes.data, p.shape[1], p.shape[0]) for p in pages)

    @property
    def layers(self) -> tuple[LayerRegion, ...]:
        return self._layers

    def spans(self) -> list[tuple[int, int]]:
        merged: list[list[int]] = []
        for lo, hi in sorted((r.base, r.base + r.page_bytes * r.num_blocks) for r in self._layers):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        return [(lo, hi - lo) for lo, hi in merged]

    def write(self, dst: Sequence[int], src: Sequence[int], lengths: Sequence[int]) -> None:
        for to, frm, size in zip(dst, src, lengths):
            ctypes.memmove(to, frm, size)

    def to_host(self, blocks: Sequence[int], host_pages: Sequence[np.ndarray], slots: Sequence[int]) -> None:
        b, s = np.asarray(blocks, dtype=np.int64), np.asarray(slots, dtype=np.int64)
        for dev, host in zip(self._pages, host_pages):
            host[s] = dev[b]

    def from_host(self, host_pages: Sequence[np.ndarray], slots: Sequence[int], blocks: Sequence[int]) -> None:
        b, s = np.asarray(blocks, dtype=np.int64), np.asarray(slots, dtype=np.int64)
        for dev, host in zip(self._pages, host_pages):
            dev[b] = host[s]
