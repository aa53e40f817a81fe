"""
Active health checks: a service that probes every backend's health path on a timer.

Why ``/health`` and not ``/v1/models``: vLLM's API server keeps answering ``/v1/models``
with 200 after its engine process has died; only ``/health`` turns to 503.

Why the loop never waits for its probes: a ``LoopingCall`` whose function returns a
Deferred waits for it before scheduling the next run, and stops for good on an unhandled
failure.  Here each tick starts the probes and returns at once; every probe has its own
timeout on the injected clock and swallows its own errors, and a backend whose previous
probe is still running is skipped rather than probed twice.  So one hung backend can
neither stall nor stop the checks of the others.
"""

from __future__ import annotations

from typing import Any

from treq import collect, json_content, text_content
from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet import error as neterror
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IResponse

from ._backend import Backend, Pool
from ._words import describe_failure

log = Logger()

#: Probe failures that say for certain nothing healthy is there: mark down at once.
_DEFINITIVE = (
    neterror.ConnectionRefusedError,
    neterror.NoRouteError,
    neterror.DNSLookupError,
    neterror.UnknownHostError,
)


def prometheus_sum(text: str, name: str) -> float | None:
    """The sum of every sample of metric ``name`` in Prometheus text (``None`` if absent)."""
    total = None
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name):]
        if rest[:1] not in ("{", " "):
            continue  # another metric whose name starts the same way
        try:
            value = float(rest.rsplit(None, 1)[-1] if "}" not in rest
                          else rest.split("}", 1)[1].split()[0])
        except (ValueError, IndexError):
            continue
        total = (total or 0.0) + value
    return total


class HealthChecker(Service):
    """Probes each backend every ``interval`` seconds and applies the rise/fall rules."""

    def __init__(
        self,
        pool: Pool,
        agent: IAgent,
        clock: IReactorTime,
        interval: float,
        timeout: float,
        path: str,
        rise: int,
        fall: int,
        scrape_engine_queue: bool = False,
    ) -> None:
        self.scrape_engine_queue = scrape_engine_queue
        self.pool = pool
        self.clock = clock
        self.interval = interval
        self.timeout = timeout
        self.path = path.encode("ascii")
        self.rise = rise
        self.fall = fall
        # The agent itself, not treq's HTTPClient: treq re-encodes the URL through
        # hyperlink, which raises on an IPv6 literal (``http://[::1]:8004``).
        self._agent = agent
        self._loop: LoopingCall | None = None
        self._probing: dict[Backend, Deferred[Any]] = {}

    def startService(self) -> None:
        super().startService()
        loop = self._loop = LoopingCall(self.probe_all)
        loop.clock = self.clock
        # Probe at once: backends start eligible, and a dead one should leave rotation
        # within one probe, not one interval.
        loop.start(self.interval, now=True).addErrback(
            lambda failure: log.failure("health check loop stopped", failure)
        )

    def stopService(self) -> None:
        super().stopService()
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        for pending in list(self._probing.values()):
            pending.cancel()

    def probe_all(self) -> None:
        """
        Start a probe of every backend that is not still being probed.

        Nothing one backend's probe does may escape: an exception here would stop the
        ``LoopingCall`` for good, and with it the probes of every other backend.
        """
        for backend in list(self.pool):
            if backend not in self._probing:
                try:
                    self.probe(backend)
                except Exception:
                    log.failure("could not probe {backend}", backend=backend.key)

    def probe(self, backend: Backend) -> Deferred[None]:
        """
        Probe one backend now.  The returned Deferred never fails; it fires once the
        backend's state has been updated.  A probe that cannot even be sent counts as a
        failed probe of that backend, never as an error of the loop.
        """
        request = self._get(backend, self.path)
        request.addCallback(self._read_body)
        request.addTimeout(self.timeout, self.clock)
        self._probing[backend] = request
        done: Deferred[None] = request.addCallbacks(
            lambda code: self._answered(backend, code),
            lambda failure: self._failed(backend, failure),
        )
        done.addBoth(self._forget, backend)
        return done

    def _read_body(self, response: IResponse) -> Deferred[int]:
        # Read the (tiny) body so the connection finishes cleanly; the status is what counts.
        body: Deferred[None] = collect(response, lambda _data: None)
        return body.addCallback(lambda _: response.code)

    def probe_soon(self, backend: Backend) -> None:
        """Probe ``backend`` now unless a probe of it is already running."""
        if backend not in self._probing:
            self.probe(backend)

    def _answered(self, backend: Backend, code: int) -> Deferred[Any] | None:
        if self.pool.get(backend.key) is not backend:
            return None  # removed while the probe ran
        if code != 200:
            self.pool.probe_failed(backend, f"health: HTTP {code}", definitive=True,
                                   fall=self.fall)
            return None
        was_down = not backend.healthy
        self.pool.probe_succeeded(backend, self.rise)
        extras = []
        if not backend.spec.models and (backend.learned_models is None or was_down):
            # learn what it serves at first sight, and again whenever it comes back up
            # (it may have been restarted with another model)
            extras.append(self._learn_models(backend))
        if self.scrape_engine_queue:
            extras.append(self._scrape_engine_queue(backend))
        if not extras:
            return None
        return gatherResults(extras, consumeErrors=True)

    def _get(self, backend: Backend, path: bytes) -> Deferred[IResponse]:
        """``GET path`` on ``backend``; a request that raises at once fails the Deferred."""
        return defer.maybeDeferred(self._agent.request, b"GET", backend.base_url + path,
                                   Headers())

    def _fetch(self, backend: Backend, path: bytes) -> Deferred[Any]:
        request = self._get(backend, path)
        request.addTimeout(self.timeout, self.clock)
        return request

    def _learn_models(self, backend: Backend) -> Deferred[None]:
        def learned(answer: Any) -> None:
            data = answer.get("data") if isinstance(answer, dict) else None
            if not isinstance(data, list):
                raise ValueError("no 'data' list")
            self.pool.set_models(backend, [e for e in data if isinstance(e, dict)])

        def failed(failure: Failure) -> None:
            log.warn("could not learn the models of {backend}: {error}",
                     backend=backend.key, error=describe_failure(failure))

        request = self._fetch(backend, b"/v1/models")
        request.addCallback(json_content)
        return request.addCallback(learned).addErrback(failed)

    def _scrape_engine_queue(self, backend: Backend) -> Deferred[None]:
        def scraped(text: str) -> None:
            running = prometheus_sum(text, "vllm:num_requests_running")
            waiting = prometheus_sum(text, "vllm:num_requests_waiting")
            if running is None or waiting is None:
                raise ValueError("no vllm:num_requests_running/waiting in /metrics")
            self.pool.set_engine_depth(backend, running, waiting)

        def failed(failure: Failure) -> None:
            backend.engine_depth = None  # fall back to local counts rather than stale ones
            log.debug("could not scrape {backend}/metrics: {error}",
                      backend=backend.key, error=failure.getErrorMessage())

        request = self._fetch(backend, b"/metrics")
        request.addCallback(text_content)
        return request.addCallback(scraped).addErrback(failed)

    def _failed(self, backend: Backend, failure: Failure) -> None:
        if not self.running or self.pool.get(backend.key) is not backend:
            return  # shutting down, or removed while the probe ran
        if failure.check(defer.TimeoutError, neterror.TimeoutError):
            reason = f"health: no answer within {self.timeout:g}s"
        else:
            reason = f"health: {describe_failure(failure)}"
        definitive = failure.check(*_DEFINITIVE) is not None
        self.pool.probe_failed(backend, reason, definitive=definitive, fall=self.fall)

    def _forget(self, result: object, backend: Backend) -> None:
        self._probing.pop(backend, None)
