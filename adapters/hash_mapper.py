"""Engine block hashes -> ours (docs/protocol.md §1): what the engine's decoded events change in the directory.

`HashMapper` keeps, per engine (one mapper per subscriber), engine hash ->
our sequence hashes (docs/protocol.md §1), bounded by an LRU of `max_entries`
engine hashes. A BlockStored's tokens are hashed with our block size and
chained from the sequence hash of its parent (``parent_block_hash``, looked
up in the map; None means the start of a sequence). A parent the map does
not know (evicted from the LRU, or stored before the subscriber started or
during a resync) makes the event a *missing parent*: counted, nothing
published, since the chain cannot be computed. BlockRemoved resolves through
the map; an unknown hash is counted and harmless.

Block sizes: equal sizes map one to one. An engine block size that is a
multiple k of ours splits each engine block into k of our blocks: the
engine hash maps to all k (removing it removes all k) and chains its
children from the last of them. Anything else is unsupported (counted,
skipped).

Several engine hashes may name the same block of ours (the same tokens
under two cache groups or media): ours are reference counted, and a removal
reaches the directory only when no engine hash holds the block any more.
An engine hash evicted from the LRU is removed from the directory too (a
miss is safe, a stale entry is not), so `max_entries` must exceed the
engine's pool (vLLM's num_gpu_blocks, plus offloaded tiers).

KV identity (docs/protocol.md §1.1): a block is hashed under
``KvIdentity(namespace, model, adapter, cache_salt)``, as the gateway hashes a request: the namespace
and model are the subscriber's (``--namespace``, ``--model``; an engine of ``--engines`` may name its
own model), the adapter is the event's ``lora_name`` (``"lora_id=" + id`` when only the deprecated id
is sent: no gateway names an adapter so, a miss), and the cache salt is SGLang's ``cache_salt``
field. vLLM carries both inside the per-block ``extra_keys`` instead, with its multimodal inputs
(`adapters.extra_keys`).
"""

from __future__ import annotations

import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from adapters.engine_events import EngineHash, Event, Removed, Stored
from adapters.extra_keys import ExtraKeys
from kvproto.hashing import KvIdentity, chain_hashes, local_hashes, mix_extra, seed_for

_U32 = next(c for c in "IL" if array.array(c).itemsize == 4)  # the array typecode of a native uint32


def event_identity(
    namespace: str = "",
    model: str = "",
    *,
    lora_name: str | None = None,
    lora_id: int | None = None,
    cache_salt: str | None = None,
) -> KvIdentity:
    """The identity an engine event's blocks are hashed under, from its own fields (see the module docstring;
    `HashMapper` also reads vLLM's extra keys and a parent's salt)."""
    adapter = lora_name or (f"lora_id={lora_id}" if lora_id is not None else "")
    return KvIdentity(namespace, model, adapter, cache_salt or "")


@dataclass(frozen=True, slots=True)
class MapResult:
    """What an event changes in the directory: our hashes to publish and to remove."""

    publish: tuple[int, ...] = ()
    remove: tuple[int, ...] = ()
    missing_parent: bool = False
    unsupported: str | None = None  # why the event could not be mapped


_Holder = tuple[int | None, str | None]  # (group_idx, medium)
_Entry = tuple[tuple[int, ...], tuple[_Holder, ...], str | None, str]
"""(ours, holders, medium, cache salt) of one engine block: the salt its chain was hashed under, which a
child event inherits. Plain tuples of ints and strings, so the garbage collector stops tracking them: with
a million entries, objects it tracked (a set each) made its full collections the adapter's largest cost."""


@dataclass(slots=True)
class MapperStats:
    stored_blocks: int = 0  # engine blocks mapped
    removed_blocks: int = 0  # engine blocks removed
    missing_parents: int = 0
    unsupported: int = 0
    unknown_removals: int = 0
    evicted: int = 0  # engine hashes dropped by the LRU bound
    unmapped_keys: int = 0  # extra keys folded in as raw keys (their blocks are misses)


class HashMapper:
    """Engine hash -> our sequence hashes for one engine, LRU-bounded. Not thread-safe.

    `namespace` and `model` are the identity's (docs/protocol.md §1.1) for every block; the adapter and the
    cache salt come from each event."""

    def __init__(self, block_size: int, namespace: str = "", max_entries: int = 1 << 20, *, model: str = "") -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.block_size = block_size
        self.namespace = namespace
        self.model = model
        self.max_entries = max_entries
        self.stats = MapperStats()
        self._map: OrderedDict[EngineHash, _Entry] = OrderedDict()
        self._refs: dict[int, int] = {}
        self._seeds: dict[tuple[str, str], tuple[str, int]] = {}  # (adapter, salt) -> (identity key, seed)

    _SEEDS_MAX = 4096  # distinct (adapter, salt) pairs remembered: salts can be per user

    def _seed(self, ident: KvIdentity) -> tuple[str, int]:
        """The identity's key and seed, remembered: its key is a JSON array once a model is set, and making it
        cost more than hashing a block."""
        got = self._seeds.get((ident.adapter, ident.cache_salt))
        if got is None:
            if len(self._seeds) >= self._SEEDS_MAX:
                self._seeds.clear()
            key = ident.key
            got = self._seeds[(ident.adapter, ident.cache_salt)] = (key, seed_for(key))
        return got

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, engine_hash: object) -> bool:
        return engine_hash in self._map

    def ours(self, engine_hash: EngineHash) -> tuple[int, ...] | None:
        """Our hashes for an engine hash (no LRU touch), or None."""
        e = self._map.get(engine_hash)
        return e[0] if e is not None else None

    def reset(self) -> None:
        """Forget everything (engine cleared, restarted, or a resync); counters stay."""
        self._map.clear()
        self._refs.clear()

    def snapshot(self) -> dict[int, str | None]:
        """Every hash of ours that some engine block holds -> a medium: what to republish under a new epoch."""
        out: dict[int, str | None] = {}
        for ours, _, medium, _ in self._map.values():
            for h in ours:
                out.setdefault(h, medium)
        return out

    def apply(self, ev: Event) -> MapResult:
        if isinstance(ev, Stored):
            return self.store(ev)
        if isinstance(ev, Removed):
            return self.remove(ev)
        removed = tuple(self._refs)
        self.reset()
        return MapResult(remove=removed)

    def identity(self, ev: Stored, parent_salt: str = "") -> tuple[KvIdentity, dict[int, bytes] | None]:
        """The identity `ev`'s blocks are hashed under, and the extra-key bytes of each of our blocks in it
        that has some (block index within the event -> bytes), from its fields and vLLM's extra keys."""
        k = ev.block_size // self.block_size
        adapter = ev.lora_name or ""
        salt = ev.cache_salt or ""
        if ev.extra_keys is None:
            if not adapter and ev.lora_id is not None:
                adapter = f"lora_id={ev.lora_id}"
            return KvIdentity(self.namespace, self.model, adapter, salt or parent_salt), None
        keys = ExtraKeys(ev, k, self.block_size)
        if not adapter:
            adapter = keys.lora or (f"lora_id={ev.lora_id}" if ev.lora_id is not None else "")
        elif keys.lora and keys.lora != adapter:
            keys.unmappable(0, ("lora", keys.lora))
        if not salt:
            salt = keys.salt
        elif keys.salt and keys.salt != salt:
            keys.unmappable(0, ("cache_salt", keys.salt))
        self.stats.unmapped_keys += keys.raw_count
        return KvIdentity(self.namespace, self.model, adapter, salt or parent_salt), keys.blocks()

    def store(self, ev: Stored) -> MapResult:
        n = len(ev.engine_hashes)
        if n == 0:
            return MapResult()
        eb, ours_b = ev.block_size, self.block_size
        if len(ev.token_ids) != eb * n:
            self.stats.unsupported += 1
            return MapResult(unsupported=f"{len(ev.token_ids)} tokens for {n} blocks of {eb}")
        if eb % ours_b:
            self.stats.unsupported += 1
            return MapResult(unsupported=f"engine block size {eb} is not a multiple of {ours_b}")
        k = eb // ours_b
        prev: int | None = None
        parent_salt = ""
        if ev.parent is not None:
            parent = self._map.get(ev.parent)
            if parent is None:
                self.stats.missing_parents += 1
                return MapResult(missing_parent=True)
            self._map.move_to_end(ev.parent)
            prev, parent_salt = parent[0][-1], parent[3]
        ident, extra = self.identity(ev, parent_salt)
        groups = self._our_blocks(ev, k, ident, extra, prev)
        if groups is None:
            self.stats.unsupported += 1
            return MapResult(unsupported="token ids are not unsigned 32-bit integers")
        salt = ident.cache_salt
        holder = (ev.group_idx, ev.medium)
        holders = (holder,)
        publish: list[int] = []
        remove: list[int] = []
        entries, refs = self._map, self._refs
        for eh, ours in zip(ev.engine_hashes, groups):
            if eh in entries:
                self._put(eh, ours, holder, ev.medium, salt, publish, remove)
                continue
            # A new engine block (nearly every store): _put's work without the checks that cannot apply.
            entries[eh] = (ours, holders, ev.medium, salt)
            for h in ours:
                c = refs.get(h, 0)
                refs[h] = c + 1
                if c == 0:
                    publish.append(h)
                    if remove and h in remove:
                        remove.remove(h)
        self.stats.stored_blocks += n
        while len(self._map) > self.max_entries:
            _, old = self._map.popitem(last=False)
            self.stats.evicted += 1
            self._release(old[0], remove)
        return MapResult(publish=tuple(publish), remove=tuple(remove))

    def _our_blocks(
        self, ev: Stored, k: int, ident: KvIdentity, extra: dict[int, bytes] | None, prev: int | None
    ) -> Iterable[tuple[int, ...]] | None:
        """Our sequence hashes of `ev`'s blocks, k per engine block, chained from `prev`: what
        `kvproto.hashing.identity_hashes` gives, with the seed remembered. None if a token id is not a uint32."""
        try:  # array() packs the tuple in C; numpy's own conversion of a tuple is slower
            tokens = np.frombuffer(array.array(_U32, ev.token_ids), dtype=np.uint32)
        except (OverflowError, TypeError):
            return None
        key, seed = self._seed(ident)
        local = local_hashes(tokens, self.block_size, key)
        if extra:
            local = [mix_extra(h, extra[i], seed) if i in extra else h for i, h in enumerate(local)]
        seq = chain_hashes(local, seed, prev)
        if k == 1:  # the usual case: one block of ours per engine block
            return ((h,) for h in seq)
        return (tuple(seq[i * k : (i + 1) * k]) for i in range(len(ev.engine_hashes)))

    def remove(self, ev: Removed) -> MapResult:
        remove: list[int] = []
        holder = (ev.group_idx, ev.medium)
        for eh in ev.engine_hashes:
            e = self._map.get(eh)
            if e is None:
                self.stats.unknown_removals += 1
                continue
            ours, holders, medium, salt = e
            if holder in holders:
                rest = tuple(x for x in holders if x != holder)
            elif len(holders) == 1:
                rest = ()  # one holder, labelled differently (an engine version mismatch): it is that one
            else:
                self.stats.unknown_removals += 1
                continue
            if rest:
                self._map[eh] = (ours, rest, medium, salt)  # keeps its place in the LRU
                continue
            del self._map[eh]
            self._release(ours, remove)
            self.stats.removed_blocks += 1
        return MapResult(remove=tuple(remove))

    def _put(
        self,
        eh: EngineHash,
        ours: tuple[int, ...],
        holder: _Holder,
        medium: str | None,
        salt: str,
        publish: list[int],
        remove: list[int],
    ) -> None:
        e = self._map.get(eh)
        if e is not None:
            self._map.move_to_end(eh)
            if e[0] == ours:
                if holder not in e[1]:
                    self._map[eh] = (ours, (*e[1], holder), e[2], e[3])
                return
            self._release(e[0], remove)  # the engine reused a hash for other content: trust the newest
            del self._map[eh]
        self._map[eh] = (ours, (holder,), medium, salt)
        for h in ours:
            c = self._refs.get(h, 0)
            self._refs[h] = c + 1
            if c == 0:
                publish.append(h)
                if h in remove:
                    remove.remove(h)

    def _release(self, ours: Iterable[int], remove: list[int]) -> None:
        for h in ours:
            c = self._refs.get(h, 0) - 1
            if c <= 0:
                self._refs.pop(h, None)
                remove.append(h)
            else:
                self._refs[h] = c
