"""The gateway's errors, answered in OpenAI's shape.

    GatewayError          a request the gateway answers itself (4xx: the client's
                          fault; 502/503: no engine could take it), never forwarded

Upstream failures are not exceptions here: a connection refused is retried on
the next-best engine (gateway.proxy), and an engine's own error response is
relayed as it came. The error and its body are kvproto.openai_api's, shared
with the worker stub, which also answers routing's 404 and 405.
"""

from __future__ import annotations

from kvproto.openai_api import OpenAIError


class GatewayError(OpenAIError):
    """An error response: status, message and OpenAI's `type`, `code` and `param`."""
