"""HOST:PORT settings and what an address means (loopback, wildcard): shared by every component's settings."""

from __future__ import annotations

import ipaddress
from typing import Annotated

from pydantic import AfterValidator


def parse_hostport(value: str) -> tuple[str, int]:
    """'HOST:PORT' -> (host, port), with a message that says what is wrong."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT with a port in 1..65535, got {value!r}")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Whether `host` names only this machine: localhost, 127.0.0.0/8 or ::1 (a host name other than
    localhost may resolve anywhere, so it is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """Whether `host` means every interface ("", 0.0.0.0, ::): something to bind, never to tell peers."""
    try:
        return host.strip("[]") == "" or ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False  # a host name


def _hostport(value: str) -> str:
    parse_hostport(value)
    return value


HostPort = Annotated[str, AfterValidator(_hostport)]
"""A HOST:PORT setting, checked when the settings are read."""


def url_list(value: str) -> list[str]:
    """Comma-separated URLs, trailing slashes dropped."""
    return [u.strip().rstrip("/") for u in value.split(",") if u.strip()]
