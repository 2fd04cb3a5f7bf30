"""The gateway's errors, answered in OpenAI's shape.

    GatewayError          a request the gateway answers itself (4xx: the client's
                          fault; 502/503: no engine could take it), never forwarded

Upstream failures are not exceptions here: a connection refused is retried on
the next-best engine (gateway.proxy), and an engine's own error response is
relayed as it came.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse


class GatewayError(Exception):
    """An error response: status, message and OpenAI's `type`, `code` and `param`."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param


def error_response(
    status: int, message: str, type_: str = "invalid_request_error", code: str | None = None, param: str | None = None
) -> JSONResponse:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status)
