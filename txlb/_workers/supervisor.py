"""
``twistd llmlb --workers N`` (N > 1): the twistd process supervises N worker processes.

nginx's master/worker split.  The supervisor binds the listening socket once and hands it
to every worker (file descriptor 4), which accept on it in turn; it creates the shared
in-flight table (txlb._cluster.shared_counts, descriptor 5) that makes least-connections exact
across them.
What must exist once stays here: the health checker (one probe per backend, not one per
worker), the admin API, the Prometheus metrics and the result log (one writer, so lines
never interleave and rotation has one owner).  Workers run the proxy only (txlb._workers.main).

Event-driven both ways, no polling:

* whenever the supervisor's pool changes (health, drain, membership, learned models), its
  backends are pushed to every worker, coalesced to one message per reactor turn;
* every finished request comes back as one message (its summary), as do backends' answers
  and passive failures; after such a message the supervisor looks at the other workers'
  ``max_conns`` queue lengths (in the shared table) and ``kick``\\s those that have
  requests waiting, since the slot just freed may be one they can use.

With ``--shared-state`` the supervisor is the host's one replica in Redis (its workers never
connect to it): its store publishes the host's in-flight counts -- the sum of the workers'
rows, looked at every few milliseconds (txlb._shared.host) -- and writes the other
replicas' into the table's remote row, which every worker adds to its own totals; the marks
(drains, membership, refusals) are the supervisor's pool's, which the workers mirror as
always; a worker's ``--rate-limit`` takes reach the shared buckets through the supervisor
(txlb._workers.relay), and it is told whether the shared state answers and how many replicas
share it.  Each of these the supervisor asks its store for
(txlb._cluster.store_capabilities), so any store that provides them serves the workers.

A worker that dies is restarted (after a short pause, longer if it died young) and its row
of the shared table is zeroed first, so a SIGKILLed worker's requests no longer count.  On
SIGTERM the supervisor asks every worker to stop, waits while they drain (each for
``--shutdown-timeout``), and only then stops probing and closes the result log.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from pathlib import Path
from typing import Any

from twisted.application.service import Service
from twisted.internet import error as neterror
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import TCP4ServerEndpoint, TCP6ServerEndpoint, serverFromString
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import InvalidLogLevelError, Logger, LogLevel
from twisted.python.failure import Failure

from txlb._balancer import LoadBalancer
from txlb._cluster.shared_counts import SharedCounts
from txlb._cluster.store import Bucket
from txlb._cluster.store_capabilities import IFleetPresence, IFleetWake, ISharedRateTakes
from txlb._compat import tcp_endpoint_address
from txlb._config.config import Config
from txlb._config.errors import ConfigError
from txlb._shared.host import HostCounts, HostScan
from txlb._shared.levels import SharedTokenLevels
from txlb._workers.relay import TakeRelay
from txlb._workers.reports import WorkerReports
from txlb._workers.wire import (
    MAX_SPENT_BUCKETS,
    FromWorker,
    Hello,
    Kick,
    Levels,
    Lines,
    Log,
    Ready,
    Reload,
    Revoked,
    Served,
    Shared,
    Spent,
    State,
    Stop,
    Take,
    Taken,
    WireError,
    config_blob,
    decode,
    encode,
)

log = Logger()

#: A worker that dies is restarted after this pause ...
RESTART_DELAY = 0.1
#: ... or after this one if it died less than :data:`YOUNG` seconds after it started (or
#: could not be started at all), so a worker that cannot start does not spin; the pause
#: doubles with each such failure in a row, up to :data:`MAX_RESTART_DELAY`.  Restarts
#: never stop: whatever broke (a full disk, a missing library) may be fixed meanwhile.
CRASH_LOOP_DELAY = 2.0
MAX_RESTART_DELAY = 30.0
YOUNG = 2.0
#: How long past --shutdown-timeout stopping workers get before they are killed.
KILL_GRACE = 10.0

_KICK = encode(Kick())
_STOP = encode(Stop())


def listening_socket(reactor: Any, description: str) -> socket.socket:
    """
    Bind the ``--listen`` endpoint (``tcp:`` or ``tcp6:`` only) as a plain socket that
    worker processes can inherit.
    """
    endpoint = serverFromString(reactor, description)
    if isinstance(endpoint, TCP6ServerEndpoint):
        family, default = socket.AF_INET6, "::"
    elif isinstance(endpoint, TCP4ServerEndpoint):
        family, default = socket.AF_INET, ""
    else:
        raise ConfigError(f"--workers: worker processes need a tcp: --listen endpoint, "
                          f"not {description!r}")
    port, interface, backlog = tcp_endpoint_address(endpoint)
    interface = interface or default
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((interface, port))
        sock.listen(backlog)
    except OSError as error:
        sock.close()
        raise neterror.CannotListenError(interface, port, error) from None
    sock.setblocking(False)
    return sock


def _worker_environment() -> dict[str, str]:
    """This process's environment, with the txlb it runs first on the path: workers must
    run the same code as their supervisor (they share its wire format and table layout)."""
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(
        [here, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != here]])
    return env


def reactor_name(reactor: Any) -> str | None:
    """The ``--reactor`` name workers should use to run the reactor this process runs."""
    try:
        from txlb._server.reactor import DirectDispatchEPollReactor
    except ImportError:  # pragma: no cover - no epoll on this platform
        return None
    return "txlb-epoll" if isinstance(reactor, DirectDispatchEPollReactor) else None


def _relog(index: int, line: bytes) -> None:
    """
    Log a worker's event (a :class:`~txlb._workers.wire.Log`, see txlb._workers.worker) as
    ours; a line that is none (something the worker printed) as it is, at level info.
    """
    try:
        message = decode(line)
        if not isinstance(message, Log):
            raise WireError(f"a {message.kind} message where log events go")
        level = LogLevel.levelWithName(message.level)
        namespace, text = message.namespace, message.text
    except (WireError, InvalidLogLevelError):
        level, namespace, text = LogLevel.info, "-", line.decode("utf-8", "replace")
    Logger(namespace=namespace).emit(level, "{text}", text=text,
                                     log_system=f"worker {index} {namespace}")


class WorkerProcess(ProcessProtocol):
    """The supervisor's side of one worker: its pipes, its messages, its end."""

    def __init__(self, supervisor: WorkerSupervisor, index: int, started: float) -> None:
        self.supervisor = supervisor
        self.index = index
        #: what this worker reports, applied to the supervisor's bookkeeper
        self.reports = WorkerReports(index, supervisor.balancer.pool,
                                     supervisor.balancer.bookkeeper,
                                     supervisor.balancer.budgets,
                                     supervisor.balancer.fairness)
        self.started = started
        self.pid: int | None = None
        self.ready = False
        self.ended = False
        self._lines = Lines()
        self._log_lines = Lines()
        self._error_lines = Lines()

    def serving(self) -> None:
        """It said ``Ready``: its port is open and it serves."""
        self.ready = True

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.pid = self.transport.pid

    def send(self, line: bytes) -> None:
        if not self.ended and self.transport is not None:
            self.transport.write(line)

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        if childFD == 1:
            for line in self._log_lines.feed(data):
                _relog(self.index, line)
            return
        if childFD == 2:
            for line in self._error_lines.feed(data):
                log.error("worker {index}: {line}", index=self.index,
                          line=line.decode("utf-8", "replace"))
            return
        messages: list[FromWorker] = []
        for line in self._lines.feed(data):
            try:
                message = decode(line)
            except WireError as error:
                log.warn("worker {index} sent a malformed message, ignored: {error}",
                         index=self.index, error=str(error))
                continue
            if isinstance(message, Hello | State | Reload | Kick | Stop | Shared | Taken | Levels
                          | Revoked):
                log.warn("worker {index} sent a message only a supervisor sends, ignored: "
                         "{kind}", index=self.index, kind=message.kind)
                continue
            messages.append(message)
        self.supervisor.received(self, messages)

    def processEnded(self, reason: Failure) -> None:
        self.ended = True
        self.supervisor.ended(self, reason)


class WorkerSupervisor(Service):
    """Starts, feeds, restarts and stops the worker processes of one balancer."""

    def __init__(self, balancer: LoadBalancer, shared: SharedCounts, reactor: Any,
                 workers: int, executable: str = sys.executable) -> None:
        self.balancer = balancer
        self.shared = shared
        self.reactor = reactor
        self.count = workers
        self.executable = executable
        self.socket: socket.socket | None = None
        self.workers: dict[int, WorkerProcess] = {}
        self.restarts = [0] * workers
        #: failed starts in a row (a young death or a spawn that raised), for the backoff
        self._failures = [0] * workers
        self.stopping = False
        self._push_call: IDelayedCall | None = None
        self._last_state = b""
        self._all_ended: Deferred[None] | None = None
        self._config_blob = config_blob(balancer.config)
        balancer.pool.on_update.append(self._schedule_push)
        # a reload (SIGHUP, POST /reload) reaches this process: pass it on to the workers
        balancer.reloader.on_applied.append(self.reconfigure)
        # the queues are the workers', not this process's router's (always empty)
        balancer.history.count_queue(self.queued)
        balancer.metrics.count_queue(self.queued, None)  # the classes: each worker's own
        store = balancer.store
        #: --shared-state: the workers' rate-limit takes, made here through the store
        self.relay = TakeRelay(ISharedRateTakes(store, None))
        self._scan: HostScan | None = None
        self._last_shared: bytes | None = None
        #: whether the shared state answers and how many replicas share it, for the workers
        self._presence = IFleetPresence(store, None)
        if self._presence is not None:
            self._presence.watch(self._push_shared)
        self._wake = IFleetWake(store, None)
        if self._wake is not None:
            # another replica freed a slot: the workers' queues look again
            self._wake.attach(balancer.pool.refresh, self._fleet_freed)
            if isinstance(store.counts, HostCounts):
                self._scan = HostScan(store.counts, reactor)
                # the workers' releases of max_conns slots, announced to the other replicas
                store.counts.tell_fell(self._host_freed)
            slots = getattr(balancer, "slots", None)
            if slots is not None:
                # another replica announced a freed slot: the workers' queues look again
                slots.wake_with(self._fleet_freed)
        #: the fleet's budget levels, as Redis answered, to pass on this turn
        self._levels: dict[str, list[Any]] = {}
        self._levels_call: IDelayedCall | None = None
        if isinstance(balancer.budgets.levels, SharedTokenLevels):
            balancer.budgets.levels.on_level.append(self._fleet_level)
        if balancer.shared_tenants is not None:
            # the other replicas' fair-share changes and revoked keys, to every worker
            balancer.fairness.on_fleet_change.append(self._fleet_served)
            balancer.shared_tenants.on_revoked.append(self._fleet_revoked)

    # -- start ----------------------------------------------------------------------------

    def privilegedStartService(self) -> None:
        """
        Bind the main port now, while twistd still has its privileges (``-u``/``--gid``
        drop them between this and :meth:`startService`): port 80 needs root to bind, not
        to accept on, so workers started later can serve it.
        """
        super().privilegedStartService()
        self._bind()

    def _bind(self) -> None:
        if self.socket is not None:
            return
        sock = self.socket = listening_socket(self.reactor, self.balancer.config.listen)
        log.info("ProxySite starting on {port} (shared by {count} worker processes)",
                 port=sock.getsockname()[1], count=self.count)

    def startService(self) -> None:
        super().startService()
        self._bind()  # started without privilegedStartService (as a plain service may be)
        for index in range(self.count):
            self._start_worker(index)
        if self._scan is not None:
            self._scan.startService()

    def _start_worker(self, index: int) -> None:
        """
        Spawn worker ``index``; if that raises (out of file descriptors or processes), log
        it and try again later rather than leave the port one worker short for good.
        """
        try:
            self._spawn(index)
        except Exception:
            self._failures[index] += 1
            delay = self._restart_delay(index)
            log.failure("could not start worker {index}; trying again in {delay:g}s",
                        index=index, delay=delay)
            self.reactor.callLater(delay, self._restart, index)

    def _restart_delay(self, index: int) -> float:
        failures = self._failures[index]
        if failures == 0:
            return RESTART_DELAY
        return float(min(CRASH_LOOP_DELAY * 2 ** (failures - 1), MAX_RESTART_DELAY))

    def _spawn(self, index: int) -> None:
        assert self.socket is not None
        worker = WorkerProcess(self, index, self.reactor.seconds())
        args = [self.executable, "-m", "txlb._workers.main", "--index", str(index)]
        name = reactor_name(self.reactor)
        if name is not None:
            args += ["--reactor", name]
        self.reactor.spawnProcess(
            worker, self.executable, args, env=_worker_environment(),
            childFDs={0: "w", 1: "r", 2: "r", 3: "r", 4: self.socket.fileno(),
                      5: self.shared.fd},
        )
        self.workers[index] = worker
        worker.send(encode(Hello(
            workers=self.count, slots=self.shared.slots_max, family=int(self.socket.family),
            config=self._config_blob, state=self.balancer.pool.shared_state())))
        # the fleet's token levels: a worker that restarts must not start with every
        # budget full (what the others spent is taken here as if it had spent it there)
        for where, short in self.balancer.budgets.deficits():
            worker.send(encode(Spent([list(where)], short, 0)))
        # and the tenants' fair-share counters, as additions to its zeros
        for tenant, served in self.balancer.fairness.counters.items():
            worker.send(encode(Served(tenant, served)))
        if self.balancer.tenants.revoked:
            worker.send(encode(Revoked(sorted(self.balancer.tenants.revoked))))
        if self._presence is not None:
            worker.send(self._shared_line())

    # -- state to the workers -------------------------------------------------------------

    def reconfigure(self, config: Config) -> None:
        """
        A reloaded config the supervisor's balancer applied: every worker applies it too,
        and a worker started later (a respawn) starts with it.
        """
        self._config_blob = config_blob(config)
        line = encode(Reload(self._config_blob))
        for worker in self.workers.values():
            worker.send(line)

    def _schedule_push(self) -> None:
        if self._push_call is None:
            self._push_call = self.reactor.callLater(0, self._push)

    def _push(self) -> None:
        self._push_call = None
        line = encode(State(self.balancer.pool.shared_state()))
        if line == self._last_state:
            return
        self._last_state = line
        for worker in self.workers.values():
            worker.send(line)

    def _shared_line(self) -> bytes:
        assert self._presence is not None
        return encode(Shared(*self._presence.presence()))

    def _push_shared(self) -> None:
        """Redis came or went, or a poll counted the replicas: the workers hear if it changed."""
        line = self._shared_line()
        if line == self._last_shared:
            return
        self._last_shared = line
        for worker in self.workers.values():
            worker.send(line)

    def _host_freed(self, key: str, slots: int) -> None:
        """This host's workers freed ``slots`` of ``key``: announced if it has max_conns."""
        wake, backend = self._wake, self.balancer.pool.get(key)
        if wake is not None and backend is not None and backend.spec.max_conns:
            for _ in range(min(slots, backend.spec.max_conns)):
                wake.publish_freed(key)

    def _fleet_level(self, bucket: Bucket, level: float) -> None:
        """A budget bucket's level across the fleet: every worker's copy takes it (this turn)."""
        key, capacity, rate = bucket
        self._levels[key] = [key, capacity, rate, level]
        if self._levels_call is None:
            self._levels_call = self.reactor.callLater(0, self._push_levels)

    def _push_levels(self) -> None:
        self._levels_call = None
        entries, self._levels = list(self._levels.values()), {}
        for start in range(0, len(entries), MAX_SPENT_BUCKETS):
            line = encode(Levels(entries[start:start + MAX_SPENT_BUCKETS]))
            for worker in self.workers.values():
                worker.send(line)

    def _fleet_freed(self) -> None:
        """Another replica freed a slot (or Redis went: the others' counts forgotten)."""
        self.balancer.pool.slots.capacity_changed()
        for worker in self.workers.values():
            if self.shared.waiters(worker.index) > 0:
                worker.send(_KICK)

    # -- messages from the workers --------------------------------------------------------

    def received(self, worker: WorkerProcess, messages: list[FromWorker]) -> None:
        """
        A worker's messages, each handed to the bookkeeper (through the worker's
        :class:`~txlb._workers.reports.WorkerReports`); if any ended a request that held a
        slot, the other workers' queues are looked at again.  ``Ready`` also marks the
        worker serving.
        """
        freed = False
        for message in messages:
            try:
                if isinstance(message, Ready):
                    worker.serving()
                    log.info("worker {index} (pid {pid}) serving",
                             index=worker.index, pid=message.pid)
                elif isinstance(message, Spent | Served):
                    self._relay(worker, message)
                elif isinstance(message, Take):
                    self._take(worker, message)
                    continue
                freed = worker.reports.apply(message) or freed
            except Exception:
                log.failure("could not handle a message from worker {index}",
                            index=worker.index)
        if freed:
            self._slots_freed(worker)

    def _relay(self, source: WorkerProcess, message: Spent | Served) -> None:
        """
        What one worker's token budgets spent, or its fair queue served, to every other
        worker (one encoding); the supervisor applies it too (its reports, below).
        """
        line = encode(message)
        for worker in self.workers.values():
            if worker is not source:
                worker.send(line)

    def _fleet_served(self, tenant: str, amount: float) -> None:
        """Another replica's change of a tenant's counter, as Redis answered: every worker's."""
        line = encode(Served(tenant, amount))
        for worker in self.workers.values():
            worker.send(line)

    def _fleet_revoked(self, digests: frozenset[str]) -> None:
        """The keys the fleet revoked, as Redis answered: every worker refuses them too."""
        line = encode(Revoked(sorted(digests)))
        for worker in self.workers.values():
            worker.send(line)

    def _take(self, worker: WorkerProcess, message: Take) -> None:
        """A worker's rate-limit take, through the store; the answer goes back to it."""
        self.relay.take(message).addCallback(
            lambda taken: worker.send(encode(taken)))

    def _slots_freed(self, source: WorkerProcess | None) -> None:
        """Requests ended (or a worker died): wake the queues of the other workers."""
        self.balancer.pool.refresh()  # also forgets removed backends now idle everywhere
        for worker in self.workers.values():
            if worker is not source and self.shared.waiters(worker.index) > 0:
                worker.send(_KICK)

    # -- ends -----------------------------------------------------------------------------

    def ended(self, worker: WorkerProcess, reason: Failure) -> None:
        index = worker.index
        if self.workers.get(index) is worker:
            del self.workers[index]
        lost = self.shared.row_status(index)["in_flight"]
        self.shared.retire(index)  # nobody writes this row any more: zero it
        self._slots_freed(None)
        code = getattr(reason.value, "exitCode", None)
        if self.stopping:
            if code not in (0, None):
                log.warn("worker {index} (pid {pid}) ended: {reason}", index=index,
                         pid=worker.pid, reason=reason.getErrorMessage())
            if not self.workers and self._all_ended is not None:
                done, self._all_ended = self._all_ended, None
                self._stop_scan()
                done.callback(None)
            return
        young = self.reactor.seconds() - worker.started < YOUNG
        self._failures[index] = self._failures[index] + 1 if young else 0
        delay = self._restart_delay(index)
        log.warn("worker {index} (pid {pid}) ended unexpectedly ({reason}) with {lost} "
                 "requests in flight (their clients saw the connection close; they have no "
                 "result-log line); its counts are cleared and it restarts in {delay:g}s",
                 index=index, pid=worker.pid, reason=reason.getErrorMessage(), lost=lost,
                 delay=delay)
        self.restarts[index] += 1
        self.reactor.callLater(delay, self._restart, index)

    def _restart(self, index: int) -> None:
        if not self.stopping and self.running and index not in self.workers:
            self._start_worker(index)

    def stopService(self) -> Deferred[None]:
        """Ask every worker to drain and stop; fire once they all ended."""
        super().stopService()
        self.stopping = True
        if self.socket is not None:
            self.socket.close()  # the workers' copies stay open until each has stopped
            self.socket = None
        if not self.workers:
            self._stop_scan()
            return succeed(None)
        done = self._all_ended = Deferred()
        for worker in self.workers.values():
            worker.send(_STOP)
        timeout = self.balancer.config.shutdown_timeout + KILL_GRACE
        killer = self.reactor.callLater(timeout, self._kill_stragglers)
        done.addBoth(lambda result: killer.cancel() if killer.active() else None)
        return done

    def _stop_scan(self) -> None:
        """The workers ended: their rows are zero, and the last scan publishes that."""
        if self._scan is not None and self._scan.running:
            self._scan.counts.scan()
            self._scan.stopService()

    def _kill_stragglers(self) -> None:
        for worker in list(self.workers.values()):
            log.warn("worker {index} (pid {pid}) did not stop in time; killing it",
                     index=worker.index, pid=worker.pid)
            if worker.transport is not None:
                with contextlib.suppress(neterror.ProcessExitedAlready):
                    worker.transport.signalProcess("KILL")

    # -- status ---------------------------------------------------------------------------

    def queued(self) -> int:
        """Requests waiting for a slot in every worker."""
        return sum(self.shared.waiters(index) for index in range(self.count))

    def status(self) -> dict[str, object]:
        """The admin ``/status`` key ``workers``: one entry per worker process."""
        rows = []
        for index in range(self.count):
            worker = self.workers.get(index)
            row: dict[str, object] = {"index": index, **self.shared.row_status(index)}
            row["pid"] = worker.pid if worker is not None else None
            row["ready"] = worker is not None and worker.ready
            row["restarts"] = self.restarts[index]
            rows.append(row)
        return {"workers": rows}
