"""Asking an engine's replay socket for the event batches a subscriber missed (docs/protocol.md §5).

The protocol is vLLM's ``ZmqEventPublisher._service_replay``, the same in
SGLang: the client sends, on a DEALER socket, ``[b"", start_seq]`` (8 bytes
big-endian; a REQ socket adds the empty delimiter itself); the ROUTER
answers every buffered batch with ``seq >= start_seq`` as ``[b"", seq,
payload]`` and ends with ``[b"", (-1 as 8 bytes), b""]``. TensorRT-LLM's
variant puts the topic before the seq; both are understood. A new DEALER
socket is used for each replay, so a late answer to an abandoned one can
never be mistaken for the next.
"""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from adapters.engine_events import DecodeStats
from adapters.event_wire import END_SEQ, Batch, DecodeError, decode_payload, decode_replay_reply, encode_seq


async def request_replay(
    ctx: zmq.asyncio.Context,
    endpoint: str,
    start: int,
    stop: int,
    *,
    timeout_s: float,
    max_message_bytes: int,
    stats: DecodeStats,
) -> tuple[dict[int, Batch], bool]:
    """Batches start..stop-1 that `endpoint` sent within `timeout_s`, by seq, and whether its end marker came.

    Replies that are not batches count in `stats` as garbage frames."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    got: dict[int, Batch] = {}
    ended = False
    try:
        sock.connect(endpoint)
        await sock.send_multipart([b"", encode_seq(start)])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0 or not await sock.poll(int(remaining * 1000) + 1):
                break
            frames = await sock.recv_multipart()
            try:
                seq, payload = decode_replay_reply(frames)
                if seq == END_SEQ:
                    ended = True
                    break
                if start <= seq < stop and seq not in got:
                    ts, events, dp_rank = decode_payload(payload, stats)
                    got[seq] = Batch(seq, ts, events, b"", dp_rank)
            except DecodeError:
                stats.garbage_frames += 1
    finally:
        sock.close(linger=0)
    return got, ended
