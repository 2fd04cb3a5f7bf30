"""The tokenizer parity probe: the gateway's tokens for a probe chat and completion against each engine's own.

A gateway that tokenizes otherwise than an engine hashes other blocks than the
engine publishes: every lookup misses and nothing says why. So at start-up and
whenever an engine registers (a new epoch), or the gateway's tokenizer for the
engine's model changes (its files found), the probe sends the engine's
`/tokenize` (vLLM's API; the worker stub has it too) a chat of a few messages
and a completion prompt and compares the ids with the gateway's own. Each
engine's outcome is on its EngineState (`parity`: /health, the status page),
counted in `kvdir_gateway_tokenizer_parity_engines{status}` and
`kvdir_gateway_tokenizer_mismatches_total`, and a mismatch, or an engine that
cannot be asked, is logged as one WARNING per engine epoch. A mismatch is also
acted on: the model's requests are tokenized by its engines
(GatewayTokenizer.disagreeing) while any engine serving it disagrees.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.engine_registry import EngineRegistry, EngineState
from gateway.model_tokenizer import NotRendered
from gateway.tokenizers import ChatPrompt, GatewayTokenizer, Local
from kvproto.openai_api import ChatMessage
from kvproto.tasks import cancel_and_wait, every

log = logging.getLogger("kvdir.gateway")

PROBE_MESSAGES = [
    {"role": "system", "content": "You are a concise assistant for a hardware store."},
    {"role": "user", "content": "Which aisle has the screws? Answer in one short sentence, please."},
    {"role": "assistant", "content": "Aisle 7, next to the nails and hinges."},
    {"role": "user", "content": "And the paint?"},
]
PROBE_PROMPT = "The quick brown fox jumps over the lazy dog. Prefix caching keeps the KV blocks of a shared prompt."
STATUSES = ("match", "mismatch", "unverified", "engine")  # "engine": the gateway asks the engine, nothing to compare


@dataclass(frozen=True, slots=True)
class Parity:
    """One engine's probe outcome: `status` (one of STATUSES) and, where it is not a match, what differed."""

    node_id: str
    epoch: int
    model: str
    tokenizer: str  # the gateway's tokenizer for the model ("engine": none of its own)
    status: str
    detail: str = ""

    def summary(self) -> str:
        """One line for the status page."""
        return self.status if not self.detail else f"{self.status}: {self.detail}"


def first_difference(ours: Sequence[int], theirs: Sequence[int]) -> str | None:
    """None for equal token lists, else where they part: the first differing index and both lengths."""
    if list(ours) == list(theirs):
        return None
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return f"first differing token at {at} (gateway {len(ours)} tokens, engine {len(theirs)})"


class ParityProbe:
    """Probes each engine once per epoch and gateway tokenizer, every `interval_s` looking for engines to probe;
    an engine that could not be asked is asked again at the next look."""

    def __init__(
        self, registry: EngineRegistry, tokenizer: GatewayTokenizer, metrics: CollectorRegistry, interval_s: float = 1.0
    ) -> None:
        self.registry = registry
        self.tokenizer = tokenizer
        self.interval_s = interval_s
        self.results: dict[str, Parity] = {}  # node id -> its latest outcome
        self._warned: set[tuple[str, int, str]] = set()  # (node, epoch, status) logged
        self._task: asyncio.Task[None] | None = None
        self.engines = Gauge(
            "kvdir_gateway_tokenizer_parity_engines",
            "Engines by how their /tokenize compares with the gateway's tokens (match, mismatch, unverified: could "
            "not be asked, engine: the gateway asks the engine)",
            ["status"],
            registry=metrics,
        )
        self.mismatches = Counter(
            "kvdir_gateway_tokenizer_mismatches_total",
            "Engine epochs whose /tokenize differed from the gateway's tokens (mismatch) or could not be asked (unverified)",
            ["status"],
            registry=metrics,
        )
        for status in STATUSES:
            self.engines.labels(status).set(0)
        for status in ("mismatch", "unverified"):
            self.mismatches.labels(status)

    def start(self, failed: Callable[[], object]) -> None:
        probe = every(self.interval_s, self.check, what="tokenizer parity probe", log=log, failed=failed)
        self._task = asyncio.create_task(probe, name="tokenizer parity")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    @property
    def problems(self) -> list[Parity]:
        """The engines whose tokens differ from the gateway's or that could not be asked, by node id."""
        return [p for _, p in sorted(self.results.items()) if p.status in ("mismatch", "unverified")]

    async def check(self) -> None:
        """Probe every engine not yet probed at its epoch with the gateway's current tokenizer for its model."""
        engines = dict(self.registry.engines)
        for node_id in [k for k in self.results if k not in engines]:
            del self.results[node_id]
        tokenizers: dict[str, Local | None] = {}  # per model, looked for once per check
        for e in engines.values():
            model = probe_model(e)
            if model is None:
                continue
            if model not in tokenizers:
                tokenizers[model] = await self.tokenizer.local(model)
            local = tokenizers[model]
            name = local.name if local is not None else "engine"
            last = self.results.get(e.node_id)
            if last is not None and (last.epoch, last.model, last.tokenizer) == (e.epoch, model, name):
                if last.status != "unverified":
                    continue
            self._record(e, await self._probe(e, model, name, local))
        self._update_disagreeing()
        counts = {s: 0 for s in STATUSES}
        for p in self.results.values():
            counts[p.status] += 1
        for status, n in counts.items():
            self.engines.labels(status).set(n)

    async def _probe(self, e: EngineState, model: str, name: str, local: Local | None) -> Parity:
        if local is None:
            return Parity(e.node_id, e.epoch, model, name, "engine", "the gateway asks the engine's /tokenize")
        differences = []
        for what, text in (("chat", None), ("completion", PROBE_PROMPT)):
            try:
                ours, prompt = await self._ours(local, model, text)
            except NotRendered as exc:  # a template that refuses the probe's chats: the completion still compares
                differences.append(f"chat: not compared ({exc})")
                continue
            try:
                theirs = await self.tokenizer.engine.ask(e, model, prompt)
            except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
                return Parity(e.node_id, e.epoch, model, name, "unverified", f"its /tokenize could not be asked: {exc}")
            diff = first_difference(ours, theirs)
            if diff is not None:
                differences.append(f"{what}: {diff}")
        if any("differing" in d for d in differences):
            return Parity(e.node_id, e.epoch, model, name, "mismatch", "; ".join(differences))
        if differences:
            return Parity(e.node_id, e.epoch, model, name, "unverified", "; ".join(differences))
        return Parity(e.node_id, e.epoch, model, name, "match")

    @staticmethod
    async def _ours(local: Local, model: str, prompt: str | None) -> tuple[list[int], str | ChatPrompt]:
        """The gateway's tokens for the completion `prompt`, or (None) for the first probe chat the model's template
        renders (with its system message, then without: some templates refuse one); NotRendered if none."""
        if prompt is not None:
            return await local.encode(model, prompt, 1 << 30), prompt
        for messages in (PROBE_MESSAGES, PROBE_MESSAGES[1:]):
            chat = ChatPrompt([ChatMessage.model_validate(m) for m in messages], messages, {})
            try:
                return await local.encode(model, chat, 1 << 30), chat
            except NotRendered as exc:
                refused = exc
        raise refused

    def _record(self, e: EngineState, p: Parity) -> None:
        self.results[e.node_id] = p
        e.parity = p.summary()
        key = (p.node_id, p.epoch, p.status)
        if p.status in ("mismatch", "unverified") and key not in self._warned:
            self._warned.add(key)
            self.mismatches.labels(p.status).inc()
            consequence = "the gateway asks the engines to tokenize this model" if p.status == "mismatch" else "asked again"
            log.warning(
                "tokenizer parity: engine %s (epoch %d, model %s, gateway tokenizer %s) %s: %s; %s",
                p.node_id,
                p.epoch,
                p.model,
                p.tokenizer,
                "tokenizes otherwise than the gateway" if p.status == "mismatch" else "is unverified",
                p.detail,
                consequence,
            )
        elif p.status == "match" and any(k[:2] == key[:2] for k in self._warned):
            log.info("tokenizer parity: engine %s (epoch %d, model %s) now matches the gateway", p.node_id, p.epoch, p.model)
        self._warned = {k for k in self._warned if k[0] not in self.results or k[1] == self.results[k[0]].epoch}

    def _update_disagreeing(self) -> None:
        """The models the gateway lets the engines tokenize: those of an engine whose tokens differ from its own."""
        disagreeing: dict[str, set[str]] = {}
        for p in self.results.values():
            if p.status == "mismatch":
                disagreeing.setdefault(p.model, set()).add(p.node_id)
        self.tokenizer.disagreeing = disagreeing


def probe_model(e: EngineState) -> str | None:
    """The model to probe `e` with: the first base model it names (its registration, then its /v1/models); None
    while it names none."""
    names = sorted((e.registered_models | e.listed_models) - e.adapters.keys())
    return names[0] if names else None
