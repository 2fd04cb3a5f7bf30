"""The gateway builds engine URLs from an origin's parts, and refuses engine URLs that are more (or less) than an origin,
or whose address is outside the configured engine networks (issue #12, item 4)."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from gateway.config import GatewaySettings
from gateway.engine_registry import EngineRefused, Origin, admit, parse_networks, parse_origin
from gateway.upstream import Upstream

HIJACK = "http://127.0.0.1:47900/internal/admin/action?x="  # the registration that made the gateway POST prompts there


@pytest.mark.parametrize(
    ("url", "origin"),
    [
        ("http://127.0.0.1:8000", Origin("http", "127.0.0.1", 8000)),
        ("http://127.0.0.1:8000/", Origin("http", "127.0.0.1", 8000)),
        ("HTTP://Worker-1.Example:9", Origin("http", "worker-1.example", 9)),
        ("https://engine.internal", Origin("https", "engine.internal", 443)),
        ("http://kvdir_worker_1", Origin("http", "kvdir_worker_1", 80)),
        ("http://[::1]:8000", Origin("http", "::1", 8000)),
        ("http://[fd00::1]", Origin("http", "fd00::1", 80)),
    ],
)
def test_plain_origins_parse(url: str, origin: Origin) -> None:
    assert parse_origin(url) == origin


@pytest.mark.parametrize(
    "url",
    [
        HIJACK,
        "http://127.0.0.1:8000/v1",  # a path
        "http://127.0.0.1:8000//",
        "http://127.0.0.1:8000?x=1",  # a query
        "http://127.0.0.1:8000#frag",  # a fragment
        "http://user:pw@127.0.0.1:8000",  # user info
        "http://127.0.0.1@evil.example:8000",
        "http://evil.example\\@127.0.0.1:8000",
        "http://127.0.0.1:8000\n/x",  # control characters (urllib strips some of them silently)
        "http://127.0.0.1:8000\t",
        "http://%31%32%37.0.0.1:8000",  # percent-encoded host
        "http://127.0.0.1:0",
        "http://127.0.0.1:65536",
        "http://127.0.0.1:",
        "http://[not-v6]:80",
        "http://[::1%25eth0]:80",
        "ftp://127.0.0.1:21",
        "file:///etc/passwd",
        "127.0.0.1:8000",  # no scheme
        "http://",
        "http:///x",
        "",
    ],
)
def test_anything_more_or_less_than_an_origin_is_refused(url: str) -> None:
    with pytest.raises(EngineRefused):
        parse_origin(url)


def test_request_urls_are_built_from_the_parts() -> None:
    assert str(parse_origin("http://127.0.0.1:8000/").url("/v1/completions")) == "http://127.0.0.1:8000/v1/completions"
    assert str(parse_origin("https://engine.internal").url("/tokenize")) == "https://engine.internal/tokenize"
    v6 = parse_origin("http://[::1]:9000")
    assert str(v6.url("/v1/models")) == "http://[::1]:9000/v1/models" and str(v6) == "http://[::1]:9000"
    url = parse_origin("http://10.1.2.3:81").url("/v1/chat/completions")
    assert (url.scheme, url.host, url.port, url.path, url.query, url.fragment, url.userinfo) == (
        "http",
        "10.1.2.3",
        81,
        "/v1/chat/completions",
        b"",
        "",
        b"",
    )


def _admit(url: str, networks: str) -> Origin:
    return asyncio.run(admit(url, parse_networks(networks)))


def test_engine_networks_refuse_addresses_outside() -> None:
    assert _admit("http://127.0.0.1:8000", "") == Origin("http", "127.0.0.1", 8000)  # no restriction by default
    assert _admit("http://127.0.0.1:8000", "10.0.0.0/8,127.0.0.0/8").host == "127.0.0.1"
    assert _admit("http://[::ffff:127.0.0.1]:8000", "127.0.0.0/8").host == "::ffff:127.0.0.1"  # v4-mapped: its v4 address counts
    for url, networks in (
        ("http://127.0.0.1:8000", "127.0.0.2/32"),
        ("http://10.0.0.1:8000", "127.0.0.0/8"),
        ("http://[::1]:8000", "127.0.0.0/8"),
        ("http://[::ffff:10.0.0.1]:8000", "127.0.0.0/8"),
    ):
        with pytest.raises(EngineRefused, match="outside the engine networks"):
            _admit(url, networks)
    with pytest.raises(EngineRefused, match="not a plain"):
        _admit(HIJACK, "127.0.0.0/8")


def test_host_names_are_resolved_and_every_address_must_be_inside() -> None:
    # localhost resolves (from /etc/hosts) to 127.0.0.1 and maybe ::1: allowed only where all of them are.
    assert _admit("http://localhost:8000", "127.0.0.0/8,::1/128").host == "localhost"
    with pytest.raises(EngineRefused, match="outside"):
        _admit("http://localhost:8000", "127.0.0.2/32,::2/128")


def test_settings_refuse_bad_static_engines_and_networks() -> None:
    assert GatewaySettings(engine="http://127.0.0.1:1/, http://[::1]:2").static_engines == [
        "http://127.0.0.1:1",
        "http://[::1]:2",
    ]
    with pytest.raises(ValidationError, match="not a plain"):
        GatewaySettings(engine="http://127.0.0.1:1/v1")
    assert [str(n) for n in GatewaySettings(engine_networks="10.0.0.0/8, 127.0.0.0/8").networks] == ["10.0.0.0/8", "127.0.0.0/8"]
    assert GatewaySettings().networks == []
    for bad in ("10.0.0.1/8", "10.0.0.0/33", "not-a-net"):
        with pytest.raises(ValidationError, match="engine networks"):
            GatewaySettings(engine_networks=bad)


@pytest.mark.parametrize(
    ("origin", "host"),
    [
        (Origin("http", "127.0.0.1", 8000), b"127.0.0.1:8000"),
        (Origin("https", "engine.internal", 443), b"engine.internal:443"),
        (Origin("http", "::1", 8000), b"[::1]:8000"),
    ],
)
def test_the_forward_goes_to_the_origins_parts_with_its_host_header(origin: Origin, host: bytes) -> None:
    """Where the forward connects: the origin's own host and port (TLS for https), and the Host header it sends."""
    target = Upstream()._target(origin)
    assert (target.origin, target.host_header, target.ssl is not None) == (origin, host, origin.scheme == "https")
