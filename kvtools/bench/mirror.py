"""`kvdir bench mirror`: how far the gateway's mirror of the directory trails the replicas.

Three replicas in their own processes; this process publishes 20,000 blocks/s (batches of 256)
and follows the watch stream with the gateway's mirror (`Feed`: one group). Lag is the time from a publish's
acknowledgement to the moment the mirror has applied it (negative when the stream delivered it
before the acknowledgement arrived). A minute runs without faults; then `--minutes` (10 by default)
during which, halfway through each third, the leader is killed and restarted. The mirror's
freshness is sampled every 10 ms: a stale sample is a lookup the gateway would have sent over REST
instead of answering it in-process. Every 50 ms a lookup of published blocks goes through the
gateway's own chain (gateway.lookup.HolderLookup, with the gateway's default timeout and stale bound),
and its source is counted: `none` is a request the gateway would have routed by load (a `fallback`
decision). Where the tail comes from: how long the mirror spent applying each frame (index merges
included) and this process's CPU time (the publisher and the mirror share it).
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

from gateway.config import GatewaySettings
from gateway.lookup import HolderLookup
from gateway.mirror import Feed, Mirror
from kvdir.local_cluster import Cluster
from kvdir.progress import Meter, stderr_meter
from kvproto.client import DirectoryClient
from kvproto.codec import BatchFrame, Frame
from kvproto.errors import DirectoryError
from kvproto.state import DirectoryState, Publish
from kvtools.bench.clusters import bench_directory
from kvtools.bench.report import emit, header, pct, say
from kvtools.plots import LagSeries, lag_over_time, latency_cdf

BATCH = 256


class _TimedMirror(Feed):
    """A mirror that notes when it applied each publish (keyed by its first hash), and how long each frame took."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.applied_at: dict[int, float] = {}
        self.apply_s: list[float] = []

    def _apply_locked(self, f: Frame) -> None:
        started = time.perf_counter()
        super()._apply_locked(f)
        self.apply_s.append(time.perf_counter() - started)

    def _apply(self, f: Frame, state: DirectoryState | None = None) -> None:
        super()._apply(f, state)
        if isinstance(f, BatchFrame):
            now = time.monotonic()
            for c in f.commands:
                if isinstance(c, Publish) and len(c.hashes):
                    self.applied_at[int(c.hashes[0])] = now


class _TimedGatewayMirror(Mirror):
    """The gateway's mirror over one `_TimedMirror` feed."""

    def _feed(self, urls: Any) -> Feed:
        return _TimedMirror(urls, None, self.max_lag_s)


async def _run(
    cluster: Cluster, seconds: float, blocks_per_s: float, kills: int, meter: Meter
) -> tuple[dict[str, Any], LagSeries]:
    """One phase: its figures, and each publish's lag by when it was acknowledged (for the figures)."""
    defaults = GatewaySettings.model_fields
    max_lag_s = defaults["mirror_max_lag_s"].default
    gateway_mirror = _TimedGatewayMirror(cluster.replica_urls, None, max_lag_s)
    mirror = gateway_mirror.feeds[""]
    assert isinstance(mirror, _TimedMirror)
    gateway_mirror.start()
    client = DirectoryClient(cluster.replica_urls, timeout=5.0)
    gateway_client = DirectoryClient(cluster.replica_urls)
    lookup = HolderLookup(
        gateway_client, defaults["lookup_timeout_s"].default, gateway_mirror, defaults["mirror_stale_lag_s"].default
    )
    rng = np.random.default_rng(1)
    acked: dict[int, float] = {}
    samples = {"fresh": 0, "stale": 0}
    sources: dict[str, int] = {}
    failed = 0
    try:
        epoch = (await client.register("bench-node", "http://127.0.0.1:1")).epoch
        while not mirror.fresh():
            await asyncio.sleep(0.05)

        async def sample() -> None:
            while True:
                samples["fresh" if mirror.fresh() else "stale"] += 1
                await asyncio.sleep(0.01)

        async def ask() -> None:
            while True:
                keys = list(acked)[-4:] or [1]
                found = await lookup(keys)
                sources[found.source] = sources.get(found.source, 0) + 1
                await asyncio.sleep(0.05)

        sampler = asyncio.create_task(sample())
        asker = asyncio.create_task(ask())
        cpu = time.process_time()
        start = time.monotonic()
        kill_at = [start + seconds * (k + 0.5) / max(kills, 1) for k in range(kills)]
        killed_at: list[float] = []
        period = BATCH / blocks_per_s
        sent = 0
        while (now := time.monotonic()) < start + seconds:
            meter.update(now - start, now)
            if kill_at and now >= kill_at[0]:
                kill_at.pop(0)
                leader = await _leader(cluster)
                meter.note(f"  killing the leader (replica {leader}) and restarting it")
                killed_at.append(time.monotonic() - start)
                cluster.kill(leader, signal.SIGKILL)
                cluster.start_replica(leader)
            hashes = rng.integers(1, 2**63, BATCH, dtype=np.uint64)
            try:
                await client.publish("bench-node", epoch, zip(hashes.tolist(), range(BATCH)))
                acked[int(hashes[0])] = time.monotonic()
            except DirectoryError:
                failed += 1
            sent += 1
            delay = start + sent * period - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        elapsed = time.monotonic() - start
        cpu = time.process_time() - cpu
        end = time.monotonic() + 5
        while time.monotonic() < end and not all(h in mirror.applied_at for h in acked):
            await asyncio.sleep(0.05)
        sampler.cancel()
        asker.cancel()
    finally:
        await client.aclose()
        await gateway_client.aclose()
        await gateway_mirror.stop()
    applied = [(t, mirror.applied_at[h] - t) for h, t in acked.items() if h in mirror.applied_at]
    lags = [lag for _, lag in applied]
    missing = sum(1 for h in acked if h not in mirror.applied_at)
    series = LagSeries(
        f"{seconds:.0f} s, {kills} leader kill{'s' * (kills != 1)}", [t - start for t, _ in applied], lags, killed_at
    )
    figures = {
        "published_blocks_per_s": len(acked) * BATCH / elapsed,
        "target_blocks_per_s": blocks_per_s,
        "leader_kills": kills,
        "publishes_failed": failed,
        "mirror_lag_p50_ms": pct(lags, 50) * 1e3,
        "mirror_lag_p99_ms": pct(lags, 99) * 1e3,
        "mirror_lag_max_ms": max(lags) * 1e3 if lags else float("nan"),
        "acknowledged_never_mirrored": missing,
        "mirror_stale_fraction": samples["stale"] / max(1, samples["fresh"] + samples["stale"]),
        **{f"gateway_lookups_{k}": sources.get(k, 0) for k in ("mirror", "rest", "mirror_stale", "none")},
        "mirror_snapshots": mirror.snapshots,
        "mirror_failovers": mirror.failovers,
        "mirror_apply_p99_ms": pct(mirror.apply_s, 99) * 1e3,
        "mirror_apply_max_ms": max(mirror.apply_s, default=float("nan")) * 1e3,
        "mirror_applies_over_50ms": sum(1 for t in mirror.apply_s if t > 0.05),
        "bench_process_cpu_s_per_s": cpu / elapsed,
    }
    return figures, series


async def _leader(cluster: Cluster) -> int:
    return await asyncio.to_thread(lambda: cluster.replica_urls.index(cluster.wait_ready(30)))


def main(*, as_json: bool, quick: bool, minutes: float = 10.0, plot: str | None = None) -> int:
    """A minute without faults, then `minutes` with 3 leader kills (15 s each with `quick`); with `plot`, also
    mirror_lag.png (lag over time, kills marked) and mirror_lag_cdf.png there."""
    results: dict[str, Any] = header(quick)
    rate = 20_000.0
    phases = ((0, 15.0 if quick else 60.0), (3, 15.0 if quick else 60.0 * minutes))
    series: list[LagSeries] = []
    with bench_directory() as (cluster, _):
        with stderr_meter("mirror", sum(seconds for _, seconds in phases), unit="s") as meter:
            for kills, seconds in phases:
                meter.note(f"publishing {rate:,.0f} blocks/s for {seconds:.0f} s with {kills} leader kills...")
                meter.stage(f"{kills} kills", seconds, time.monotonic())
                run, lagged = asyncio.run(_run(cluster, seconds, rate, kills, meter))
                results.update({f"{k}{'' if kills == 0 else '_with_kills'}": v for k, v in run.items()})
                series.append(lagged)
    emit(results, as_json)
    if plot:
        lag_over_time(Path(plot) / "mirror_lag.png", series, target_s=0.1)
        latency_cdf(
            Path(plot) / "mirror_lag_cdf.png",
            {s.name: s.lag_s for s in series},
            title=f"Mirror lag at {rate:,.0f} blocks/s\n(negative: streamed before the acknowledgement arrived)",
            xlabel="lag",
        )
        say(f"wrote mirror_lag.png and mirror_lag_cdf.png into {plot}")
    return 0
