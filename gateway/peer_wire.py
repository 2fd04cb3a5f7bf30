"""What gateways send each other about their routing (the design: gateway.peers): the notes' wire format."""

from __future__ import annotations

from typing import Annotated

import msgspec

NOTES_PATH = "/v1/peers/notes"
STATUS_PATH = "/v1/peers"
MAX_BATCH = 512  # notes (and dones) per POST
MAX_TTL_S = 600.0


class Note(msgspec.Struct, forbid_unknown_fields=True):
    """A peer sent a request with `tokens` prompt tokens to compute to engine `node`@`epoch`."""

    id: Annotated[int, msgspec.Meta(ge=0)]
    node: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    epoch: Annotated[int, msgspec.Meta(ge=0)]
    tokens: Annotated[float, msgspec.Meta(ge=0, le=1e9)]
    ttl_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_TTL_S)]


class NoteBatch(msgspec.Struct, forbid_unknown_fields=True):
    """One POST: new notes, then the ids (of this sender) whose prefill is over."""

    sender: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    notes: Annotated[list[Note], msgspec.Meta(max_length=MAX_BATCH)] = msgspec.field(default_factory=list)
    done: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_BATCH)] = msgspec.field(
        default_factory=list
    )
