"""The gateway's errors, answered in OpenAI's shape.

    GatewayError          a request the gateway answers itself (4xx: the client's
                          fault; 502/503: no engine could take it), never forwarded

Upstream failures are not exceptions here: a connection refused is retried on
the next-best engine (gateway.proxy), and an engine's own error response is
relayed as it came. The response body is made by kvproto.openai_errors,
shared with the worker stub, which also answers routing's 404 and 405.
"""

from __future__ import annotations


class GatewayError(Exception):
    """An error response: status, message and OpenAI's `type`, `code` and `param`."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
