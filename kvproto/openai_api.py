"""OpenAI's error shape, shared by kvdir's OpenAI-compatible servers (the gateway and the worker stub).

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

OpenAI's SDKs and the tools built on them look for `error.message` and `error.code`, which
FastAPI's own `{"detail": "Not Found"}` for an unknown path or method lacks. `http_error`
answers routing's 404 and 405 in OpenAI's shape instead, naming the request and the routes
the server has. This module imports only FastAPI and Starlette, so both
servers use it without importing each other (docs/architecture.md, "Import layers").
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

_CODES = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


def error_response(
    status: int, message: str, type_: str = "invalid_request_error", code: str | None = None, param: str | None = None
) -> JSONResponse:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status)


def _routes(request: Request) -> str:
    """The app's documented routes, as `METHOD /path`, in the order they were declared."""
    return ", ".join(
        f"{'/'.join(sorted(r.methods or ()))} {r.path}"
        for r in request.app.routes
        if isinstance(r, APIRoute) and r.include_in_schema
    )


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's HTTP errors in OpenAI's shape: an unknown path (404) or method (405) says what exists.

    For `app.exception_handler(HTTPException)(http_error)`: routing raises it for both. Its
    headers (a 405's `Allow`) are kept.
    """
    status = exc.status_code
    what = f"{request.method} {request.url.path}"
    if status == 404:
        message = f"Invalid URL ({what}): no such route; this server has {_routes(request)}"
    elif status == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"Invalid method ({what}): {request.url.path} takes {allowed}; this server has {_routes(request)}"
    else:
        message = str(exc.detail)
    response = error_response(status, message, code=_CODES.get(status))
    response.headers.update(exc.headers or {})
    return response
