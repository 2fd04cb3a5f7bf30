"""Run the gateway on uvicorn."""

from __future__ import annotations

import uvicorn

from directory.addresses import parse_hostport
from directory.http_limits import LimitedHttpToolsProtocol
from directory.logs import configure_logging
from gateway.app import create_app
from gateway.config import GatewaySettings


def serve(settings: GatewaySettings) -> None:
    configure_logging(settings.log_level)
    host, port = parse_hostport(settings.http)
    uvicorn.run(
        create_app(settings),
        host=host,
        port=port,
        log_level=settings.log_level.lower(),
        access_log=False,
        loop="uvloop",
        http=LimitedHttpToolsProtocol,
        timeout_graceful_shutdown=5,
    )
