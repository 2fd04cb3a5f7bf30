"""The OpenAI shapes of the worker's answers: the completion body, the SSE chunks, `usage` and the
`kvdir` extension. The gateway and clients read `usage.prompt_tokens_details.cached_tokens` and the
extension's fields, so these names are part of the protocol.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from worker_stub.stub_engine import RequestStats

SSE_DONE = b"data: [DONE]\n\n"


def usage(stats: RequestStats) -> dict[str, Any]:
    """OpenAI's `usage`; `cached_tokens` counts the prompt tokens not recomputed (local hits plus pulled blocks)."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


def kvdir_extension(node_id: str, stats: RequestStats, ttft: float) -> dict[str, Any]:
    """The `kvdir` field: which node answered, where the time went and what was pulled."""
    return {
        "node_id": node_id,
        "local_cached_tokens": stats.local_cached_tokens,
        "host_cached_tokens": stats.host_cached_tokens,
        "host_load_s": stats.host_load_s,
        "pulled_tokens": stats.pulled_tokens,
        "queue_s": stats.queue_s,
        "pull_s": stats.pull_s,
        "pull_transfer_s": stats.pull_transfer_s,
        "pull_bytes": stats.pull_bytes,
        "pull_rank_s": stats.pull_rank_s,
        "prefill_s": stats.prefill_s,
        "decode_s": stats.decode_s,
        "ttft_s": ttft,
        "pull_failures": stats.pull_failures,
    }


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def decode(piece: bytes) -> str:
    """Output bytes as text: a token may end mid-character, which is replaced rather than refused."""
    return piece.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Completion:
    """One answer's fixed fields, shared by its body or by each of its chunks."""

    id: str
    created: int
    model: str
    chat: bool
    stream: bool

    @classmethod
    def new(cls, model: str, *, chat: bool, stream: bool) -> Completion:
        prefix = "chatcmpl-" if chat else "cmpl-"
        return cls(prefix + uuid.uuid4().hex[:24], int(time.time()), model, chat, stream)

    def choice(self, text: str, final: bool) -> dict[str, Any]:
        """The only choice; the stub always decodes to `max_tokens`, so a final one ends for `length`."""
        reason = "length" if final else None
        if self.chat:
            key = "delta" if self.stream else "message"
            return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": reason}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

    def body(self, text: str, usage: dict[str, Any], kvdir: dict[str, Any]) -> dict[str, Any]:
        """The whole non-streaming answer."""
        obj = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [self.choice(text, True)],
            "usage": usage,
            "kvdir": kvdir,
        }

    def chunk(self, text: str) -> dict[str, Any]:
        """A streamed piece of the output."""
        return {**self._chunk_base(), "choices": [self.choice(text, False)]}

    def last_chunk(self, usage: dict[str, Any], kvdir: dict[str, Any]) -> dict[str, Any]:
        """The stream's closing chunk: no text, the finish reason, and what the body would report."""
        return {**self._chunk_base(), "choices": [self.choice("", True)], "usage": usage, "kvdir": kvdir}

    def _chunk_base(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}
