"""
The connection to the shared Redis, and what happens when it fails.

Every call here is bounded: a command that has not answered within :attr:`RedisLink.timeout`
is cancelled and counts as a failure, and while the link is down nothing but the store's
periodic poll is sent (so nothing piles up behind a dead server).  The first failure after
a success is logged once -- the replicas fall back to their local view -- and the first
success after it once more; ``/status`` and the metrics show the state in between.

The client is ``txredisapi`` (the maintained Twisted Redis client: replies in order on one
connection, so commands written back to back are pipelined; scripts; reconnection with
backoff through ``ClientService``; TLS through the ``IOpenSSLClientConnectionCreator`` it
accepts).  It reads the global reactor when imported, so it is imported only when the link
starts -- after ``twistd`` installed its reactor -- and never by parsing a config.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from txlb._config.shared import SharedStateSpec
from txlb._shared.replies import ANY, ReplyRefused, Shape, bounded, preview

log = Logger()

#: Seconds a command may take before the link counts as down (the poll runs every
#: :data:`txlb._shared.store.POLL_INTERVAL`, so a stalled Redis is noticed within their sum).
COMMAND_TIMEOUT = 0.5
#: Longest error text kept for ``/status`` (a server's message is not ours to trust).
MAX_ERROR = 200


class Commands(Protocol):
    """What the link needs of a Redis client: one command, its reply in a Deferred."""

    def execute_command(self, *args: Any, **kwargs: Any) -> Deferred[Any]: ...


class LinkDown(Exception):
    """The shared store is unreachable: the caller keeps to its local view."""


class Script:
    """
    A Lua script run by its SHA1 (``EVALSHA``), sent whole only when the server lacks it;
    ``name`` and ``expect`` (what it answers) are for checking and naming its replies.
    """

    def __init__(self, source: str, name: str = "a script", expect: Shape = ANY) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode("utf-8")).hexdigest()
        self.name = name
        self.expect = expect


class BadReply(Exception):
    """Redis answered, but not what the command answers: it is not a Redis txlb can use."""


def drop_connections(client: object) -> None:
    """
    Abort the connections of a txredisapi client (its factory's pool): a call given up on
    must not leave its connection reading whatever the server sends next, and a server
    that answered nonsense is not spoken to again on the same connection.  The factory
    reconnects as after any lost connection.  A client without a factory (a test's) has
    nothing to drop.
    """
    factory = getattr(client, "_factory", None)
    for protocol in list(getattr(factory, "pool", ())):
        transport = getattr(protocol, "transport", None)
        if transport is not None:
            transport.abortConnection()


def _utc(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat(
        timespec="milliseconds").replace("+00:00", "Z")


def client_tls(spec: SharedStateSpec) -> Any:
    """
    The TLS options of a ``rediss://`` link: the server's certificate checked for the
    URL's host, against the URL's ``ca`` if it names one, else the system's CAs.
    """
    from twisted.internet.ssl import Certificate, optionsForClientTLS, trustRootFromCertificates

    from txlb._config.shared import ca_certificates

    if spec.ca is None:
        return optionsForClientTLS(spec.host)
    roots = trustRootFromCertificates(
        [Certificate.loadPEM(pem.encode("ascii")) for pem in ca_certificates(spec.ca)])
    return optionsForClientTLS(spec.host, trustRoot=roots)


def no_delay(base: Any) -> Any:
    """
    A subclass of the txredisapi protocol ``base`` that turns Nagle's algorithm off: a
    command written while an earlier one is unacknowledged would otherwise wait for that
    acknowledgement (0.14 ms p50 and 8.4 ms p99 per round trip on loopback, against 0.08
    and 0.2 ms without).  The factory builds its protocols only once connected, so setting
    it right after the connection is made applies to the first connection too.
    """

    class NoDelay(base):
        def connectionMade(self) -> Any:
            transport = getattr(self.transport, "setTcpNoDelay", None)
            if transport is None:  # TLS: the socket is the wrapped transport's
                transport = getattr(getattr(self.transport, "transport", None),
                                    "setTcpNoDelay", None)
            if transport is not None:
                with contextlib.suppress(OSError):
                    transport(True)
            return super().connectionMade()

    return NoDelay


class RedisLink:
    """
    One Redis connection as the store uses it: bounded calls, an up/down state with its
    transitions logged once, and listeners told of each transition.
    """

    def __init__(self, spec: SharedStateSpec, clock: IReactorTime,
                 client: Commands | None = None, timeout: float = COMMAND_TIMEOUT,
                 answer_errors: tuple[type[BaseException], ...] = ()) -> None:
        self.spec = spec
        #: the client's class of an error Redis answered (a ``NOSCRIPT`` one is not a failure)
        self.answer_errors = answer_errors
        self.clock = clock
        self.timeout = timeout
        self._client = client
        #: whether the last call answered
        self.connected = False
        #: when :attr:`connected` last changed (or the link was made)
        self.since = clock.seconds()
        self.last_error: str | None = None
        #: times the replica fell back to its local view (up -> down transitions)
        self.fallbacks = 0
        #: whether it was ever up (the first failure at start is logged too)
        self._ever_up = False
        self._down_logged = False
        self.on_up: list[Callable[[], object]] = []
        self.on_down: list[Callable[[], object]] = []
        #: why Redis refused this client's login (AUTH or SELECT), if it did
        self.refusal: str | None = None
        #: the client's class of a lost connection: after the link dropped it, what the
        #: calls on it say is the consequence, not the cause, and last_error keeps the cause
        self.lost_errors: tuple[type[BaseException], ...] = ()
        self._dropped = False
        #: the last refusal of what Redis sent, since the last answer
        self._refused_reply: str | None = None

    # -- life cycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Connect (in the background; the first poll finds out whether it worked)."""
        if self._client is not None:
            return
        import txredisapi  # type: ignore[import-untyped]  # the global reactor is installed by now (see the module's doc)

        from txlb._compat import quiet_client_service

        if not getattr(txredisapi.ClientService, "quiet", False):
            # one line per reconnection attempt is not ours to print: the link logs once
            txredisapi.ClientService = quiet_client_service(txredisapi.ClientService)
            txredisapi.ClientService.quiet = True

        tls: Any = False
        if self.spec.tls:
            tls = client_tls(self.spec)
        client = txredisapi.lazyConnection(
            host=self.spec.host, port=self.spec.port, dbid=self.spec.db, reconnect=True,
            password=self.spec.password, username=self.spec.username,
            ssl_context_factory=tls, connectTimeout=1.0, replyTimeout=None,
            convertNumbers=False)
        # back to a returning Redis within a couple of seconds, not the default ten
        factory = client._factory
        factory.initialDelay, factory.maxDelay = 0.25, 2.0
        # replies read within bounds (txlb._shared.replies), on the plain parser whatever
        # txredisapi would pick; and the slot script is awaited by a request: no Nagle
        # delay behind the flush's writes
        factory.protocol = no_delay(bounded(txredisapi.BaseRedisProtocol, self.clock,
                                            self.reply_refused))
        # a refused AUTH or SELECT reaches only the factory (the client stops retrying and
        # every command fails as "Not connected"): keep its words for last_error
        told = factory.connectionError

        def refused(why: str) -> None:
            self.refused(why)
            told(why)

        factory.connectionError = refused
        self._client = client
        self.answer_errors = (txredisapi.ResponseError,)
        self.lost_errors = (txredisapi.ConnectionError,)

    def stop(self) -> Deferred[Any] | None:
        client, self._client = self._client, None
        disconnect = getattr(client, "disconnect", None)
        return disconnect() if disconnect is not None else None

    def reply_refused(self, why: str) -> None:
        """
        A connection was dropped for what Redis sent (txlb._shared.replies): down, in those
        words, until a call answers -- the calls that then wait for a new connection in vain
        say only that they had no answer.
        """
        self._refused_reply = why
        self._failed(Failure(ReplyRefused(why)))

    def refused(self, why: str) -> None:
        """
        Redis refused the login (a wrong password, an unknown user or database): every
        later failure is reported with these words, not as the "Not connected" the client
        answers from then on -- a wrong password is not a slow server.
        """
        self.refusal = str(why)

    # -- calls --------------------------------------------------------------------------

    def call(self, *args: Any, probe: bool = False, expect: Shape = ANY,
             what: str | None = None) -> Deferred[Any]:
        """
        Send one command.  While the link is down only a ``probe`` is sent (the poll that
        finds out it is back); anything else fails at once with :class:`LinkDown`.  A reply
        that is not ``expect`` fails with :class:`BadReply` (``what`` names the command in
        ``last_error``) and counts as down: a server answering nonsense shares nothing.
        """
        if self._client is None or not (self.connected or probe):
            return fail(LinkDown("shared state unreachable"))
        result = self._client.execute_command(*args)
        timers: list[Any] = []
        timers.append(self.clock.callLater(self.timeout, self._expire, result, timers))

        def settled(value: object) -> object:
            for timer in timers:
                if timer.active():
                    timer.cancel()
            if not isinstance(value, Failure) and not expect.fits(value):
                value = Failure(BadReply(
                    f"{what or args[0]} answered {preview(value)}, not {expect.words}"))
                self._failed(value)
                self._drop()
                return value
            if isinstance(value, Failure) and not self._script_missing(value):
                self._failed(value)
                return value
            self._answered()
            return value

        result.addBoth(settled)
        return result

    def _expire(self, result: Deferred[Any], timers: list[Any]) -> None:
        """
        A command's time is up -- unless the reactor itself was busy (a large reply being
        parsed, a loaded machine): timed calls run before the sockets are read, so the
        answer may be waiting unread.  One more turn of the reactor reads it; only a
        command still unanswered then is given up.  A slow reactor is not a slow Redis.
        """
        timers.append(self.clock.callLater(0, self._give_up, result))

    def _give_up(self, result: Deferred[Any]) -> None:
        """
        Cancel an unanswered command and drop its connection: left open, it would go on
        reading whatever the server sends (a stalled server's late replies, a hostile one's
        endless bytes) for calls that no longer wait.  The client reconnects.  (An answer
        cancels this timer: ``result.called`` cannot say, it is true while ``result``
        waits on the client's own Deferred.)
        """
        result.cancel()
        self._drop()

    def _drop(self) -> None:
        self._dropped = True
        drop_connections(self._client)

    def run(self, script: Script, keys: Sequence[str], args: Sequence[Any],
            probe: bool = False, expect: Shape | None = None) -> Deferred[Any]:
        """
        Run ``script`` by its SHA1, sending its source only if Redis has not got it; its
        reply must be ``expect``, else what the script says it answers.
        """
        shape = expect or script.expect
        result = self.call("EVALSHA", script.sha, len(keys), *keys, *args, probe=probe,
                           expect=shape, what=script.name)

        def unknown(failure: Failure) -> object:
            if "NOSCRIPT" not in str(failure.value):
                return failure
            return self.call("EVAL", script.source, len(keys), *keys, *args, probe=probe,
                             expect=shape, what=script.name)

        return result.addErrback(unknown)

    def _script_missing(self, failure: Failure) -> bool:
        """
        Redis answered that it lacks a script (:meth:`run` sends it whole next): the link
        is up.  Any other error answer (``NOAUTH``, ``OOM``, ``READONLY``) means nothing
        can be shared through this server, and counts as down.
        """
        return bool(failure.check(*self.answer_errors)) and "NOSCRIPT" in str(failure.value)

    # -- state --------------------------------------------------------------------------

    def _answered(self) -> None:
        if self.connected:
            return
        self.connected, self.since, self._ever_up = True, self.clock.seconds(), True
        self._down_logged = self._dropped = False
        self._refused_reply = None
        log.info("shared state: connected to {url}; sharing counts, marks and rate "
                 "buckets with the other replicas", url=self.spec.masked)
        self._tell(self.on_up)

    def _failed(self, failure: Failure) -> None:
        if not (self._dropped and self.last_error and failure.check(*self.lost_errors)):
            self.last_error = self._words(failure)
        if self.connected:
            self.connected, self.since = False, self.clock.seconds()
            self.fallbacks += 1
            self._tell(self.on_down)
        elif not self._ever_up and not self.fallbacks:
            # never reached: this replica has been on its local view since it started
            self.fallbacks = 1
        if not self._down_logged:
            self._down_logged = True
            log.warn("shared state: {url} unreachable ({error}); this replica uses its "
                     "local view until it answers again", url=self.spec.masked,
                     error=self.last_error)

    def _words(self, failure: Failure) -> str:
        from twisted.internet.defer import CancelledError

        if self.refusal is not None:
            text = f"login refused ({self.refusal}); the client stopped retrying"
        elif failure.check(CancelledError) and self._refused_reply is not None:
            text = self._refused_reply
        elif failure.check(CancelledError):
            text = f"no answer within {self.timeout:g}s"
        elif failure.check(ReplyRefused, BadReply):
            text = failure.getErrorMessage()
        else:
            text = f"{type(failure.value).__name__}: {failure.getErrorMessage()}"
        if self.spec.password:
            text = text.replace(self.spec.password, "***")
        return "".join(c if c.isprintable() else "?" for c in text)[:MAX_ERROR]

    def _tell(self, listeners: list[Callable[[], object]]) -> None:
        for listener in list(listeners):
            try:
                listener()
            except Exception:
                log.failure("a shared-state listener failed")

    def status(self) -> dict[str, object]:
        """The ``shared_state`` of ``/status`` (the URL masked)."""
        return {
            "url": self.spec.masked,
            "connected": self.connected,
            "since": _utc(self.since),
            "last_error": self.last_error,
            "fallbacks": self.fallbacks,
        }
