"""
One worker process of ``twistd llmlb --workers N`` (started as ``python -m txlb._workers.main
--index I``, which installs the reactor first and then runs :func:`main` here).

A worker runs the proxy and nothing else.  Its supervisor (txlb._workers.supervisor) started it
with the listening socket on file descriptor 4, the shared in-flight table on 5, control
messages on its standard input and a pipe back on 3, and sends it a ``hello`` (config and
backends) before anything else.  The worker then serves the socket with
``adoptStreamPort`` and, while it runs:

* takes and releases in-flight slots in its own row of the shared table, choosing under
  the table's lock, so least-connections and ``max_conns`` hold across all workers;
* mirrors the supervisor's backends (health, drain, membership, models) as they change;
* with ``--shared-state``, adds the other replicas' counts (the table's remote row, written
  by the supervisor) to its own, and has the supervisor make its ``--rate-limit`` takes
  through its store (txlb._workers.relay): the worker itself never connects to Redis;
* reports what only the supervisor may act on, through its request observer
  (txlb._workers.reports): each finished request's summary (for the one result log and the
  metrics), backends' answers (outlier ejection), backends it found refusing or resetting
  connections, retries and queue waits.

Log events go to the supervisor over standard output (which logs them as its own, tagged
``worker I``, wherever its own log goes); what a crash prints on standard error reaches it
too.  Neither pipe back to the supervisor may block the worker: if the supervisor stops
reading (stalled, stopped), the worker keeps serving, holds a bounded amount of log and of
messages for it, and drops (and counts) the rest.

``SIGINT`` is ignored (Ctrl-C reaches the whole process group; the supervisor decides);
``SIGTERM``, a ``stop`` message or the supervisor going away drain the worker for
``--shutdown-timeout`` and end it with status 0.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections.abc import Callable
from typing import Any

import attrs
from twisted.application.service import IService, Service
from twisted.internet import tcp
from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.interfaces import (
    IHalfCloseableProtocol,
    IListeningPort,
    IPushProducer,
    IWriteDescriptor,
)
from twisted.internet.protocol import Protocol, ServerFactory
from twisted.logger import ILogObserver, LogEvent, Logger, eventAsText, globalLogBeginner
from twisted.python.failure import Failure
from zope.interface import implementer

from txlb._balancer import LoadBalancer, SequentialService
from txlb._cluster.shared_counts import SharedCounts
from txlb._compat import adopt_listening_port
from txlb._config.config import Config
from txlb._log.quiet import summarise_accept_errors
from txlb._records.bookkeeper import budget_reconciles, fair_shares_settle, policy_learns
from txlb._records.privacy import privacy_of
from txlb._server.heap import freeze_heap
from txlb._workers.handoff import FairHandoff
from txlb._workers.relay import WorkerRelay, WorkerStore, take_levels
from txlb._workers.reports import SupervisorForwarder
from txlb._workers.wire import (
    BudgetRefused,
    Hello,
    Kick,
    Levels,
    Lines,
    Log,
    Message,
    Ready,
    Reload,
    Revoked,
    Served,
    Shared,
    Spent,
    State,
    Stop,
    Taken,
    WireError,
    config_from,
    decode,
    encode,
)

log = Logger(namespace="txlb._workers.main")  # the name operators see in ps

LISTEN_FD = 4
SHARED_FD = 5
#: Connections a worker accepts each time the shared socket wakes it (see FewAccepts).
ACCEPTS_PER_WAKEUP = 1
#: How long past --shutdown-timeout a stopping worker may take before it ends itself.
STOP_GRACE = 15.0
#: Log bytes a worker holds for its supervisor (beyond the pipe's own 64 KiB) before it
#: drops lines.
LOG_BUFFER = 1 << 20
#: Message bytes (summaries mostly) a worker holds for its supervisor beyond the pipe's
#: own buffering before it drops messages.
MESSAGE_BUFFER = 32 << 20
#: How long an ending worker tries to hand its last log lines over.
FINAL_FLUSH = 2.0


class FewAccepts:
    """
    For :class:`twisted.internet.tcp.Port` subclasses: accept one connection per wake-up.

    Every worker polls the same listening socket and all are woken when a connection
    arrives.  Twisted's port accepts up to 100 (and growing) per wake-up, so the first
    worker awake would take a whole burst of new connections for itself; taking one at a
    time (nginx's ``multi_accept off``) lets the others take their share, and a busy worker,
    slower to come back to its loop, naturally takes fewer.
    """

    numberAccepts: int

    def doRead(self) -> None:
        self.numberAccepts = ACCEPTS_PER_WAKEUP
        super().doRead()  # type: ignore[misc]


class AdoptedPort(Service):
    """Serve a listening socket opened by another process (stopped first on shutdown)."""

    def __init__(self, reactor: Any, fd: int, family: int, site: ServerFactory) -> None:
        self._reactor = reactor
        self._fd = fd
        self._family = family
        self._site = site
        self.port: IListeningPort | None = None

    def startService(self) -> None:
        super().startService()
        base: type[tcp.Port] = tcp.Port
        with contextlib.suppress(ImportError):
            from txlb._server.reactor import DirectDispatchEPollReactor, EagerPort

            if isinstance(self._reactor, DirectDispatchEPollReactor):
                base = EagerPort
        port_class: Any = type("WorkerPort", (FewAccepts, base), {})
        port = adopt_listening_port(port_class, self._reactor, self._fd, self._family,
                                    self._site)
        port.startListening()
        summarise_accept_errors(port, self._reactor, "the main port")
        self.port = port
        # The port listens on a duplicate of the inherited descriptor; the original must
        # go now, or it stays open after the port stops: the kernel would keep accepting
        # connections on it that nobody answers (while this worker drains, and for good
        # if its supervisor was killed), and a new supervisor could not bind the address.
        os.close(self._fd)

    def stopService(self) -> Deferred[None] | None:
        super().stopService()
        if self.port is None:
            return None
        # Closes this process's copy only: adopted ports are never shut down, so the
        # other workers keep accepting on the same socket.
        port, self.port = self.port, None
        stopped: Deferred[None] = maybeDeferred(port.stopListening)  # type: ignore[call-overload]
        return stopped


class _ForwardedBooks:
    """
    What a worker's forwarder keeps follows a reload (one of ``lb.reconfigurable``): its
    policy's lessons go to the policy the reload left, its summaries keep what the new
    ``--log-*`` options say.
    """

    def __init__(self, balancer: LoadBalancer, forwarder: SupervisorForwarder) -> None:
        self._balancer = balancer
        self._forwarder = forwarder

    def reconfigure(self, config: Config) -> None:
        feed = self._forwarder.summaries
        feed.replace(policy_learns(self._balancer.pool, self._balancer.policy))
        feed.keep_private(privacy_of(config))


@implementer(IHalfCloseableProtocol, IPushProducer)
class SupervisorLink(Protocol):
    """The worker's side of the pipes to its supervisor, and the worker's life cycle."""

    def __init__(self, reactor: Any, index: int) -> None:
        self.reactor = reactor
        self.index = index
        self.balancer: LoadBalancer | None = None
        #: --shared-state: the supervisor makes this worker's rate-limit takes
        self.relay: WorkerRelay | None = None
        self.services: IService | None = None
        self.exit_code = 0
        self._lines = Lines()
        self._stopping = False
        self._closed = False
        self._paused = False
        #: bytes written while the pipe was full (paused), and messages dropped for that
        self._held_back = 0
        self.dropped = 0

    def connectionMade(self) -> None:
        # A streaming producer of the pipe's writer: paused once the pipe and 64 KiB of
        # buffer are full, resumed when they drained -- how we learn the supervisor reads.
        transport: Any = self.transport  # a StandardIO: a consumer too
        transport.registerProducer(self, True)

    def send(self, line: bytes) -> None:
        """
        Queue a message for the supervisor; never blocks.  While it does not read, at most
        :data:`MESSAGE_BUFFER` bytes wait here; later messages are dropped and counted (a
        summary dropped is a request missing from the result log and metrics, better than
        a worker growing without bound).
        """
        if self.transport is None or self._closed:
            return
        if self._paused:
            if self._held_back + len(line) > MESSAGE_BUFFER:
                self.dropped += 1
                return
            self._held_back += len(line)
        self.transport.write(line)

    def report(self, message: Message) -> None:
        """Send one typed message (never raises: bookkeeping must never fail a request)."""
        try:
            line = encode(message)
        except Exception:
            log.failure("could not encode a {kind} message for the supervisor",
                        kind=message.kind)
            return
        self.send(line)

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        self._held_back = 0
        if self.dropped:
            dropped, self.dropped = self.dropped, 0
            log.warn("the supervisor read nothing for a while: {count} messages to it were "
                     "dropped (finished requests among them have no result-log line)",
                     count=dropped)

    def stopProducing(self) -> None:
        pass

    def dataReceived(self, data: bytes) -> None:
        for line in self._lines.feed(data):
            try:
                message = decode(line)
            except WireError as error:
                log.warn("the supervisor sent a malformed message, ignored: {error}",
                         error=str(error))
                continue
            if isinstance(message, Hello):
                self._start(message)
            elif isinstance(message, State) and self.balancer is not None:
                self.balancer.pool.mirror(message.state)
            elif isinstance(message, Reload) and self.balancer is not None:
                self._reload(message)
            elif isinstance(message, Kick) and self.balancer is not None:
                self.balancer.pool.slots.capacity_changed()
            elif isinstance(message, Revoked) and self.balancer is not None:
                self.balancer.tenants.take_revoked(frozenset(message.digests))
            elif isinstance(message, Served) and self.balancer is not None:
                self.balancer.fairness.served_elsewhere(message.tenant, message.amount)
            elif isinstance(message, Spent) and self.balancer is not None:
                self.balancer.budgets.spent_elsewhere(
                    [(name, window, client) for name, window, client in message.buckets],
                    message.amount, message.charged)
            elif isinstance(message, Shared) and self.relay is not None:
                self.relay.update(message.connected, message.replicas)
            elif isinstance(message, Taken) and self.relay is not None:
                self.relay.answered(message)
            elif isinstance(message, Levels) and self.balancer is not None:
                take_levels(self.balancer.budgets.levels, message)
            elif isinstance(message, Stop):
                self.stop("the supervisor asked")

    @staticmethod
    def _own_config(blob: str) -> Config:
        """
        The supervisor's config as a worker runs it: no backends of its own (it mirrors
        the supervisor's, DNS-sourced ones too: only the supervisor resolves), no result
        log or admin port (the supervisor keeps them), and no Redis link: the supervisor is
        the host's one replica in the shared state (see txlb._workers.relay).
        """
        return attrs.evolve(config_from(blob), backends=(), dns_backends=(),
                            log_file="none", admin="none", workers=1, shared_state=None)

    def _reload(self, message: Reload) -> None:
        """The supervisor applied a reloaded config: the same reload here, but membership."""
        assert self.balancer is not None
        try:
            config = self._own_config(message.config)
            self.balancer.reloader.apply(config, membership=False, trigger="the supervisor")
        except Exception:
            # refused (logged already) or a bad blob: this worker keeps the config it runs
            log.failure("could not apply the supervisor's new config")

    def _start(self, hello: Hello) -> None:
        config = self._own_config(hello.config)
        shared = SharedCounts(SHARED_FD, hello.workers, hello.slots, row=self.index)
        shared.set_pid(os.getpid())
        # What the supervisor does for every worker (result log, metrics, outlier
        # ejection, probing) is reported to it instead of done here ...
        forwarder = SupervisorForwarder(self.report, privacy_of(config))
        spec = config_from(hello.config).shared_state
        if spec is None:
            balancer = LoadBalancer(config=config, reactor=self.reactor, inflight=shared,
                                    observer=forwarder)
        else:
            relay = self.relay = WorkerRelay(self.report, self.reactor, hello.workers)
            balancer = LoadBalancer(config=config, reactor=self.reactor, observer=forwarder,
                                    store=WorkerStore(shared, relay))
        self.balancer = balancer
        # ... but this worker's policy learns from the requests it served itself.
        forwarder.summaries.add(policy_learns(balancer.pool, balancer.policy))
        # ... and settles the token budgets of the requests it admitted, telling the
        # supervisor (and through it the other workers) what it took and gave back
        forwarder.summaries.add(budget_reconciles(balancer.budgets))
        # ... and its fair queue's counters, of the requests it routed, telling the
        # supervisor (and through it the other workers) each change
        forwarder.summaries.add(fair_shares_settle(balancer.fairness))
        balancer.fairness.report_to(
            lambda tenant, amount: self.report(Served(tenant, amount)))
        balancer.budgets.report_to(
            spent=lambda buckets, amount, charged: self.report(
                Spent([list(where) for where in buckets], amount, charged)),
            refused=lambda name: self.report(BudgetRefused(name)))
        balancer.reconfigurable.append(_ForwardedBooks(balancer, forwarder))
        balancer.pool.mirror(hello.state)
        # the fair handoff: this worker's waiting tenants published, the others' read
        handoff = FairHandoff(shared, balancer.classes, balancer.fairness)
        handoff.reconfigure(config)
        balancer.reconfigurable.append(handoff)
        balancer.router.tell_queue_length(handoff.queue_changed)
        balancer.router.handoff.defer_with(handoff.defers)
        balancer.fairness.lift_with(handoff.waiting_elsewhere)
        services = self.services = SequentialService()
        balancer.service(health_checks=False).setServiceParent(services)
        AdoptedPort(self.reactor, LISTEN_FD, hello.family,
                    balancer.main_factory()).setServiceParent(services)
        services.startService()
        freeze_heap()  # the worker's start-up state, out of the collector's walks
        self.report(Ready(os.getpid()))

    def stop(self, why: str) -> None:
        """Stop accepting, let requests in flight finish, flush the pipe, exit."""
        if self._stopping:
            return
        self._stopping = True
        log.info("stopping ({why})", why=why)
        timeout = self.balancer.config.shutdown_timeout if self.balancer else 0.0
        self.reactor.callLater(timeout + STOP_GRACE, self._give_up)
        services = self.services
        stopped: Deferred[Any] = (maybeDeferred(services.stopService) if services is not None
                                  else succeed(None))
        stopped.addErrback(lambda failure: log.failure("stopping failed", failure))
        stopped.addBoth(lambda _: self._close())

    def _close(self) -> None:
        """Every summary is written: close the pipe (after it flushed), then end."""
        if self.transport is None or self._closed:
            self._end()
            return
        self._closed = True
        transport: Any = self.transport
        transport.unregisterProducer()  # or a paused writer would never close
        transport.loseConnection()

    def connectionLost(self, reason: Failure | None = None) -> None:
        self._closed = True
        if self._stopping:
            self._end()
        else:
            self.stop("the pipe to the supervisor closed")

    def readConnectionLost(self) -> None:
        self.stop("the supervisor went away")

    def writeConnectionLost(self) -> None:
        self._closed = True  # nobody to report to; keep draining the requests

    def _end(self) -> None:
        if self.reactor.running:
            self.reactor.stop()

    def _give_up(self) -> None:
        log.warn("still not stopped {grace:g}s after the shutdown timeout; exiting",
                 grace=STOP_GRACE)
        os._exit(1)


@implementer(ILogObserver)
class ForwardingObserver:
    """
    This worker's log events as lines on standard output -- one
    :class:`~txlb._workers.wire.Log` message each -- which the supervisor reads and logs
    as its own (tagged ``worker I``), so they go wherever its log goes: a file, journald,
    standard output.
    """

    def __init__(self, write: Callable[[str], object]) -> None:
        self._write = write

    def __call__(self, event: LogEvent) -> None:
        text = eventAsText(event, includeTimestamp=False, includeSystem=False)
        level = event.get("log_level")
        name = level.name if level is not None else "info"
        namespace = event.get("log_namespace") or "-"
        self._write(encode(Log(name, namespace, text)).decode("ascii"))


@implementer(IWriteDescriptor)
class PipeWriter:
    """
    Non-blocking, bounded writes of whole lines to a pipe (a worker's log to its supervisor).

    A blocking write would stop the whole worker -- every request it serves -- as soon as
    the supervisor stops reading for long enough to fill the pipe.  Instead what the pipe
    does not take waits here, written when the reactor says the pipe has room; beyond
    ``limit`` bytes waiting, lines are dropped and counted, and ``on_recovered`` is told the
    count once everything waiting was written.  A line is dropped whole or written whole.
    """

    def __init__(self, reactor: Any, fd: int, limit: int,
                 on_recovered: Callable[[int], object] = lambda dropped: None) -> None:
        self._reactor = reactor
        self._fd = fd
        self.limit = limit
        self._on_recovered = on_recovered
        self._pending = bytearray()
        self._writing = False
        self._lost = False
        self.dropped = 0
        os.set_blocking(fd, False)

    def fileno(self) -> int:
        return self._fd

    def logPrefix(self) -> str:
        return "PipeWriter"

    def pending(self) -> int:
        """Bytes waiting for the pipe to take them."""
        return len(self._pending)

    def write(self, data: bytes) -> bool:
        """Write ``data`` (one or more whole lines) or drop it; False if dropped."""
        if self._lost:
            return False
        if self._pending:
            if len(self._pending) + len(data) > self.limit:
                self.dropped += 1
                return False
            self._pending += data
            return True
        written = self._write(data)
        if written < len(data) and not self._lost:
            self._pending += data[written:]  # the rest of a line begun: kept whatever its size
            if not self._writing:
                self._writing = True
                self._reactor.addWriter(self)
        return not self._lost

    def _write(self, data: bytes | bytearray) -> int:
        try:
            return os.write(self._fd, data)
        except BlockingIOError:
            return 0
        except OSError:  # the supervisor is gone (EPIPE): nobody to log to
            self._lost = True
            self._pending.clear()
            self._stop()
            return 0

    def _stop(self) -> None:
        if self._writing:
            self._writing = False
            self._reactor.removeWriter(self)

    def doWrite(self) -> None:
        del self._pending[:self._write(self._pending)]
        if self._pending:
            return
        self._stop()
        if self.dropped and not self._lost:
            dropped, self.dropped = self.dropped, 0
            self._on_recovered(dropped)

    def connectionLost(self, reason: Failure) -> None:
        self._lost = True
        self._pending.clear()
        self._stop()

    def flush(self, timeout: float) -> None:
        """Before the process ends: hand over what waits, for at most ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while self._pending and not self._lost:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            select.select([], [self._fd], [], remaining)
            del self._pending[:self._write(self._pending)]


def _log_dropped(dropped: int) -> None:
    log.warn("the supervisor read no log for a while: {count} log lines of this worker "
             "were dropped", count=dropped)


def main(args: list[str]) -> int:
    """Run one worker (its reactor is installed already: see txlb._workers.main)."""
    index = int(args[args.index("--index") + 1])
    from twisted.internet import reactor as default_reactor
    from twisted.internet import stdio

    reactor: Any = default_reactor
    output = PipeWriter(reactor, 1, LOG_BUFFER, _log_dropped)
    globalLogBeginner.beginLoggingTo(
        [ForwardingObserver(lambda line: output.write(line.encode("utf-8")))],
        redirectStandardIO=False)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # a reload is the supervisor's to receive and pass on (a Reload message); a HUP sent
    # to the whole process group must not end a worker (its default action)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    link = SupervisorLink(reactor, index)
    signal.signal(signal.SIGTERM,
                  lambda number, frame: reactor.callFromThread(link.stop, "SIGTERM"))
    stdio.StandardIO(link, stdin=0, stdout=3, reactor=reactor)  # type: ignore[call-arg]
    reactor.run(installSignalHandlers=False)
    output.flush(FINAL_FLUSH)
    return link.exit_code
