"""Who can reach a transfer engine's ports: only connections addressed to the transfer host (issue #12, item 3).

Mooncake binds its listeners to 0.0.0.0 / [::] whatever host it is given; kvdir
confines them with a socket filter. "Another interface" is played by 127.0.0.2:
a wildcard listener answers it, a confined one must not. All traffic is loopback.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Callable, Iterator

import pytest

from kvtransfer.backends import ENGINES, create_engine
from kvtransfer.socket_filter import EarlyConnectionError, TcpListener, confine_listeners, own_tcp_listeners

HOST = "127.0.0.1"
ELSEWHERE = "127.0.0.2"  # loopback too, but not the transfer host
CONNECT_S = 1.0  # a confined port drops the SYN: the connect times out

pytestmark = pytest.mark.timeout(120)


def reaches(host: str, port: int) -> bool:
    """A TCP connection to host:port completes (and is closed at once)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as c:
        c.settimeout(CONNECT_S)
        try:
            c.connect((host, port))
        except OSError:
            return False
        return True


@pytest.fixture
def wildcard_listener() -> Iterator[Callable[[str], tuple[socket.socket, TcpListener]]]:
    """Listening sockets bound as Mooncake binds them (0.0.0.0, or [::] dual-stack); closed at teardown."""
    made: list[socket.socket] = []

    def make(bind: str) -> tuple[socket.socket, TcpListener]:
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        made.append(s)
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind((bind, 0))
        s.listen(16)
        s.settimeout(5)
        inode = os.fstat(s.fileno()).st_ino
        return s, TcpListener(inode, s.fileno(), family, ipaddress.ip_address(bind), s.getsockname()[1])

    yield make
    for s in made:
        s.close()


@pytest.mark.parametrize(
    ("bind", "host", "allowed", "refused"),
    [
        ("0.0.0.0", HOST, [HOST], [ELSEWHERE]),
        ("::", HOST, [HOST], [ELSEWHERE, "::1"]),
        ("::", "::1", ["::1"], [HOST, ELSEWHERE]),
    ],
)
def test_confined_listener_accepts_only_connections_to_its_host(wildcard_listener, bind, host, allowed, refused) -> None:
    listener, li = wildcard_listener(bind)
    for target in allowed + refused:  # the premise: a wildcard listener answers every address
        assert reaches(target, li.port), target
        listener.accept()[0].close()
    confine_listeners([li], host)
    for target in refused:
        assert not reaches(target, li.port), target
    for target in allowed:
        assert reaches(target, li.port), target
        listener.accept()[0].close()  # accepted connections inherit the filter and still work


def test_a_connection_that_got_in_before_confining_is_refused(wildcard_listener) -> None:
    _, li = wildcard_listener("0.0.0.0")
    with socket.create_connection((ELSEWHERE, li.port), timeout=5):  # established, waiting in the accept queue
        with pytest.raises(EarlyConnectionError, match=f"{ELSEWHERE}:{li.port}"):
            confine_listeners([li], HOST)


def test_a_wildcard_host_cannot_be_confined(wildcard_listener) -> None:
    _, li = wildcard_listener("0.0.0.0")
    with pytest.raises(OSError, match="wildcard"):
        confine_listeners([li], "0.0.0.0")
    assert reaches(ELSEWHERE, li.port)


def test_mooncake_listeners_are_confined_to_the_transfer_host(caplog) -> None:
    """Both of Mooncake's listeners (P2P handshake, TCP data) are bound to the wildcard and must refuse 127.0.0.2."""
    before = {li.inode for li in own_tcp_listeners()}
    with caplog.at_level(logging.INFO, logger="kvtransfer.backends"):
        engine = create_engine("mooncake", HOST, timeout_s=1.0)
    try:
        mine = [li for li in own_tcp_listeners() if li.inode not in before]
        rpc_port = int(engine.session.rpartition(":")[2])
        assert rpc_port in {li.port for li in mine} and len(mine) == 2, mine  # handshake + TCP data port
        for li in mine:
            assert not reaches(ELSEWHERE, li.port), li
            assert reaches(HOST, li.port), li
        assert f"accept only connections addressed to {HOST}" in caplog.text
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "kvtransfer.backends"]
    finally:
        engine.close()


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_a_wildcard_transfer_host_logs_a_warning_naming_the_ports(name: str, caplog) -> None:
    before = {li.inode for li in own_tcp_listeners()}
    with caplog.at_level(logging.WARNING, logger="kvtransfer.backends"):
        engine = create_engine(name, "0.0.0.0", timeout_s=1.0)
    try:
        ports = [li.port for li in own_tcp_listeners() if li.inode not in before]
        assert ports
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "kvtransfer.backends"]
        assert len(warnings) == 1, warnings
        assert "all interfaces" in warnings[0] and all(str(p) in warnings[0] for p in ports), warnings[0]
    finally:
        engine.close()
