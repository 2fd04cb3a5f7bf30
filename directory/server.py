"""Run one directory replica: the REST API on uvicorn with its Raft node."""

from __future__ import annotations

import uvicorn

from directory.addresses import parse_hostport
from directory.api import create_app
from directory.config import DirectorySettings
from directory.http_limits import LimitedHttpToolsProtocol
from directory.logs import configure_logging


def serve(settings: DirectorySettings) -> None:
    """Serve until SIGINT/SIGTERM; the lifespan stops the Raft node cleanly."""
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
