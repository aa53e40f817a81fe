"""
The queue's wake across replicas: a subscription to ``<prefix>:freed``.

A request queued at ``max_conns`` on one replica must learn at once that another replica
freed a slot of its backend, not at the next poll.  Each replica that gives such a slot back
publishes ``"<replica> <backend>"`` on the channel (:meth:`RedisStore.publish_freed
<txlb._shared.store.RedisStore.publish_freed>`, right after the row that shows the freed
count); every replica subscribes here and is told the backend of each message from another
replica.  A subscribed connection can carry nothing else, so this is a second connection,
made and remade by txredisapi's reconnecting factory; a message lost while it is down costs
at most one poll (the poll still reads the rows and wakes the queue when a count fell).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger

from txlb._config.shared import SharedStateSpec

log = Logger()

#: Longest message taken from the channel (a replica id and a backend key); anything longer
#: is not one of ours and is ignored.
MAX_MESSAGE = 400


def parse_freed(message: object, me: str) -> str | None:
    """The backend key of a ``"<replica> <backend>"`` message from another replica, else None."""
    if isinstance(message, bytes):
        try:
            message = message.decode("utf-8")
        except UnicodeDecodeError:
            return None
    if not isinstance(message, str) or len(message) > MAX_MESSAGE:
        return None
    replica, _, key = message.partition(" ")
    if not replica or not key or replica == me or " " in key:
        return None
    return key


class FreedChannel:
    """
    The subscription: ``on_freed(key)`` for each slot another replica announces freed.
    Nothing here blocks or is awaited by a request.
    """

    def __init__(self, spec: SharedStateSpec, channel: str, replica: str,
                 on_freed: Callable[[str], object]) -> None:
        self.spec = spec
        self.channel = channel
        self.replica = replica
        self.on_freed = on_freed
        #: messages taken (from other replicas, well formed)
        self.heard = 0
        self._factory: Any = None

    def received(self, channel: object, message: object) -> None:
        """One message of the subscription (from txredisapi's protocol)."""
        if isinstance(channel, bytes):
            channel = channel.decode("utf-8", "replace")
        if channel != self.channel:
            return
        key = parse_freed(message, self.replica)
        if key is None:
            return
        self.heard += 1
        try:
            self.on_freed(key)
        except Exception:
            log.failure("waking the queue on a slot freed by another replica failed")

    def start(self) -> None:
        """Connect and subscribe, again after every lost connection (in the background)."""
        import txredisapi  # type: ignore[import-untyped]  # imported late: see txlb._shared.link

        from txlb._shared.replies import bounded

        channel = self
        # a hostile server's bytes on this connection are read within the same bounds
        subscriber_base: Any = bounded(txredisapi.SubscriberProtocol)

        class Subscriber(subscriber_base):
            def connectionMade(self) -> Any:
                # subscribe once authenticated and in the database (whenConnected fires then)
                self.whenConnected().addCallback(
                    lambda protocol: protocol.subscribe(channel.channel)).addErrback(
                    lambda failure: None)
                return super().connectionMade()

            def messageReceived(self, pattern: object, name: object, message: object) -> None:
                channel.received(name, message)

        factory = txredisapi.SubscriberFactory(isLazy=True)
        factory.protocol = Subscriber
        factory.password, factory.username = self.spec.password, self.spec.username
        factory.initialDelay, factory.maxDelay = 0.25, 2.0
        from txlb._shared.link import client_tls

        # the same trust as the link's own connection: the URL's ``ca`` if it names one
        tls: Any = client_tls(self.spec) if self.spec.tls else None
        factory.startConnecting(txredisapi._makeEndpoint(
            self.spec.host, self.spec.port, 1.0, tls))
        self._factory = factory

    def stop(self) -> Deferred[Any]:
        factory, self._factory = self._factory, None
        if factory is None:
            return succeed(None)
        done: Deferred[Any] = factory.disconnect()
        return done.addErrback(lambda failure: None)
