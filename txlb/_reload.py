"""
Live reconfiguration: apply a new, validated :class:`~txlb.Config` to a running balancer
without dropping a connection or a stream (``kill -HUP``, ``POST /reload``).

A reload happens in two steps, the way ``nginx -t`` then ``nginx -s reload`` does:

1. **plan** (:func:`plan_reload`): everything that can fail is done first -- the new
   policy built, the backend changes worked out, the rate buckets chosen -- on the new
   config, touching nothing that runs;
2. **apply** (:func:`apply_reload`): the pool's membership methods, the planned policy and
   rate limiter swapped in, then every part's ``reconfigure(config)`` -- the same list, in
   the same order, that took the first config at start-up
   (``LoadBalancer.configure_parts``).  None of it refuses, so a refused reload leaves the
   running config whole and an accepted one is never half applied; a part that raises
   keeps its own settings, logged.

Which wins between the file and the admin API: the file says which backends exist and
with what weight, ``max_conns`` and models -- a backend added at runtime through the admin
API and absent from the file is drained and removed by the reload, as nginx forgets its
API changes on reload; one being removed that the file lists again stays.  Whether a
backend is drained is the operator's, not the file's: a backend the admin drained stays
drained across any number of reloads.  The addresses a ``dns:``/``srv:`` name yields are
that name's (txlb._discovery.membership): a reload leaves them to it, and its
``reconfigure`` starts and stops the names.

What cannot change without a restart (:data:`RESTART_ONLY`) is named in one log line and
left as it runs; the rest is applied.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol, TypeVar

import attrs
from twisted.internet.defer import Deferred, fail, maybeDeferred
from twisted.internet.interfaces import IReactorThreads, IReactorTime
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure

from txlb._cluster.backend import Backend
from txlb._cluster.local_store import TokenBuckets
from txlb._config.backends import BackendSpec
from txlb._config.config import Config, build_config
from txlb._config.errors import ConfigError
from txlb._config.option import OptionSpec
from txlb._config.toml_file import read_toml
from txlb._scheduling.policies import IPolicy, PolicyFactory
from txlb._scheduling.policies.registry import find_factory, make_policy
from txlb._scheduling.ratelimit import RateLimiter, rate_burst, rate_limiter_for

if TYPE_CHECKING:
    import random

    from txlb._cluster.health import HealthChecker
    from txlb._cluster.pool import Pool
    from txlb._cluster.store import IBackendStore
    from txlb._discovery.membership import DnsMembership
    from txlb._log.quiet import RepeatSummary
    from txlb._proxy.resource import ProxyResource
    from txlb._records.metrics import Metrics

log = Logger()

#: Options a running process cannot change (its ports, processes and result-log file are
#: open already), by ``Config`` attribute: a reload that changes one says so and keeps it.
RESTART_ONLY: tuple[str, ...] = ("listen", "admin", "workers", "log_file", "resolver",
                                "shared_state")


class Reconfigurable(Protocol):
    """A part built from the config: told each new one by ``reconfigure``."""

    def reconfigure(self, config: Config) -> None:
        """Take ``config`` (whole, validated) in place, keeping the live state."""


class LoadBalancer(Protocol):
    """
    What a reload reads and changes of a balancer (:class:`txlb.LoadBalancer` is the
    one), declared here so that this module needs nothing of the balancer's own: the
    balancer builds its :class:`Reloader`, not the other way round.
    """

    config: Config
    #: whether ``policy`` is ``--policy``'s (a reload may replace it), not an embedder's
    owns_policy: bool
    policy: IPolicy
    reactor: IReactorTime
    rng: random.Random | None
    pool: Pool
    dns: DnsMembership
    store: IBackendStore
    proxy: ProxyResource
    health: HealthChecker
    metrics: Metrics
    repeats: RepeatSummary
    #: every part made from the config: each is told the new one
    reconfigurable: list[Reconfigurable]

    def use_policy(self, policy: IPolicy) -> None:
        """Route by ``policy`` from the next request on."""

    def configure_parts(self, config: Config) -> None:
        """Run on ``config``: every part of :attr:`reconfigurable` takes it."""


@attrs.frozen
class ConfigSource:
    """
    Where a reload reads its config: the command line and the environment as the process
    was started (they still win over the file), and the ``--config`` file, read again.
    """

    command_line: Mapping[str, object | None]
    environ: Mapping[str, str]

    @classmethod
    def snapshot(cls, command_line: Mapping[str, object | None],
                 environ: Mapping[str, str]) -> ConfigSource:
        """Copies of both, so later changes to ``os.environ`` do not leak into a reload."""
        return cls(dict(command_line), dict(environ))

    @property
    def path(self) -> str | None:
        """The ``--config`` file, or ``None``: nothing to re-read."""
        given = self.command_line.get("config") or self.environ.get("LB_CONFIG")
        return str(given) if given else None

    def read(self) -> Config:
        """The config a start would build now; raises :class:`ConfigError`."""
        return self.load().config

    def load(self) -> Loaded:
        """
        Read the file (once) and build the config from it; raises :class:`ConfigError`.
        It touches nothing of a running balancer, so a reload runs it off the reactor
        thread.
        """
        path = self.path
        values = read_toml(path) if path is not None else {}
        config = build_config(self.command_line, self.environ, file_values=values)
        # whether log-user-key is set (environment or file), rather than drawn at random
        # for --log-user hash: a reload keeps the running random key, or every reload
        # would give the same user another digest
        gives = "LB_LOG_USER_KEY" in self.environ or "log-user-key" in values
        return Loaded(config, gives)


@attrs.frozen
class Loaded:
    """A config read from its source, and whether that source set ``log-user-key``."""

    config: Config
    gives_user_key: bool


@attrs.define
class ConfigGeneration:
    """Which config runs: its generation, when it was loaded, and the last refusal."""

    loaded_at: float
    path: str | None = None
    generation: int = 1
    last_error: str | None = None

    def applied(self, at: float) -> None:
        self.generation += 1
        self.loaded_at = at
        self.last_error = None

    def refused(self, error: str) -> None:
        self.last_error = error

    def status(self) -> dict[str, object]:
        """``/status``'s ``config``."""
        iso = datetime.datetime.fromtimestamp(self.loaded_at, datetime.timezone.utc)
        return {"generation": self.generation, "loaded_at": round(self.loaded_at, 3),
                "loaded_at_iso": iso.isoformat(timespec="seconds").replace("+00:00", "Z"),
                "path": self.path, "last_error": self.last_error}


class ReloadRefused(ConfigError):
    """A reload not applied: its one line is the message; the running config stays."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = str(self)
        #: what ``POST /reload`` answers: 400 for a bad config, 409 for none to read
        self.status = status


@attrs.frozen
class _Plan:
    """Everything a reload will do, worked out before anything changes."""

    config: Config
    policy: IPolicy
    added: tuple[BackendSpec, ...]
    respecified: tuple[tuple[Backend, BackendSpec], ...]
    kept: tuple[Backend, ...]
    removed: tuple[Backend, ...]
    limiter: RateLimiter | None
    retune_buckets: bool
    restart_only: tuple[str, ...]


def restart_only_changes(old: Config, new: Config) -> tuple[str, ...]:
    """The options, as ``--name``, that differ but need a restart to change."""
    return tuple(f"--{name.replace('_', '-')}" for name in RESTART_ONLY
                 if getattr(old, name) != getattr(new, name))


def _keep_restart_only(old: Config, new: Config) -> Config:
    """``new`` with the values that cannot change now kept as they run."""
    return attrs.evolve(new, **{name: getattr(old, name) for name in RESTART_ONLY})


def _policy(lb: LoadBalancer, config: Config) -> IPolicy:
    """
    The policy after the reload: the running one (and all it has learned) when the name
    and what it is built from stay the same, or when an embedder gave its own object.
    """
    old = lb.config
    if not lb.owns_policy:
        return lb.policy
    factory = find_factory(config.policy)
    # what it is built from: the options its module declares (cache-aware's --cache-*)
    options: tuple[OptionSpec, ...] = (
        factory.options if isinstance(factory, PolicyFactory) else ())
    same_inputs = all(getattr(old, spec.attribute) == getattr(config, spec.attribute)
                      for spec in options)
    if config.policy == old.policy and same_inputs:
        return lb.policy
    try:
        return make_policy(config.policy, lb.reactor, lb.rng, config)
    except Exception as error:  # a plugin's factory may raise anything
        raise ReloadRefused(f"--policy: {config.policy!r} could not be built: "
                            f"{error}") from None


def _limiter(lb: LoadBalancer, config: Config) -> tuple[RateLimiter | None, bool]:
    """The rate limiter after the reload, and whether its buckets take new parameters."""
    return rate_limiter_for(config, lb.store, lb.reactor, lb.proxy.rate_limiter, lb.config)


def plan_reload(lb: LoadBalancer, new: Config, membership: bool = True) -> _Plan:
    """
    Work out a reload of ``lb`` to ``new`` without changing anything; raises
    :class:`ReloadRefused`.  ``membership=False`` leaves the backends alone (a
    ``--workers`` worker: its supervisor's pool is the truth, mirrored to it).
    """
    restart = restart_only_changes(lb.config, new)
    config = _keep_restart_only(lb.config, new)
    added: list[BackendSpec] = []
    respecified: list[tuple[Backend, BackendSpec]] = []
    kept: list[Backend] = []
    removed: list[Backend] = []
    if membership:
        lb.pool.refresh()  # with --workers: removals that went idle in a worker are gone
        wanted = {spec.key: spec for spec in config.backends}
        for backend in lb.pool:
            spec = wanted.get(backend.key)
            if spec is None:
                if lb.dns.owns(backend.key):
                    continue  # a dns:/srv: name's: its reconfigure decides
                if not backend.health.removing:
                    removed.append(backend)
                continue
            if backend.health.removing:
                kept.append(backend)
            if spec != backend.spec:
                respecified.append((backend, spec))
        added = [spec for key, spec in wanted.items() if lb.pool.get(key) is None]
        fits = getattr(lb.pool.shared, "fits", None)
        if added and callable(fits) and not fits(spec.key for spec in added):
            raise ReloadRefused(f"--backends: the {len(added)} new backends do not fit in "
                                "--workers' shared table of in-flight counts (restart "
                                "txlb to reset it)")
    policy = _policy(lb, config)
    limiter, retune = _limiter(lb, config)
    return _Plan(config, policy, tuple(added), tuple(respecified), tuple(kept),
                 tuple(removed), limiter, retune, restart)


def apply_reload(lb: LoadBalancer, plan: _Plan) -> None:
    """Make ``plan`` so: nothing here refuses (see the module docstring)."""
    config = plan.config
    pool = lb.pool
    for backend in plan.kept:
        pool.keep(backend)
    for backend, spec in plan.respecified:
        pool.respecify(backend, spec)
    for backend in plan.removed:
        log.info("backend {backend} is not in the new config: draining it, removed once "
                 "idle", backend=backend.key)
        pool.remove(backend)
    new_backends = []
    for spec in plan.added:
        new_backends.append(pool.add(spec, ramp=True, origin="config"))
        log.info("backend {backend} added by the new config (weight {weight}, max_conns "
                 "{max_conns})", backend=spec.key, weight=spec.weight,
                 max_conns=spec.max_conns)

    if plan.policy is not lb.policy:
        log.info("policy {old} replaced by {new}", old=lb.config.policy, new=config.policy)
        lb.use_policy(plan.policy)
    if plan.retune_buckets and plan.limiter is not None:
        buckets = plan.limiter.buckets
        assert isinstance(buckets, TokenBuckets)
        buckets.retune(config.rate_limit or 1.0, rate_burst(config))
    lb.proxy.limit_rate(plan.limiter)

    # every part takes the new config: the same road as at start-up
    lb.configure_parts(config)
    for backend in new_backends:
        try:
            lb.health.probe_soon(backend)
        except Exception:
            log.failure("could not start the first probe of {backend}", backend=backend.key)


def _reload(trigger: str | None) -> str:
    """How the one line of a reload starts: ``reload``, or ``reload (SIGHUP)``."""
    return "reload" if trigger is None else f"reload ({trigger})"


_T = TypeVar("_T")


class Reloader:
    """
    One balancer's reloads: reads its :class:`ConfigSource`, refuses a bad config with
    one log line, applies a good one, and counts generations.

    The file is read and parsed off the reactor thread (the reactor's thread pool, when
    the clock is a reactor that has one): a slow disk or a large file delays only the
    reload, never the ports.  The config is planned and applied on the reactor thread.

    Reloads never overlap.  One asked for while another is read or applied (a second
    SIGHUP, a ``POST /reload``, a reconfigured part asking) waits, and all that wait are
    one more reload, read after it, with the file as it is then: a storm of SIGHUPs is
    two reloads, not thousands.  A config given to :meth:`apply` while one is applied is
    applied after it.

    Each outcome is logged as one line, through the balancer's repeat summary: the same
    refusal, or the same config applied again, within a minute is counted and summarised
    in one line rather than written each time; a different one is logged at once.
    """

    def __init__(self, lb: LoadBalancer, source: ConfigSource | None,
                 clock: IReactorTime) -> None:
        self._lb = lb
        self.source = source
        self._clock = clock
        #: where the file is read: the reactor's thread pool, or (a Clock) right here
        self._threads = clock if IReactorThreads.providedBy(clock) else None
        self.generation = ConfigGeneration(clock.seconds(),
                                           source.path if source is not None else None)
        self._reading = False
        self._applying = False
        #: asked for while one was read or applied: one more reload after it, whose
        #: result each of these is given, and the trigger its line names
        self._waiting: list[Deferred[int]] = []
        self._waiting_trigger: str | None = None
        #: a config given while one was being applied: apply this after
        self._next: tuple[Config, bool] | None = None
        #: told of every applied config (the supervisor sends it to its workers)
        self.on_applied: list[Callable[[Config], object]] = []

    def reload_from_source(self, trigger: str | None = None) -> Deferred[int]:
        """
        Re-read the config and apply it: the new generation, or a failure with
        :class:`ReloadRefused` (already logged) when it is not applied.  ``trigger`` says
        what asked (``SIGHUP``, ``POST /reload``) in the one line logged.
        """
        source = self.source
        if source is None or source.path is None:
            return fail(self._refuse(ReloadRefused(
                f"{_reload(trigger)} refused: txlb was started without --config, so there "
                "is no file to re-read", status=409)))
        if self._reading or self._applying:
            if not self._waiting:
                self._waiting_trigger = trigger
            waiter: Deferred[int] = Deferred()
            self._waiting.append(waiter)
            return waiter
        self._reading = True
        reading = self._off_thread(source.load)
        return reading.addBoth(self._loaded, trigger)

    def _off_thread(self, work: Callable[[], _T]) -> Deferred[_T]:
        threads = self._threads
        if threads is None:
            return maybeDeferred(work)
        return deferToThreadPool(threads, threads.getThreadPool(), work)

    def _loaded(self, result: Loaded | Failure, trigger: str | None) -> int:
        """Back on the reactor thread with what the file gave: apply it, or refuse."""
        self._reading = False
        try:
            if isinstance(result, Failure):
                if result.check(ConfigError):
                    raise self._refuse(ReloadRefused(
                        self._still_running(trigger, str(result.value))))
                # txlb's bug, not the file's: loud, whole, and refused like a bad file so
                # the running config stays and the refusal is counted
                log.failure("{reload}: reading the config failed", result,
                            reload=_reload(trigger))
                raise self._refuse(ReloadRefused(self._still_running(
                    trigger, "txlb could not read its config (see txlb's log)"), status=500))
            config = result.config
            running = self._lb.config
            if (config.log_user == running.log_user == "hash"
                    and not result.gives_user_key):
                config = attrs.evolve(config, log_user_key=running.log_user_key)
            return self.apply(config, trigger=trigger)
        finally:
            self._run_waiting()

    def _run_waiting(self) -> None:
        """The one reload asked for meanwhile, now that none runs: each asker told."""
        if self._reading or self._applying or not self._waiting:
            return
        waiting, self._waiting = self._waiting, []

        def tell(result: int | Failure) -> None:
            for waiter in waiting:
                if isinstance(result, Failure):
                    waiter.errback(result)
                else:
                    waiter.callback(result)

        self.reload_from_source(self._waiting_trigger).addBoth(tell)

    def apply(self, config: Config, membership: bool = True,
              trigger: str | None = None) -> int:
        """
        Apply an already validated ``config``; the new generation (see the class).
        ``membership=False`` leaves the backends to the supervisor (a worker).
        """
        if self._applying:
            self._next = (config, membership)
            return self.generation.generation
        self._applying = True
        try:
            self._apply(config, membership, trigger)
        finally:
            self._applying = False
            pending, self._next = self._next, None
            if pending is not None:
                with contextlib.suppress(ReloadRefused):  # logged; the one before runs
                    self.apply(*pending, trigger=trigger)
            self._run_waiting()
        return self.generation.generation

    def _apply(self, config: Config, membership: bool, trigger: str | None) -> None:
        try:
            plan = plan_reload(self._lb, config, membership)
        except ReloadRefused as refused:
            raise self._refuse(ReloadRefused(
                self._still_running(trigger, refused.message))) from None
        repeats = self._lb.repeats
        if plan.restart_only:
            repeats.emit(("reload restart-only", trigger, plan.restart_only), log,
                         LogLevel.warn, "{reload}: {names} cannot change without a restart "
                         "and keep their running values; the rest is applied",
                         reload=_reload(trigger), names=", ".join(plan.restart_only))
        try:
            apply_reload(self._lb, plan)
        except Exception:
            # txlb's bug, not the file's: say so, whole, and that it is half applied
            log.failure("{reload}: applying generation {generation} failed part-way",
                        reload=_reload(trigger),
                        generation=self.generation.generation + 1)
            raise self._refuse(ReloadRefused(
                f"{_reload(trigger)} failed part-way (see txlb's log)", status=500)) \
                from None
        self.generation.applied(self._clock.seconds())
        self._lb.metrics.reloaded(True, self.generation.generation)
        # the same config applied again is one kind: a storm of reloads of one file is
        # summarised; a reload that changes something is a line at once
        # a worker's config names no backends: its pool is the supervisor's to fill, so it
        # says so rather than "0 backends", which at 3 a.m. reads as an emptied pool
        count = (f"{len(plan.config.backends)} backends" if membership
                 else "the supervisor's backends")
        repeats.emit(("reload applied", trigger, hash(plan.config)), log, LogLevel.info,
                     "{reload}: generation {generation} applied ({count}, "
                     "policy {policy})", reload=_reload(trigger),
                     generation=self.generation.generation,
                     count=count, policy=plan.config.policy)
        for listener in list(self.on_applied):
            try:
                listener(plan.config)
            except Exception:
                log.failure("telling of the new config failed")

    def _still_running(self, trigger: str | None, why: str) -> str:
        return (f"{_reload(trigger)} refused, still running generation "
                f"{self.generation.generation}: {why}")

    def _refuse(self, refused: ReloadRefused) -> ReloadRefused:
        # the same refusal again (a storm of SIGHUPs on one broken file) is counted in
        # one summary line a minute; every one is counted in the metric and /status
        self._lb.repeats.emit(("reload refused", refused.message), log, LogLevel.error,
                              "{refusal}", refusal=refused.message)
        self.generation.refused(refused.message)
        self._lb.metrics.reloaded(False, self.generation.generation)
        return refused
