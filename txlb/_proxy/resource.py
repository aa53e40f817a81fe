"""
The reverse-proxy resource: pick a backend, forward the request upstream (with
:mod:`txlb._upstream.client`, or an embedder's Agent through :mod:`txlb._upstream.agent`), relay the
response, and map every failure to the status the contract promises.

Each client request becomes one :class:`Exchange`, which owns all of that request's state
(the in-flight slot, the upstream Deferred, the read watchdog, whether the client is still
there).  Every way a request can end -- upstream body done, upstream failure, read timeout,
client gone -- funnels into :meth:`Exchange._end`, which is what makes "the in-flight count
falls exactly once" true by construction rather than by care.
"""

from __future__ import annotations

import ipaddress
import json
import math
from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet import error as neterror
from twisted.internet.address import UNIXAddress
from twisted.internet.defer import CancelledError, Deferred, fail
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure
from twisted.web.client import RequestNotSent, RequestTransmissionFailed, ResponseNeverReceived
from twisted.web.http import HTTPChannel
from twisted.web.http_headers import Headers
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from txlb._cluster.backend import Backend, Lease, Pool
from txlb._proxy.errors import error_body, write_body, write_json
from txlb._proxy.headers import (
    RawHeaders,
    downstream_response_headers,
    flatten,
    upstream_request_headers,
)
from txlb._records.summary import RequestRecord, parse_json_object
from txlb._scheduling.ratelimit import RateLimiter, client_key
from txlb._scheduling.request import RoutingRequest
from txlb._scheduling.router import Router, RoutingError
from txlb._server.quiet import RepeatSummary
from txlb._upstream.client import Upstream, UpstreamResponse
from txlb._upstream.words import describe_failure

log = Logger()

STATUS_PATH = b"/__lb_status"
MODELS_PATH = b"/v1/models"

#: Connection failures that mean "nothing is listening there": the backend is down.
_UNREACHABLE = (
    neterror.ConnectionRefusedError,
    neterror.NoRouteError,
    neterror.DNSLookupError,
    neterror.UnknownHostError,
)
#: The connection failed before the whole request left (txlb's client, or Agent's): the
#: backend never had it, so it cannot have started generating.
_NEVER_SENT = (RequestTransmissionFailed, RequestNotSent)
#: Connect attempts that ran out of time: ambiguous, so the prober decides (as nginx: 504).
_CONNECT_TIMEOUT = (neterror.TimeoutError, neterror.TCPTimedOutError)
#: Answers that mean "this backend cannot take it now": retried elsewhere when possible.
_RETRIED_STATUSES = frozenset({502, 503})
#: Methods whose requests carry a body: one missing (or not JSON) provokes a 5xx from some
#: engines, which is then the request's fault, not the backend's.
_BODY_METHODS = frozenset({b"POST", b"PUT", b"PATCH"})
#: Statuses whose responses never carry a body, so no Content-Length is invented for them.
_NO_BODY_STATUSES = frozenset({204, 304})


def forwarded_uri(request: Request) -> bytes:
    """
    The path and query to request upstream, exactly as the client wrote them.

    Built from the raw request URI rather than ``postpath`` (which twisted.web has already
    percent-decoded, losing ``%2F``), dropping the segments of the mount point when the
    proxy is mounted below the root of a larger site.
    """
    uri = request.uri
    if uri[:8].lower().startswith((b"http://", b"https://")):
        # absolute-form (RFC 9112 3.2.2), as sent to proxies: forward in origin-form
        # the authority ends at the first "/" or "?" (RFC 3986 3.2): "http://h?q" is "/?q"
        after_scheme = uri.split(b"://", 1)[1]
        ends = [i for i in (after_scheme.find(b"/"), after_scheme.find(b"?")) if i >= 0]
        uri = after_scheme[min(ends):] if ends else b""
        if not uri.startswith(b"/"):
            uri = b"/" + uri
    raw_path, question, query = uri.partition(b"?")
    mounted = len(request.prepath or ())
    if mounted:
        segments = raw_path.split(b"/")
        raw_path = b"/" + b"/".join(segments[1 + mounted :])
    return raw_path + question + query


def local_path(request: Request) -> bytes:
    """The request path relative to where the proxy is mounted, without the query."""
    return forwarded_uri(request).partition(b"?")[0]


RecordSink = Callable[[RequestRecord], None]


def read_body(request: Request) -> bytes:
    """
    The request body twisted.web has already read (into memory or a temporary file).

    Its buffer is closed once read: the proxy keeps its own copy (for retries and the log),
    and a long prompt should not sit in memory twice for the whole generation.
    """
    if request.content is None:
        return b""
    request.content.seek(0)
    body = request.content.read()
    request.content.close()
    return body


@attrs.define
class ProxyContext:
    """What every exchange of one proxy shares: collaborators, limits and callbacks."""

    pool: Pool
    upstream: Upstream
    clock: IReactorTime
    read_timeout: float
    send_timeout: float = 60.0
    retries: int = 0
    retry_window: float = 10.0
    on_end: RecordSink = lambda record: None
    on_suspect: Callable[[Backend], object] = lambda backend: None
    #: a status the backend answered, and who caused it: the client's key (``--rate-key``),
    #: or ``None`` for a 5xx the request itself provoked (its body is not JSON), which must
    #: not count against the backend
    on_answer: Callable[[Backend, int, str | None], object] = (
        lambda backend, status, client: None)
    #: who sent a request, for the outlier streak's "two clients at least"
    client_key: Callable[[Request], str] = client_key
    on_retry: Callable[[], object] = lambda: None
    live: set[Exchange] = attrs.field(factory=set)
    #: who gets ``X-Backend``/``X-Backend-Port``: ``on``, ``loopback`` or ``off``
    x_backend: str = "on"
    #: per-request warnings, one line per kind a minute (``None``: every one logged)
    repeats: RepeatSummary | None = None


@attrs.frozen
class RetryPlan:
    """How one request gets another backend: ``acquire(tried)`` and ``possible(tried)``."""

    acquire: Callable[[frozenset[str]], Deferred[Lease]]
    possible: Callable[[frozenset[str]], bool]


class Exchange:
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
                 "retry", "tried", "state", "client_gone", "_headers", "_upstream",
                 "_producer", "_watchdog", "_now", "_last_activity", "_paused_at",
                 "_write", "__weakref__")

    def __init__(self, request: Request, record: RequestRecord, lease: Lease,
                 context: ProxyContext, retry: RetryPlan | None = None) -> None:
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
        self._headers: RawHeaders = []
        self._upstream: Deferred[Any] | None = None
        self._producer: IPushProducer | None = None
        self._watchdog: IDelayedCall | None = None
        self._now = context.clock.seconds
        self._last_activity = self._now()
        self._paused_at: float | None = None
        #: how body bytes reach the client: ``request.write``, or straight to the channel
        #: when the backend's chunked framing is passed through as it came
        self._write: Callable[[bytes], object] = request.write
        record.backend = lease.backend.key

    # -- start ------------------------------------------------------------------------------

    def start(self) -> None:
        request = self.request
        client = request.getClientAddress()
        client_host = getattr(client, "host", None) or "unix"
        scheme = b"https" if request.isSecure() else b"http"
        self._headers = upstream_request_headers(
            flatten(request.requestHeaders.getAllRawHeaders()), client_host, scheme
        )
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

    def _send(self) -> None:
        """One attempt: the request, body replayed from the buffered copy, to the leased backend."""
        request = self.request
        body: bytes | None = self.record.request_body
        if not body and request.getHeader(b"content-length") is None:
            body = None  # no body, and no "Content-Length: 0" either
        backend = self.lease.backend
        self._arm_watchdog()
        try:
            upstream = self._upstream = self.context.upstream.send(
                backend.host, backend.port, request.method, forwarded_uri(request),
                self._headers, body)
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
        self.context.on_retry()
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
        """A per-request warning: summarised per kind (see txlb._server.quiet.RepeatSummary)."""
        repeats = self.context.repeats
        if repeats is None:
            log.emit(level, format, **fields)
        else:
            repeats.emit(kind, log, level, format, **fields)

    # -- response head ----------------------------------------------------------------------

    def _got_response(self, response: UpstreamResponse) -> None:
        self._upstream = None
        self.lease.backend.last_byte = self._now()
        self.context.on_answer(self.lease.backend, response.code, self._blamed(response.code))
        if response.code in _RETRIED_STATUSES and self._can_retry():
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
        body = self.record.request_body
        if (body or self.request.method in _BODY_METHODS) and not standard_json_object(body):
            return None
        return self.context.client_key(self.request)

    def _write_head(self, response: UpstreamResponse) -> bool:
        """
        Give the client the backend's status and headers; whether the body can be passed
        on in the backend's own chunked framing (``raw``).
        """
        request = self.request
        backend = self.lease.backend
        self.record.status = response.code
        request.setResponseCode(response.code, response.phrase)
        out = request.responseHeaders
        headers = response.headers
        for name, value in downstream_response_headers(headers):
            out.addRawHeader(name, value)
        # Twisted's Request sets its own Date and Server; the backend's win, if it sent them.
        content_type = None
        content_length: list[bytes] = []
        own: dict[bytes, list[bytes]] = {}
        for name, value in headers:
            if name == b"content-type" and content_type is None:
                content_type = value
            elif name == b"content-length":
                content_length.append(value)
            elif name == b"date" or name == b"server":
                own.setdefault(name, []).append(value)
        for name, values in own.items():
            out.setRawHeaders(name, values)
        self.record.content_type = content_type
        if response.code == 204:
            pass  # RFC 9110 section 8.6: a 204 carries no Content-Length, whatever was sent
        elif request.method == b"HEAD" or response.code in _NO_BODY_STATUSES:
            # no body follows: the backend's own Content-Length (if any) describes the
            # resource (a 304 may carry it)
            if content_length:
                out.setRawHeaders(b"content-length", content_length[:1])
        elif response.length is not None:
            out.setRawHeaders(b"content-length", [b"%d" % response.length])
        if self._shows_backend():
            out.setRawHeaders(b"x-backend", [backend.key.encode()])
            out.setRawHeaders(b"x-backend-port", [b"%d" % backend.port])
        else:
            # nor the backend's own (a balancer or nginx behind us names its backends too)
            out.removeHeader(b"x-backend")
            out.removeHeader(b"x-backend-port")
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
            channel = request.channel
            if response.chunked and request.chunked and isinstance(channel, HTTPChannel):
                raw = True
                self._write = channel.write
                self.record.chunked = True
        return raw

    # -- IRelayOwner: the body --------------------------------------------------------------

    def body_started(self, producer: IPushProducer) -> None:
        self._producer = producer
        if self.state == "relaying":
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
        now = self.lease.backend.last_byte = self._last_activity = self._now()
        record = self.record
        if record.first_byte is None:
            record.first_byte = now
        record.capture(data)
        self._write(data)

    def body_ended(self, failure: Failure | None) -> None:
        if self.state != "relaying":
            return  # we stopped it ourselves (client gone, timeout): already ended
        self._producer = None  # finished: stopping it now would kill a reusable connection
        if failure is None:
            self._end("ok", self._finish_client)
        elif not self.request.startedWriting:
            self._fail_before_body(502, f"{self._named(self.lease.backend)} failed "
                                        "before its body", "upstream_error")
        else:
            self._say(
                ("part-way", self.lease.backend.key), LogLevel.warn,
                "backend {backend} stopped part-way through a response ({error}); the "
                "client got a truncated response",
                backend=self.lease.backend.key,
                error=describe_failure(failure),
            )
            self._end("upstream_error", self._cut_client)

    # -- failures ---------------------------------------------------------------------------

    def _request_failed(self, failure: Failure) -> None:
        self._upstream = None
        if self.state == "ended":
            return  # the client left, or the watchdog fired: already answered
        backend = self.lease.backend
        if failure.check(*_UNREACHABLE) or failure.check(*_NEVER_SENT):
            # Provably never started: nothing listens there, or the connection died
            # while part of the request was still unsent.  Safe to send elsewhere.
            self.pool.mark_down(backend, f"proxy: {_failure_words(failure)}")
            if not failure.check(*_UNREACHABLE):
                # a reset may be a backend restarting, not a dead one: probe now, so a
                # healthy one is back at once
                self.context.on_suspect(backend)
            if self._can_retry():
                self._retry()
                return
            self._fail(502, f"{self._named(backend)} could not be reached", "upstream_error")
        elif _is_reset(failure):
            # The backend had the whole request and closed or reset the connection without
            # answering: an engine killed mid-prefill may have done the work already, and
            # for an LLM a second try is a second generation.  502, never a retry; the
            # backend is probed at once and leaves rotation only if the probe fails.
            self._say(("closed-unanswered", backend.key), LogLevel.warn,
                      "backend {backend} closed the connection after receiving the whole "
                      "request, before answering; not retried", backend=backend.key)
            self.context.on_suspect(backend)
            self._fail(502, f"{self._named(backend)} closed the connection without answering",
                       "upstream_error")
        elif failure.check(*_CONNECT_TIMEOUT):
            self._fail(504, f"timed out connecting to {self._named(backend)}", "timeout")
        else:
            self._say(
                ("failed", backend.key), LogLevel.warn,
                "request to {backend} failed: {error}",
                backend=backend.key,
                error=describe_failure(failure),
            )
            self._fail(502, f"bad response from {self._named(backend)}", "upstream_error")

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
            self._end("client_timeout", self._cut_client)
            return
        silent = self._now() - self._last_activity
        if silent < self.read_timeout:
            # data came since the watchdog was set: wait out the rest of the timeout
            self._watchdog = self.clock.callLater(self.read_timeout - silent,
                                                  self._read_timed_out)
            return
        self._say(
            ("silent", backend.key), LogLevel.warn,
            "backend {backend} silent for {timeout}s; giving up",
            backend=backend.key,
            timeout=self.read_timeout,
        )
        message = f"{self._named(backend)} sent nothing for {self.read_timeout:g}s"
        if self.state == "waiting":
            self._fail(504, message, "timeout")
        elif not self.request.startedWriting:
            self._fail_before_body(504, message, "timeout")
        else:
            self._end("timeout", self._cut_client)

    def _client_lost(self, failure: Failure) -> None:
        if self.state == "ended":
            return
        self.client_gone = True
        self._end("client_abort")

    def abort(self, reason: str) -> None:
        """End the exchange from outside (shutdown): an error if nothing was sent yet,
        else a truncated response."""
        if self.state == "waiting":
            self._fail(503, reason, "shutdown")
        elif self.state == "relaying" and not self.request.startedWriting:
            self._fail_before_body(503, reason, "shutdown")
        elif self.state == "relaying":
            self._end("shutdown", self._cut_client)

    def _shows_backend(self) -> bool:
        """Whether this client may learn which backend served it (``--x-backend``)."""
        exposure = self.context.x_backend
        return exposure == "on" or (exposure == "loopback" and is_local_client(self.request))

    def _named(self, backend: Backend) -> str:
        """
        The backend as txlb's own error messages name it: ``backend host:port`` only to a
        client that ``--x-backend`` lets see the address, else ``the backend`` -- an
        operator who hides the header does not want every 502 to say it instead.
        """
        return f"backend {backend.key}" if self._shows_backend() else "the backend"

    def _fail_before_body(self, status: int, message: str, outcome: str) -> None:
        """
        The backend's head came but nothing of it reached the client yet (a fixed-length
        answer's head waits for its body): the client can still get a proper error
        instead of a cut connection.
        """
        self._detach()
        self.request.responseHeaders = Headers()
        self._fail(status, message, outcome)

    def _fail(self, status: int, message: str, outcome: str,
              retry_after: int | None = None) -> None:
        """Answer with an error of txlb's own, before any of the response was sent."""
        body = error_body(status, message)
        self.record.answered_by_proxy(status, body)
        self._end(outcome, None if self.client_gone else
                  lambda: write_body(self.request, status, body, retry_after))

    # -- every way out ----------------------------------------------------------------------

    def _end(self, outcome: str, answer_client: Callable[[], object] | None = None) -> None:
        """
        Leave the exchange: release the slot, stop the watchdog, stop the upstream, give
        the client its ending (``answer_client``), and only then hand the record to the
        bookkeeping (summary, metrics, result log), so none of that delays the client.

        Cancelling the pending Agent request or stopping the upstream transport closes the
        backend connection, which is how vLLM learns to abort the generation.
        """
        self.state = "ended"
        self.context.live.discard(self)
        try:
            self.lease.release()
        except Exception:  # a capacity listener failed: the rest must still happen
            log.failure("releasing a backend slot")
        if self._watchdog is not None and self._watchdog.active():
            self._watchdog.cancel()
        self._watchdog = None
        if self._upstream is not None:
            upstream, self._upstream = self._upstream, None
            upstream.cancel()
        if self._producer is not None:
            producer, self._producer = self._producer, None
            producer.stopProducing()
        if answer_client is not None:
            answer_client()
        self.record.outcome = outcome
        self.record.ended = self.clock.seconds()
        self.context.on_end(self.record)

    def _arm_watchdog(self) -> None:
        """
        Start (or restart) the read-timeout clock.  Chunks only note the time they came
        (:meth:`body_chunk`); the watchdog checks it when it fires and sleeps again for
        what is left -- cheaper on the per-chunk path than moving a timer on every chunk.
        """
        self._last_activity = self._now()
        if self._watchdog is None or not self._watchdog.active():
            self._watchdog = self.clock.callLater(self.read_timeout, self._read_timed_out)

    def _finish_client(self) -> None:
        self._detach()
        self.request.finish()

    def _cut_client(self) -> None:
        self._detach()
        self._truncate_client()

    def _detach(self) -> None:
        """Unregister the exchange as the client's producer, if the client is still there."""
        if self.request.channel is not None:
            self.request.unregisterProducer()

    def _truncate_client(self) -> None:
        """
        Close the client connection without the final chunk, so a failure after the head
        was sent shows as a truncated response, never as a clean (fake) success.
        """
        channel = getattr(self.request, "channel", None)
        if channel is not None and channel.transport is not None:
            channel.transport.abortConnection()

    def _bug(self, failure: Failure) -> None:
        log.failure("unexpected error in the proxy", failure)
        if self.state == "ended":
            return
        if self.request.startedWriting:
            self._end("proxy_error", self._cut_client)
        elif self.state == "relaying":  # the backend's headers may be half copied
            self._fail_before_body(502, "internal proxy error", "proxy_error")
        else:
            self._fail(502, "internal proxy error", "proxy_error")


def is_local_client(request: Request) -> bool:
    """
    Whether the client is on this host: a loopback address (127.0.0.0/8, ``::1``, or
    ``::ffff:127.x`` on a dual-stack socket) or a UNIX socket.  The peer address only:
    ``X-Forwarded-For`` is the client's to write.
    """
    address = request.getClientAddress()
    host = getattr(address, "host", None)
    if host is None:
        return isinstance(address, UNIXAddress)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _failure_words(failure: Failure) -> str:
    """What a connection failure was, in words (a wrapper's own message is a repr list)."""
    reasons: list[Any] = getattr(failure.value, "reasons", [])
    if reasons and isinstance(reasons[0], Failure):
        return f"connection lost while sending the request ({describe_failure(reasons[0])})"
    return describe_failure(failure)


def _is_reset(failure: Failure) -> bool:
    """A connection the backend closed or reset before sending a response head."""
    if not failure.check(ResponseNeverReceived):
        return False
    reasons: list[Any] = getattr(failure.value, "reasons", [])
    return any(reason.check(neterror.ConnectionLost, neterror.ConnectionDone) for reason in reasons)


class ProxyResource(Resource):
    """
    The main port: ``GET /__lb_status`` answers locally, everything else is forwarded.

    A leaf resource, so it also works mounted below the root of someone else's ``Site``.
    """

    isLeaf = True

    def __init__(self, router: Router, context: ProxyContext, retry_after: float = 1,
                 affinity: str | None = None, rate_limiter: RateLimiter | None = None,
                 max_body: int = 0, lb_status: str = "on") -> None:
        super().__init__()
        #: who ``GET /__lb_status`` answers: ``on``, ``loopback`` or ``off`` (the others'
        #: requests for it are proxied like any other path)
        self.lb_status = lb_status
        self.rate_limiter = rate_limiter
        self.max_body = max_body
        self.router = router
        self.context = context
        self.clock = context.clock
        self.retry_after = max(1, math.ceil(retry_after))
        self.affinity = affinity
        self.shutting_down = False

    def _answers_status(self, request: Request) -> bool:
        exposure = self.lb_status
        return exposure == "on" or (exposure == "loopback" and is_local_client(request))

    @property
    def live(self) -> set[Exchange]:
        return self.context.live

    @property
    def on_end(self) -> RecordSink:
        return self.context.on_end

    def render(self, request: Request) -> object:
        request.defaultContentType = None
        path = local_path(request)
        if request.method == b"GET" and path == STATUS_PATH and self._answers_status(request):
            status = self.router.pool.status()
            status["queue"] = self.router.queue_status()
            write_json(request, 200, status)
            return NOT_DONE_YET
        if request.method == b"GET" and path == MODELS_PATH:
            write_json(request, 200, self.router.model_list())
            return NOT_DONE_YET
        record = RequestRecord(
            started=self.clock.seconds(),
            method=request.method,
            path=path,
            orid_header=request.getHeader(b"x-orid"),
            request_body=read_body(request),
        )
        if not record.path.startswith(b"/"):
            self._refuse(request, record, 400, "request target must be a path")
            return NOT_DONE_YET
        if self.shutting_down:
            # a new request on a kept-alive connection while draining: refuse it and close
            # (the channel is taken first: a finished request no longer has one)
            channel = request.channel
            self._refuse(request, record, 503, "the balancer is shutting down",
                         self.retry_after)
            if channel is not None:
                channel.loseConnection()
            return NOT_DONE_YET
        if self.max_body and len(record.request_body) > self.max_body:
            # only when mounted in a Site of the embedder's: ProxySite refuses it earlier
            self._refuse(request, record, 413, f"the request body is over the limit of "
                                               f"{self.max_body} bytes")
            return NOT_DONE_YET
        if self.rate_limiter is not None:
            wait = self.rate_limiter.check(request)
            if wait is not None:
                self._refuse(request, record, 429, "rate limit exceeded for this client; "
                                                   f"retry in {wait}s", wait)
                return NOT_DONE_YET
        routing = self._routing_request(request, record)
        waiting = self.router.acquire(routing)
        if not waiting.called:
            # queued for a slot: a client that leaves also leaves the queue (once started,
            # the exchange watches the client itself)
            def client_left(failure: Failure) -> None:
                waiting.cancel()

            request.notifyFinish().addErrback(client_left)
        waiting.addCallbacks(
            lambda lease: self._forward(request, record, lease, routing),
            lambda failure: self._not_routed(request, record, failure),
        ).addErrback(lambda failure: log.failure("routing a request failed", failure))
        return NOT_DONE_YET

    def _routing_request(self, request: Request, record: RequestRecord) -> RoutingRequest:
        """
        What the request is routed by: the model it names (after alias resolution,
        rewriting the body for the backend), its session key for affinity, its client key,
        and the body with the one parse of it made here.  A body that is not a JSON object
        is forwarded untouched and routes like a request without a model.
        """
        body = parse_json_object(record.request_body)
        model = None
        if body is not None and isinstance(body.get("model"), str):
            model = body["model"]
            target = self.router.resolve(model)
            if target != model:
                body["model"] = model = target
                record.request_body = json.dumps(body).encode("utf-8")
        session = None
        if self.affinity == "user":
            if body is not None and isinstance(body.get("user"), str | int):
                session = str(body["user"])
        elif self.affinity is not None:
            value = request.getHeader(self.affinity.split(":", 1)[1].encode("ascii"))
            session = value.decode("utf-8", "replace") if value else None
        return RoutingRequest(model=model, session=session,
                              client=self.context.client_key(request),
                              body=record.request_body, json=body)

    def _forward(self, request: Request, record: RequestRecord, lease: Lease,
                 routing: RoutingRequest) -> None:
        record.queue_wait = lease.waited
        router = self.router
        retry = RetryPlan(
            acquire=lambda tried: router.acquire(routing, exclude=tried),
            possible=lambda tried: router.can_serve_now(routing.model, tried),
        )
        exchange = Exchange(request, record, lease, self.context, retry)
        self.live.add(exchange)
        exchange.start()

    def _not_routed(self, request: Request, record: RequestRecord, failure: Failure) -> None:
        if failure.check(CancelledError):
            # the client left while queued: log it like any client abort
            record.outcome = "client_abort"
            record.queue_wait = self.clock.seconds() - record.started
            record.ended = self.clock.seconds()
            self.on_end(record)
            return
        error = failure.value
        if not isinstance(error, RoutingError):
            failure.raiseException()
        self._refuse(request, record, error.status, error.message, error.retry_after)

    def abort_all(self, reason: str) -> None:
        """End every request still in flight (the shutdown timeout ran out)."""
        for exchange in list(self.live):
            exchange.abort(reason)

    def log_refused(self, request: Request, status: int, body: bytes) -> None:
        """A request the Site refused before it got here (413 while the body arrived)."""
        path = b"-"
        if isinstance(request.uri, bytes) and request.uri.startswith((b"/", b"http")):
            path = local_path(request)
        record = RequestRecord(
            started=self.clock.seconds(),
            method=request.method if isinstance(request.method, bytes) else b"-",
            path=path,
            orid_header=request.getHeader(b"x-orid"),
            request_body=b"",
            outcome="proxy_error",
        )
        record.answered_by_proxy(status, body)
        record.ended = record.started
        self.on_end(record)

    def _refuse(self, request: Request, record: RequestRecord, status: int, message: str,
                retry_after: int | None = None) -> None:
        """
        Answer a request txlb will not forward, and log it like any other -- the answer
        first, so that nothing in the bookkeeping can keep the client waiting.
        """
        body = error_body(status, message)
        record.answered_by_proxy(status, body)
        record.outcome = "proxy_error"
        record.ended = self.clock.seconds()
        write_body(request, status, body, retry_after)
        self.on_end(record)


def standard_json_object(body: bytes) -> bool:
    """
    Whether ``body`` is a JSON object as RFC 8259 and strict parsers read it.  Python's
    parser also takes ``NaN``, ``Infinity``, numbers past a double and lone surrogates,
    which llama.cpp's rejects with a 500: a client sending them must not count as the
    backend failing.  Only a 5xx asks, so the re-encoding (for surrogates) is rare.
    """
    if not body or body.lstrip()[:1] != b"{":
        return False

    def refused(text: str) -> float:
        raise ValueError(text)

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(text)
        return value

    try:
        value = json.loads(body, parse_constant=refused, parse_float=finite,
                           parse_int=finite)
        if b"\\u" in body:
            json.dumps(value, ensure_ascii=False).encode("utf-8")  # lone surrogates raise
    except (ValueError, RecursionError):
        return False
    return isinstance(value, dict)
