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

import json
from collections.abc import Callable
from typing import Any

from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet import error as neterror
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.interfaces import IPushProducer, IReactorTime
from twisted.internet.protocol import Protocol, connectionDone
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IResponse

from txlb._cluster import engines as _engines
from txlb._cluster.backend import Backend
from txlb._cluster.engines import prometheus_sum
from txlb._cluster.hung import timed_out
from txlb._cluster.pool import Pool
from txlb._config.config import Config
from txlb._http.words import describe_failure

__all__ = ["HealthChecker", "prometheus_sum"]

log = Logger()

#: Probe failures that say for certain nothing healthy is there: mark down at once.
_DEFINITIVE = (
    neterror.ConnectionRefusedError,
    neterror.NoRouteError,
    neterror.DNSLookupError,
    neterror.UnknownHostError,
)


#: The most of a probe's body kept (``/v1/models``, ``/metrics``: kilobytes in practice).
MAX_PROBE_BODY = 4 * 1024 * 1024


class _Body(Protocol):
    """
    Collects a response body for the prober.  Cancelling :attr:`done` (the probe timed out)
    stops the body's transport, which closes the connection: otherwise a backend that
    stalls halfway through a body would keep one connection open per probe.  A body over
    :data:`MAX_PROBE_BODY` is a failed read, not memory the backend may fill.
    """

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._size = 0
        self.done: Deferred[bytes] = Deferred(lambda _: self._stop())

    def _stop(self) -> None:
        transport: IPushProducer | None = self.transport  # type: ignore[assignment]
        if transport is not None:
            transport.stopProducing()

    def dataReceived(self, data: bytes) -> None:
        if self.done.called:
            return
        self._size += len(data)
        if self._size > MAX_PROBE_BODY:
            self._stop()
            self.done.errback(ValueError(f"body over {MAX_PROBE_BODY} bytes"))
            return
        self._parts.append(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self.done.called:
            return
        if reason.check(ResponseDone, PotentialDataLoss):
            self.done.callback(b"".join(self._parts))
        else:
            self.done.errback(reason)


def read_body(response: IResponse) -> Deferred[bytes]:
    """The whole body of ``response`` (see :class:`_Body`)."""
    body = _Body()
    response.deliverBody(body)
    return body.done


def _json_body(response: IResponse) -> Deferred[Any]:
    return read_body(response).addCallback(json.loads)


def _text_body(response: IResponse) -> Deferred[str]:
    return read_body(response).addCallback(lambda data: data.decode("utf-8", "replace"))


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
        #: backends already warned about for exporting no queue metrics txlb knows
        self._warned_no_queue: set[str] = set()

    def startService(self) -> None:
        super().startService()
        self._start_loop()

    def _start_loop(self) -> None:
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

    def reconfigure(self, config: Config) -> None:
        """``config``'s probes: interval, timeout, path, rise and fall (see :meth:`retune`)."""
        self.retune(interval=config.health_interval, timeout=config.health_timeout,
                    path=config.health_path, rise=config.rise, fall=config.fall,
                    scrape_engine_queue=self.scrape_engine_queue)

    def scrape_engines(self, scrape: bool) -> None:
        """Whether probes read engine ``/metrics`` too: what the policy of the moment needs."""
        self.scrape_engine_queue = scrape

    def retune(self, *, interval: float, timeout: float, path: str, rise: int, fall: int,
               scrape_engine_queue: bool) -> None:
        """
        A reloaded config's health checks.  Probes under way finish under the old
        timeout; a new interval restarts the loop at once (a probe round now, then every
        ``interval``), so a shortened one does not wait out the old one first.
        """
        self.timeout = timeout
        self.path = path.encode("ascii")
        self.rise = rise
        self.fall = fall
        self.scrape_engine_queue = scrape_engine_queue
        if interval == self.interval:
            return
        self.interval = interval
        if self._loop is not None and self._loop.running:
            self._loop.stop()
            self._start_loop()

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
        request = self.health_status(backend)
        request.addTimeout(self.timeout, self.clock)
        self._probing[backend] = request
        started = self.clock.seconds()
        done: Deferred[None] = request.addCallbacks(
            lambda code: self._answered(backend, code),
            lambda failure: self._failed(backend, failure, started),
        )
        done.addBoth(self._forget, backend)
        return done

    def health_status(self, backend: Backend) -> Deferred[int]:
        """
        ``GET`` the health path once, no state changed: the status, after the (small) body
        is read so the connection ends cleanly -- and is closed if the caller cancels (a
        timeout), instead of left open on a backend that stalls.  The hang detector's
        confirming probe is this too.
        """
        request = self._get(backend, self.path)
        return request.addCallback(
            lambda response: read_body(response).addCallback(lambda _: response.code))

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
        was_down = not backend.health.healthy
        self.pool.probe_succeeded(backend, self.rise)
        # As its models are learned -- at first sight, and again whenever it comes back up
        # (it may have been restarted with another model, or another engine) -- learn
        # which engine it runs too; that scrape also reads the queue.  A backend whose
        # models are configured is looked at only when its queue is wanted: otherwise it
        # gets nothing from txlb but probes and traffic.  Both fetches at once: the next
        # probe waits for this one.
        learning = not backend.spec.models and (backend.listing.names is None or was_down)
        # an engine not recognised yet (its /metrics failed) is looked for again
        first_sight = (learning or (not backend.spec.models and backend.engine.name is None)
                       or (self.scrape_engine_queue and (backend.engine.name is None or was_down)))
        extras = []
        if first_sight:
            extras.append(self._scrape_engine(backend, recognise=True))
        elif self.scrape_engine_queue:
            extras.append(self._scrape_engine(backend, recognise=False))
        if learning:
            extras.append(self._learn_models(backend))
        if not extras:
            return None
        return gatherResults(extras, consumeErrors=True)

    def _get(self, backend: Backend, path: bytes) -> Deferred[IResponse]:
        """
        ``GET path`` on ``backend`` (with its engine's key, when it has one: an engine
        started with ``--api-key`` answers nothing without it); a request that raises at
        once fails the Deferred.
        """
        headers = Headers()
        if backend.spec.api_key is not None:
            headers.setRawHeaders(b"authorization",
                                  [b"Bearer " + backend.spec.api_key.encode("ascii")])
        return defer.maybeDeferred(self._agent.request, b"GET", backend.base_url + path,
                                   headers)

    def _fetch(self, backend: Backend, path: bytes,
               read: Callable[[IResponse], Deferred[Any]]) -> Deferred[Any]:
        """
        ``GET path`` and ``read`` its body, all within the probe timeout: a backend that
        sends a head and then stalls its body must not hold the probe -- and with it every
        later probe of that backend -- open forever.
        """
        request = self._get(backend, path)
        request.addCallback(read)
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

        request = self._fetch(backend, b"/v1/models", _json_body)
        return request.addCallback(learned).addErrback(failed)

    def _scrape_engine(self, backend: Backend, recognise: bool) -> Deferred[None]:
        """
        Read the backend's ``/metrics``: recognise its engine (``recognise``), then, with
        ``--policy queue-depth``, its queue, by the names of the engine recognised.  A
        backend exporting no queue txlb knows is warned about once, not silently counted
        by local in-flight requests only.
        """
        engine = _engines.BY_NAME.get(backend.engine.name or "")
        if not recognise and engine is None:
            return defer.succeed(None)  # nothing to read there: local counts only

        def answered(response: IResponse) -> Deferred[tuple[str, str]]:
            """(why there is nothing to read, or ``""``; the text)."""
            if response.code >= 500 and response.code != 501:
                # a failure, not an answer (501: llama.cpp without --metrics): the engine
                # is not taken for "unknown" on that -- it is looked for again
                def failure(_: object) -> tuple[str, str]:
                    raise ValueError(f"/metrics answered HTTP {response.code}")

                return read_body(response).addBoth(failure)
            if response.code != 200:
                skipped = read_body(response)
                return skipped.addCallback(lambda _: (f"HTTP {response.code}", ""))
            return _text_body(response).addCallback(lambda body: ("", body))

        def scraped(result: tuple[str, str]) -> None:
            why, text = result
            found = engine
            if recognise:
                found = _engines.recognise(text)
                why = why or "no metric name txlb knows"
            reading = _engines.Reading() if found is None else _engines.read(text, found)
            if recognise:
                self.pool.set_engine(backend, _engines.UNKNOWN if found is None
                                     else found.name, reading.kv_cache)
            if not self.scrape_engine_queue:
                return
            if reading.running is None or reading.waiting is None:
                self.pool.forget_engine_depth(backend)
                self._warn_no_queue(backend, why if found is None else
                                    f"{found.running} or {found.waiting} missing")
                return
            self.pool.set_engine_depth(backend, reading.running, reading.waiting,
                                       reading.kv_cache, reading.prefix_cache)

        def failed(failure: Failure) -> None:
            if self.scrape_engine_queue:
                self.pool.forget_engine_depth(backend)
                if backend.engine.name is None:
                    # never read at all: as silent a fallback as a /metrics without a queue
                    self._warn_no_queue(backend, "reading it failed: "
                                        + (failure.getErrorMessage() or "no answer"))
                    return
            log.debug("could not scrape {backend}/metrics: {error}",
                      backend=backend.key, error=failure.getErrorMessage())

        request = self._fetch(backend, b"/metrics", answered)
        return request.addCallback(scraped).addErrback(failed)

    def _warn_no_queue(self, backend: Backend, why: str) -> None:
        if backend.key in self._warned_no_queue:
            return
        self._warned_no_queue.add(backend.key)
        log.warn("backend {backend} exports no engine queue in /metrics ({why}); "
                 "--policy queue-depth counts only this balancer's requests to it "
                 "(txlb reads vLLM, SGLang, llama.cpp and TGI metrics)",
                 backend=backend.key, why=why)

    def _failed(self, backend: Backend, failure: Failure, started: float = 0.0) -> None:
        if not self.running or self.pool.get(backend.key) is not backend:
            return  # shutting down, or removed while the probe ran
        timeout = timed_out(failure)
        if timeout:
            reason = f"health: no answer within {self.timeout:g}s"
        else:
            reason = f"health: {describe_failure(failure)}"
        if timeout and backend.pace.last_byte is not None and backend.pace.last_byte >= started:
            # Its streams flowed while /health said nothing: busy, not dead (SGLang's
            # /health times out during a long prefill).  Not a failure towards --fall.
            log.info("backend {backend}: {reason}, but its responses flow; not counted",
                     backend=backend.key, reason=reason)
            return
        definitive = failure.check(*_DEFINITIVE) is not None
        self.pool.probe_failed(backend, reason, definitive=definitive, fall=self.fall)

    def _forget(self, result: object, backend: Backend) -> None:
        self._probing.pop(backend, None)
