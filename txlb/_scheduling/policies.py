"""
Selection policies: given the backends eligible for a request, pick one.

A policy only chooses; it never changes backend state.  The caller takes the in-flight slot
(:meth:`txlb._cluster.pool.Pool.acquire`) immediately after ``choose`` returns, in the same
synchronous step, which is what keeps a burst of simultaneous requests spread out.

Policies read what they need from :class:`~txlb._cluster.backend.Backend` (in-flight count, weight,
latency average, scraped engine queue), which the proxy and the prober keep up to date; the
random ones take an injected ``random.Random`` so tests and simulations are repeatable.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from zope.interface import Interface, implementer

from txlb._cluster.backend import Backend


class IPolicy(Interface):
    """Chooses one backend among eligible candidates."""

    def choose(candidates: Sequence[Backend]) -> Backend:
        """
        Return one of ``candidates`` (never empty, in pool order).
        """


def load(backend: Backend) -> float:
    """In-flight requests per unit of weight: the quantity least-connections minimises."""
    return backend.active / backend.effective_weight


class _WeightedTies:
    """
    Breaks ties between equally good backends by smooth weighted round-robin, as nginx's
    ``least_conn`` does.  On an idle fleet of equal weights that is plain rotation (a
    sequence of short requests visits every GPU, not the first one each time); with
    weights -- including a weight still ramping up after recovery (slow start) -- each
    backend gets its weight's share of the ties.
    """

    def __init__(self) -> None:
        self._current: dict[str, float] = {}

    def pick(self, tied: Sequence[Backend]) -> Backend:
        if len(tied) == 1:
            return tied[0]
        total = 0.0
        best: Backend | None = None
        for backend in tied:
            weight = backend.effective_weight
            current = self._current.get(backend.key, 0.0) + weight
            self._current[backend.key] = current
            total += weight
            if best is None or current > self._current[best.key]:
                best = backend
        assert best is not None
        self._current[best.key] -= total
        return best

    def best(self, candidates: Sequence[Backend],
             score: Callable[[Backend], float]) -> Backend:
        scores = [score(b) for b in candidates]
        lowest = min(scores)
        return self.pick([b for b, s in zip(candidates, scores, strict=True)
                          if s <= lowest * (1 + 1e-9) + 1e-12])


@implementer(IPolicy)
class LeastConnections:
    """Fewest in-flight requests per unit of weight; ties by smooth weighted round-robin."""

    name = "least-conn"

    def __init__(self) -> None:
        self._ties = _WeightedTies()

    def choose(self, candidates: Sequence[Backend]) -> Backend:
        return self._ties.best(candidates, load)


@implementer(IPolicy)
class SmoothWeightedRoundRobin:
    """
    nginx's smooth weighted round-robin: weights 5,1,1 give a,a,b,a,c,a,a.

    Each choice adds every candidate's weight to its running score, picks the highest and
    subtracts the total from the winner, which interleaves the heavy backend with the
    light ones instead of sending it five in a row.
    """

    name = "round-robin"

    def __init__(self) -> None:
        self._order = _WeightedTies()

    def choose(self, candidates: Sequence[Backend]) -> Backend:
        return self._order.pick(candidates)


@implementer(IPolicy)
class WeightedRandom:
    """A random backend, with probability proportional to its weight."""

    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Backend]) -> Backend:
        weights = [b.effective_weight for b in candidates]
        return self._rng.choices(list(candidates), weights=weights)[0]


@implementer(IPolicy)
class PowerOfTwoChoices:
    """
    Two backends drawn at random (by weight), the less loaded of the two wins.

    Nearly as good as least-connections at spreading load, without every balancer
    replica stampeding to the same "least loaded" backend at once.
    """

    name = "p2c"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Backend]) -> Backend:
        if len(candidates) == 1:
            return candidates[0]
        pool = list(candidates)
        weights = [b.effective_weight for b in pool]
        first = self._rng.choices(pool, weights=weights)[0]
        index = pool.index(first)
        del pool[index], weights[index]
        second = self._rng.choices(pool, weights=weights)[0]
        return first if load(first) <= load(second) else second


@implementer(IPolicy)
class PeakEwmaLatency:
    """
    Lowest expected wait: peak-EWMA of time to first byte times (in flight + 1).

    Time to first byte is the engine's queueing plus prefill, the part of an LLM
    request's latency that load drives (total duration mostly measures answer length).
    The average is *peak*-sensitive: a slow sample replaces it at once, fast ones pull it
    down gradually (decaying with time, ``decay`` seconds), so a backend that turns slow
    is avoided immediately and trusted again only slowly.  Cold start: a backend with no
    sample yet is preferred (least loaded first), so every backend gets measured.  Ties
    go to the fewer in flight, then round-robin.
    """

    name = "latency"

    def __init__(self, clock: Callable[[], float], decay: float = 10.0) -> None:
        self._now = clock
        self.decay = decay
        self._ties = _WeightedTies()

    def observe(self, backend: Backend, seconds: float) -> None:
        """Fold one latency sample into the backend's peak-EWMA."""
        now = self._now()
        previous = backend.peak_ewma
        if previous is None or seconds > previous:
            backend.peak_ewma = seconds
        else:
            stamp = backend.peak_ewma_at if backend.peak_ewma_at is not None else now
            elapsed = max(0.0, now - stamp)
            weight = math.exp(-elapsed / self.decay) if self.decay > 0 else 0.0
            backend.peak_ewma = previous * weight + seconds * (1 - weight)
        backend.peak_ewma_at = now

    def choose(self, candidates: Sequence[Backend]) -> Backend:
        unmeasured = [b for b in candidates if b.peak_ewma is None]
        if unmeasured:
            return self._ties.best(unmeasured, load)

        def cost(backend: Backend) -> float:
            assert backend.peak_ewma is not None
            return backend.peak_ewma * (backend.active + 1) / backend.effective_weight

        lowest = min(cost(b) for b in candidates)
        tied = [b for b in candidates if cost(b) <= lowest * (1 + 1e-9)]
        return self._ties.best(tied, load)  # equal cost: fewer in flight, then by weight


@implementer(IPolicy)
class QueueDepth:
    """
    Fewest requests in the engine itself: its own ``vllm:num_requests_running`` +
    ``vllm:num_requests_waiting`` (scraped from ``/metrics`` with each health probe), plus
    the requests this balancer sent since that scrape, minus those of its requests that
    ended since (without the minus, a busy balancer over-counts between scrapes and its
    tail latency suffers near saturation -- measured by ``bench/policies.py``).

    Because the engine's counts include every balancer's requests, several replicas in
    front of one fleet see the same load -- which local in-flight counts cannot give them.
    A backend not scraped yet counts its local in-flight requests instead.
    """

    name = "queue-depth"

    def __init__(self) -> None:
        self._ties = _WeightedTies()

    @staticmethod
    def depth(backend: Backend) -> float:
        if backend.engine_depth is None:
            return backend.active / backend.effective_weight
        local = backend.started_since_scrape - backend.finished_since_scrape
        return max(0.0, backend.engine_depth + local) / backend.effective_weight

    def choose(self, candidates: Sequence[Backend]) -> Backend:
        return self._ties.best(candidates, self.depth)


POLICY_NAMES = ("least-conn", "round-robin", "random", "p2c", "latency", "queue-depth")


def make_policy(name: str, clock: Callable[[], float],
                rng: random.Random | None = None) -> IPolicy:
    """The policy called ``name`` (one of :data:`POLICY_NAMES`)."""
    policies: dict[str, Callable[[], IPolicy]] = {
        "least-conn": LeastConnections,
        "round-robin": SmoothWeightedRoundRobin,
        "random": lambda: WeightedRandom(rng),
        "p2c": lambda: PowerOfTwoChoices(rng),
        "latency": lambda: PeakEwmaLatency(clock),
        "queue-depth": QueueDepth,
    }
    return policies[name]()
