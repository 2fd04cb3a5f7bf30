"""The engines the gateway can route to: discovered from the directory, plus static ones.

The directory's node list gives each engine's API URL, epoch, transfer
endpoint and the load it reported in its last heartbeat (routed on while no
read of the engine's own /metrics is fresh: gateway.engine_load). The gateway adds
what it knows first-hand: requests it has in flight to each engine and the
uncached prompt tokens it sent there that have not produced a first token
yet. An engine that refuses a connection is skipped for `unhealthy_s`.

Anyone holding an engine token can register any `api_url`, so the gateway
keeps only its origin (scheme, host, port) and builds every request URL from
those parts: an `api_url` with a path, query, fragment or user info (which
would make the gateway POST users' prompts to some other service's endpoint)
is not routed to. With `networks` set, neither is an engine whose address is
outside them; a host name is resolved once, when the engine is learned (a DNS
server that later answers differently is not noticed: list engines by IP
where that matters).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import socket
import time
from collections import Counter
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, field

import httpx

from gateway.engine_load import EngineLoad
from kvproto import media, schemas
from kvproto.client import DirectoryClient
from kvproto.errors import DirectoryError
from kvproto.ranks import tp_size
from kvproto.schemas import PULL_GBPS_LABEL, NodeInfo, Origin
from kvproto.tasks import cancel_and_wait, every

log = logging.getLogger("kvdir.gateway")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_RESOLVE_TIMEOUT_S = 5.0
_RESOLVE_RETRY_S = 30.0  # an engine whose name did not resolve is tried again after this long
_MODELS_RETRY_S = 5.0  # an engine that did not list its models is asked again after this long
_MODELS_REFRESH_S = 30.0  # an engine that did is asked again after this long (adapters load and unload at run time)
_BLOCK_SIZES_KEPT = 1024  # models whose hashing block size is remembered between engine-list changes
REFRESH_RETRY_MAX_S = 30.0  # refreshes that keep raising are retried at most this far apart


class EngineRefused(ValueError):
    """An engine URL the gateway will not send requests to, and why."""


def parse_origin(url: str) -> Origin:
    """`url` as an origin (`kvproto.schemas.parse_origin`); EngineRefused for anything more or less."""
    try:
        return schemas.parse_origin(url)
    except ValueError as exc:
        raise EngineRefused(str(exc)) from exc


def parse_networks(value: str) -> list[Network]:
    """Comma-separated CIDRs; ValueError naming the first bad one (host bits set count as bad: say what you mean)."""
    try:
        return [ipaddress.ip_network(part.strip()) for part in value.split(",") if part.strip()]
    except ValueError as exc:
        raise ValueError(f"engine networks: {exc}") from exc


def reported_load(load: dict[str, float], label: str) -> float:
    """An engine's reported load figure, as routing may count it: a negative or non-finite one (outside input,
    which would make the engine look idler than idle and draw all traffic) is 0."""
    value = load.get(label, 0.0)
    return value if 0.0 < value < math.inf else 0.0


def _unmapped(addr: IPAddress) -> IPAddress:
    return (addr.ipv4_mapped or addr) if isinstance(addr, ipaddress.IPv6Address) else addr


async def _addresses(host: str, port: int) -> list[IPAddress]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = await asyncio.wait_for(
            asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM), _RESOLVE_TIMEOUT_S
        )
    except (TimeoutError, OSError) as exc:
        raise OSError(f"{host!r} did not resolve: {exc or 'timed out'}") from exc
    return [ipaddress.ip_address(str(info[4][0])) for info in infos]


async def admit(url: str, networks: Sequence[Network]) -> Origin:
    """The origin of an engine's `url` if the gateway may route to it: EngineRefused (for good) or OSError (name lookup failed)."""
    origin = parse_origin(url)
    if networks:
        for addr in await _addresses(origin.host, origin.port):
            if not any(_unmapped(addr) in net for net in networks):
                raise EngineRefused(f"{origin.host} ({addr}) is outside the engine networks")
    return origin


@dataclass(slots=True)
class EngineState:
    node_id: str
    origin: Origin
    api_url: str = ""  # as registered (to notice a change), never shown: only `origin` is used
    epoch: int = 0
    registered: bool = True  # from the directory (False: a static --engine)
    can_pull: bool = False  # has a transfer endpoint, so it understands kvdir_pull plans
    block_bytes: int = 0  # KV bytes of one block over all ranks
    block_size: int = 0  # tokens per KV block, as registered (0: unknown): predictions are rounded to it
    # KV blocks it can hold over its tiers, as registered (media.total_capacity: its device's, host's and disk's,
    # docs/protocol.md §2.3; a block the device evicts there is not lost). None: unknown.
    capacity_blocks: int | None = None
    blocks: int = 0  # blocks the directory lists for it, in any tier: with capacity_blocks, its free space
    max_model_len: int | None = None  # from its /v1/models, once it answered
    registered_models: frozenset[str] = frozenset()  # model and adapter names its registration lists
    listed_models: frozenset[str] = frozenset()  # the ids its /v1/models lists (empty until it answered)
    adapters: dict[str, str] = field(default_factory=dict)  # adapter name -> its base model, from /v1/models ("parent")
    roots: dict[str, str] = field(default_factory=dict)  # model id -> where the engine read it, from /v1/models ("root")
    models_known: bool = False  # its registration or its /v1/models said what it serves
    fingerprint: str | None = None  # its KV fingerprint as registered (None: never a pull source nor destination)
    tp_size: int = 1  # its tensor-parallel ranks, from its registered regions (a pull needs as many on both ends)
    dp_rank: int | None = None  # the data-parallel rank behind its api_url it is: requests name it in a header
    tenant: str = ""  # its registered tenant
    shared: bool = False  # registered shared: routed to by every tenant, it pulls only from shared engines
    heartbeat_running: float = 0.0  # as its last heartbeat reported: routed on while no read of its /metrics is fresh
    heartbeat_waiting: float = 0.0
    scraped: EngineLoad | None = None  # its /metrics as last read (gateway.engine_load)
    scraped_at: float = 0.0  # monotonic: when that read began
    scraped_inflight: int = 0  # this gateway's requests in flight there when that read began
    scraped_until: float = 0.0  # monotonic: that read is routed on until then
    pull_gbps: float = 0.0  # pull bandwidth it measured (PULL_GBPS_LABEL; 0: none reported)
    inflight: int = 0
    pending_prefill_tokens: float = 0.0
    unhealthy_until: float = 0.0
    served: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    parity: str = ""  # how its /tokenize compares with the gateway's tokens (gateway.tokenizer_parity; "": not yet)
    models_due: float = 0.0  # when to ask its /v1/models (again)

    @property
    def healthy(self) -> bool:
        return time.monotonic() >= self.unhealthy_until

    @property
    def load_scraped(self) -> EngineLoad | None:
        """Its last read of its own /metrics while fresh, else None (its heartbeat's figures are routed on)."""
        return self.scraped if time.monotonic() < self.scraped_until else None

    @property
    def running(self) -> float:
        """Requests it runs, as it last said: its /metrics while fresh, else its heartbeat (this gateway's included)."""
        load = self.load_scraped
        return self.heartbeat_running if load is None else load.running

    @property
    def waiting(self) -> float:
        """Requests queued in it, from the same report as `running`."""
        load = self.load_scraped
        return self.heartbeat_waiting if load is None else load.waiting

    @property
    def reported_inflight(self) -> int:
        """This gateway's requests in flight there when `running` and `waiting` were taken: at the read's start,
        or now for a heartbeat's (when it was taken is not known)."""
        return self.inflight if self.load_scraped is None else self.scraped_inflight

    def serves(self, model: str) -> bool:
        """Whether requests for `model` may go here: it lists the name, or nothing says what it serves yet."""
        return not self.models_known or model in self.registered_models or model in self.listed_models


class EngineRegistry:
    """Engine list and load, refreshed from the directory in the background."""

    def __init__(
        self,
        directory: DirectoryClient,
        http: httpx.AsyncClient,
        static: list[str],
        refresh_s: float,
        unhealthy_s: float,
        networks: Sequence[Network] = (),
        tenant: str = "",
        block_size: int = 16,
    ) -> None:
        """`block_size`: the tokens per block to hash a model's prompts at while no engine serving it registered one."""
        self.directory = directory
        self.block_size = block_size
        self.tenant = tenant
        self.http = http
        self.static = static
        self.refresh_s = refresh_s
        self.unhealthy_s = unhealthy_s
        self.networks = list(networks)
        self.engines: dict[str, EngineState] = {}
        self.on_gone: Callable[[str], None] = lambda node_id: None  # the policy's on_engine_gone (runtime.py)
        self.directory_ok = False
        self._silent_shards: set[str] = set()  # shards whose node list did not answer at the last refresh
        self._task: asyncio.Task[None] | None = None
        self._probes: set[asyncio.Task[None]] = set()
        self._refused: dict[str, tuple[str, float]] = {}  # node id -> (URL refused, when to look at it again)
        self._foreign: set[str] = set()  # listed engines of other tenants, not routed to (logged once each)
        self._mismatched: set[str] = set()  # known engines whose published blocks are hashed at another block size
        self._block_sizes: dict[str, int] = {}  # model -> the block size its prompts are hashed at (hash_block_size)

    @property
    def max_model_len(self) -> int | None:
        """The longest context any engine serves (a prompt longer than that fits none), None until one said."""
        return max((e.max_model_len for e in self.engines.values() if e.max_model_len), default=None)

    def serving(self, model: str) -> list[EngineState]:
        """The engines requests for `model` may go to (EngineState.serves), in the registry's order."""
        return [e for e in self.engines.values() if e.serves(model)]

    def hash_block_size(self, model: str) -> int:
        """The block size to hash `model`'s prompts at: the one most engines serving it registered (a tie goes to
        the size whose engines list more cached blocks, then to the smaller), else `block_size` (no engine
        serving it registered one). Known per model until the engine list or what the engines serve changes."""
        size = self._block_sizes.get(model)
        if size is None:
            votes: Counter[int] = Counter()
            blocks: Counter[int] = Counter()
            for e in self.serving(model):
                if e.block_size:
                    votes[e.block_size] += 1
                    blocks[e.block_size] += e.blocks
            size = min(votes, key=lambda b: (-votes[b], -blocks[b], b)) if votes else self.block_size
            if len(self._block_sizes) >= _BLOCK_SIZES_KEPT:  # clients name models: bound what they can make it keep
                self._block_sizes.clear()
            self._block_sizes[model] = size
        return size

    def model_root(self, model: str) -> str | None:
        """Where an engine serving `model` read it from (its /v1/models "root": a path or a hub repo id), if one said."""
        return next((root for e in self.engines.values() if (root := e.roots.get(model)) is not None), None)

    def base_of(self, model: str) -> str | None:
        """The base model of `model` if an engine lists it as a LoRA adapter (its /v1/models "parent"), else None."""
        for e in self.engines.values():
            base = e.adapters.get(model)
            if base is not None:
                return base
        return None

    def _ours(self, n: NodeInfo) -> bool:
        """Whether this gateway's tenant may route to `n`: the same tenant, or an engine registered as shared."""
        if n.tenant == self.tenant or n.shared:
            self._foreign.discard(n.node_id)
            return True
        if n.node_id not in self._foreign:
            self._foreign.add(n.node_id)
            log.info("engine %r belongs to tenant %r, not %r: not routed to", n.node_id, n.tenant, self.tenant)
        return False

    def start(self, failed: Callable[[], object]) -> None:
        """`refresh` every `refresh_s` for as long as the gateway runs; a refresh that fails unexpectedly (a bug, a
        malformed answer) is logged and counted (`failed`), and the next comes after a backoff (doubling
        while refreshes keep failing, up to REFRESH_RETRY_MAX_S): the engine list is never left frozen."""
        self._task = asyncio.create_task(
            every(
                self.refresh_s,
                self.refresh,
                what="engine refresh",
                log=log,
                failed=failed,
                retry_max_s=REFRESH_RETRY_MAX_S,
            ),
            name="engine refresh",
        )

    async def stop(self) -> None:
        await cancel_and_wait(self._task, *self._probes)

    async def _admit(self, node_id: str, url: str) -> Origin | None:
        """The engine's origin, or None (with one warning per node and URL) when it is not to be routed to."""
        refused = self._refused.get(node_id)
        if refused is not None and refused[0] == url and time.monotonic() < refused[1]:
            return None
        try:
            origin = await admit(url, self.networks)
        except (EngineRefused, OSError) as exc:
            again = math.inf if isinstance(exc, EngineRefused) else time.monotonic() + _RESOLVE_RETRY_S
            if refused is None or refused[0] != url:
                log.warning("engine %r is not routed to: %s", node_id, exc)
            self._refused[node_id] = (url, again)
            return None
        self._refused.pop(node_id, None)
        return origin

    async def refresh(self) -> None:
        for i, url in enumerate(self.static):
            node_id = f"static-{i + 1}"
            if node_id not in self.engines and (origin := await self._admit(node_id, url)) is not None:
                self.engines[node_id] = EngineState(node_id, origin, url, registered=False)
                log.info("engine %s at %s", node_id, origin)
        try:
            by_shard = await self.directory.nodes_by_shard()
        except DirectoryError as exc:
            if self.directory_ok:
                log.warning("directory unreachable (%s): routing by load alone", exc)
            self.directory_ok = False
        else:
            self.directory_ok = True
            # A shard that did not answer keeps its engines as last seen; the others are brought up to date.
            silent = {name for name, ns in by_shard.items() if isinstance(ns, DirectoryError)}
            if silent != self._silent_shards:
                for name in sorted(silent - self._silent_shards):
                    log.warning("directory shard %s unreachable (%s): its engines are kept as last seen", name, by_shard[name])
                self._silent_shards = silent
            nodes = [n for ns in by_shard.values() if not isinstance(ns, DirectoryError) for n in ns]
            await self._update([n for n in nodes if self._ours(n)], silent)
            # Only ids still listed are remembered: another tenant's churning registrations must not grow these.
            self._foreign &= {n.node_id for n in nodes}
        self._probe_models()

    async def _update(self, nodes: Sequence[NodeInfo], silent: Set[str] = frozenset()) -> None:
        """Bring the engine list up to `nodes`; engines homed on a shard in `silent` (it did not answer) stay."""
        seen = set()
        for n in nodes:
            e = self.engines.get(n.node_id)
            if e is None or e.api_url != n.api_url:
                origin = await self._admit(n.node_id, n.api_url)
                if origin is None:
                    continue
                if e is None or e.origin != origin:
                    e = self.engines[n.node_id] = EngineState(n.node_id, origin)
                    log.info("engine %s at %s (epoch %d)", n.node_id, origin, n.epoch)
                e.api_url = n.api_url
            seen.add(n.node_id)
            e.epoch = n.epoch
            e.can_pull = bool(n.transfer_url) and bool(n.regions)
            e.block_bytes = sum(r.block_bytes for r in n.regions if r.medium is None)  # a device copy, all ranks
            e.block_size = n.block_size or 0
            e.capacity_blocks = media.total_capacity(n.capacity_blocks, n.regions)
            e.blocks = n.blocks
            e.heartbeat_running = reported_load(n.load, "running")
            e.heartbeat_waiting = reported_load(n.load, "waiting")
            e.pull_gbps = reported_load(n.load, PULL_GBPS_LABEL)
            e.fingerprint = n.fingerprint
            e.tp_size = tp_size(n.regions)
            e.dp_rank = n.dp_rank
            e.tenant = n.tenant
            e.shared = n.shared
            e.registered_models = frozenset(n.models)
            e.models_known = e.models_known or bool(n.models)
            e.last_seen = time.monotonic()
        keep = {n.node_id for n in nodes} | {f"static-{i + 1}" for i in range(len(self.static))}
        for node_id in [k for k in self._refused if k not in keep]:
            del self._refused[node_id]
        gone = [k for k, e in self.engines.items() if e.registered and k not in seen and e.inflight == 0]
        for node_id in [k for k in gone if not silent or self.directory.home_shard(k) not in silent]:
            log.info("engine %s left the directory", node_id)
            del self.engines[node_id]
            self.on_gone(node_id)
        self._block_sizes.clear()
        self._check_block_sizes()

    @property
    def mismatched_block_size(self) -> list[str]:
        """Engines that registered a block size other than the one their model's prompts are hashed at (the one
        most of its engines registered): no hash of theirs can match."""
        return sorted(self._mismatched)

    def _check_block_sizes(self) -> None:
        """Warn once per engine that publishes blocks of another size than its models are hashed at: a silent 0%
        hit rate otherwise (every lookup misses, every request is routed by load)."""
        self._mismatched &= self.engines.keys()
        for e in self.engines.values():
            models = sorted(e.registered_models | e.listed_models) if e.models_known else [""]
            wrong = next(((m, b) for m in models if e.block_size and (b := self.hash_block_size(m)) != e.block_size), None)
            if wrong is not None and e.node_id not in self._mismatched:
                self._mismatched.add(e.node_id)
                log.warning(
                    "engine %s hashes %d-token blocks and the gateway hashes %s's prompts at %d (what most of its "
                    "engines registered): none of its cached blocks can be found, it is routed by load alone",
                    e.node_id,
                    e.block_size,
                    repr(wrong[0]) if wrong[0] else "every model",
                    wrong[1],
                )
            elif wrong is None and e.node_id in self._mismatched:
                self._mismatched.discard(e.node_id)
                log.info("engine %s now hashes %d-token blocks, as the gateway hashes its models", e.node_id, e.block_size)

    def _probe_models(self) -> None:
        """Ask engines' /v1/models, in the background, what they serve (model ids, adapters' "parent") and their
        max_model_len (vLLM and the stub list it): until they answer, then every _MODELS_REFRESH_S."""
        now = time.monotonic()
        for e in self.engines.values():
            if now >= e.models_due:
                e.models_due = now + _MODELS_RETRY_S
                task = asyncio.create_task(self._ask_models(e))
                self._probes.add(task)
                task.add_done_callback(self._probes.discard)

    async def _ask_models(self, e: EngineState) -> None:
        try:
            data = [
                m for m in (await self.http.get(e.origin.url("/v1/models"), timeout=2.0)).json()["data"] if isinstance(m, dict)
            ]
            lens = [m["max_model_len"] for m in data if type(m.get("max_model_len")) is int]
            ids = {m["id"]: m.get("parent") for m in data if isinstance(m.get("id"), str)}
        except (httpx.HTTPError, ValueError, KeyError, TypeError, RecursionError) as exc:
            log.debug("engine %s did not list its models: %s", e.node_id, exc)
            return
        e.models_due = time.monotonic() + _MODELS_REFRESH_S
        if ids and frozenset(ids) != e.listed_models:
            log.info("engine %s serves %s", e.node_id, ", ".join(sorted(ids)))
            self._block_sizes.clear()  # the engines serving a model changed: so may the size it is hashed at
        e.listed_models = frozenset(ids)
        e.adapters = {name: parent for name, parent in ids.items() if isinstance(parent, str) and parent != name}
        e.roots = {m["id"]: m["root"] for m in data if isinstance(m.get("id"), str) and isinstance(m.get("root"), str)}
        e.models_known = e.models_known or bool(ids)
        if lens and max(lens) > 0 and e.max_model_len != max(lens):
            e.max_model_len = max(lens)
            log.info("engine %s serves up to %d tokens of context", e.node_id, e.max_model_len)

    def mark_unhealthy(self, node_id: str) -> None:
        e = self.engines.get(node_id)
        if e is not None:
            e.unhealthy_until = time.monotonic() + self.unhealthy_s
            log.warning("engine %s refused a connection: skipped for %.1fs", node_id, self.unhealthy_s)
