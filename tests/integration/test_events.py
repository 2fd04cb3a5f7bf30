"""The KV-events subscriber against a real 3-replica directory, a real ZMQ publisher and a fake engine's /health.

The subscriber runs in its own process (`adapters.subscriber.serve`), so
the test only talks to it over sockets: it plays the engine (an XPUB socket
that connects to the subscriber's bound SUB, as vLLM's PUB does, plus a tiny
HTTP server for /health and, in one test, a ROUTER replay socket) and reads
the outcome from the directory. Every scenario ends by checking that the
directory holds exactly the engine's current blocks: the node's entry count,
and token lookups (hashed by the directory itself) that match exactly the
cached prefix of every prompt the engine saw.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from kvdir.local_cluster import Cluster, free_ports
from tests.support.wait import wait_for

ROOT = Path(__file__).resolve().parents[2]
CAPTURES = ROOT / "tests" / "data" / "vllm_kv_events"  # a copy of shared/data/vllm_kv_events (vLLM 0.32 captures)
BS = 32  # the captures' block size; ours too
TTL = 1.5


# -- the fake engine ---------------------------------------------------------------------


class FakeEngine:
    """/health over HTTP, KV events over ZMQ (XPUB: a PUB that also tells when the subscriber is there)."""

    def __init__(self) -> None:
        self.healthy = True
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                code = 200 if self.path == "/health" and engine.healthy else 503
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        # shutdown() returns once serve_forever next checks for it: every 0.5 s by default, half of each test's teardown.
        threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        zport, rport = free_ports(2)
        self.zmq_endpoint = f"tcp://127.0.0.1:{zport}"
        self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self.ctx = zmq.Context()
        self.pub: zmq.Socket | None = None
        self.sent: dict[int, bytes] = {}  # seq -> payload: the replay buffer
        self._replay_stop = threading.Event()
        self._replay_thread: threading.Thread | None = None

    def connect(self, timeout: float = 20.0) -> None:
        """(Re)connect the publisher to the subscriber and wait until its subscription arrives."""
        if self.pub is not None:
            self.pub.close(linger=0)
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.connect(self.zmq_endpoint)
        if not self.pub.poll(int(timeout * 1000)):
            raise AssertionError(f"the subscriber did not subscribe at {self.zmq_endpoint} within {timeout}s")
        assert self.pub.recv()[:1] == b"\x01"

    def send(self, seq: int, events: list[Any], *, deliver: bool = True, ts: float | None = None) -> None:
        payload = msgspec.msgpack.encode([time.time() if ts is None else ts, events, 0])
        self.sent[seq] = payload
        if deliver:
            self.send_frames([b"kv", seq.to_bytes(8, "big", signed=True), payload])

    def send_frames(self, frames: list[bytes]) -> None:
        assert self.pub is not None
        self.pub.send_multipart(frames)

    def serve_replay(self) -> None:
        """A ROUTER replay socket answering as vLLM's ZmqEventPublisher does."""

        def loop() -> None:
            router = self.ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(self.replay_endpoint)
            try:
                while not self._replay_stop.is_set():
                    if not router.poll(50):
                        continue
                    client, _, start = router.recv_multipart()
                    first = int.from_bytes(start, "big", signed=True)
                    for seq in sorted(self.sent):
                        if seq >= first:
                            router.send_multipart([client, b"", seq.to_bytes(8, "big"), self.sent[seq]])
                    router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])
            finally:
                router.close(linger=0)

        self._replay_thread = threading.Thread(target=loop, daemon=True)
        self._replay_thread.start()

    def close(self) -> None:
        self._replay_stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(5)
        if self.pub is not None:
            self.pub.close(linger=0)
        self.ctx.term()
        self.http.shutdown()
        self.http.server_close()


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def removed(hashes: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


CLEARED = {"type": "AllBlocksCleared"}


class Prompt:
    """A prompt the fake engine caches block by block, with made-up engine hashes."""

    def __init__(self, rng: random.Random, blocks: int) -> None:
        self.tokens = [rng.randrange(1000) for _ in range(blocks * BS)]
        self.hashes = [rng.getrandbits(64) for _ in range(blocks)]

    def store(self, first: int = 0, last: int | None = None) -> dict[str, Any]:
        last = len(self.hashes) if last is None else last
        parent = self.hashes[first - 1] if first else None
        return stored(self.hashes[first:last], parent, self.tokens[first * BS : last * BS])


# -- the subscriber process and the directory -------------------------------------------


class Subscriber:
    """One adapter process: of `engine` (the single-engine settings), or of every engine in `engines` (--engines)."""

    def __init__(
        self,
        cluster: Cluster,
        engine: FakeEngine | None,
        log_path: Path,
        node_id: str,
        replay: bool,
        extra_env: dict[str, str],
        engines: dict[str, FakeEngine] | None = None,
    ) -> None:
        self.node_id = node_id
        self.metrics_url = f"http://127.0.0.1:{free_ports(1)[0]}/metrics"
        self.http = httpx.Client(timeout=2)  # one for every read of the metrics: a client costs ~20 ms of CPU to make
        if engines is None:
            assert engine is not None
            which = {"KVDIR_ENGINE_URL": engine.url, "KVDIR_ZMQ": engine.zmq_endpoint, "KVDIR_NODE_ID": node_id}
        else:
            which = {
                "KVDIR_ENGINES": json.dumps(
                    [{"engine_url": e.url, "zmq": e.zmq_endpoint, "node_id": node} for node, e in engines.items()]
                )
            }
        env = {
            **os.environ,
            **which,
            "KVDIR_BIND": "true",
            "KVDIR_TOPIC": "kv",
            "KVDIR_BLOCK_SIZE": str(BS),
            "KVDIR_DIRECTORY": ",".join(cluster.replica_urls),
            "KVDIR_METRICS": self.metrics_url.split("/")[2],
            "KVDIR_HEARTBEAT_INTERVAL_S": "0.25",
            "KVDIR_REPLAY_TIMEOUT_S": "2",
            "KVDIR_LOG_LEVEL": "debug",
        }
        if replay:
            assert engine is not None
            env["KVDIR_REPLAY"] = engine.replay_endpoint
        env.update(extra_env)
        self.log_path = log_path
        with open(log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from adapters.config import EventsSettings; from adapters.subscriber import serve; serve(EventsSettings())",
                ],
                cwd=ROOT,
                env=env,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def metric(self, name: str, node: str | None = None) -> float:
        """A series of one engine (by default this subscriber's node): every series carries a node label."""
        return self.labelled(name, "", node)

    def labelled(self, name: str, label: str, node: str | None = None) -> float:
        labels = f'node="{node or self.node_id}"' + (f",{label}" if label else "")
        for line in self.http.get(self.metrics_url).text.splitlines():
            if line.startswith(f"{name}{{{labels}}} "):
                return float(line.split()[-1])
        raise KeyError(f"{name}{{{labels}}}")

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


class Directory:
    def __init__(self, cluster: Cluster) -> None:
        self.urls = cluster.replica_urls
        self.http = httpx.Client(timeout=3)

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        last: Exception | None = None
        for url in self.urls:
            try:
                r = self.http.post(url + path, json=body)
                r.raise_for_status()
                return r.json()
            except httpx.HTTPError as exc:
                last = exc
        raise AssertionError(f"no replica answered {path}: {last}")

    def node(self, node_id: str) -> dict[str, Any] | None:
        nodes = self.http.get(self.urls[0] + "/v1/nodes").json()["nodes"]
        return next((n for n in nodes if n["node_id"] == node_id), None)

    def matched(self, node_id: str, tokens: list[int], **identity: str) -> int:
        """The node's match for a token lookup, hashed by the directory under `identity` (model, adapter,
        cache_salt; none: the namespace alone)."""
        body = {"tokens": tokens, "block_size": BS, "consistency": "linearizable", **identity}
        holders = self._post("/v1/lookup", body)["holders"]
        return next((h["matched_blocks"] for h in holders if h["node_id"] == node_id), 0)

    def holds_exactly(self, node_id: str, total: int, prompts: list[tuple[list[int], int]]) -> bool:
        """The node holds `total` entries and each prompt's cached prefix is exactly `n` blocks long."""
        node = self.node(node_id)
        if node is None or node["blocks"] != total:
            return False
        return all(self.matched(node_id, tokens) == n for tokens, n in prompts)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One 3-replica directory (lease TTL 1.5 s) for every scenario here, as conftest's make_cluster
    builds it: a cluster per test would double the run time. Each scenario has its own node."""
    ports = free_ports(6)
    c = Cluster(tmp_path_factory.mktemp("events-cluster"), ports[:3], ports[3:], lease_ttl_s=TTL, log_level="info")
    try:
        c.start()
        c.wait_ready(60)
        yield c
    finally:
        c.stop()


@pytest.fixture
def setup(
    cluster: Cluster, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., tuple[Directory, FakeEngine, Subscriber]]]:
    """A fake engine and its subscriber, registered as a node of its own; all stopped at teardown, pass or fail."""
    started: list[Any] = []

    def make(replay: bool = False, **env: str) -> tuple[Directory, FakeEngine, Subscriber]:
        node_id = request.node.name.removeprefix("test_")[:60].replace("_", "-")
        engine = FakeEngine()
        started.append(engine)
        if replay:
            engine.serve_replay()
        sub = Subscriber(cluster, engine, tmp_path / "subscriber.log", node_id, replay, env)
        started.append(sub)
        d = Directory(cluster)
        started.append(d)
        try:
            engine.connect()
            wait_for(lambda: d.node(node_id) is not None, 20, what=f"{node_id} registered")
        except AssertionError:
            print(f"subscriber exit status: {sub.proc.poll()}\n{sub.log_tail()}")  # why it never subscribed
            raise
        return d, engine, sub

    yield make
    for thing in reversed(started):
        if isinstance(thing, Subscriber):
            if thing.proc.poll() is not None and thing.proc.returncode not in (0, -15):
                print(thing.log_tail())
            thing.stop()
        elif isinstance(thing, FakeEngine):
            thing.close()
        else:
            thing.http.close()


def expect(
    d: Directory, sub: Subscriber, total: int, prompts: list[tuple[list[int], int]], what: str, timeout: float = 10
) -> None:
    try:
        wait_for(lambda: d.holds_exactly(sub.node_id, total, prompts), timeout, what=what)
    except AssertionError:
        print(sub.log_tail())
        raise


# -- scenarios ------------------------------------------------------------------------------


def test_captured_vllm_frames_replayed(setup: Callable[..., Any]) -> None:
    d, engine, sub = setup()
    msgs = [
        [(CAPTURES / f.name.replace("frame0", f"frame{i}")).read_bytes() for i in range(3)]
        for f in sorted(CAPTURES.glob("msg*_frame0.bin"))
    ]
    decoded = [msgspec.msgpack.decode(m[2]) for m in msgs]
    assert [int.from_bytes(m[1], "big") for m in msgs] == list(range(10, 21))

    def tokens(seq: int, event: int = -1) -> list[int]:
        return decoded[seq - 10][1][event]["token_ids"]

    for m in msgs[:4]:  # seq 10-13: AllBlocksCleared + the shared prefix, its two continuations, one text prompt
        engine.send_frames(m)
    prompt_a, prompt_b = tokens(10) + tokens(11), tokens(10) + tokens(12)
    expect(d, sub, 5, [(prompt_a, 3), (prompt_b, 3), (tokens(13), 1)], "the first four batches")

    for m in msgs[4:10]:  # seq 14-19: six long prompts, evicting the first ones
        engine.send_frames(m)
    longs = [tokens(s) for s in range(14, 20)]
    expect(
        d,
        sub,
        62,
        [(prompt_a, 0), (prompt_b, 0), (tokens(13), 0), (longs[0], 0), (longs[1], 6), *[(t, 14) for t in longs[2:]]],
        "the state after seq 19",
    )

    engine.send_frames(msgs[10])  # seq 20: AllBlocksCleared
    expect(d, sub, 0, [(t, 0) for t in longs], "an empty node after AllBlocksCleared")
    assert sub.metric("kvdir_events_gaps_total") == 0 and sub.metric("kvdir_events_missing_parents_total") == 0
    assert sub.metric("kvdir_events_batches_total") == 11


def test_blocks_are_hashed_under_the_kv_identity_the_gateway_looks_up(setup: Callable[..., Any]) -> None:
    """With --model, the node registers the model and its blocks match token lookups under (model, adapter,
    salt) as the gateway hashes requests: a LoRA event, and a vLLM salted chain (the salt in the first block's
    extra keys, its child event without it)."""
    d, engine, sub = setup(KVDIR_MODEL="tiny-llama")
    node = d.node(sub.node_id)
    assert node is not None and node["models"] == ["tiny-llama"] and node.get("fingerprint") is None
    rng = random.Random(11)
    plain, lora, salted = Prompt(rng, 2), Prompt(rng, 2), Prompt(rng, 3)
    lora_ev = {**lora.store(), "lora_name": "sql", "lora_id": 1, "extra_keys": [[["lora", "sql", "/a/sql"]]] * 2}
    salted_first = {**salted.store(0, 2), "extra_keys": [[["cache_salt", "s1"]], None]}
    engine.send(0, [plain.store(), lora_ev, salted_first, salted.store(2)])
    m = {"model": "tiny-llama"}
    expect(d, sub, 7, [], "seven blocks")
    assert d.matched(sub.node_id, plain.tokens, **m) == 2 and d.matched(sub.node_id, plain.tokens) == 0
    assert d.matched(sub.node_id, lora.tokens, **m, adapter="sql") == 2 and d.matched(sub.node_id, lora.tokens, **m) == 0
    assert d.matched(sub.node_id, salted.tokens, **m, cache_salt="s1") == 3
    assert d.matched(sub.node_id, salted.tokens, **m) == 0 and d.matched(sub.node_id, salted.tokens, **m, cache_salt="s2") == 0


def test_gap_without_replay_resyncs_then_rebuilds(setup: Callable[..., Any]) -> None:
    d, engine, sub = setup()
    rng = random.Random(1)
    x, z = Prompt(rng, 4), Prompt(rng, 3)
    engine.send(0, [x.store()])
    expect(d, sub, 4, [(x.tokens, 4)], "prompt x")
    engine.send(1, [removed(x.hashes)], deliver=False)  # lost
    engine.send(2, [z.store(0, 2)])
    expect(d, sub, 2, [(x.tokens, 0), (z.tokens, 2)], "the resync: x cleared, z stored after the gap")
    engine.send(3, [z.store(2)])  # rebuilding as the engine works: chained from a block stored after the resync
    expect(d, sub, 3, [(x.tokens, 0), (z.tokens, 3)], "z complete")
    assert sub.metric("kvdir_events_gaps_total") == 1 and sub.metric("kvdir_events_resyncs_total") == 1


def test_gap_with_replay_fetches_the_missing_batches(setup: Callable[..., Any]) -> None:
    d, engine, sub = setup(replay=True)
    rng = random.Random(2)
    w, x, y, z = Prompt(rng, 2), Prompt(rng, 4), Prompt(rng, 3), Prompt(rng, 2)
    # Seq 0-1 went out before the subscriber listened: it catches up from the replay buffer on its first message.
    engine.send(0, [w.store(0, 1)], deliver=False)
    engine.send(1, [w.store(1)], deliver=False)
    engine.send(2, [x.store()])
    expect(d, sub, 6, [(w.tokens, 2), (x.tokens, 4)], "w caught up from the replay buffer, x")
    engine.send(3, [removed(x.hashes[:1:-1]), y.store()], deliver=False)  # lost on the PUB socket, still in the buffer
    engine.send(4, [z.store()], deliver=False)
    engine.send(5, [removed(y.hashes[2:])])
    expect(d, sub, 8, [(w.tokens, 2), (x.tokens, 2), (y.tokens, 2), (z.tokens, 2)], "the replayed batches applied in order")
    assert sub.labelled("kvdir_events_replays_total", 'outcome="ok"') == 2
    assert sub.metric("kvdir_events_resyncs_total") == 0 and sub.metric("kvdir_events_gaps_total") == 1


def test_engine_restart_means_a_new_epoch(setup: Callable[..., Any]) -> None:
    d, engine, sub = setup()
    rng = random.Random(3)
    x, y = Prompt(rng, 4), Prompt(rng, 2)
    engine.send(0, [x.store(0, 2)])
    engine.send(1, [x.store(2)])
    expect(d, sub, 4, [(x.tokens, 4)], "prompt x")
    epoch = d.node(sub.node_id)["epoch"]
    engine.sent.clear()
    engine.connect()  # a new engine process: a new publisher, seq from 0 again
    engine.send(0, [y.store()])
    expect(d, sub, 2, [(x.tokens, 0), (y.tokens, 2)], "only the restarted engine's blocks")
    assert d.node(sub.node_id)["epoch"] > epoch
    assert sub.metric("kvdir_events_restarts_total") == 1


def test_all_blocks_cleared_empties_the_node(setup: Callable[..., Any]) -> None:
    d, engine, sub = setup()
    rng = random.Random(4)
    x, y, z = Prompt(rng, 3), Prompt(rng, 2), Prompt(rng, 2)
    engine.send(0, [x.store(), y.store()])
    expect(d, sub, 5, [(x.tokens, 3), (y.tokens, 2)], "x and y")
    engine.send(1, [CLEARED])
    expect(d, sub, 0, [(x.tokens, 0), (y.tokens, 0)], "an empty node")
    assert d.node(sub.node_id) is not None  # still registered, same epoch
    engine.send(2, [x.store(), CLEARED, z.store()])  # a clear in the middle of a batch
    expect(d, sub, 2, [(x.tokens, 0), (z.tokens, 2)], "only what came after the clear")


def test_a_burst_arrives_whole_and_full_rounds_do_not_wait_for_the_window(setup: Callable[..., Any]) -> None:
    """128 one-block batches sent at once (taken from the socket many at a time) with a 10 s window and rounds
    of 64: both rounds go out as soon as they are full, so all of it is there before the window ends."""
    d, engine, sub = setup(KVDIR_BATCH_WINDOW_S="10", KVDIR_BATCH_MAX_BLOCKS="64")
    rng = random.Random(8)
    prompts = [Prompt(rng, 1) for _ in range(128)]
    for seq, p in enumerate(prompts):
        engine.send(seq, [p.store()])
    expect(d, sub, 128, [(p.tokens, 1) for p in prompts[::16]], "128 blocks, before the window", timeout=8)
    assert sub.metric("kvdir_events_batches_total") == 128 and sub.metric("kvdir_events_gaps_total") == 0


def test_unknown_removals_unknown_events_and_garbage_are_harmless(setup: Callable[..., Any]) -> None:
    d, engine, sub = setup()
    rng = random.Random(5)
    x, y = Prompt(rng, 3), Prompt(rng, 2)
    engine.send(0, [x.store()])
    expect(d, sub, 3, [(x.tokens, 3)], "prompt x")
    engine.send_frames([b"kv", b"\x00" * 8])  # wrong frame count
    engine.send_frames([b"kv", (1).to_bytes(8, "big"), b"\xc1\xc1"])  # not msgpack
    engine.send_frames([b"kv", b"\x01", msgspec.msgpack.encode([0.0, [], 0])])  # short seq
    engine.send(
        1, [removed([rng.getrandbits(64)]), {"type": "BlockUpdated", "block_hashes": [1]}, ["SomethingElse", 1, 2], y.store()]
    )
    expect(d, sub, 5, [(x.tokens, 3), (y.tokens, 2)], "x untouched, y stored")
    assert sub.metric("kvdir_events_garbage_frames_total") == 3
    assert sub.metric("kvdir_events_unknown_events_total") == 2
    assert sub.metric("kvdir_events_unknown_removals_total") == 1
    assert sub.metric("kvdir_events_gaps_total") == 0 and sub.proc.poll() is None


def test_engine_health_down_stops_heartbeats_and_the_node_expires(setup: Callable[..., Any]) -> None:
    d, engine, sub = setup()
    rng = random.Random(6)
    x, y = Prompt(rng, 3), Prompt(rng, 2)
    engine.send(0, [x.store()])
    expect(d, sub, 3, [(x.tokens, 3)], "prompt x")
    epoch = d.node(sub.node_id)["epoch"]
    engine.healthy = False
    wait_for(lambda: d.node(sub.node_id) is None, 10 * TTL, what="the node expired")
    assert d.matched(sub.node_id, x.tokens) == 0
    engine.healthy = True  # back (possibly restarted): registered again, from an empty map
    wait_for(lambda: (d.node(sub.node_id) or {}).get("epoch", 0) > epoch, 10, what="registered again")
    engine.send(1, [y.store()])
    expect(d, sub, 2, [(x.tokens, 0), (y.tokens, 2)], "only blocks stored after the engine came back")


# -- several engines in one adapter process (--engines) ------------------------------------------


def test_one_adapter_follows_two_engines_and_one_lapsing_leaves_the_other(cluster: Cluster, tmp_path: Path) -> None:
    engines = {"two-engines-a": FakeEngine(), "two-engines-b": FakeEngine()}
    sub = Subscriber(cluster, None, tmp_path / "adapter.log", "two-engines-a", False, {}, engines=engines)
    d = Directory(cluster)
    try:
        a, b = engines.values()
        for e in (a, b):
            e.connect()
        rng = random.Random(9)
        xa, xb, yb = Prompt(rng, 3), Prompt(rng, 2), Prompt(rng, 4)
        a.send(0, [xa.store()])
        b.send(0, [xb.store()])
        expect(d, sub, 3, [(xa.tokens, 3), (xb.tokens, 0)], "engine a's blocks under its node")
        wait_for(lambda: d.holds_exactly("two-engines-b", 2, [(xb.tokens, 2), (xa.tokens, 0)]), 10, what="b's blocks")
        epoch_b = d.node("two-engines-b")["epoch"]
        a.healthy = False
        wait_for(lambda: d.node("two-engines-a") is None, 10 * TTL, what="engine a's node expired")
        b.send(1, [yb.store()])  # b keeps flowing, in the same epoch
        wait_for(lambda: d.holds_exactly("two-engines-b", 6, [(xb.tokens, 2), (yb.tokens, 4)]), 10, what="b's new blocks")
        assert d.node("two-engines-b")["epoch"] == epoch_b and d.matched("two-engines-a", xa.tokens) == 0
        assert sub.metric("kvdir_events_engine_up", "two-engines-a") == 0
        assert sub.metric("kvdir_events_engine_up", "two-engines-b") == 1
        assert sub.metric("kvdir_events_batches_total", "two-engines-b") == 2
        assert sub.metric("kvdir_events_subscriber_failures_total", "two-engines-b") == 0
        assert sub.proc.poll() is None
    finally:
        if sub.proc.poll() is not None:
            print(sub.log_tail())
        sub.stop()
        d.http.close()
        for e in engines.values():
            e.close()


def _adapter_exit(engines: list[dict[str, Any]], timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvdir", "events", "--engines", json.dumps(engines), "--directory", "http://127.0.0.1:9"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_engines_sharing_a_node_id_are_refused_at_start() -> None:
    z1, z2 = free_ports(2)
    out = _adapter_exit(
        [
            {"engine_url": "http://127.0.0.1:8000", "zmq": f"tcp://127.0.0.1:{z1}"},
            {"engine_url": "http://127.0.0.1:8000", "zmq": f"tcp://127.0.0.1:{z2}"},
        ]
    )
    assert out.returncode == 2, out.stderr
    assert "--engines" in out.stderr and "same node id '127.0.0.1:8000'" in out.stderr and "node_id" in out.stderr


def test_an_engine_endpoint_that_cannot_be_bound_stops_the_adapter_at_start() -> None:
    z1, z2 = free_ports(2)
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    try:
        taken.bind(f"tcp://127.0.0.1:{z2}")
        out = _adapter_exit(
            [
                {"engine_url": "http://127.0.0.1:8000", "zmq": f"tcp://127.0.0.1:{z1}", "node_id": "free"},
                {"engine_url": "http://127.0.0.1:8001", "zmq": f"tcp://127.0.0.1:{z2}", "node_id": "taken"},
            ]
        )
    finally:
        taken.close(linger=0)
        ctx.term()
    assert out.returncode == 1, out.stderr
    assert f"engine taken: cannot bind its ZMQ endpoint tcp://127.0.0.1:{z2}" in out.stderr
