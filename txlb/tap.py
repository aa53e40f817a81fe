"""
``twistd llmlb``: command-line options and the service they build.

Every option defaults to ``None`` here so :func:`txlb._config.build_config` can tell "given
on the command line" from "not given" and apply the precedence rule
(command line > environment > config file > default).
"""

from __future__ import annotations

import errno
import os
import re
import signal
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from twisted.application.internet import StreamServerEndpointService
from twisted.application.service import IService, Service
from twisted.internet import endpoints
from twisted.internet.error import CannotListenError
from twisted.logger import Logger
from twisted.python import usage
from twisted.python.failure import Failure
from twisted.web.server import Site

from txlb._admin import ADMIN_MAX_BODY
from txlb._balancer import LoadBalancer, SequentialService
from txlb._config.config import Config
from txlb._config.endpoints import is_loopback_endpoint
from txlb._config.errors import ConfigError, closest_name
from txlb._config.table import OPTIONS
from txlb._log.quiet import QuietAcceptErrors
from txlb._reload import ConfigSource, ReloadRefused
from txlb._server.heap import FreezeHeapOnStart
from txlb._server.reactor import describe, install_by_default
from txlb._server.site import LimitedRequest, ProxyChannel
from txlb._verdict import verdict
from txlb._version import __version__

log = Logger()


def _describe(name: str) -> str:
    spec = next(s for s in OPTIONS if s.name == name)
    env = f" [env {spec.env}]" if spec.env else ""
    default = spec.shown_default or ("none" if spec.default in ((), None) else spec.default)
    return f"{spec.help_text} Default: {default}.{env}"


class Options(usage.Options):
    """The options of ``twistd llmlb``; see docs/usage.md for each one."""

    synopsis = "[options]"
    longdesc = (
        "Run the txlb load balancer in front of OpenAI-compatible inference servers. "
        "Every option can also come from its environment variable or from the TOML file "
        "given with --config (command line > environment > file > default). It runs on "
        "txlb's own epoll reactor, txlb-epoll, unless twistd's --reactor (before 'llmlb') "
        "names another; the first log line says which."
    )
    optParameters = [
        ["config", "c", None, "TOML config file. [env LB_CONFIG]"],
        *[[spec.name, None, None, _describe(spec.name)] for spec in OPTIONS if spec.cli],
    ]
    optFlags = [
        ["check", None, "Validate the configuration (file, command line, environment) as "
                        "a start would, print 'OK: <file>' and exit 0, or the error and "
                        "exit 2; start nothing (like nginx -t)."],
    ]

    config: Config
    #: where a reload reads the config again: this command line, the environment as now
    source: ConfigSource

    def parseOptions(self, options: Sequence[str] | None = None) -> None:
        """
        Parse, and under twistd/twist turn any error into one line on standard error and
        exit status 2.

        Overridden because twistd answers a ``UsageError`` from a plugin by printing the
        plugin's whole usage text (some 75 lines) with the error last, where an operator
        reading a failed unit's journal sees only the tail of the help.  Run on its own
        (tests, embedders) the ``UsageError`` is raised as usual.
        """
        try:
            super().parseOptions(options)
        except usage.UsageError as error:
            if getattr(self, "parent", None) is None:
                raise
            message = str(error)
            if not isinstance(error, _BadValue):
                message = self._explain(message)
            sys.stderr.write(f"txlb: error: {message}\n")
            raise SystemExit(2) from None

    def _explain(self, message: str) -> str:
        """A usage error in words, with the option most likely meant."""
        unknown = re.fullmatch(r"option (-{1,2})(\S+) not recognized", message)
        if unknown:
            names = [str(spec[0]) for spec in self.optParameters]
            hint = closest_name(unknown.group(2), names)
            meant = f" (did you mean --{hint}?)" if hint else ""
            return (f"unknown option {unknown.group(1)}{unknown.group(2)}{meant}; "
                    "'twistd llmlb --help' lists them all")
        return f"{message}; 'twistd llmlb --help' lists the options"

    def postOptions(self) -> None:
        given = {k: v for k, v in self.items() if k != "check"}
        self.source = ConfigSource.snapshot(given, os.environ)
        try:
            self.config = self.source.read()
        except ConfigError as error:
            raise _BadValue(str(error)) from None
        if self["check"]:
            sys.stdout.write(verdict(self.config, self.source.path) + "\n")
            raise SystemExit(0)
        if getattr(self, "parent", None) is not None:
            # under twistd, before anything imports a reactor: txlb's own, unless the
            # operator chose one with --reactor (already installed by then)
            install_by_default()


class _BadValue(usage.UsageError):
    """A value the options parser accepted and txlb's configuration refused."""


class _CleanExitOnSignals(Service):
    """
    Make SIGTERM/SIGINT a graceful stop that exits 0.

    twistd's own handler re-raises the signal once shut down, so the process "dies of
    SIGTERM" even after a clean drain; supervisors other than systemd count that as a
    failure.  This installs handlers (once the reactor runs, after Twisted's own) that
    stop the reactor the same way, draining in-flight requests, without that.
    """

    def __init__(self, reactor: Any) -> None:
        self._reactor = reactor

    def startService(self) -> None:
        super().startService()
        self._reactor.callWhenRunning(self._install)

    def _install(self) -> None:
        for number in (signal.SIGTERM, signal.SIGINT):
            signal.signal(number, self._stop)

    def _stop(self, number: int, frame: object) -> None:
        log.info("received {signal}: draining, then exiting",
                 signal=signal.Signals(number).name)
        self._reactor.callFromThread(self._stop_once)

    def _stop_once(self) -> None:
        if self._reactor.running:
            self._reactor.stop()


def _quiet_signal_wakeup() -> None:
    """
    The reactor's signal wake-up pipe, told not to warn when it is full: Python writes a byte
    to it for every signal, and under a storm of them printed five lines of "Exception
    ignored when trying to write to the signal wakeup fd" for each one it could not write
    -- to standard error, where no repeat summary reaches.  A full pipe wakes the reactor
    all the same, and every signal's handler still runs.
    """
    descriptor = signal.set_wakeup_fd(-1)
    if descriptor != -1:
        signal.set_wakeup_fd(descriptor, warn_on_full_buffer=False)


class _ReloadOnHangup(Service):
    """
    ``kill -HUP``: re-read the config file and apply it (see :mod:`txlb._reload`).

    The handler is installed when the service starts, before the reactor runs (a HUP during
    start-up must not kill the process: SIGHUP's default action), and does only
    ``reactor.callFromThread``: a signal arrives between any two bytecodes, the reload must
    run in the reactor's turn like everything else -- one that came during start-up runs
    in its first turn.  Several HUPs before that turn are one reload.

    The handler returns at once while an earlier HUP is still on its way to the reactor: a
    HUP arriving while the handler runs runs the handler again, nested, and a storm of
    them (``while true; do kill -HUP``) nested it until a ``RecursionError`` broke
    whatever the reactor was doing.  Once running, the reactor's signal wake-up pipe stops
    warning when it is full (:func:`_quiet_signal_wakeup`).
    """

    def __init__(self, reactor: Any, balancer: LoadBalancer) -> None:
        self._reactor = reactor
        self._balancer = balancer
        self._pending = False
        #: a HUP is handed to the reactor and not yet taken in its turn
        self._signalled = False

    def startService(self) -> None:
        super().startService()
        self._install()

    def _install(self) -> None:
        signal.signal(signal.SIGHUP, self._hangup)
        self._reactor.callWhenRunning(_quiet_signal_wakeup)
        source = self._balancer.reloader.source
        if source is not None and source.path is not None:
            log.info("kill -HUP {pid} re-reads {path}", pid=os.getpid(), path=source.path)

    def _hangup(self, number: int, frame: object) -> None:
        if self._signalled:
            return  # one is on its way: this HUP is the same reload
        self._signalled = True
        self._reactor.callFromThread(self._requested)

    def _requested(self) -> None:
        self._signalled = False
        if self._pending:
            return
        self._pending = True
        self._reactor.callLater(0, self._reload)

    def _reload(self) -> None:
        self._pending = False
        self._balancer.reload_from_source("SIGHUP").addErrback(self._not_applied)

    def _not_applied(self, failure: Failure) -> None:
        if not failure.check(ReloadRefused):  # a refusal is logged as its one line already
            log.failure("reload (SIGHUP) failed", failure)


class _AdminSite(Site):
    """
    The admin port's Site: no tracebacks in answers (they are JSON errors instead); a
    body over the admin API's cap is refused with 413 while it arrives rather than spooled
    to a temporary file first (the API itself refuses it too, under any Site); and form
    bodies are not parsed, so a malformed one reaches the API's JSON 415 instead of
    twisted.web's own empty 400.
    """

    displayTracebacks = False
    #: the main port's channel: strict framing (a smuggled write behind a read), a deadline
    #: for the head, and JSON for what it refuses
    protocol = ProxyChannel  # type: ignore[assignment]
    requestFactory = LimitedRequest
    max_body = ADMIN_MAX_BODY
    noisy = False  # its "Starting factory" line says nothing the port's own line does not

    def __init__(self, resource: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parsePOSTFormSubmission", False)
        super().__init__(resource, **kwargs)

    def log(self, request: Any) -> None:
        """
        No access line per admin request: the dashboard polls every two seconds and a
        Prometheus scrape comes every few, which would bury the lines that say what
        changed (changes made through the admin API are logged where they happen).
        """


class _ListeningService(StreamServerEndpointService):
    """
    A port that ``twistd llmlb`` listens on.

    It fails start-up with one line naming the option and the endpoint, rather than the
    traceback twistd prints for a ``CannotListenError``, and it reports accept errors
    (file-descriptor exhaustion) as a summary rather than a line per refused client.
    """

    def __init__(self, option: str, description: str, factory: Any, reactor: Any) -> None:
        endpoint = QuietAcceptErrors(endpoints.serverFromString(reactor, description),
                                     reactor, f"--{option} {description}")
        super().__init__(endpoint, factory)
        self._option = option
        self._description = description
        self._raiseSynchronously = True  # as strports.service: fail start-up, not later

    def privilegedStartService(self) -> None:
        try:
            super().privilegedStartService()
        except (CannotListenError, OSError) as error:
            # OSError too: a unix: path whose directory is missing fails in Twisted's
            # lock file with a plain FileNotFoundError, not a CannotListenError
            _cannot_listen(self._option, self._description, error)


def _cannot_listen(option: str, description: str, error: Exception) -> NoReturn:
    """End start-up with one line on a port that cannot be listened on, exit status 1."""
    cause = error.socketError if isinstance(error, CannotListenError) else error
    reason = getattr(cause, "strerror", None) or str(cause)
    # only a port in use is held by something the operator could stop
    held = getattr(cause, "errno", None) == errno.EADDRINUSE
    hint = "Stop whatever holds it, or choose" if held else "Check the endpoint, or choose"
    log.critical("txlb: error: --{option} {endpoint}: cannot listen: {reason}. {hint} "
                 "another with --{option}", option=option, endpoint=description,
                 reason=str(reason).lower(), hint=hint)
    raise SystemExit(1) from None


def makeService(options: Options) -> IService:
    """The balancer's background services plus the listening ports."""
    from twisted.internet import reactor

    config = options.config
    source = getattr(options, "source", None)
    log.info("txlb {version} runs on {reactor}", version=__version__,
             reactor=describe(reactor))
    if config.workers > 1:
        return _supervised(config, reactor, source)
    balancer = LoadBalancer(config=config, source=source)
    # Stopped in reverse: the main port first (no new connections), then the balancer
    # (drain in-flight requests, health checks still running), and the admin port last,
    # so operators can watch and drain during the graceful period.
    top = SequentialService()
    if config.admin != "none":
        _warn_open_admin(config)
        admin_site = _AdminSite(balancer.admin_resource())
        _ListeningService("admin", config.admin, admin_site, reactor).setServiceParent(top)
    balancer.service().setServiceParent(top)
    _CleanExitOnSignals(reactor).setServiceParent(top)
    _ReloadOnHangup(reactor, balancer).setServiceParent(top)
    _ListeningService("listen", config.listen, balancer.main_factory(),
                      reactor).setServiceParent(top)
    FreezeHeapOnStart(reactor).setServiceParent(top)
    return top


def _warn_open_admin(config: Config) -> None:
    if config.admin_token is None and not is_loopback_endpoint(config.admin):
        log.warn("the admin API ({endpoint}) is reachable from other machines and has "
                 "no --admin-token: anyone who can reach it can drain or remove backends",
                 endpoint=config.admin)


def _supervised(config: Config, reactor: Any, source: ConfigSource | None) -> IService:
    """
    ``--workers N``: this process supervises N workers that serve the main port (see
    txlb._workers.supervisor), and keeps what must exist once: probes, admin, metrics, result log.
    Stopped in reverse like the single process: the workers drain first.
    """
    from txlb._cluster.shared_counts import SharedCounts
    from txlb._workers.supervisor import WorkerSupervisor

    class _Supervisor(WorkerSupervisor):
        """Binds the main port itself: a port in use is the same one line as without."""

        def privilegedStartService(self) -> None:
            try:
                super().privilegedStartService()
            except (CannotListenError, OSError) as error:
                _cannot_listen("listen", config.listen, error)

    shared = SharedCounts.create(config.workers)
    if config.shared_state is None:
        balancer = LoadBalancer(config=config, inflight=shared, source=source)
    else:
        # the host's one replica in Redis: its row is the sum of its workers' (see
        # txlb._shared.host), the other replicas' counts go to the table's remote row
        from txlb._shared.host import HostCounts
        from txlb._shared.store import RedisStore

        store = RedisStore(config.shared_state, reactor, counts=HostCounts(shared))
        balancer = LoadBalancer(config=config, store=store, source=source)
    supervisor = _Supervisor(balancer, shared, reactor, config.workers)
    top = SequentialService()
    if config.admin != "none":
        _warn_open_admin(config)
        admin_site = _AdminSite(balancer.admin_resource(extra_status=supervisor.status))
        _ListeningService("admin", config.admin, admin_site, reactor).setServiceParent(top)
    balancer.service().setServiceParent(top)
    _CleanExitOnSignals(reactor).setServiceParent(top)
    _ReloadOnHangup(reactor, balancer).setServiceParent(top)
    supervisor.setServiceParent(top)
    FreezeHeapOnStart(reactor).setServiceParent(top)
    return top
