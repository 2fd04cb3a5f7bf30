"""A gateway whose directory URLs lead to a hostile watch stream (issue #29, item 4): a real gateway process,
and two small HTTP servers on 127.0.0.1 that speak the watch stream's wire format (kvproto.codec)
and send, one connection after the other, frames malformed in every way a frame can be, then a good stream.

The gateway must refuse each malformed frame, drop the state it had from that source and snapshot again
from the next (no request resumes `from` a position), and end up following the good stream, fresh, with
its feed still running. Before, a tick without a field ended the feed's task with a KeyError, nothing
restarted it, and the gateway stayed on REST lookups for good; a mistyped field was ignored or applied."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvdir.local_cluster import Gateway, free_ports
from kvproto.codec import HEADER, MEDIA_TYPE, VERSION, frame, group_of, snapshot_message, snapshot_of, tick_frame
from kvproto.state import DirectoryState, Publish, Register, new_epoch_base
from tests.support.metrics import mirror_gauges
from tests.support.wait import wait_for

TICK_S = 0.05


def _good_state() -> DirectoryState:
    s = DirectoryState(max_nodes=8)
    s.apply(Register("n1", "i1", "http://127.0.0.1:1", capacity_blocks=64, epoch_base=new_epoch_base(4242)))
    epoch = s.nodes["n1"].epoch
    s.apply(Publish("n1", epoch, np.asarray([11, 12, 13], np.uint64), np.asarray([1, 2, 3], np.uint32)))
    return s


STATE = _good_state()
P, G, EPOCH = STATE.applied, group_of(STATE), STATE.nodes["n1"].epoch
assert G is not None


def _snap(spoil: Callable[[dict[str, object]], object] | None = None) -> bytes:
    snap = snapshot_of(STATE)
    if spoil is not None:
        spoil(snap)
    return frame(snapshot_message(snap))


def _tick(**fields: object) -> bytes:
    return frame({"v": VERSION, "k": "tick", "position": P, "fresh": True, "bound_s": 0.5, "group": G, **fields})


def _without(key: str) -> Callable[[dict[str, object]], object]:
    return lambda d: d.pop(key)


def _huge_index(snap: dict[str, object]) -> None:
    """The node index near 2**32 of the issue, with every bound that would admit it raised to match."""
    snap["max_nodes"] = snap["next_idx"] = 2**32
    snap["nodes"][0][1] = 2**32 - 1  # type: ignore[index]
    snap["holders"] = np.full(3, 2**32 - 1, "<u4").tobytes()


def _holders_of(idx: int) -> Callable[[dict[str, object]], None]:
    return lambda snap: snap.__setitem__("holders", np.full(3, idx, "<u4").tobytes())


def _slot(value: int) -> Callable[[dict[str, object]], None]:
    return lambda snap: snap.__setitem__("slots", np.asarray([1, 2, value], "<u4").tobytes())


def _tick_without(key: str) -> bytes:
    d = {"v": VERSION, "k": "tick", "position": P, "fresh": True, "bound_s": 0.5, "group": G}
    d.pop(key)
    return frame(d)


def _spoiled_group() -> bytes:
    msg = snapshot_message(snapshot_of(STATE))
    msg["group"] = G + 1
    return frame(msg)


# Each: (name, frames sent after the response headers). A snapshot first where the malformed frame needs a state
# to arrive at; the ones that spoil a snapshot alternate with those (so the feed's backoff stays short).
MALFORMED: list[tuple[str, list[bytes]]] = [
    ("tick without fresh", [_snap(), _tick_without("fresh")]),
    ("snapshot with a node index near 2**32", [_snap(_huge_index)]),
    ("tick without position", [_snap(), _tick_without("position")]),
    ("snapshot with holders of an unregistered index", [_snap(_holders_of(5))]),
    ("tick with a string position", [_snap(), _tick(position=str(P))]),
    ("snapshot with a slot beyond its node's capacity", [_snap(_slot(64))]),
    ("tick of another group", [_snap(), _tick(group=G + 1)]),
    ("snapshot without nodes", [_snap(_without("nodes"))]),
    ("batch with an unknown command", [_snap(), frame({"v": VERSION, "k": "batch", "position": P + 1, "commands": [["Z"]]})]),
    ("snapshot frame of another group", [_spoiled_group()]),
    (
        "batch with a torn publish",
        [_snap(), frame({"v": VERSION, "k": "batch", "position": P + 1, "commands": [["P", "n1", EPOCH, b"\0" * 7, b"", None]]})],
    ),
    ("a frame that is not msgpack", [HEADER.pack(4) + b"\xc1\xc1\xc1\xc1"]),
    ("batch to the wrong position", [_snap(), frame({"v": VERSION, "k": "batch", "position": P + 5, "commands": [["N"]]})]),
    ("a frame of an unknown kind", [frame({"v": VERSION, "k": "evil", "position": P})]),
    (
        "batch with a string epoch",
        [_snap(), frame({"v": VERSION, "k": "batch", "position": P + 1, "commands": [["H", "n1", str(EPOCH), None]]})],
    ),
    ("snapshot with a mistyped load", [_snap(lambda s: s["nodes"][0].__setitem__(9, {"running": "many"}))]),  # type: ignore[index]
    ("batch half good", [_snap(), frame({"v": VERSION, "k": "batch", "position": P + 2, "commands": [["N"], ["C", "n1", "x"]]})]),
    ("a frame over the limit", [HEADER.pack(2**31)]),
    ("batch whose commands are no list", [_snap(), frame({"v": VERSION, "k": "batch", "position": P + 1, "commands": {"N": 1}})]),
    ("a frame of another codec version", [_snap(), frame({"v": VERSION + 1, "k": "batch", "position": P + 1, "commands": []})]),
]


class Script:
    """What the fake replicas answer, shared by both: the malformed streams in order, then good ones."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []  # (path and query, what was sent)
        self.left = list(MALFORMED)
        self.closing = threading.Event()

    def next(self, target: str) -> tuple[str, list[bytes]]:
        with self.lock:
            name, frames = self.left.pop(0) if self.left else ("good", [_snap()])
            self.requests.append((target, name))
            return name, frames


def _handler(script: Script) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the body ends with the connection: no chunking to get in the way

        def log_message(self, *_: object) -> None:
            pass

        def _json(self, doc: object) -> None:
            body = json.dumps(doc).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path.startswith("/v1/shards"):
                return self._json({"version": 0})  # not sharded: the mirror follows the URLs it was given
            if self.path.startswith("/v1/nodes"):
                return self._json({"nodes": []})
            if not self.path.startswith("/v1/watch"):
                self.send_error(404)
                return None
            name, frames = script.next(self.path)
            self.send_response(200)
            self.send_header("Content-Type", MEDIA_TYPE)
            self.end_headers()
            try:
                for f in frames:
                    self.wfile.write(f)
                self.wfile.flush()
                # The good stream ticks on; a malformed one says nothing more: the gateway must leave on its own.
                while not script.closing.wait(TICK_S):
                    if name == "good":
                        self.wfile.write(tick_frame(P, True, 0.5, group=G))
                        self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass
            return None

    return Handler


@pytest.fixture
def fake_replicas() -> Iterator[tuple[Script, list[str]]]:
    script = Script()
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _handler(script)) for _ in range(2)]
    threads = [threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True) for s in servers]
    for s in servers:
        s.daemon_threads = True
    for t in threads:
        t.start()
    try:
        yield script, [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    finally:
        script.closing.set()
        for s in servers:
            s.shutdown()
            s.server_close()


def test_every_malformed_frame_drops_its_source_and_the_gateway_snapshots_from_the_next(
    fake_replicas: tuple[Script, list[str]], tmp_path: Path
) -> None:
    script, urls = fake_replicas
    g = Gateway(tmp_path, free_ports(1)[0], urls, log_level="info", extra_args=("--refresh-s", "0.2"))
    try:
        g.wait_ready(60, engines=0)
        wait_for(
            lambda: not script.left and (m := mirror_gauges(g.url))["position"] == P and m["lag_seconds"] <= 0.5,
            timeout=90,
            what="every malformed stream refused and the gateway's mirror fresh on the good one",
        )
        names = [name for _, name in script.requests]
        assert names[: len(MALFORMED)] == [name for name, _ in MALFORMED]
        # Each refusal dropped the state: every stream asked for was a snapshot, none resumed `from` a position.
        assert all(target == "/v1/watch" for target, _ in script.requests), script.requests
        m = mirror_gauges(g.url)
        assert m["failovers_total"] >= len(MALFORMED) and m["rejected_total"] >= 1 and m["snapshots_total"] >= 1, m
        # Still following: fresh a while later, without another request (the good stream is kept).
        count = len(script.requests)
        wait_for(lambda: mirror_gauges(g.url)["lag_seconds"] <= 0.5, what="the mirror still fresh")
        assert len(script.requests) == count
        assert g.proc.poll() is None
        log = g.log_path.read_text()
        assert "Traceback" not in log, log[-3000:]  # every one was a refusal the feed expects, not a crash
    finally:
        g.stop()


def test_the_fake_speaks_the_real_format() -> None:
    """The good stream the fake sends decodes to the state it was made from (the test above is about the
    malformed ones only)."""
    from kvproto.codec import FrameReader, SnapshotFrame, state_from

    (f,) = FrameReader().feed(_snap())
    assert isinstance(f, SnapshotFrame) and state_from(f.state).digest() == STATE.digest() and f.group == G
    assert msgspec.msgpack.decode(tick_frame(P, True, 0.5, group=G)[HEADER.size :])["group"] == G
