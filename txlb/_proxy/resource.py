"""
The reverse-proxy resource: admit each request (its API key first, with ``--auth keys``;
then shutdown, body limit, rate limit, token budgets), find its model and session, ask the
router for a backend, and hand it to an :class:`~txlb._proxy.exchange.Exchange`, which
forwards it and relays the answer.
"""

from __future__ import annotations

import math

from twisted.internet.defer import CancelledError
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from txlb._cluster.slots import Lease
from txlb._config.config import Config
from txlb._config.keys import TenantSpec
from txlb._http.errors import error_body, write_body
from txlb._proxy.context import LiveExchange, ProxyContext, RetryPlan
from txlb._proxy.exchange import Exchange
from txlb._proxy.incoming import local_path, read_body
from txlb._proxy.local import LocalAnswers
from txlb._records.needs import Needs
from txlb._records.observer import IRequestObserver
from txlb._records.record import RequestRecord
from txlb._scheduling.budgets import TokenBudgets
from txlb._scheduling.ratelimit import RateLimiter
from txlb._scheduling.request import RoutingRequest
from txlb._scheduling.router import Router, RoutingError, retry_after_of
from txlb._scheduling.tenants import Refusal, Tenants
from txlb._scheduling.work import WorkBudget, read_json

log = Logger()


class _Refused(Exception):
    """A request admission will not route: its status, message and OpenAI error code."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def needs_of(observer: IRequestObserver) -> Needs:
    """What ``observer``'s readers need of an answer: all of it, if it does not say."""
    return getattr(observer, "needs", Needs.TEXTS)


class ProxyResource(Resource):
    """
    The main port: txlb's own answers (:mod:`txlb._proxy.local`) first; every other
    request is admitted (or refused), routed and forwarded by an exchange.

    A leaf resource, so it also works mounted below the root of someone else's ``Site``.
    """

    isLeaf = True

    def __init__(self, router: Router, context: ProxyContext, retry_after: float = 1,
                 affinity: str | None = None, rate_limiter: RateLimiter | None = None,
                 max_body: int = 0, lb_status: str = "on",
                 budgets: TokenBudgets | None = None, tenants: Tenants | None = None) -> None:
        super().__init__()
        #: ``--auth keys``: who a request is, by its API key (off: ``None`` or disabled)
        self.tenants = tenants
        #: what txlb answers itself (``/__lb_status``, ``/v1/models``) before admission
        self.local = LocalAnswers(router, lb_status)
        self.rate_limiter = rate_limiter
        #: the token budgets (``[[budgets]]``), checked when it has any
        self.budgets = budgets
        self.max_body = max_body
        self.router = router
        self.context = context
        self.clock = context.clock
        self.retry_after = max(1, math.ceil(retry_after))
        self.affinity = affinity
        self.shutting_down = False

    def reconfigure(self, config: Config) -> None:
        """
        ``config``'s ``--max-body``, ``--affinity``, ``--lb-status`` and ``Retry-After``,
        from the next request on.  The rate limiter is a reload's to plan (its buckets may
        be shared): :meth:`limit_rate`.
        """
        self.max_body = config.max_body
        self.retry_after = retry_after_of(config)
        self.affinity = config.affinity
        self.local.reconfigure(config)

    def limit_rate(self, limiter: RateLimiter | None) -> None:
        """Admit by ``limiter`` from the next request on (``None``: no rate limit)."""
        self.rate_limiter = limiter

    def shut_down(self) -> None:
        """Refuse every new request from now on (each kept-alive connection is closed)."""
        self.shutting_down = True

    @property
    def live(self) -> set[LiveExchange]:
        return self.context.live

    def render(self, request: Request) -> object:
        request.defaultContentType = None
        path = local_path(request)
        started = self.clock.seconds()
        tenant: TenantSpec | None = None
        tenants = self.tenants
        if tenants is not None and tenants.enabled and not self.local.open(request, path):
            found = tenants.identify(request)
            if isinstance(found, Refusal):
                self._unauthorized(request, self._record(request, path, started), found)
                return NOT_DONE_YET
            tenant = found
        answered = self.local.answer(request, path, tenant)
        if answered is not None:
            self._answered_locally(request, path, started, answered)
            return NOT_DONE_YET
        record = self._record(request, path, started)
        record.tenant = tenant.name if tenant is not None else None
        if not record.path.startswith(b"/"):
            self._refuse(request, record, 400, "request target must be a path")
            return NOT_DONE_YET
        if len(request.requestHeaders.getRawHeaders(b"authorization", ())) > 1:
            # RFC 9110 11.6.2 allows one: txlb would key budgets, rate limits and classes
            # by one value and the engine authenticate by another
            self._refuse(request, record, 400, "the request has more than one "
                                               "Authorization header")
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
        wait = self._rate_wait(request, tenant)
        if wait is not None:
            self._refuse(request, record, 429, "rate limit exceeded for this client; "
                                               f"retry in {wait}s", wait)
            return NOT_DONE_YET
        try:
            routing = self._routing_request(request, record, tenant)
        except _Refused as refused:
            self._refuse(request, record, refused.status, refused.message, code=refused.code)
            return NOT_DONE_YET
        budgets = self.budgets
        if budgets is not None and budgets.specs:
            admission = budgets.admit(request, routing, record.path, routing.priority)
            if admission.refused:
                for name, value in admission.headers:
                    request.responseHeaders.setRawHeaders(name, [value])
                self._refuse(request, record, 429, admission.message, admission.retry_after)
                return NOT_DONE_YET
            record.added_headers = admission.headers
            record.count_events = admission.reserved
        record.client = routing.client
        record.routing = routing
        self.router.fairness.price(routing, record.path, request.method)
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

    def _record(self, request: Request, path: bytes, started: float) -> RequestRecord:
        return RequestRecord(
            started=started,
            method=request.method,
            path=path,
            orid_header=request.getHeader(b"x-orid"),
            request_body=read_body(request),
            needs=needs_of(self.context.observer),
        )

    def _rate_wait(self, request: Request, tenant: TenantSpec | None) -> int | None:
        """
        ``Retry-After`` of a request over its rate, else ``None``: a tenant's own
        ``rate_limit`` when it has one, else ``--rate-limit`` per tenant (with keys) or per
        ``--rate-key`` client.
        """
        if tenant is not None and self.tenants is not None and self.tenants.has_own_rate(tenant):
            return self.tenants.rate_wait(tenant)
        if self.rate_limiter is None:
            return None
        return self.rate_limiter.check(
            request, None if tenant is None else "tenant:" + tenant.name)

    def _routing_request(self, request: Request, record: RequestRecord,
                         tenant: TenantSpec | None = None) -> RoutingRequest:
        """
        What the request is routed by: the model it names (after alias resolution,
        rewriting the body for the backend), its session key for affinity, its client key,
        and the body with the one parse of it made here.  A body that is not a JSON object
        is forwarded untouched and routes like a request without a model.  The body is read
        within the request's :class:`~txlb._scheduling.work.WorkBudget`: a large one only as
        far as routing and the result log need (:func:`~txlb._scheduling.work.read_json`).
        """
        budget = WorkBudget()
        reading = read_json(record.request_body, budget)
        body = reading.json
        model = named = None
        if body is not None and isinstance(body.get("model"), str):
            model = named = body["model"]
            target = self.router.resolve(model)
            if target != model:
                record.request_body = reading.with_model(target, record.request_body)
                body["model"] = model = target
        # a class's models match the name the client sent or, for an alias, its target
        models = [m for m in (named, model) if m is not None]
        if tenant is not None and tenant.models and not any(m in tenant.models
                                                            for m in models):
            shown = f"`{named}`" if named is not None else "(none named)"
            raise _Refused(404, f"The model {shown} does not exist or you do not have "
                                f"access to it. Your models: {', '.join(tenant.models)}",
                           "model_not_found")
        priority = self.router.classes.resolve(
            request, record.path, models, None if tenant is None else tenant.priority,
            ranked=tenant is not None)
        session = None
        if self.affinity == "user":
            if body is not None and isinstance(body.get("user"), str | int):
                session = str(body["user"])
        elif self.affinity is not None:
            value = request.getHeader(self.affinity.split(":", 1)[1].encode("ascii"))
            session = value.decode("utf-8", "replace") if value else None
        client = ("tenant:" + tenant.name if tenant is not None
                  else self.context.client_key(request))
        return RoutingRequest(model=model, session=session, client=client,
                              tenant=None if tenant is None else tenant.name,
                              weight=1.0 if tenant is None else tenant.weight,
                              priority=priority, body=record.request_body, json=body,
                              budget=budget)

    def _forward(self, request: Request, record: RequestRecord, lease: Lease,
                 routing: RoutingRequest) -> None:
        record.queue_wait = lease.waited
        router = self.router
        router.fairness.granted(routing)
        retry = RetryPlan(
            acquire=lambda tried: router.acquire(routing, exclude=tried),
            possible=lambda tried: router.can_serve_now(routing.model, tried),
        )
        meter = router.fairness.meter(routing)
        exchange = Exchange(request, record, lease, self.context, retry,
                            None if meter is None else meter.feed)
        self.live.add(exchange)
        exchange.start()

    def _not_routed(self, request: Request, record: RequestRecord, failure: Failure) -> None:
        if failure.check(CancelledError):
            # the client left while queued: log it like any client abort
            record.outcome = "client_abort"
            record.queue_wait = self.clock.seconds() - record.started
            record.ended = self.clock.seconds()
            self.context.observer.ended(record)
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
            needs=needs_of(self.context.observer),
        )
        record.answered_by_proxy(status, body)
        record.ended = record.started
        self.context.observer.ended(record)

    def _answered_locally(self, request: Request, path: bytes, started: float,
                          body: bytes) -> None:
        """
        The result-log line of an answer txlb made itself (:mod:`txlb._proxy.local`):
        every request gets one, ``/v1/models`` and ``OPTIONS *`` too.  A refusal among
        them (405) ends as the other refusals do, ``proxy_error``.
        """
        record = RequestRecord(
            started=started,
            method=request.method,
            path=path,
            orid_header=request.getHeader(b"x-orid"),
            request_body=b"",
            needs=needs_of(self.context.observer),
        )
        record.answered_by_proxy(request.code, body)
        if request.code >= 400:
            record.outcome = "proxy_error"
        record.ended = self.clock.seconds()
        self.context.observer.ended(record)

    def _unauthorized(self, request: Request, record: RequestRecord, refusal: Refusal) -> None:
        """A request without a valid key: 401 in OpenAI's shape, ``WWW-Authenticate`` set."""
        request.responseHeaders.setRawHeaders(b"www-authenticate", [b'Bearer realm="txlb"'])
        self._refuse(request, record, 401, refusal.message, code="invalid_api_key")

    def _refuse(self, request: Request, record: RequestRecord, status: int, message: str,
                retry_after: int | None = None, code: str | None = None) -> None:
        """
        Answer a request txlb will not forward, and log it like any other -- the answer
        first, so that nothing in the bookkeeping can keep the client waiting.
        """
        body = error_body(status, message, code)
        record.answered_by_proxy(status, body)
        record.outcome = "proxy_error"
        record.ended = self.clock.seconds()
        write_body(request, status, body, retry_after)
        self.context.observer.ended(record)
