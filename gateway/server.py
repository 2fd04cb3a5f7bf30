"""Run the gateway on uvicorn."""

from __future__ import annotations

from gateway.app import create_app
from gateway.config import GatewaySettings
from kvproto.http_limits import serve_app


def serve(settings: GatewaySettings) -> None:
    serve_app(lambda: create_app(settings), settings.http, settings.log_level)
