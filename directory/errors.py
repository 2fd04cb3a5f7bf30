"""The directory API's errors: every one is JSON `{"error": ..., "detail": ...}` (the statuses are listed in
directory.api), whether a route raised it as an `ApiError`, the state machine refused a command, or FastAPI
and Starlette refused the request before a route ran."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvproto import codec
from kvproto import state as st
from kvproto.errors import CommitTimeout
from kvproto.rate_limit import retry_after
from kvproto.schemas import ErrorResponse

if TYPE_CHECKING:
    from directory.replica import Replica

_STATUS = {
    st.STALE_EPOCH: 409,
    st.UNKNOWN_NODE: 409,
    st.NODE_LIMIT: 429,
    st.INDEX_FULL: 507,
    st.INVALID: 422,
    st.WRONG_SHARD: 409,
    st.ENDPOINT_TAKEN: 409,
}
_ERRORS = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "body_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
}
RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 409, 410, 413, 415, 422, 429, 503, 507)
}
"""The error responses every route documents."""


class ApiError(Exception):
    def __init__(self, status: int, error: str, detail: object = None, *, retry_after_s: float | None = None) -> None:
        self.status, self.error, self.detail = status, error, detail
        self.retry_after_s = retry_after_s  # sent as Retry-After (503s say 1 s without it)


def error_response(status: int, error: str, detail: object = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": error, "detail": jsonable_encoder(detail)}, status_code=status, headers=headers)


async def commit(replica: Replica, cmd: st.Command) -> st.Result:
    """Commit `cmd`; a timeout is a 503, a command the log cannot carry a 422, and one the state machine refused an
    ApiError for its status."""
    try:
        res = await replica.submit(cmd)
    except CommitTimeout as exc:
        raise ApiError(503, "commit_timeout", str(exc)) from exc
    except codec.WireError as exc:  # the schemas' bounds let through what the log cannot carry: refused, not stored
        raise ApiError(422, "invalid_request", str(exc)) from exc
    if not res.ok:
        raise ApiError(_STATUS.get(res.status, 422), res.status, res.detail)
    return res


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error as JSON, counted in the replica's metrics by its `error`."""

    def count(request: Request, error: str) -> None:
        m = getattr(request.app.state, "metrics", None)
        if m is not None:
            m.rejected.labels(error).inc()

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        count(request, exc.error)
        if exc.retry_after_s is not None:
            headers: dict[str, str] | None = {"Retry-After": retry_after(exc.retry_after_s)}
        else:
            headers = {"Retry-After": "1"} if exc.status == 503 else None
        return error_response(exc.status, exc.error, exc.detail, headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            count(request, "invalid_json")
            return error_response(400, "invalid_json", "the request body is not valid JSON")
        count(request, "invalid_request")
        detail = [{"loc": e.get("loc"), "msg": e.get("msg"), "type": e.get("type")} for e in errors[:20]]
        return error_response(422, "invalid_request", detail)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = _ERRORS.get(exc.status_code, "http_error")
        count(request, error)
        return error_response(exc.status_code, error, exc.detail)
