"""
The dashboard's memory: the last few minutes of the fleet and of each backend, one sample
a second, kept server-side so that a page opened at 3 a.m. shows what happened before it
was opened.

Two promises shape it:

* **Bounded.**  A ring of :data:`CAPACITY` samples (5 minutes); the oldest falls off as a
  new one arrives.  A sample is a few numbers for the fleet and a few per backend, so the
  memory is about ``CAPACITY * (400 + 230 * backends)`` bytes whatever the traffic
  (measured with tracemalloc: 0.64 MB for 8 backends, 4.4 MB for 64).
* **Nothing per request beyond O(1) counters.**  :meth:`History.observe` adds to integer
  counters -- a time-to-first-byte goes into one bucket of a fixed log-spaced histogram --
  and allocates nothing once a backend has been seen.  The percentiles, rates and means
  are worked out once a second, in :meth:`History.sample`, on the reactor's clock.

It lives where every finished request is counted once: the single process, or with
``--workers`` the supervisor (which is sent every worker's summaries and reads the shared
in-flight counts), so the history is already merged across workers.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import attrs
from twisted.application.service import Service
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from txlb._cluster.backend import Backend
from txlb._records.summary import Summary

log = Logger()

#: Seconds between samples, and how many are kept (5 minutes).
SAMPLE_SECONDS = 1.0
CAPACITY = 300
#: Upper bounds of the time-to-first-byte buckets: 1 ms to about 10 minutes, 10% apart, so
#: a percentile is known to within 10% (a slower first byte counts in the last bucket).
_BOUNDS = tuple(0.001 * 1.1 ** i for i in range(int(math.log(600_000) / math.log(1.1)) + 1))
#: Request outcomes that are a failure of the backend, not of the client or of shutdown.
_ERRORS = frozenset({"upstream_error", "timeout"})


@attrs.define
class _Tally:
    """One backend's counts since the last sample (reset, never reallocated)."""

    requests: int = 0
    ttfb_sum: float = 0.0
    ttfb_count: int = 0
    server_errors: int = 0
    errors: int = 0

    def reset(self) -> None:
        self.requests = self.ttfb_count = self.server_errors = self.errors = 0
        self.ttfb_sum = 0.0


#: One backend in a sample: (in flight, requests ended, mean TTFB or None, 5xx, errors,
#: engine queue or None).
BackendSample = tuple[int, int, float | None, int, int, float | None]


@attrs.frozen
class Sample:
    """The fleet and every backend over one second."""

    time: float
    elapsed: float
    requests: int
    ttfb_p50: float | None
    ttfb_p99: float | None
    in_flight: int
    queued: int
    server_errors: int
    errors: int
    backends: tuple[tuple[str, BackendSample], ...]

    def as_json(self) -> dict[str, Any]:
        return {
            "t": round(self.time, 3), "requests": self.requests,
            "rps": round(self.requests / self.elapsed, 2),
            "ttfb_p50_s": self.ttfb_p50, "ttfb_p99_s": self.ttfb_p99,
            "in_flight": self.in_flight, "queued": self.queued,
            "5xx": self.server_errors, "errors": self.errors,
            "backends": {key: {"in_flight": b[0], "requests": b[1],
                               "rps": round(b[1] / self.elapsed, 2), "ttfb_s": b[2],
                               "5xx": b[3], "errors": b[4], "engine_queue": b[5]}
                         for key, b in self.backends},
        }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


class History:
    """
    The ring of samples.  ``backends`` gives the pool's current backends (read once a
    second), ``queued`` the number of requests waiting for a slot (the router's queue, or
    every worker's under ``--workers``).
    """

    def __init__(self, clock: IReactorTime, backends: Callable[[], Iterable[Backend]],
                 queued: Callable[[], int], capacity: int = CAPACITY) -> None:
        self.clock = clock
        self.backends = backends
        self.queued = queued
        self.samples: deque[Sample] = deque(maxlen=capacity)
        self._tallies: dict[str, _Tally] = {}
        self._buckets = [0] * (len(_BOUNDS) + 1)
        self._requests = 0
        self._server_errors = 0
        self._errors = 0
        self._since = clock.seconds()

    def count_queue(self, queued: Callable[[], int]) -> None:
        """Where the samples' ``queued`` is read from (under ``--workers``: every worker's)."""
        self.queued = queued

    def observe(self, summary: Summary, answered: bool = True) -> None:
        """Count one finished request (called for every request: counters only)."""
        self._requests += 1
        server_error = summary.status >= 500
        error = summary.outcome in _ERRORS
        self._server_errors += server_error
        self._errors += error
        ttfb = summary.ttft if answered else None
        if ttfb is not None:
            self._buckets[bisect.bisect_left(_BOUNDS, ttfb)] += 1
        if summary.backend == "-":
            return
        tally = self._tallies.get(summary.backend)
        if tally is None:
            # the first request of a backend; those no longer in the pool are dropped at
            # the next sample, so a stream of invented names cannot grow this
            tally = self._tallies[summary.backend] = _Tally()
        tally.requests += 1
        tally.server_errors += server_error
        tally.errors += error
        if ttfb is not None:
            tally.ttfb_sum += ttfb
            tally.ttfb_count += 1

    def sample(self) -> Sample:
        """Close the current second: turn the counters into a sample, and start again."""
        now = self.clock.seconds()
        elapsed = max(now - self._since, 1e-9)
        backends = list(self.backends())
        rows = []
        for backend in backends:
            tally = self._tallies.get(backend.key) or _Tally()
            mean = tally.ttfb_sum / tally.ttfb_count if tally.ttfb_count else None
            rows.append((backend.key, (
                backend.counts.active, tally.requests, _rounded(mean),
                tally.server_errors, tally.errors, backend.engine.depth)))
        known = {backend.key for backend in backends}
        for key in [key for key in self._tallies if key not in known]:
            del self._tallies[key]
        for tally in self._tallies.values():
            tally.reset()
        sample = Sample(
            time=now, elapsed=elapsed, requests=self._requests,
            ttfb_p50=self._percentile(0.5), ttfb_p99=self._percentile(0.99),
            in_flight=sum(backend.counts.active for backend in backends), queued=self.queued(),
            server_errors=self._server_errors, errors=self._errors, backends=tuple(rows))
        self.samples.append(sample)
        self._buckets = [0] * len(self._buckets)
        self._requests = self._server_errors = self._errors = 0
        self._since = now
        return sample

    def _percentile(self, fraction: float) -> float | None:
        """The bucket bound under which ``fraction`` of this second's first bytes came."""
        total = sum(self._buckets)
        if not total:
            return None
        rank = math.ceil(fraction * total)
        seen = 0
        for index, count in enumerate(self._buckets):
            seen += count
            if seen >= rank:
                return _rounded(_BOUNDS[min(index, len(_BOUNDS) - 1)])
        return None  # pragma: no cover - the counts add up to total

    def since(self, after: float | None) -> list[dict[str, Any]]:
        """The samples newer than ``after`` (all of them for ``None``), oldest first."""
        # compared as served: ``t`` is rounded to the millisecond
        return [sample.as_json() for sample in self.samples
                if after is None or round(sample.time, 3) > after]


class HistoryService(Service):
    """Takes a sample every :data:`SAMPLE_SECONDS` while running."""

    def __init__(self, history: History) -> None:
        self.history = history
        self._loop: LoopingCall | None = None

    def startService(self) -> None:
        super().startService()
        self._loop = LoopingCall(self._sample)
        self._loop.clock = self.history.clock
        self._loop.start(SAMPLE_SECONDS, now=False)

    def _sample(self) -> None:
        # A LoopingCall stops for good on one exception: a failed sample is logged instead.
        try:
            self.history.sample()
        except Exception:
            log.failure("could not take a dashboard history sample")

    def stopService(self) -> None:
        super().stopService()
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
