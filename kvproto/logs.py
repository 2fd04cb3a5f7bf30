"""Logging set-up shared by every kvdir process: one line per event, on stderr."""

from __future__ import annotations

import logging
from typing import Literal

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
"""Every role's `--log-level` choices."""


def configure_logging(level: str) -> None:
    """One format for every process; httpx's per-request lines off (noise at any useful level)."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise
