"""The watch stream (GET /v1/watch) and the gateway's mirror of the directory, on real replicas in their own
processes: the mirror equals the replicas' state through writes, a leader kill and a restart; a position no
longer kept answers 410 and the mirror re-snapshots; a stalled source is detected within the lag bound."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import time

import httpx

from gateway.mirror import Mirror
from kvdir.local_cluster import Cluster
from kvproto.client import DirectoryClient
from kvproto.codec import BatchFrame, Frame, FrameReader, SnapshotFrame, TickFrame, group_of
from kvproto.errors import DirectoryError
from kvproto.state import Publish
from tests.support.cluster import leader_index
from tests.support.wait import until

WAIT_S = 30.0


async def _leader_digest(cluster: Cluster) -> dict[str, object]:
    """The digest of a replica that has applied every write acknowledged so far (linearizable barrier first)."""
    async with httpx.AsyncClient(timeout=5) as http:
        for url in cluster.replica_urls:
            try:
                await http.post(url + "/v1/lookup?consistency=linearizable", json={"hashes": []})
                d: dict[str, object] = (await http.get(url + "/v1/digest")).json()
                return d
            except httpx.HTTPError:
                continue
    raise AssertionError("no replica answered")


async def _write(client: DirectoryClient, rng: random.Random, nodes: dict[str, int], n: int) -> None:
    """`n` random writes (publishes, removals, a re-registration now and then); failures are retried by the client
    or skipped: the mirror must match whatever was committed, not a script."""
    for _ in range(n):
        node = rng.choice(sorted(nodes))
        try:
            roll = rng.random()
            if roll < 0.05:
                nodes[node] = (await client.register(node, "http://127.0.0.1:1", incarnation=str(rng.random()))).epoch
            elif roll < 0.75:
                blocks = [(rng.getrandbits(64), rng.randrange(4096)) for _ in range(rng.randrange(1, 200))]
                await client.publish(node, nodes[node], blocks)
            else:
                await client.remove(node, nodes[node], [rng.getrandbits(64) for _ in range(5)])
        except DirectoryError:
            pass


def test_the_mirror_equals_the_replicas_through_writes_a_leader_kill_and_a_restart(make_cluster) -> None:
    cluster = make_cluster(3)

    async def scenario() -> None:
        mirror = Mirror(cluster.replica_urls, None, max_lag_s=0.5)
        mirror.start()
        client = DirectoryClient(cluster.replica_urls, timeout=5.0)
        rng = random.Random(7)
        try:
            nodes = {f"n{i}": (await client.register(f"n{i}", "http://127.0.0.1:1")).epoch for i in range(4)}
            await _write(client, rng, nodes, 40)
            await until(mirror.fresh, "a fresh mirror", timeout=WAIT_S)
            leader = leader_index(cluster)
            cluster.kill(leader)
            await _write(client, rng, nodes, 40)
            cluster.start_replica(leader)
            await _write(client, rng, nodes, 40)
            want = await _leader_digest(cluster)
            await until(
                lambda: mirror.position >= int(want["applied"]), f"the mirror at position {want['applied']}", timeout=WAIT_S
            )  # type: ignore[call-overload]
            assert mirror.position == want["applied"]
            assert mirror.state is not None and mirror.state.digest() == want["digest"]
            assert len(mirror.state.index) == want["entries"] > 0
        finally:
            await client.aclose()
            await mirror.stop()

    asyncio.run(scenario())


def test_a_position_no_longer_kept_answers_410_and_the_mirror_resnapshots(make_cluster) -> None:
    cluster = make_cluster(3, extra_args=("--watch-buffer-bytes", "2000"))

    async def scenario() -> None:
        client = DirectoryClient(cluster.replica_urls, timeout=5.0)
        mirror = Mirror(cluster.replica_urls, None, max_lag_s=0.5)
        mirror.start()
        try:
            epoch = (await client.register("n1", "http://127.0.0.1:1")).epoch
            await client.publish("n1", epoch, [(h, h % 100) for h in range(1, 11)])
            await until(
                lambda: mirror.fresh() and mirror.state is not None and len(mirror.state.index) == 10,
                "10 entries",
                timeout=WAIT_S,
            )
            await mirror.stop()
            old = mirror.position
            for k in range(5):  # 5 publishes of 40 blocks (~600 bytes each): past the 2,000 bytes kept
                await client.publish("n1", epoch, [(h, h % 100) for h in range(100 + 40 * k, 140 + 40 * k)])
            async with httpx.AsyncClient(timeout=5) as http:
                r = await http.get(cluster.replica_urls[0] + "/v1/watch", params={"from": old})
            assert r.status_code == 410, r.text
            assert r.json()["error"] == "compacted" and "without `from`" in r.json()["detail"]

            resumed = Mirror(cluster.replica_urls, None, max_lag_s=0.5)
            resumed.state, resumed.position = mirror.state, old
            resumed.start()
            try:
                await until(lambda: resumed.snapshots == 1 and resumed.fresh(), "a re-snapshot", timeout=WAIT_S)
                want = await _leader_digest(cluster)
                await until(lambda: resumed.position >= int(want["applied"]), "the new position", timeout=WAIT_S)  # type: ignore[call-overload]
                assert resumed.state is not None and resumed.state.digest() == want["digest"]
                assert len(resumed.state.index) == 210
            finally:
                await resumed.stop()
        finally:
            await client.aclose()
            await mirror.stop()

    asyncio.run(scenario())


def test_a_stalled_source_is_detected_within_the_bound_and_the_mirror_recovers(make_cluster) -> None:
    """SIGSTOP on every replica: the stream goes silent (as behind a partition), the mirror turns stale
    within its bound; after SIGCONT it is fresh again and has every write, without a restart."""
    cluster = make_cluster(3)

    async def scenario() -> None:
        client = DirectoryClient(cluster.replica_urls, timeout=5.0)
        mirror = Mirror(cluster.replica_urls, None, max_lag_s=0.5)
        mirror.start()
        pids = [p.pid for p in cluster.procs if p is not None]
        try:
            epoch = (await client.register("n1", "http://127.0.0.1:1")).epoch
            await until(mirror.fresh, "a fresh mirror", timeout=WAIT_S)
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                await until(lambda: not mirror.fresh(), "a stale mirror", timeout=5)
                assert time.monotonic() - stopped < 0.5 + 1.0  # the bound, and a tick of slack (no sleeps involved)
            finally:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
            await client.publish("n1", epoch, [(5, 1), (6, 2)])
            await until(
                lambda: mirror.fresh() and mirror.state is not None and len(mirror.state.index) == 2, "recovery", timeout=WAIT_S
            )
            holders = await mirror.lookup([5, 6])
            assert holders is not None
            assert [(h.node_id, h.matched_blocks, h.slots) for h in holders] == [("n1", 2, [1, 2])]
        finally:
            await client.aclose()
            await mirror.stop()

    asyncio.run(scenario())


def test_the_stream_carries_a_snapshot_then_batches_then_ticks(make_cluster) -> None:
    cluster = make_cluster(1)
    with httpx.Client(timeout=5) as http:
        reg = http.post(cluster.replica_urls[0] + "/v1/nodes", json={"node_id": "n1", "api_url": "http://127.0.0.1:1"})
        epoch = reg.json()["epoch"]
        frames: list[Frame] = []
        with http.stream("GET", cluster.replica_urls[0] + "/v1/watch") as r:
            assert r.headers["content-type"].startswith("application/x-kvdir-watch")
            reader = FrameReader()
            published = False
            for chunk in r.iter_raw():
                frames += reader.feed(chunk)
                if not published and frames:
                    body = {"node_id": "n1", "epoch": epoch, "blocks": [{"hash": 9, "slot": 3}]}
                    assert http.post(cluster.replica_urls[0] + "/v1/blocks", json=body).status_code == 200
                    published = True
                if any(isinstance(f, BatchFrame) for f in frames) and isinstance(frames[-1], TickFrame):
                    break
    assert isinstance(frames[0], SnapshotFrame)
    batch = next(f for f in frames if isinstance(f, BatchFrame))
    (cmd,) = batch.commands
    assert isinstance(cmd, Publish) and cmd.hashes.tolist() == [9] and cmd.slots.tolist() == [3]
    tick = frames[-1]
    assert isinstance(tick, TickFrame) and tick.position == batch.position and tick.fresh is True


def test_a_bad_position_is_a_422(make_cluster) -> None:
    cluster = make_cluster(1)
    for bad in ("-1", "abc", "1.5", ""):
        r = httpx.get(cluster.replica_urls[0] + "/v1/watch", params={"from": bad}, timeout=5)
        assert r.status_code == 422, (bad, r.text)
        assert r.json()["error"] == "invalid_request"


def _first_frames(url: str, params: dict[str, object], kinds: tuple[type[Frame], ...]) -> list[Frame]:
    """The stream's frames up to and including the first of each of `kinds`."""
    frames: list[Frame] = []
    with httpx.stream("GET", url + "/v1/watch", params=params, timeout=5) as r:  # type: ignore[arg-type]
        assert r.status_code == 200, r.read()
        reader = FrameReader()
        for chunk in r.iter_raw():
            frames += reader.feed(chunk)
            if all(any(isinstance(f, k) for f in frames) for k in kinds):
                return frames
    raise AssertionError(f"the stream ended before {kinds}")


def test_a_foreign_group_or_a_future_position_answers_410(make_cluster) -> None:
    cluster = make_cluster(1)
    url = cluster.replica_urls[0]
    assert httpx.post(url + "/v1/nodes", json={"node_id": "n1", "api_url": "http://127.0.0.1:1"}, timeout=5).status_code == 200
    snap, *_, tick = _first_frames(url, {}, (SnapshotFrame, TickFrame))
    assert isinstance(snap, SnapshotFrame) and isinstance(tick, TickFrame)
    group, applied = snap.group, snap.position
    assert isinstance(group, int) and tick.group == group  # the snapshot and every tick carry it

    def get(params: dict[str, object]) -> httpx.Response:
        return httpx.get(url + "/v1/watch", params=params, timeout=5)  # type: ignore[arg-type]

    # Before: a position the replica never reached was answered with ticks saying "fresh" (the consumer kept
    # whatever it had as current), and no identity was checked.
    r = get({"from": applied + 100})
    assert r.status_code == 410 and r.json()["error"] == "future_position", r.text
    r = get({"from": applied, "group": group + 1})
    assert r.status_code == 410 and r.json()["error"] == "foreign_group", r.text
    assert "without `from`" in r.json()["detail"]
    for bad in ("x", "-1", "", str(2**64), "1" * 5000):
        r = get({"from": applied, "group": bad})
        assert r.status_code == 422 and r.json()["error"] == "invalid_request", (bad, r.text)
    # Its own group: resumed; a position ahead of this replica is one it will reach (a lagging replica): it waits.
    (tick,) = _first_frames(url, {"from": applied, "group": group}, (TickFrame,))
    assert isinstance(tick, TickFrame) and tick.position == applied and tick.group == group
    frames = _first_frames(url, {"from": applied + 1, "group": group}, (TickFrame,))
    assert [type(f) for f in frames] == [TickFrame]
    # A consumer that names no group still resumes from a position the replica has.
    assert [type(f) for f in _first_frames(url, {"from": applied}, (TickFrame,))] == [TickFrame]


def test_the_mirror_resnapshots_a_directory_rebuilt_from_empty_data_dirs(make_cluster) -> None:
    """The directory is stopped, its data dirs wiped, and started again on the same addresses, under a running
    mirror: a new group, at a position below the mirror's, then past it. Before, the mirror resumed from its
    position on the new directory, was told it was fresh while it served the dead state, and then applied the
    new directory's batches onto the dead state."""
    cluster = make_cluster(1)

    async def scenario() -> None:
        mirror = Mirror(cluster.replica_urls, None, max_lag_s=0.5)
        mirror.start()
        client = DirectoryClient(cluster.replica_urls, timeout=5.0)
        try:
            epochs = {f"old{i}": (await client.register(f"old{i}", "http://127.0.0.1:1")).epoch for i in range(3)}
            for k in range(20):
                node = f"old{k % 3}"
                await client.publish(node, epochs[node], [(1000 + k, k)])
            want = await _leader_digest(cluster)
            await until(
                lambda: mirror.fresh() and mirror.position == want["applied"], "the mirror of the old directory", timeout=WAIT_S
            )
            old_position, old_group = mirror.position, group_of(mirror.state)  # type: ignore[arg-type]
            assert mirror.snapshots == 1 and old_group is not None

            cluster.stop()
            for i in range(len(cluster.procs)):
                shutil.rmtree(cluster.data_dir / f"replica{i + 1}")
            cluster.start()
            cluster.wait_ready(60)
            await client.aclose()
            client = DirectoryClient(cluster.replica_urls, timeout=5.0)
            epoch = (await client.register("new", "http://127.0.0.1:1")).epoch
            await client.publish("new", epoch, [(7, 1), (8, 2)])
            want = await _leader_digest(cluster)
            assert int(want["applied"]) < old_position  # type: ignore[call-overload]
            await until(lambda: mirror.snapshots == 2 and mirror.fresh(), "a snapshot of the new directory", timeout=WAIT_S)
            await until(lambda: mirror.position == want["applied"], f"the mirror at position {want['applied']}", timeout=WAIT_S)
            assert mirror.state is not None and group_of(mirror.state) not in (None, old_group)
            assert mirror.state.digest() == want["digest"] and set(mirror.state.nodes) == {"new"}

            # Past the old position: the new directory's batches, applied to its own state.
            for k in range(old_position):
                await client.publish("new", epoch, [(100 + k, k)])
            want = await _leader_digest(cluster)
            assert int(want["applied"]) > old_position  # type: ignore[call-overload]
            await until(
                lambda: mirror.fresh() and mirror.position == want["applied"], "the mirror past the old position", timeout=WAIT_S
            )
            assert mirror.state.digest() == want["digest"] and mirror.snapshots == 2
            holders = await mirror.lookup([1000])
            assert holders == []  # the dead directory's entries are gone
        finally:
            await client.aclose()
            await mirror.stop()

    asyncio.run(scenario())
