"""``--policy latency``: lowest expected wait, by a peak-EWMA of time to first byte."""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs
from twisted.internet.interfaces import IReactorTime

from txlb._scheduling.policies import Policy, PolicyFactory
from txlb._scheduling.policies._ties import WeightedTies
from txlb._scheduling.policies.least_conn import load
from txlb._scheduling.request import ANY_REQUEST, RoutingRequest

if TYPE_CHECKING:
    from txlb._cluster.backend import Backend
    from txlb._scheduling.outcome import RequestOutcome


@attrs.define
class _Estimate:
    """One backend's peak-EWMA and when it was last updated."""

    seconds: float
    at: float


class PeakEwmaLatency(Policy):
    """
    Lowest expected wait: peak-EWMA of time to first byte times (in flight + 1).

    Time to first byte is the engine's queueing plus prefill, the part of an LLM
    request's latency that load drives (total duration mostly measures answer length).
    The average is *peak*-sensitive: a slow sample replaces it at once, fast ones pull it
    down gradually (decaying with time, ``decay`` seconds), so a backend that turns slow
    is avoided immediately and trusted again only slowly.  Cold start: a backend with no
    sample yet is preferred (least loaded first), so every backend gets measured.  Ties
    go to the fewer in flight, then round-robin.

    The estimates are the policy's own, held per backend object and weakly: a backend the
    pool forgets (removed, or replaced by one with another spec) takes its estimate with
    it, and one added again under the same address starts unmeasured -- nothing has to
    tell the policy.
    """

    name = "latency"

    def __init__(self, clock: IReactorTime, decay: float = 10.0) -> None:
        self._clock = clock
        self.decay = decay
        self._ties = WeightedTies()
        self._estimates: weakref.WeakKeyDictionary[Backend, _Estimate] = (
            weakref.WeakKeyDictionary())

    def estimate(self, backend: Backend) -> float | None:
        """``backend``'s peak-EWMA time to first byte in seconds; ``None`` before a sample."""
        found = self._estimates.get(backend)
        return None if found is None else found.seconds

    def observe(self, backend: Backend, outcome: RequestOutcome) -> None:
        """Fold the request's time to first byte into the backend's peak-EWMA."""
        if outcome.ttfb is not None:
            self.sample(backend, outcome.ttfb)

    def sample(self, backend: Backend, seconds: float) -> None:
        """Fold one time-to-first-byte sample into ``backend``'s peak-EWMA."""
        now = self._clock.seconds()
        previous = self._estimates.get(backend)
        if previous is None or seconds > previous.seconds:
            self._estimates[backend] = _Estimate(seconds, now)
            return
        elapsed = max(0.0, now - previous.at)
        weight = math.exp(-elapsed / self.decay) if self.decay > 0 else 0.0
        previous.seconds = previous.seconds * weight + seconds * (1 - weight)
        previous.at = now

    def describe(self, backend: Backend) -> Mapping[str, object]:
        seconds = self.estimate(backend)
        return {"latency_peak_ewma_s": None if seconds is None else round(seconds, 4)}

    def choose(self, candidates: Sequence[Backend],
               request: RoutingRequest = ANY_REQUEST) -> Backend:
        unmeasured = [b for b in candidates if b not in self._estimates]
        if unmeasured:
            return self._ties.best(unmeasured, load)

        def cost(backend: Backend) -> float:
            return self._estimates[backend].seconds * (backend.counts.active + 1) / (
                backend.effective_weight)

        lowest = min(cost(b) for b in candidates)
        tied = [b for b in candidates if cost(b) <= lowest * (1 + 1e-9)]
        return self._ties.best(tied, load)  # equal cost: fewer in flight, then by weight


factory = PolicyFactory(
    PeakEwmaLatency.name, lambda clock, rng: PeakEwmaLatency(clock),
    "lowest peak-EWMA time to first byte times (in flight + 1)", rank=50)
