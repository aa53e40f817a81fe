"""
:class:`LoadBalancer`: the public object that ties the pieces together.

The twistd plugin is one user of it; an existing Twisted application is another -- it can
mount :meth:`LoadBalancer.resource` under a path of its own ``Site`` and attach
:meth:`LoadBalancer.service` to its service hierarchy.  Reactor and agents are injectable so
tests run the whole balancer in memory.
"""

from __future__ import annotations

import ipaddress
import random
from collections.abc import Callable, Iterable
from typing import Any

from twisted.application.service import IService, MultiService, Service
from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.endpoints import HostnameEndpoint, TCP4ClientEndpoint, TCP6ClientEndpoint
from twisted.internet.interfaces import IReactorTime, IStreamClientEndpoint
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import URI, Agent
from twisted.web.error import SchemeNotSupported
from twisted.web.iweb import IAgent, IAgentEndpointFactory
from twisted.web.resource import IResource
from twisted.web.server import Site
from zope.interface import implementer

from txlb._admin.history import History, HistoryService
from txlb._cluster.backend import Backend
from txlb._cluster.health import HealthChecker
from txlb._cluster.hung import HangDetector
from txlb._cluster.local_store import LocalStore
from txlb._cluster.pool import Pool
from txlb._cluster.store import IBackendStore, IInFlightCounts
from txlb._cluster.store_capabilities import (
    IFleetPrefixIndex,
    IFleetSlotGate,
    IFleetWake,
    IPrefixSharing,
    ISlotGates,
    IStoreReport,
    IStoreService,
    ITenantSharing,
)
from txlb._config.config import Config, build_config
from txlb._config.table import OPTIONS
from txlb._discovery.membership import DnsMembership
from txlb._discovery.resolver import system_resolver
from txlb._log.quiet import QuietConnectionPool, RepeatSummary
from txlb._proxy.context import LiveExchange, ProxyContext
from txlb._proxy.resource import ProxyResource
from txlb._records.bookkeeper import (
    Bookkeeper,
    SummaryConsumer,
    SummaryFeed,
    budget_reconciles,
    fair_shares_settle,
    metrics_counts,
    policy_learns,
    pool_results,
)
from txlb._records.metrics import Metrics
from txlb._records.needs import Needs
from txlb._records.observer import IRequestObserver
from txlb._records.privacy import Privacy
from txlb._records.resultlog import ResultLog, open_result_log
from txlb._records.summary import Summary
from txlb._reload import ConfigSource, Reconfigurable, Reloader
from txlb._scheduling.budgets import TokenBudgets
from txlb._scheduling.classes import PriorityClasses
from txlb._scheduling.fairness import FairShares
from txlb._scheduling.policies import IPolicy
from txlb._scheduling.policies.registry import make_policy
from txlb._scheduling.ratelimit import rate_limiter_for
from txlb._scheduling.router import Router
from txlb._scheduling.tenants import Tenants
from txlb._server.lean import LeanSite
from txlb._server.site import ProxySite
from txlb._shared.fair import SharedTenants
from txlb._shared.store import RedisStore
from txlb._upstream.agent import AgentUpstream
from txlb._upstream.client import UpstreamClient
from txlb._upstream.interfaces import Upstream
from txlb._version import __version__

log = Logger()


class SequentialService(MultiService):
    """
    A MultiService whose children stop one after the other, the last added first, each
    waiting for the previous one to finish stopping.

    Twisted's MultiService stops all its children at once; a balancer that drains needs an
    order: stop accepting, let in-flight requests finish (while health checks and the admin
    port keep working), and only then stop the rest.
    """

    def stopService(self) -> Deferred[Any]:
        Service.stopService(self)
        done: Deferred[Any] = succeed(None)
        for child in reversed(list(self)):
            done.addBoth(_then_stop, child)
        return done


def _then_stop(previous: object, service: IService) -> Deferred[Any]:
    """Stop ``service`` whatever became of the one before (a failure is logged, not fatal)."""
    if isinstance(previous, Failure):
        log.failure("stopping a service failed", previous)
    return maybeDeferred(service.stopService)


class _LifecycleService(Service):
    """
    Stops the balancer gracefully: refuse new requests, let those in flight finish for up
    to ``shutdown_timeout`` seconds, end the rest, then release the upstream connection
    pool and close the result log (last, so every request's line is written).
    """

    def __init__(self, balancer: LoadBalancer) -> None:
        self._balancer = balancer

    def stopService(self) -> Deferred[None]:
        super().stopService()
        balancer = self._balancer
        balancer.proxy.shut_down()
        in_flight = balancer.pool.slots.in_flight
        if in_flight:
            log.info("shutting down: waiting up to {timeout:g}s for {count} requests in flight",
                     timeout=balancer.config.shutdown_timeout, count=in_flight)
        timer = balancer.reactor.callLater(balancer.config.shutdown_timeout, self._give_up)
        idle = balancer.pool.slots.when_idle()
        idle.addCallback(lambda _: timer.cancel() if timer.active() else None)
        # Nothing in flight, so nothing will free a slot: answer whatever still waits.
        idle.addCallback(lambda _: balancer.router.abandon_queue(
            "the balancer is shutting down"))
        # Continue on a later reactor turn: the last request's release happens in the
        # middle of its own cleanup, and letting the reactor's shutdown (which drops every
        # connection) run inside that call stack would pull its client out from under it.
        idle.addCallback(lambda _: deferLater(balancer.reactor, 0, self._release))
        return idle

    def _give_up(self) -> None:
        log.warn("shutdown timeout: ending {count} requests still in flight",
                 count=self._balancer.pool.slots.in_flight)
        self._balancer.router.abandon_queue("the balancer is shutting down")
        self._balancer.proxy.abort_all("the balancer is shutting down")

    def _release(self) -> Deferred[None] | None:
        balancer = self._balancer
        balancer.repeats.flush()  # the summaries still counting, before the process ends
        if balancer.result_log is not None:
            balancer.result_log.close()
        return balancer.upstream.close_idle()



@implementer(IAgentEndpointFactory)
class ProbeEndpoints:
    """
    Where the health prober connects: a backend given as an IP address directly, one
    given by name through the reactor's resolver.

    Agent's own endpoints resolve every host, an IP literal too, with ``getaddrinfo`` in
    the reactor's thread pool: a few backends whose names resolve slowly held every thread,
    and the probes of all the others waited behind them past ``--health-timeout`` -- the
    whole fleet marked down for a DNS problem of backends it does not need DNS for.
    """

    def __init__(self, reactor: Any, connect_timeout: float) -> None:
        self._reactor = reactor
        self._timeout = connect_timeout

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        if uri.scheme != b"http":
            raise SchemeNotSupported(f"unsupported scheme: {uri.scheme!r}")
        host = uri.host.decode("ascii")
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return HostnameEndpoint(self._reactor, uri.host, uri.port, timeout=self._timeout)
        endpoint = TCP6ClientEndpoint if address.version == 6 else TCP4ClientEndpoint
        return endpoint(self._reactor, host, uri.port, timeout=self._timeout)


def _log_writer(result_log: ResultLog) -> Callable[[Summary, bool], object]:
    """The result log as a summary consumer: one line per finished request."""
    return lambda summary, answered: result_log.write(summary)


class LoadBalancer:
    """
    A least-connections, health-checked, streaming reverse proxy over a set of backends.

    ``LoadBalancer(["127.0.0.1:8002", "127.0.0.1:8003"], health_interval=2)`` takes the
    same options as the command line (underscores for dashes); or pass a ready
    :class:`~txlb.Config` as ``config``.  ``policy`` is ``--policy``'s name, or an object
    providing :class:`~txlb.IPolicy`, which then chooses instead of ``config.policy``.
    ``reactor`` is what everything waits on, an ``IReactorTime`` (a
    ``twisted.internet.task.Clock`` in tests), and, unless ``agent`` is given, what it
    connects with; ``store`` is where in-flight counts, backend marks and rate buckets live
    when several balancers share them (:mod:`txlb._cluster.store`).

    What the proxy observes of each request goes to :attr:`bookkeeper`, which keeps this
    process's books; ``observer`` (an
    :class:`~txlb._records.observer.IRequestObserver`) is told instead when the books are
    kept elsewhere -- a ``--workers`` worker passes the forwarder to its supervisor.
    ``resolver`` (a ``twisted.names`` ``IResolver``) resolves ``dns:``/``srv:`` backends
    instead of ``--resolver``'s servers or the system's.
    """

    def __init__(
        self,
        backends: Iterable[str] | None = None,
        *,
        config: Config | None = None,
        reactor: IReactorTime | None = None,
        agent: IAgent | None = None,
        probe_agent: IAgent | None = None,
        rng: random.Random | None = None,
        inflight: IInFlightCounts | None = None,
        observer: IRequestObserver | None = None,
        store: IBackendStore | None = None,
        policy: IPolicy | str | None = None,
        source: ConfigSource | None = None,
        resolver: Any = None,
        **options: object,
    ) -> None:
        if isinstance(policy, str):  # the --policy option, by name
            options["policy"] = policy
            policy = None
        elif policy is not None and not IPolicy.providedBy(policy):
            raise TypeError(f"LoadBalancer(policy=...): {policy!r} is neither a policy's "
                            "name nor an IPolicy provider")
        if config is None:
            unknown = sorted(set(options) - {spec.attribute for spec in OPTIONS})
            if unknown:
                raise TypeError(f"LoadBalancer() got an unknown option {unknown[0]!r}")
            given: dict[str, object | None] = {
                name.replace("_", "-"): value for name, value in options.items()
            }
            if backends is not None:
                given["backends"] = list(backends)
            config = build_config(given, environ={})
        elif backends is not None or options:
            raise TypeError("pass either config or backends/options, not both")
        if store is not None and inflight is not None:
            raise TypeError("pass either store or inflight (a store has its own counts)")
        if reactor is None:
            from twisted.internet import reactor as default_reactor

            reactor = default_reactor
        self.config = config
        self.reactor = reactor
        self.rng = rng
        # txlb's own upstream client (passes chunked bodies through untouched); an
        # embedder's Agent, when given, is used through an adapter instead.
        self.upstream: Upstream = (
            UpstreamClient(reactor, connect_timeout=config.connect_timeout)
            if agent is None else AgentUpstream(agent)
        )
        if probe_agent is None:
            # Probes use fresh connections: a probe must prove the backend still accepts.
            probe_agent = Agent.usingEndpointFactory(
                reactor,
                ProbeEndpoints(reactor, config.health_timeout),
                # quiet: two "Starting/Stopping factory" lines per probe would flood the log
                pool=QuietConnectionPool(reactor, persistent=False),
            )
        #: per-request warnings, summarised per kind: one line a minute each, not per request
        self.repeats = RepeatSummary(reactor)
        self.result_log = open_result_log(
            config.log_file, config.log_max_bytes, config.log_backups, config.log_format, reactor
        )
        #: where counts, marks and rate buckets live (txlb._cluster.store): this process,
        #: or a store several balancers share
        if store is None and config.shared_state is not None:
            store = RedisStore(config.shared_state, reactor)
        self.store = store if store is not None else LocalStore(counts=inflight)
        self.pool = Pool(config.backends, clock=reactor, store=self.store)
        # the outlier rule and slow start, before any backend ramps
        self.pool.reconfigure(config)
        self.metrics = Metrics(self.pool)
        # what the store offers beyond the seam (txlb._cluster.store_capabilities)
        wake, report = IFleetWake(self.store, None), IStoreReport(self.store, None)
        if wake is not None:
            # marks other replicas saved reach the pool; a slot they freed wakes the queue
            wake.attach(self.pool.refresh, self.pool.slots.capacity_changed)
        if report is not None:
            self.metrics.registry.register(report.collector())
        #: max_conns exact over the fleet, and the queue woken by others' releases
        self.slots: IFleetSlotGate | None = None
        gates = ISlotGates(self.store, None)
        if gates is not None:
            self.slots = gates.slot_gate(self.pool.slots.capacity_changed)
            self.pool.slots.confirm_with(self.slots)
            self.metrics.registry.register(self.slots.collector())
        #: whether the policy is the one ``--policy`` names (a reload may replace it),
        #: not an embedder's own object (which a reload keeps)
        self.owns_policy = policy is None
        #: an embedder's own policy object (it overrides ``config.policy``), or the one
        #: ``--policy`` names
        self.policy: IPolicy = (
            policy if policy is not None else make_policy(config.policy, reactor, rng, config))
        #: with ``--shared-state``: the cache-aware index shared over the fleet (its key,
        #: its sends published and the others' applied); it follows a reload's new policy
        self.shared_index: IFleetPrefixIndex | None = None
        sharing = IPrefixSharing(self.store, None)
        if sharing is not None:
            self.shared_index = sharing.prefix_index(self.pool, lambda: self.policy)
        #: the priority classes: how a request's class is found and how each class waits;
        #: ``reconfigure(config)`` changes them in place, the queue keeps its waiters
        self.classes = PriorityClasses(config)
        #: the tenants' counters and the order they give each class's queue (VTC, or FIFO)
        self.fairness = FairShares()
        #: ``--auth keys``: who each request is, by its API key (off: nothing asked)
        self.tenants = Tenants(config, self.store, reactor)
        #: with ``--shared-state``: the fleet's fair-share counters and revoked keys
        self.shared_tenants: SharedTenants | None = None
        tenant_sharing = ITenantSharing(self.store, None)
        if tenant_sharing is not None:
            self.shared_tenants = tenant_sharing.tenant_sharing(self.fairness)
            self.shared_tenants.on_revoked.append(self.tenants.take_revoked)
        self.router = Router(self.pool, self.policy, reactor, rng=rng, classes=self.classes,
                             fairness=self.fairness)
        self.history = History(reactor, self._current_backends,
                               lambda: self.router.queue_length)
        self.metrics.count_queue(lambda: self.router.queue_length, self.router.queue_lengths)
        self.health = HealthChecker(
            self.pool,
            probe_agent,
            reactor,
            interval=config.health_interval,
            timeout=config.health_timeout,
            path=config.health_path,
            rise=config.rise,
            fall=config.fall,
            scrape_engine_queue=bool(self.policy.needs_engine_metrics),
        )
        # another replica's refusal: this replica probes at once and judges for itself
        self.pool.on_suspect.append(self.health.probe_soon)
        #: the token budgets (``[[budgets]]``), in the store's levels; ``reconfigure``
        #: takes a reloaded config's
        self.budgets = TokenBudgets(config, self.store.token_levels(reactor))
        self.metrics.watch_budgets(self.budgets)
        #: every finished request is summarised once, for these consumers (in this order)
        self.summaries = SummaryFeed(consumers=[
            pool_results(self.pool),
            policy_learns(self.pool, self.policy),
            budget_reconciles(self.budgets),
            fair_shares_settle(self.fairness),
            metrics_counts(self.metrics),
            # the history counts requests and times them: nothing of the answer
            SummaryConsumer("the history", self.history.observe, Needs.NOTHING),
        ])
        if self.result_log is not None:
            self.summaries.add(SummaryConsumer("the result log", _log_writer(self.result_log)))
        #: keeps this process's books: what its proxy reports, or its workers do
        self.bookkeeper = Bookkeeper(self.pool, self.metrics, self.summaries,
                                     self.health.probe_soon)
        #: who the proxy, the router and the pool report to: the bookkeeper, unless an
        #: observer was given (a ``--workers`` worker's forwarder to its supervisor)
        self.observer: IRequestObserver = self.bookkeeper if observer is None else observer
        if observer is not None:
            # the bookkeeper's pool is this one: only another observer needs telling
            self.pool.on_down.append(observer.down)
        self.router.tell_waits(self.observer.waited)
        #: this process's requests in flight, which the hung-backend detector watches
        live: set[LiveExchange] = set()
        self.hung = HangDetector(self.pool, live, reactor, self.health.health_status,
                                 stall=config.hung_after)
        context = ProxyContext(
            pool=self.pool,
            upstream=self.upstream,
            clock=reactor,
            read_timeout=config.read_timeout,
            observer=self.observer,
            repeats=self.repeats,
            live=live,
            left_unanswered=self.hung.left_unanswered,
        )
        limiter, _ = rate_limiter_for(config, self.store, reactor)
        self.proxy = ProxyResource(self.router, context, rate_limiter=limiter,
                                   budgets=self.budgets, tenants=self.tenants)
        #: the backends ``dns:``/``srv:`` names yield (resolved only where membership is
        #: owned: see :meth:`service`); the resolver is made when a name first needs one
        servers = config.resolver  # --resolver needs a restart: the servers at start
        self.dns = DnsMembership(self.pool, config, resolver, reactor,
                                 on_added=self.health.probe_soon,
                                 make_resolver=lambda: system_resolver(servers, reactor))
        #: the sites built so far (:meth:`main_factory`, :meth:`site`)
        self.sites: list[ProxySite | LeanSite] = []
        #: every part made from the config, each told a reloaded one by its
        #: ``reconfigure(config)``, in this order: the one road from a config to the running
        #: parts, at start-up (:meth:`_take`) and on every reload (:mod:`txlb._reload`).
        #: The sites and admin APIs join it as they are built; an embedder's or a worker's
        #: own parts may too.
        self.reconfigurable: list[Reconfigurable] = [
            self.pool, self.router, self.health, self.hung, context, self.upstream,
            self.proxy, self.summaries, self.classes, self.budgets, self.dns, self.fairness,
            self.tenants]
        if self.shared_tenants is not None:
            self.reconfigurable.append(self.shared_tenants)
        if self.result_log is not None:
            self.reconfigurable.append(self.result_log)
        # the pool, the classes, the budgets, the DNS names and the tenants were made from
        # the config
        # above; the others take it now, as they will take each reload's
        made: tuple[Reconfigurable, ...] = (self.pool, self.classes, self.budgets, self.dns,
                                            self.tenants)
        for part in self.reconfigurable:
            if not any(part is one for one in made):
                part.reconfigure(config)
        #: reloads (``kill -HUP``, ``POST /reload``): ``source`` is where the config is
        #: read again (the command line and environment as started, the file as it is now)
        self.reloader = Reloader(self, source, reactor)

    @property
    def privacy(self) -> Privacy:
        """What the result log keeps of a request's content and user (``--log-*``)."""
        return self.summaries.privacy

    def _take(self, part: Reconfigurable) -> None:
        """A part built after start-up: made to the running config, and told each reload's."""
        part.reconfigure(self.config)
        self.reconfigurable.append(part)

    def use_policy(self, policy: IPolicy) -> None:
        """
        Route by ``policy`` from the next request on (a reload's new ``--policy``): the
        router chooses with it, it learns from the answers, the health checks read the
        engine metrics it needs, and the fleet's shared index hashes with its key.
        """
        self.policy = policy
        self.router.use_policy(policy)
        self.health.scrape_engines(bool(policy.needs_engine_metrics))
        if self.shared_index is not None:
            self.shared_index.attach()
        self.summaries.replace(policy_learns(self.pool, policy))

    def configure_parts(self, config: Config) -> None:
        """
        Run on ``config`` from now on (a reload's, validated and planned): every part of
        :attr:`reconfigurable` takes it, in order, as each took the first at start-up.  A
        part that raises keeps its own settings, logged; the others take theirs.
        """
        self.config = config
        for part in list(self.reconfigurable):
            try:
                part.reconfigure(config)
            except Exception:
                log.failure("{part} could not take the new config", part=part)

    def reload(self, new_config: Config) -> int:
        """
        Apply ``new_config`` (validated, whole) to the running balancer without dropping a
        connection or a stream (see :mod:`txlb._reload`): the new generation.  Raises
        :class:`~txlb._reload.ReloadRefused`, already logged, when it cannot be applied;
        the running config then stays whole.
        """
        return self.reloader.apply(new_config)

    def reload_from_source(self, trigger: str | None = None) -> Deferred[int]:
        """
        Re-read the config file (with the command line and environment as started), as
        SIGHUP does; ``trigger`` names who asked in the log line.  The file is read off
        the reactor thread, so this is a Deferred: the new generation, or a failure with
        :class:`~txlb._reload.ReloadRefused` (already logged).
        """
        return self.reloader.reload_from_source(trigger)

    def _current_backends(self) -> list[Backend]:
        """The pool's backends with their in-flight counts as of now (shared ones read)."""
        self.pool.refresh()
        return list(self.pool)

    def resource(self) -> IResource:
        """The proxy as a twisted.web resource, to serve as a Site's root or mount below it."""
        return self.proxy

    def admin_resource(self, extra_status: Callable[[], dict[str, object]] | None = None,
                       ) -> IResource:
        """
        The admin API (Klein): status, drain, membership, metrics and the dashboard.
        ``extra_status`` adds keys to ``/status`` (a supervisor's view of its workers);
        without it, ``/status`` has this process's ``queue``, per priority class, as
        ``/__lb_status`` has.
        """
        from txlb._admin.app import Admin  # Klein (and its reactor import) only when it is built
        from txlb._admin.tenants import TenantKeys

        budgets = self.budgets
        router = self.router

        dns = self.dns

        def status() -> dict[str, object]:
            extra: dict[str, object] = {"version": __version__}
            extra["resumes"] = self.metrics.resume_status()
            extra.update(budgets.status())
            extra.update(dns.status())
            report = IStoreReport(self.store, None)
            if report is not None:
                shared = {**report.status()}
                if self.slots is not None:
                    shared["slots"] = self.slots.status()
                if self.shared_index is not None:
                    shared["prefix_index"] = self.shared_index.status()
                extra["shared_state"] = shared
            if extra_status is None:
                # one process: its router holds the queue (a --workers supervisor's is
                # always empty; its workers hold theirs)
                extra["queue"] = router.queue_status()
            else:
                extra.update(extra_status())
            return extra

        # its token and allowed hosts are the config's: _take below
        admin = Admin(self.pool, self.metrics, None,
                      on_added=self.health.probe_soon, clock=self.reactor,
                      extra_status=status,
                      history=self.history,
                      # the policy of the moment: a reload may replace it
                      describe=lambda backend: self.policy.describe(backend),
                      reload=lambda: self.reload_from_source("POST /reload"),
                      config_status=self.reloader.generation.status,
                      tenants=TenantKeys(
                          lambda: {"tenants": self.tenants.status(),
                                   "fairness": self.fairness.status()},
                          lambda: (self.config.keys_file if self.config.auth == "keys"
                                   else None),
                          lambda: self.reload_from_source("admin: tenant keys"),
                          self._announce_revoked))
        self._take(admin)
        return admin.resource()

    def _announce_revoked(self, digest: str) -> None:
        """A key revoked here: with ``--shared-state``, every replica is told."""
        if self.shared_tenants is not None:
            self.shared_tenants.revoke(digest)

    def main_factory(self) -> LeanSite:
        """
        The main port's server: the proxy behind txlb's lean HTTP/1.1 server (llhttp, with
        the limits and framing rules of :meth:`site`, at a fraction of twisted.web's cost
        per request).  What ``twistd llmlb``, its ``--workers`` and ``txlb.demo`` listen
        with; a reload retunes its ``--max-body`` and ``--header-timeout``.
        """
        factory = LeanSite(self.proxy, on_refused=self.proxy.log_refused, reactor=self.reactor,
                           repeats=self.repeats)
        self._take(factory)
        self.sites.append(factory)
        return factory

    def site(self) -> Site:
        """
        A twisted.web ``Site`` serving only the proxy, with the same limits and framing
        rules as :meth:`main_factory` -- for an embedder who wants a ``Site`` object (to
        wrap, or to serve with other twisted.web machinery).
        """
        site = ProxySite(self.proxy, on_refused=self.proxy.log_refused, reactor=self.reactor,
                         repeats=self.repeats)
        self._take(site)
        self.sites.append(site)
        return site

    def service(self, health_checks: bool = True) -> IService:
        """
        The balancer's background work (health checks, upstream connection pool) as one
        service; attach it to an application so it starts and stops with it.
        ``health_checks=False`` leaves probing and DNS resolution to someone else (a
        ``--workers`` worker's supervisor probes and resolves once for all of them).
        """
        services = SequentialService()
        store = IStoreService(self.store, None)
        if store is not None:
            # first, so it stops last: the row shows the drain's requests until they end
            store.service().setServiceParent(services)
        if self.slots is not None:
            self.slots.service().setServiceParent(services)
        if health_checks:
            self.health.setServiceParent(services)  # stops last: probing goes on while draining
            # where membership is owned (not in a --workers worker, which mirrors it)
            self.dns.setServiceParent(services)
            # the dashboard's history is kept where every request is counted once
            HistoryService(self.history).setServiceParent(services)
        # in every process that proxies: it judges from this process's own traffic (while
        # --hung-after is not 0, which a reload may change)
        self.hung.setServiceParent(services)
        _LifecycleService(self).setServiceParent(services)
        return services
