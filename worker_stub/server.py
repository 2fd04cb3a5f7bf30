"""Run one worker stub on uvicorn."""

from __future__ import annotations

from kvproto.http_limits import serve_app
from worker_stub.api import create_app
from worker_stub.config import WorkerSettings


def serve(settings: WorkerSettings) -> None:
    serve_app(lambda: create_app(settings), settings.http, settings.log_level)
