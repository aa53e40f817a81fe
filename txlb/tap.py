"""
``twistd llmlb``: command-line options and the service they build.

Every option defaults to ``None`` here so :func:`txlb._config.build_config` can tell "given
on the command line" from "not given" and apply the precedence rule
(command line > environment > config file > default).
"""

from __future__ import annotations

import signal
import sys
from typing import Any

from twisted.application import strports
from twisted.application.service import IService, Service
from twisted.logger import Logger
from twisted.python import usage
from twisted.web.server import Site

from ._admin import ADMIN_MAX_BODY
from ._balancer import LoadBalancer, SequentialService
from ._config import OPTIONS, Config, ConfigError, build_config, is_loopback_endpoint
from ._site import LimitedRequest, ProxyChannel

log = Logger()


def _describe(name: str) -> str:
    spec = next(s for s in OPTIONS if s.name == name)
    env = f" [env {spec.env}]" if spec.env else ""
    default = "none" if spec.default == () else spec.default
    return f"{spec.help} Default: {default}.{env}"


class Options(usage.Options):
    """The options of ``twistd llmlb``; see docs/usage.md for each one."""

    synopsis = "[options]"
    longdesc = (
        "Run the txlb load balancer in front of OpenAI-compatible inference servers. "
        "Every option can also come from its environment variable or from the TOML file "
        "given with --config (command line > environment > file > default)."
    )
    optParameters = [
        ["config", "c", None, "TOML config file. [env LB_CONFIG]"],
        *[[spec.name, None, None, _describe(spec.name)] for spec in OPTIONS if spec.cli],
    ]

    config: Config

    def postOptions(self) -> None:
        try:
            self.config = build_config({k: v for k, v in self.items()})
        except ConfigError as error:
            if getattr(self, "parent", None) is not None:
                # Under twistd/twist a UsageError dumps the whole usage text before the
                # error; an operator reading a failed unit's journal wants the one line.
                sys.stderr.write(f"txlb: error: {error}\n")
                raise SystemExit(2) from None
            raise usage.UsageError(str(error)) from None


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

    def __init__(self, resource: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parsePOSTFormSubmission", False)
        super().__init__(resource, **kwargs)


def makeService(options: Options) -> IService:
    """The balancer's background services plus the listening ports."""
    from twisted.internet import reactor

    config = options.config
    if config.workers > 1:
        return _supervised(config, reactor)
    balancer = LoadBalancer(config=config)
    # Stopped in reverse: the main port first (no new connections), then the balancer
    # (drain in-flight requests, health checks still running), and the admin port last,
    # so operators can watch and drain during the graceful period.
    top = SequentialService()
    if config.admin != "none":
        _warn_open_admin(config)
        admin_site = _AdminSite(balancer.admin_resource())
        strports.service(config.admin, admin_site).setServiceParent(top)
    balancer.service().setServiceParent(top)
    _CleanExitOnSignals(reactor).setServiceParent(top)
    strports.service(config.listen, balancer.site()).setServiceParent(top)
    return top


def _warn_open_admin(config: Config) -> None:
    if config.admin_token is None and not is_loopback_endpoint(config.admin):
        log.warn("the admin API ({endpoint}) is reachable from other machines and has "
                 "no --admin-token: anyone who can reach it can drain or remove backends",
                 endpoint=config.admin)


def _supervised(config: Config, reactor: Any) -> IService:
    """
    ``--workers N``: this process supervises N workers that serve the main port (see
    txlb._supervisor), and keeps what must exist once: probes, admin, metrics, result log.
    Stopped in reverse like the single process: the workers drain first.
    """
    from ._shm import SharedCounts
    from ._supervisor import WorkerSupervisor

    shared = SharedCounts.create(config.workers)
    balancer = LoadBalancer(config=config, inflight=shared)
    supervisor = WorkerSupervisor(balancer, shared, reactor, config.workers)
    top = SequentialService()
    if config.admin != "none":
        _warn_open_admin(config)
        admin_site = _AdminSite(balancer.admin_resource(extra_status=supervisor.status))
        strports.service(config.admin, admin_site).setServiceParent(top)
    balancer.service().setServiceParent(top)
    _CleanExitOnSignals(reactor).setServiceParent(top)
    supervisor.setServiceParent(top)
    return top
