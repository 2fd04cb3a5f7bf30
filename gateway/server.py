"""Run the gateway on uvicorn."""

from __future__ import annotations

from directory.http_limits import serve_app
from gateway.app import create_app
from gateway.config import GatewaySettings


def serve(settings: GatewaySettings) -> None:
    serve_app(lambda: create_app(settings), settings.http, settings.log_level)
