"""
One client request forwarded upstream (with :mod:`txlb._upstream.client`, or an embedder's
Agent through :mod:`txlb._upstream.agent`), with failover, the response relayed under the
client's flow control, and every failure mapped to the status the contract promises.

Each client request becomes one :class:`Exchange`, which owns all of that request's state
(the in-flight slot, the upstream Deferred, the read watchdog, whether the client is still
there).  Every way a request can end -- upstream body done, upstream failure, read timeout,
client gone -- funnels into :meth:`Exchange._end`, which is what makes "the in-flight count
falls exactly once" true by construction rather than by care.

What the exchange decides is not here: the heads it sends and relays are computed by
:mod:`txlb._proxy.head`, and what each failure means (status, outcome, retried, the
backend's cost) is the table in :mod:`txlb._proxy.failures`.  The exchange holds the
state machine, the failover, the flow control and the two watchdogs (the backend's
``--read-timeout`` and the client's ``--send-timeout``), and applies those decisions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import IDelayedCall, IPushProducer
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers
from twisted.web.server import Request

from txlb._cluster.backend import Backend
from txlb._cluster.slots import Lease
from txlb._http.errors import error_body, write_body
from txlb._http.headers import flatten
from txlb._http.words import describe_failure
from txlb._proxy.client_end import cut_answer, detach, finish_answer
from txlb._proxy.context import ProxyContext, RetryPlan
from txlb._proxy.failures import (
    FAILURES,
    Kind,
    answered,
    classify,
    failure_words,
    provoked_by_request,
)
from txlb._proxy.head import UpstreamHead, client_head, upstream_head, with_credentials
from txlb._proxy.incoming import exposed_to, framed_writer
from txlb._proxy.resuming import RESUME_KEEP, Resuming
from txlb._records.record import RequestRecord
from txlb._resume.rewrite import ContinuationRewriter
from txlb._scheduling.router import RoutingError
from txlb._upstream.interfaces import UpstreamResponse

#: the namespace operators see on these lines (worker logs name it): kept from before the
#: exchange had a module of its own
log = Logger(namespace="txlb._proxy.resource")


class Exchange(Resuming):
    """
    One client request, forwarded to one backend (or, on failover, to a few in turn).

    States: ``waiting`` (request sent, no response head yet), ``relaying`` (head written
    to the client, body flowing) and ``ended``.  The client can go away in either of the
    first two; the read watchdog can fire in either; the upstream can fail in either.
    Every one of those paths calls :meth:`_end` exactly once, which releases the slot and
    hands the finished :class:`RequestRecord` to the result log.

    A retry happens only in ``waiting``, when nothing of the response has reached the
    client: the slot is released, another backend (not tried yet) is acquired, and the
    buffered body is sent again.
    """

    # One lives for every request in flight (10,000 held streams: 10,000 of these).
    __slots__ = ("request", "record", "lease", "context", "pool", "clock", "read_timeout",
                 "retry", "tried", "state", "client_gone", "_head", "_upstream",
                 "_producer", "_watchdog", "_now", "_last_activity", "_paused_at",
                 "_write", "_meter", "_relayed", "_unresumable", "_raw_to_client", "_continuation",
                 "_continuation_body", "_continuation_tries", "_client_write",
                 "_resume_plan", "__weakref__")

    def __init__(self, request: Request, record: RequestRecord, lease: Lease,
                 context: ProxyContext, retry: RetryPlan | None = None,
                 meter: Callable[[bytes], object] | None = None) -> None:
        self.request = request
        self.record = record
        self.lease = lease
        self.context = context
        self.pool = context.pool
        self.clock = context.clock
        self.read_timeout = context.read_timeout
        self.retry = retry
        self.tried: set[str] = set()
        self.state = "waiting"
        self.client_gone = False
        self._head = UpstreamHead(request.method, b"", [])  # until start()
        self._upstream: Deferred[Any] | None = None
        self._producer: IPushProducer | None = None
        self._watchdog: IDelayedCall | None = None
        self._now = context.clock.seconds
        self._last_activity = self._now()
        self._paused_at: float | None = None
        #: how body bytes reach the client: ``request.write``, or straight to the channel
        #: when the backend's chunked framing is passed through as it came
        self._write: Callable[[bytes], object] = request.write
        #: told each chunk of the body relayed: the fair queue's charge of a streamed
        #: answer (:class:`~txlb._scheduling.fairness.StreamMeter`)
        self._meter = meter
        #: --resume: the bytes the client got (a stream that may be continued), whether
        #: they are in the backend's chunked framing, and the continuation relayed now
        self._relayed: bytearray | None = None
        self._unresumable: str | None = None  # why a stream no longer can be (too long)
        self._raw_to_client = False
        self._continuation: ContinuationRewriter | None = None
        self._continuation_body = b""
        self._continuation_tries = 0
        self._client_write: Callable[[bytes], object] = request.write
        record.backend = lease.backend.key

    # -- start ------------------------------------------------------------------------------

    def start(self) -> None:
        request = self.request
        client = request.getClientAddress()
        client_host = getattr(client, "host", None) or "unix"
        scheme = b"https" if request.isSecure() else b"http"
        self._head = upstream_head(
            request.method, request.uri, len(request.prepath or ()),
            flatten(request.requestHeaders.getAllRawHeaders()), client_host, scheme)
        request.notifyFinish().addErrback(self._client_lost)
        self._send()

    @property
    def backend(self) -> Backend:
        """The backend of the current try."""
        return self.lease.backend

    @property
    def backend_waited_since(self) -> float | None:
        """
        For the hung-backend detector: since when this request has waited on its backend
        (its try was sent, or its last byte came); ``None`` while it waits on nothing of
        the backend's -- ended, between tries, or held up by a client that reads slowly.
        """
        if self.state == "ended" or self.lease.released or self._paused_at is not None:
            return None
        return self._last_activity

    def _send(self, body: bytes | None = None) -> None:
        """
        One attempt: the request, body replayed from the buffered copy (or ``body``: a
        stream's continuation), to the leased backend.
        """
        request = self.request
        if body is None:
            body = self.record.request_body
            if not body and request.getHeader(b"content-length") is None:
                body = None  # no body, and no "Content-Length: 0" either
        backend = self.lease.backend
        self._arm_watchdog()
        try:
            head = self._head
            headers = with_credentials(head.headers, self.context.auth == "keys",
                                       backend.spec.api_key)
            upstream = self._upstream = self.context.upstream.send(
                backend.spec.host, backend.spec.port, head.method, head.target, headers, body)
        except Exception:
            # an Agent raises synchronously for a URI or method it rejects
            upstream = self._upstream = fail()
        upstream.addCallbacks(self._got_response, self._request_failed).addErrback(self._bug)

    # -- failover ---------------------------------------------------------------------------

    def _can_retry(self) -> bool:
        tried = frozenset(self.tried | {self.lease.backend.key})
        return (
            self.retry is not None
            and not self.client_gone
            and self.record.tries <= self.context.retries
            and self.clock.seconds() - self.record.started - (self.record.queue_wait or 0.0)
            < self.context.retry_window
            and self.retry.possible(tried)
        )

    def _retry(self) -> None:
        """Leave this backend (its slot released) and try another one not tried yet."""
        assert self.retry is not None
        self.tried.add(self.lease.backend.key)
        self.lease.release()
        self.record.tries += 1
        self.record.backend = None  # until another backend is acquired
        self.context.observer.retried()
        if self._watchdog is not None and self._watchdog.active():
            self._watchdog.cancel()  # waiting for a slot is not backend silence
        self._watchdog = None
        acquiring = self._upstream = self.retry.acquire(frozenset(self.tried))
        acquiring.addCallbacks(self._retry_with, self._retry_refused).addErrback(self._bug)

    def _retry_with(self, lease: Lease) -> None:
        self._upstream = None
        self.lease = lease
        self.record.backend = lease.backend.key
        self._send()

    def _retry_refused(self, failure: Failure) -> None:
        self._upstream = None
        if self.state == "ended":
            return  # the client left while we waited for another backend
        error = failure.value
        if isinstance(error, RoutingError):
            self._fail(error.status, error.message, "upstream_error", error.retry_after)
        else:
            failure.raiseException()

    def _say(self, kind: tuple[object, ...], level: LogLevel, format: str,
             **fields: object) -> None:
        """A per-request warning: summarised per kind (see txlb._log.quiet.RepeatSummary)."""
        repeats = self.context.repeats
        if repeats is None:
            log.emit(level, format, **fields)
        else:
            repeats.emit(kind, log, level, format, **fields)

    # -- response head ----------------------------------------------------------------------

    def _got_response(self, response: UpstreamResponse) -> None:
        self._upstream = None
        now = self._now()
        # the try's send time until now; only a 2xx head sets the backend's pace
        self.lease.head_came(now, now - self._last_activity, response.code)
        self.context.observer.answered(self.lease.backend, response.code,
                                       self._blamed(response.code))
        if self._continuation is not None:
            self._continuation_head(response)
            return
        if FAILURES[answered(response.code)].retried and self._can_retry():
            self._say(("retried", self.lease.backend.key, response.code), LogLevel.info,
                      "backend {backend} answered {status}; trying another",
                      backend=self.lease.backend.key, status=response.code)
            response.discard()
            self._retry()
            return
        self.state = "relaying"
        self._arm_watchdog()
        try:
            raw = self._write_head(response)
        except BaseException:
            response.discard()  # nobody will read it: close it, the backend stops
            raise
        self._keep_for_resume(response, raw)
        response.deliver(self, raw)

    def _blamed(self, status: int) -> str | None:
        """
        Who an answer of ``status`` is to be held against: the client's key, or ``None``
        when a 5xx was the request's own doing -- a body that is not a JSON object (an
        engine such as llama.cpp answers 500 to one), so garbage POSTs cannot eject a
        healthy backend.  Parsed only for a 5xx: other answers never need it.
        """
        if status < 500:
            return ""
        if provoked_by_request(self.request.method, self.record.request_body):
            return None
        if self.record.client is not None:  # taken once, when the request was routed
            return self.record.client
        return self.context.client_key(self.request)

    def _write_head(self, response: UpstreamResponse) -> bool:
        """
        Give the client the backend's status and headers; whether the body can be passed
        on in the backend's own chunked framing (``raw``).
        """
        request = self.request
        backend = self.lease.backend
        head = client_head(response.code, request.method, response.headers, response.length,
                           (backend.key, backend.spec.port) if self._shows_backend() else None)
        self.record.status = response.code
        request.setResponseCode(response.code, response.phrase)
        out = request.responseHeaders
        for name, values in head.headers:
            out.setRawHeaders(name, values)
        if self.record.added_headers:
            for name, value in self.record.added_headers:
                out.setRawHeaders(name, [value])
        self.record.content_type = head.content_type
        raw = False
        if response.length is None:
            # A stream: send the head now, as nginx does, so an SSE client sees its 200
            # while the engine is still queueing or prefilling, not only with the first
            # token.  A fixed-length answer's body follows its head at once; writing them
            # together saves a packet.
            request.write(b"")
            # An HTTP/1.1 client gets the body chunked by twisted.web's Request; when the
            # backend's body is chunked too, its framing is passed on as it came (the
            # Request still writes the last chunk on finish): no decoding, no re-encoding.
            write_framed = framed_writer(request) if response.chunked else None
            if write_framed is not None and request.chunked:
                raw = True
                self._write = write_framed
                self.record.chunked = True
        return raw

    # -- IRelayOwner: the body --------------------------------------------------------------

    def body_started(self, producer: IPushProducer) -> None:
        self._producer = producer
        if self._continuation is not None:
            # the exchange is the client's producer already: the continuation's body
            # starts paused if the client is
            if self._paused_at is not None:
                producer.pauseProducing()
        elif self.state == "relaying":
            self.request.registerProducer(self, True)

    # -- IPushProducer: the client's flow control, passed upstream ------------------------

    def pauseProducing(self) -> None:
        """
        The client's socket is full: stop reading from the backend.  While the client is
        the slow one the backend's silence is ours, so the watchdog measures the client
        instead: one that reads nothing for ``send_timeout`` seconds is cut off (nginx's
        ``send_timeout``), rather than pinning a GPU slot for as long as it likes.
        """
        if self._producer is not None:
            self._producer.pauseProducing()
        now = self._paused_at = self._now()
        limit = self.context.send_timeout
        watchdog = self._watchdog
        if watchdog is not None and watchdog.active():
            if watchdog.getTime() > now + limit:
                watchdog.reset(limit)  # the client's deadline comes first
        elif self.state == "relaying":
            self._watchdog = self.clock.callLater(limit, self._read_timed_out)

    def resumeProducing(self) -> None:
        if self._producer is not None:
            self._producer.resumeProducing()
        self._paused_at = None
        if self.state == "relaying":
            self._arm_watchdog()

    def stopProducing(self) -> None:
        if self._producer is not None:
            self._producer.stopProducing()

    def body_chunk(self, data: bytes) -> None:
        if self.state != "relaying":
            return
        # the watchdog reads it when it fires, the hung-backend detector the backend's
        now = self._last_activity = self._now()
        self.lease.backend.pace.heard(now)  # per chunk: straight to the backend
        record = self.record
        if record.first_byte is None:
            record.first_byte = now
        if self._continuation is None:  # a continuation's is captured as rewritten
            record.capture(data)
            relayed = self._relayed
            if relayed is not None:
                relayed += data
                if len(relayed) > RESUME_KEEP:
                    self._too_long()
        if self._meter is not None:
            self._meter(data)
        self._write(data)

    def body_ended(self, failure: Failure | None) -> None:
        if self.state != "relaying":
            return  # we stopped it ourselves (client gone, timeout): already ended
        self._producer = None  # finished: stopping it now would kill a reusable connection
        if failure is None:
            if self._continuation is not None:
                self._continuation.close()
            self._end("ok", finish_answer)
            return
        if self._continuation is not None and not self._continuation.fed:
            # the continuation's head came, then it failed before a byte of its body
            self._continuation_failed(describe_failure(failure))
            return
        if self._try_resume(describe_failure(failure)):
            return
        if self.request.startedWriting:
            self._say(
                ("part-way", self.lease.backend.key), LogLevel.warn,
                "backend {backend} stopped part-way through a response ({error}); the "
                "client got a truncated response",
                backend=self.lease.backend.key,
                error=describe_failure(failure),
            )
        self._give_up(Kind.BODY_FAILED, backend=self._named(self.lease.backend))

    # -- failures ---------------------------------------------------------------------------

    def _request_failed(self, failure: Failure) -> None:
        if self.state != "waiting":
            # ended (the client left, the watchdog fired: already answered), or a try the
            # exchange itself cancelled to leave it (a silent continuation)
            return
        self._upstream = None
        backend = self.lease.backend
        kind = classify(failure)
        rule = FAILURES[kind]
        if kind is Kind.CLOSED_UNANSWERED:
            # The backend had the whole request and closed or reset the connection without
            # answering; the backend is probed at once and leaves rotation only if the
            # probe fails.
            self._say(("closed-unanswered", backend.key), LogLevel.warn,
                      "backend {backend} closed the connection after receiving the whole "
                      "request, before answering; not retried", backend=backend.key)
        elif kind is Kind.BAD_RESPONSE:
            self._say(
                ("failed", backend.key), LogLevel.warn,
                "request to {backend} failed: {error}",
                backend=backend.key,
                error=describe_failure(failure),
            )
        if rule.backend.marks_down:
            self.pool.mark_down(backend, f"proxy: {failure_words(failure)}")
        if rule.backend.probes:
            # a reset may be a backend restarting, not a dead one: probe now, so a
            # healthy one is back at once
            self.context.observer.suspect(backend)
        if self._continuation is not None:
            self._continuation_failed(failure_words(failure))
            return
        if rule.retried and self._can_retry():
            self._retry()
            return
        self._give_up(kind, backend=self._named(backend))

    def _read_timed_out(self) -> None:
        self._watchdog = None
        backend = self.lease.backend
        if self.state == "ended":
            return
        if self._paused_at is not None:
            stalled = self._now() - self._paused_at
            limit = self.context.send_timeout
            if stalled < limit:
                self._watchdog = self.clock.callLater(limit - stalled, self._read_timed_out)
                return
            self._say(("client-stalled",), LogLevel.info,
                      "client of a {backend} response read nothing for {timeout:g}s; "
                      "cutting it off", backend=backend.key, timeout=limit)
            self._end(FAILURES[Kind.CLIENT_STALLED].outcome, cut_answer)
            return
        silent = self._now() - self._last_activity
        if silent < self.read_timeout:
            # data came since the watchdog was set: wait out the rest of the timeout
            self._watchdog = self.clock.callLater(self.read_timeout - silent,
                                                  self._read_timed_out)
            return
        if self.state == "relaying" and self._try_resume(
                f"silent for {self.read_timeout:g}s"):
            return
        if self._continuation is not None and self.state == "waiting":
            self._abandon_try()
            self._continuation_failed(f"no answer in {self.read_timeout:g}s")
            return
        self._say(
            ("silent", backend.key), LogLevel.warn,
            "backend {backend} silent for {timeout}s; giving up",
            backend=backend.key,
            timeout=self.read_timeout,
        )
        self._give_up(Kind.READ_TIMEOUT, backend=self._named(backend),
                      timeout=self.read_timeout)

    def backend_hung(self) -> None:
        """
        The hung-backend detector took this request's backend out: a stream it was
        relaying (and not held up by its client) is resumed elsewhere if it can be; else
        it waits out ``--read-timeout`` as before.
        """
        if self.state == "relaying" and self._paused_at is None:
            self._try_resume("judged hung", cut=False)

    def _client_lost(self, failure: Failure) -> None:
        if self.state == "ended":
            return
        self.client_gone = True
        if self.state == "waiting" and not self.lease.released:
            # the try was sent and no byte of it came: evidence of a backend's silence
            # that leaves the requests in flight with the client
            self.context.left_unanswered(self.lease.backend, self._last_activity,
                                         self._now())
        self._end(FAILURES[Kind.CLIENT_GONE].outcome)

    def abort(self, reason: str) -> None:
        """End the exchange from outside (shutdown): an error if nothing was sent yet,
        else a truncated response."""
        self._give_up(Kind.SHUTDOWN, reason=reason)

    def _shows_backend(self) -> bool:
        """Whether this client may learn which backend served it (``--x-backend``)."""
        return exposed_to(self.context.x_backend, self.request)

    def _named(self, backend: Backend) -> str:
        """
        The backend as txlb's own error messages name it: ``backend host:port`` only to a
        client that ``--x-backend`` lets see the address, else ``the backend`` -- an
        operator who hides the header does not want every 502 to say it instead.
        """
        return f"backend {backend.key}" if self._shows_backend() else "the backend"

    def _give_up(self, kind: Kind, **fields: object) -> None:
        """
        End the exchange as the failure table says for ``kind``: txlb's own error while
        nothing of the response has reached the client (the backend's head may have come
        already: it is dropped), else a truncated response.  ``fields`` fill the rule's
        message.
        """
        if self.state == "ended":
            return
        rule = FAILURES[kind]
        if self.request.startedWriting or not isinstance(rule.status, int):
            self._end(rule.outcome, cut_answer)
        elif self.state == "relaying":  # the backend's headers may be half copied
            self._fail_before_body(rule.status, rule.message.format(**fields), rule.outcome)
        else:
            self._fail(rule.status, rule.message.format(**fields), rule.outcome)

    def _cut(self, outcome: str) -> None:
        """End a stream the client has part of: cut short, as the backend left it."""
        self._end(outcome, cut_answer)

    def _fail_before_body(self, status: int, message: str, outcome: str) -> None:
        """
        The backend's head came but nothing of it reached the client yet (a fixed-length
        answer's head waits for its body): the client can still get a proper error
        instead of a cut connection.
        """
        detach(self.request)
        self.request.responseHeaders = Headers()
        self._fail(status, message, outcome)

    def _fail(self, status: int, message: str, outcome: str,
              retry_after: int | None = None) -> None:
        """Answer with an error of txlb's own, before any of the response was sent."""
        body = error_body(status, message)
        self.record.answered_by_proxy(status, body)
        self._end(outcome, None if self.client_gone else
                  lambda request: write_body(request, status, body, retry_after))

    # -- every way out ----------------------------------------------------------------------

    def _end(self, outcome: str,
             answer_client: Callable[[Request], object] | None = None) -> None:
        """
        Leave the exchange: release the slot, stop the watchdog, stop the upstream, give
        the client its ending (``answer_client``), and only then hand the record to the
        bookkeeping (summary, metrics, result log), so none of that delays the client.

        Cancelling the pending Agent request or stopping the upstream transport closes the
        backend connection, which is how vLLM learns to abort the generation.
        """
        self.state = "ended"
        self._relayed = None
        self.context.live.discard(self)
        try:
            self.lease.release()
        except Exception:  # a capacity listener failed: the rest must still happen
            log.failure("releasing a backend slot")
        self._stop_try()
        if answer_client is not None:
            answer_client(self.request)
        self.record.outcome = outcome
        self.record.ended = self.clock.seconds()
        self.context.observer.ended(self.record)

    def _stop_try(self) -> None:
        """Stop the try's watchdog, cancel its request, stop its body: the backend stops."""
        if self._watchdog is not None and self._watchdog.active():
            self._watchdog.cancel()
        self._watchdog = None
        if self._upstream is not None:
            upstream, self._upstream = self._upstream, None
            upstream.cancel()
        if self._producer is not None:
            producer, self._producer = self._producer, None
            producer.stopProducing()

    def _arm_watchdog(self) -> None:
        """
        Start (or restart) the read-timeout clock.  Chunks only note the time they came
        (:meth:`body_chunk`); the watchdog checks it when it fires and sleeps again for
        what is left -- cheaper on the per-chunk path than moving a timer on every chunk.
        """
        self._last_activity = self._now()
        if self._watchdog is None or not self._watchdog.active():
            self._watchdog = self.clock.callLater(self.read_timeout, self._read_timed_out)

    def _bug(self, failure: Failure) -> None:
        log.failure("unexpected error in the proxy", failure)
        self._give_up(Kind.PROXY_ERROR)


