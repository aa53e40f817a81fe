"""
The reverse-proxy resource: pick a backend, forward the request with Agent, relay the
response, and map every failure to the status the contract promises.

Each client request becomes one :class:`Exchange`, which owns all of that request's state
(the in-flight slot, the upstream Deferred, the read watchdog, whether the client is still
there).  Every way a request can end -- upstream body done, upstream failure, read timeout,
client gone -- funnels into :meth:`Exchange._end`, which is what makes "the in-flight count
falls exactly once" true by construction rather than by care.
"""

from __future__ import annotations

import math
from typing import Any

from twisted.internet import error as neterror
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IConsumer, IDelayedCall, IPushProducer, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseNeverReceived
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IAgent, IBodyProducer, IResponse
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request
from zope.interface import implementer

from ._backend import Lease, Pool
from ._errors import write_error, write_json
from ._headers import downstream_response_headers, flatten, upstream_request_headers
from ._relay import BodyRelay
from ._routing import Router

log = Logger()

STATUS_PATH = b"/__lb_status"

#: Connection failures that mean "nothing is listening there": the backend is down.
_UNREACHABLE = (
    neterror.ConnectionRefusedError,
    neterror.NoRouteError,
    neterror.DNSLookupError,
    neterror.UnknownHostError,
)
#: Connect attempts that ran out of time: ambiguous, so the prober decides (as nginx: 504).
_CONNECT_TIMEOUT = (neterror.TimeoutError, neterror.TCPTimedOutError)
#: Statuses whose responses never carry a body, so no Content-Length is invented for them.
_NO_BODY_STATUSES = frozenset({204, 304})


@implementer(IBodyProducer)
class BytesProducer:
    """
    The buffered request body, sent in one write.

    twisted.web has already read the whole body before ``render`` runs, so there is nothing
    to stream; writing it at once also needs no cooperator (unlike ``FileBodyProducer``).
    """

    def __init__(self, body: bytes) -> None:
        self._body = body
        self.length = len(body)

    def startProducing(self, consumer: IConsumer) -> Deferred[None]:
        consumer.write(self._body)
        return succeed(None)

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


def forwarded_uri(request: Request) -> bytes:
    """
    The path and query to request upstream, exactly as the client wrote them.

    Built from the raw request URI rather than ``postpath`` (which twisted.web has already
    percent-decoded, losing ``%2F``), dropping the segments of the mount point when the
    proxy is mounted below the root of a larger site.
    """
    raw_path, question, query = request.uri.partition(b"?")
    mounted = len(request.prepath or ())
    if mounted:
        segments = raw_path.split(b"/")
        raw_path = b"/" + b"/".join(segments[1 + mounted :])
    return raw_path + question + query


def local_path(request: Request) -> bytes:
    """The request path relative to where the proxy is mounted, without the query."""
    return forwarded_uri(request).partition(b"?")[0]


class Exchange:
    """
    One client request forwarded to one backend.

    States: ``waiting`` (request sent, no response head yet), ``relaying`` (head written
    to the client, body flowing) and ``ended``.  The client can go away in either of the
    first two; the read watchdog can fire in either; the upstream can fail in either.
    """

    def __init__(
        self,
        request: Request,
        lease: Lease,
        pool: Pool,
        agent: IAgent,
        clock: IReactorTime,
        read_timeout: float,
    ) -> None:
        self.request = request
        self.lease = lease
        self.pool = pool
        self.agent = agent
        self.clock = clock
        self.read_timeout = read_timeout
        self.state = "waiting"
        self.client_gone = False
        self.timed_out = False
        self._upstream: Deferred[IResponse] | None = None
        self._producer: IPushProducer | None = None
        self._watchdog: IDelayedCall | None = None

    # -- start ------------------------------------------------------------------------------

    def start(self) -> None:
        request = self.request
        backend = self.lease.backend
        client = request.getClientAddress()
        client_host = getattr(client, "host", None) or "unix"
        scheme = b"https" if request.isSecure() else b"http"
        headers = upstream_request_headers(
            flatten(request.requestHeaders.getAllRawHeaders()), client_host, scheme
        )
        upstream_headers = Headers()
        for name, value in headers:
            upstream_headers.addRawHeader(name, value)

        body = b""
        if request.content is not None:
            request.content.seek(0)
            body = request.content.read()
        producer = None
        if body or request.getHeader(b"content-length") is not None:
            producer = BytesProducer(body)

        request.notifyFinish().addErrback(self._client_lost)
        self._arm_watchdog()
        self._upstream = self.agent.request(
            request.method,
            backend.base_url + forwarded_uri(request),
            upstream_headers,
            producer,
        )
        self._upstream.addCallbacks(self._got_response, self._request_failed)
        self._upstream.addErrback(self._bug)

    # -- response head ----------------------------------------------------------------------

    def _got_response(self, response: IResponse) -> None:
        self._upstream = None
        self.state = "relaying"
        self._arm_watchdog()
        request = self.request
        backend = self.lease.backend
        request.setResponseCode(response.code, response.phrase)
        out = request.responseHeaders
        for name, value in downstream_response_headers(
            flatten(response.headers.getAllRawHeaders())
        ):
            out.addRawHeader(name, value)
        # Twisted's Request sets its own Date and Server; the backend's win, if it sent them.
        for name in (b"date", b"server"):
            values = response.headers.getRawHeaders(name)
            if values:
                out.setRawHeaders(name, values)
        if (
            response.length is not UNKNOWN_LENGTH
            and response.code not in _NO_BODY_STATUSES
            and request.method != b"HEAD"
        ):
            out.setRawHeaders(b"content-length", [str(response.length).encode()])
        out.setRawHeaders(b"x-backend", [backend.key.encode()])
        out.setRawHeaders(b"x-backend-port", [str(backend.port).encode()])
        response.deliverBody(BodyRelay(self))

    # -- IRelayOwner: the body --------------------------------------------------------------

    def body_started(self, producer: IPushProducer) -> None:
        self._producer = producer
        if self.state == "relaying":
            self.request.registerProducer(producer, True)

    def body_chunk(self, data: bytes) -> None:
        if self.state != "relaying":
            return
        if self._watchdog is not None:
            self._watchdog.reset(self.read_timeout)
        self.request.write(data)

    def body_ended(self, failure: Failure | None) -> None:
        if self.state != "relaying":
            return  # we stopped it ourselves (client gone, timeout): already ended
        self._producer = None  # finished: stopping it now would kill a reusable connection
        self._end()
        self.request.unregisterProducer()
        if failure is None:
            self.request.finish()
        else:
            log.warn(
                "upstream {backend} failed mid-response: {error}",
                backend=self.lease.backend.key,
                error=failure.getErrorMessage(),
            )
            self._truncate_client()

    # -- failures ---------------------------------------------------------------------------

    def _request_failed(self, failure: Failure) -> None:
        self._upstream = None
        if self.state == "ended":
            return  # the client left, or the watchdog fired: already answered
        backend = self.lease.backend
        self._end()
        if failure.check(*_UNREACHABLE) or _is_reset(failure):
            self.pool.mark_down(backend, f"proxy: {failure.getErrorMessage()}")
            self._respond_error(502, f"backend {backend.key} could not be reached")
        elif failure.check(*_CONNECT_TIMEOUT):
            self._respond_error(504, f"timed out connecting to backend {backend.key}")
        else:
            log.warn(
                "request to {backend} failed: {error}",
                backend=backend.key,
                error=failure.getErrorMessage(),
            )
            self._respond_error(502, f"bad response from backend {backend.key}")

    def _read_timed_out(self) -> None:
        self._watchdog = None
        backend = self.lease.backend
        state = self.state
        if state == "ended":
            return
        self.timed_out = True
        self._end()
        log.warn(
            "backend {backend} silent for {timeout}s; giving up",
            backend=backend.key,
            timeout=self.read_timeout,
        )
        if state == "waiting":
            self._respond_error(
                504, f"backend {backend.key} sent nothing for {self.read_timeout:g}s"
            )
        else:
            self.request.unregisterProducer()
            self._truncate_client()

    def _client_lost(self, failure: Failure) -> None:
        if self.state == "ended":
            return
        self.client_gone = True
        self._end()

    # -- every way out ----------------------------------------------------------------------

    def _end(self) -> None:
        """
        Leave the exchange: release the slot, stop the watchdog, stop the upstream.

        Cancelling the pending Agent request or stopping the upstream transport closes the
        backend connection, which is how vLLM learns to abort the generation.
        """
        self.state = "ended"
        self.lease.release()
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
        if self._watchdog is not None and self._watchdog.active():
            self._watchdog.reset(self.read_timeout)
        else:
            self._watchdog = self.clock.callLater(self.read_timeout, self._read_timed_out)

    def _respond_error(self, status: int, message: str) -> None:
        if not self.client_gone:
            write_error(self.request, status, message)

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
        if self.state != "ended":
            self._end()
            self._respond_error(502, "internal proxy error")


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

    def __init__(
        self,
        router: Router,
        agent: IAgent,
        clock: IReactorTime,
        read_timeout: float,
        retry_after: float,
    ) -> None:
        super().__init__()
        self.router = router
        self.agent = agent
        self.clock = clock
        self.read_timeout = read_timeout
        self.retry_after = max(1, math.ceil(retry_after))

    def render(self, request: Request) -> object:
        request.defaultContentType = None
        if request.method == b"GET" and local_path(request) == STATUS_PATH:
            write_json(request, 200, self.router.pool.status())
            return NOT_DONE_YET
        lease = self.router.pick()
        if lease is None:
            write_error(request, 503, "no backend is available", retry_after=self.retry_after)
            return NOT_DONE_YET
        Exchange(
            request, lease, self.router.pool, self.agent, self.clock, self.read_timeout
        ).start()
        return NOT_DONE_YET
