"""Request bodies of the directory API, decoded with msgspec rather than FastAPI's pydantic models, their bulk
fields counted against the limits before anything in them is decoded; and which format the answer takes.

Those that publish, remove and look up also come as binary batches (kvproto.binary), chosen by Content-Type.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
import numpy as np
from fastapi import Request

from directory.errors import ApiError
from kvproto import binary


def check_count(n: int, limit: int, what: str) -> None:
    if n > limit:
        raise ApiError(
            422, "too_many", f"{n} {what.replace('_', ' ')} in one request; the limit is {limit} (KVDIR_MAX_{what.upper()})"
        )


BodyT = TypeVar("BodyT", bound=msgspec.Struct)


class Counted:
    """A bulk field of a request body and its limit, counted on the raw JSON before anything in it is decoded."""

    ARRAY, OBJECTS, MAPPING = "array", "objects", "mapping"

    def __init__(self, field: str, shape: str, limit: int, what: str) -> None:
        self.field, self.shape, self.limit, self.what = field, shape, limit, what

    def bound(self, raw: bytes) -> int:
        """At least the number of elements in `raw`, exact for a valid field. Every element of an array is
        followed by a comma but the last; every object element has a "{"; every entry of a mapping a ":".
        Counting more only refuses what the decoder would, since it stops at the first invalid element."""
        if self.shape == self.ARRAY:
            return raw.count(b",") + 1 if raw.startswith(b"[") else 0
        return raw.count(b"{" if self.shape == self.OBJECTS else b":")


# curl -d sends form-urlencoded unless told otherwise: taken as JSON, as before content types were checked.
_JSON_TYPES = frozenset({binary.JSON, "application/x-www-form-urlencoded"})


def is_msgpack(request: Request, *, binary_ok: bool = True) -> bool:
    """Whether the body is a binary batch (Content-Type application/msgpack); JSON is the default, also
    without a Content-Type. 415 for any other type, or msgpack where a route takes JSON only."""
    ctype = request.headers.get("content-type")
    media = ctype.split(";", 1)[0].strip().lower() if ctype is not None else binary.JSON
    if media in _JSON_TYPES or media.endswith("+json"):
        return False
    if media == binary.MSGPACK and binary_ok:
        return True
    accepted = f"{binary.JSON} (the default) or {binary.MSGPACK}" if binary_ok else f"{binary.JSON} only"
    raise ApiError(415, "unsupported_media_type", f"Content-Type {ctype!r}: this route takes {accepted}")


async def decode(request: Request, body_type: type[BodyT], *counted: Counted) -> BodyT:
    """The request's JSON body as `body_type`, its bulk fields refused (422 too_many) before they are decoded.

    Decoding with msgspec is linear and cheap, and per-element validation runs on at most the limit's
    worth of elements, so no body, however large, holds the GIL long enough to starve the Raft thread
    into an election (as validating every element with pydantic once did).
    """
    is_msgpack(request, binary_ok=False)
    body = await request.body()
    try:
        try:
            fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
        except msgspec.ValidationError:
            msgspec.json.decode(body, type=msgspec.Raw)  # not an object; but is it JSON at all (else 400)?
            raise
        for c in counted:
            raw = fields.get(c.field)
            if raw is not None:
                check_count(c.bound(bytes(raw)), c.limit, c.what)
        return msgspec.json.decode(body, type=body_type)
    except msgspec.ValidationError as exc:
        raise ApiError(422, "invalid_request", f"{body_type.__name__}: {exc}") from exc
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ApiError(400, "invalid_json", f"the request body is not valid JSON: {exc}") from exc


async def decode_batch(request: Request, body_type: type[BodyT]) -> BodyT:
    """The request's msgpack body as `body_type`: its packed arrays are bytes, counted by `packed_count`."""
    body = await request.body()
    try:
        return msgspec.msgpack.decode(body, type=body_type)
    except msgspec.ValidationError as exc:
        raise ApiError(422, "invalid_request", f"{body_type.__name__}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ApiError(400, "invalid_msgpack", f"the request body is not valid msgpack: {exc}") from exc


def packed_count(packed: bytes, dtype: np.dtype, field: str, limit: int, what: str) -> int:
    """How many values a packed array holds: 400 for a partial value, 422 too_many over `limit`."""
    try:
        n = binary.count(packed, dtype, field)
    except ValueError as exc:
        raise ApiError(400, "invalid_batch", str(exc)) from exc
    check_count(n, limit, what)
    return n


def u64(values: list[int], what: str) -> np.ndarray:
    try:
        return np.array(values, dtype=np.uint64)
    except OverflowError as exc:
        raise ApiError(422, "invalid_request", f"{what} must be unsigned 64-bit integers (0..2**64-1)") from exc


def body_doc(body_type: type[msgspec.Struct]) -> dict[str, Any]:
    """The OpenAPI request body of a route that decodes `body_type` itself (see `decode`)."""
    ref = {"$ref": f"#/components/schemas/{body_type.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def accepts_msgpack(request: Request) -> bool:
    """Whether the client asked for a msgpack answer (`Accept: application/msgpack`); else JSON."""
    accept = request.headers.get("accept", "")
    return any(r.split(";", 1)[0].strip().lower() == binary.MSGPACK for r in accept.split(","))
