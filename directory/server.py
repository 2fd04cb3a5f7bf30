"""Run one directory replica: the REST API on uvicorn with its Raft node."""

from __future__ import annotations

from directory.api import create_app
from directory.config import DirectorySettings
from kvproto.http_limits import serve_app


def serve(settings: DirectorySettings) -> None:
    """Serve until SIGINT/SIGTERM; the lifespan stops the Raft node cleanly."""
    serve_app(lambda: create_app(settings), settings.http, settings.log_level)
