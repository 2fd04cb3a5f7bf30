"""What the gateway learns from the requests it forwards: each engine's TTFT curve, each model's output length.

The cost model (gateway.cost) prices a request with a prefill rate and an output length. As flags they are
guesses, and wrong ones in front of real engines: an engine on shared CPUs (or a GPU under batching) prefills
several times slower under load than idle, and a client's `max_tokens` says little about how long answers are.
So the flags are priors, and what the gateway observes corrects them.

Per engine, the observed TTFT ``y`` (request sent -> first byte back), less the parts of the estimate priced
from other figures (slot waits, lower-tier loads, pulls: ``fixed_s``), is fitted on the prefill work the
request waited for, ``x`` = its own uncached tokens + the uncached tokens sent there ahead of it, and the
requests ``r`` running there when it was sent::

    y - fixed_s = overhead_s + x * (a + b * r)        (x in thousands of tokens)

by weighted least squares over ``(1, x, x * r)``: each observation's weight decays by ``1 - 1/window`` per later
one (engines change: a busy hour, a restart), one far off the current fit (``|residual|`` above ``HUBER_K``
times the recent mean ``|residual|``) is weighted down in proportion (Huber: one stall does not drag the curve),
and a ridge pulls toward the priors (no overhead, the configured rate, no load slope) with the weight of
``PRIOR_WEIGHT`` observations, so a few observations move the curve a little and a steady stream moves it all
the way. The curve gives a candidate its rate at its own load (``Candidate.prefill_tokens_per_s``) and its
overhead. Each observation also scores the estimate that routed the request (predicted minus observed), kept
per engine for the status page and the bench.

Event loop only (not thread-safe); no clock: observations carry their figures.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

import numpy as np

__all__ = ["EngineCurve", "Observation", "OutputLengths", "TtftLearner"]

HUBER_K = 3.0  # residuals beyond this many recent mean |residuals| are weighted down
PRIOR_WEIGHT = 4.0  # the priors count as this many observations
ERRORS_KEPT = 256  # (predicted, observed) pairs kept per engine for the error figures
_MIN_SCALE_S = 0.005  # the Huber scale never shrinks below this: TTFTs of a few ms jitter by that much
_RATE_RANGE = 100.0  # a learned rate stays within this factor of the prior, either way


@dataclass(frozen=True, slots=True)
class Observation:
    """One request's first byte, with the figures it was routed on."""

    observed_s: float  # sent -> first byte
    predicted_s: float  # the decision's estimated TTFT
    work_tokens: float  # its uncached prompt tokens + those sent there ahead of it, not prefilled yet
    running: float  # requests running there when it was sent (the engine's and the gateway's)
    fixed_s: float = 0.0  # the parts of the estimate not learned here (slot waits, loads, pulls)


class EngineCurve:
    """One engine's TTFT curve: the decayed, robust, ridge-regularised fit described in the module docstring."""

    def __init__(self, prior_rate: float, window: int) -> None:
        self.prior = np.array([0.0, 1000.0 / prior_rate, 0.0])
        self.decay = 1.0 - 1.0 / window
        self._a = np.zeros((3, 3))
        self._b = np.zeros(3)
        self.theta = self.prior.copy()
        self._scale = 0.05  # recent mean |residual|, seconds
        self.observations = 0  # fitted
        self.seen = 0  # observed, fitted or not (learning off)
        self.errors: deque[tuple[float, float]] = deque(maxlen=ERRORS_KEPT)

    def score(self, o: Observation) -> None:
        """Keep how far the estimate that routed `o` was from what happened."""
        self.seen += 1
        self.errors.append((o.predicted_s, o.observed_s))

    def observe(self, o: Observation) -> None:
        """Fit the curve to `o` too."""
        x = o.work_tokens / 1000.0
        phi = np.array([1.0, x, x * o.running])
        y = o.observed_s - o.fixed_s
        resid = abs(y - float(phi @ self.theta))
        limit = HUBER_K * max(self._scale, _MIN_SCALE_S)
        w = 1.0 if resid <= limit else limit / resid
        self._scale = self.decay * self._scale + (1.0 - self.decay) * min(resid, limit)
        self._a = self.decay * self._a + w * np.outer(phi, phi)
        self._b = self.decay * self._b + w * y * phi
        ridge = PRIOR_WEIGHT * np.eye(3)
        theta = np.linalg.solve(self._a + ridge, self._b + ridge @ self.prior)
        low = self.prior[1] / _RATE_RANGE
        theta[0] = min(max(theta[0], 0.0), 30.0)
        theta[1] = min(max(theta[1], low), self.prior[1] * _RATE_RANGE)
        theta[2] = max(theta[2], 0.0)
        self.theta = theta
        self.observations += 1

    @property
    def overhead_s(self) -> float:
        return float(self.theta[0])

    def rate(self, running: float) -> float:
        """Tokens/s it prefills at with `running` requests running."""
        return 1000.0 / float(self.theta[1] + self.theta[2] * max(running, 0.0))

    def median_abs_error_s(self) -> float | None:
        """Median |predicted - observed| over the kept observations (None: none yet)."""
        if not self.errors:
            return None
        return statistics.median(abs(p - o) for p, o in self.errors)

    def median_relative_error(self) -> float | None:
        """Median |predicted - observed| / observed (None: none yet)."""
        errs = [abs(p - o) / o for p, o in self.errors if o > 0]
        return statistics.median(errs) if errs else None


class OutputLengths:
    """Per model, the decayed mean of the completion tokens its answers had, starting from `prior` counted as
    `PRIOR_WEIGHT` answers that decay like the others: one short answer (a client's warm-up of `max_tokens: 1`)
    does not make every request ahead free, and a steady stream replaces the prior."""

    def __init__(self, window: int, prior: float) -> None:
        self.decay = 1.0 - 1.0 / window
        self.prior = prior
        self._sums: dict[str, tuple[float, float]] = {}  # model -> (decayed tokens, decayed count)

    def observe(self, model: str, tokens: int) -> None:
        s, n = self._sums.get(model, (PRIOR_WEIGHT * self.prior, PRIOR_WEIGHT))
        self._sums[model] = (self.decay * s + tokens, self.decay * n + 1.0)

    def mean(self, model: str) -> float | None:
        s, n = self._sums.get(model, (0.0, 0.0))
        return s / n if n > 0 else None


class TtftLearner:
    """The curves of all engines (by node id: a restarted engine is the same hardware) and the output lengths.

    `window` 0 turns learning off: candidates keep the configured figures and nothing is fitted, but the
    estimate errors are still kept (they are what shows whether learning is needed).
    """

    def __init__(self, prior_rate: float, window: int = 64, output_prior: int = 256) -> None:
        self.prior_rate = prior_rate
        self.window = window
        self.output_prior = output_prior
        self.curves: dict[str, EngineCurve] = {}
        self.outputs = OutputLengths(max(window, 1), output_prior)

    @property
    def learning(self) -> bool:
        return self.window > 0

    def curve(self, node_id: str) -> EngineCurve:
        c = self.curves.get(node_id)
        if c is None:
            c = self.curves[node_id] = EngineCurve(self.prior_rate, max(self.window, 1))
        return c

    def observe(self, node_id: str, o: Observation) -> None:
        c = self.curve(node_id)
        c.score(o)
        if self.learning:
            c.observe(o)

    def learned(self, node_id: str, running: float) -> tuple[float, float] | None:
        """(prefill tokens/s at `running`, overhead s) for the engine, None until it was observed (the priors)."""
        c = self.curves.get(node_id)
        if c is None or not c.observations:
            return None
        return c.rate(running), c.overhead_s

    def output_tokens(self, model: str, max_tokens: int) -> float:
        """What a request of `model` is expected to generate: the observed mean, else the prior; at most
        `max_tokens` in either case only for the prior (a client's cap says nothing of the others' answers)."""
        mean = self.outputs.mean(model) if self.learning else None
        return mean if mean is not None else float(min(max_tokens, self.output_prior))
