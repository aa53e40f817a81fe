"""
How a name is asked: Twisted's own DNS client (``twisted.names``), never ``getaddrinfo``,
so a slow or dead DNS server costs a timeout in the reactor, not a thread or the reactor
itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
from twisted.internet.defer import Deferred, DeferredList, fail
from twisted.internet.defer import TimeoutError as DeferredTimeout
from twisted.internet.error import TimeoutError as LookupTimeout
from twisted.names import client, dns, hosts, resolve
from twisted.names.common import ResolverBase
from twisted.names.error import DNSNameError, DNSQueryRefusedError, DNSServerError, DomainError
from twisted.python.failure import Failure

from txlb._config.backends import DnsBackendSpec
from txlb._discovery.answers import Member, Resolved, address_records, capped, srv_targets

#: seconds each query waits before it is sent again, then given up: 4 s at most per name
QUERY_TIMEOUT = (1, 3)


#: queries one UDP socket sends before a fresh one, on a new random source port, takes over
QUERIES_PER_SOCKET = 16


class QuietResolver(client.Resolver):
    """
    Twisted's DNS client, asking over UDP through one socket per address family that
    serves :data:`QUERIES_PER_SOCKET` queries, then gives way to a fresh one (the kernel
    picks its port at random) and closes once its last query has ended.  Not a socket per
    query: Twisted's UDP port logs two lines as it opens and closes, so that would put
    four lines a second in the service log for a name with a short TTL; not one socket
    for the process's life either: a fixed source port leaves a spoofer only the 16-bit
    query id to guess (RFC 5452 asks for both to be random).  Each query has a random id,
    and an answer from any address but the server asked is dropped
    (``DNSDatagramProtocol`` checks both); a truncated answer is asked again over TCP.
    Each server is tried in turn, one try per entry of ``timeout``.
    """

    #: resolv.conf's ``options ndots:N`` (1 when it says nothing, as the system's)
    ndots = 1
    #: resolv.conf's ``search`` domains (or its ``domain``), as Twisted parses them
    search: list[bytes] | None = None
    domain: bytes | None = None

    def __init__(self, reactor: Any, **options: Any) -> None:
        self._socket_reactor = reactor
        #: per address family: the socket queries go out on, and how many it has sent
        self._sockets: dict[int, dns.DNSDatagramProtocol] = {}
        self._sent: dict[int, int] = {}
        #: sockets given way to, still waiting for an answer to one of their queries
        self._retired: list[dns.DNSDatagramProtocol] = []
        super().__init__(reactor=reactor, **options)

    def parseConfig(self, resolvConf: Any) -> None:
        """resolv.conf as Twisted reads it, and its ``ndots`` option, which Twisted skips."""
        lines = list(resolvConf)
        self.search = self.domain = None  # a file that no longer names them: none
        self.ndots = 1
        super().parseConfig(lines)
        for line in lines:
            words = line.split()
            if words[:1] != [b"options"]:
                continue
            for option in words[1:]:
                if option.startswith(b"ndots:") and option[6:].isdigit():
                    self.ndots = min(MAX_NDOTS, int(option[6:]))

    def names(self, name: str) -> list[str]:
        """The names to ask for ``name``, in turn (resolv.conf's search list applied)."""
        domains = self.search if self.search is not None else [self.domain or b""]
        return search_names(name, [d.decode("ascii", "replace") for d in domains],
                            self.ndots)

    def queryUDP(self, queries: list[dns.Query], timeout: Any = None) -> Deferred[Any]:
        servers = [*self.servers, *self.dynServers]
        if not servers:
            return fail(OSError("no DNS server to ask"))
        return self._ask(queries, servers, list(timeout if timeout else QUERY_TIMEOUT), 0)

    def _ask(self, queries: list[dns.Query], servers: list[tuple[str, int]],
             timeouts: list[float], attempt: int) -> Deferred[Any]:
        address = servers[attempt % len(servers)]
        try:
            protocol = self._socket_for(address[0])
        except Exception:
            return fail()
        asked: Deferred[Any] = protocol.query(address, queries, timeouts[attempt])
        asked.addBoth(self._ended)

        def again(failure: Failure) -> Any:
            failure.trap(DeferredTimeout)
            if attempt + 1 >= len(timeouts):
                return failure
            return self._ask(queries, servers, timeouts, attempt + 1)

        return asked.addErrback(again)

    def _socket_for(self, host: str) -> dns.DNSDatagramProtocol:
        family = 6 if ":" in host else 4
        protocol = self._sockets.get(family)
        if protocol is not None and self._sent.get(family, 0) >= QUERIES_PER_SOCKET:
            self._retired.append(protocol)  # closed once its queries have ended
            protocol = None
        if protocol is None or protocol.transport is None:
            protocol = dns.DNSDatagramProtocol(self, reactor=self._socket_reactor)
            protocol.noisy = False
            # port 0: the kernel's pick, random on Linux (net.ipv4.ip_local_port_range)
            self._socket_reactor.listenUDP(0, protocol, interface="::" if family == 6 else "")
            self._sockets[family] = protocol
            self._sent[family] = 0
        self._sent[family] += 1
        self._close_retired()
        return protocol

    def _ended(self, result: object) -> object:
        """A query ended (answered, timed out, failed): a retired socket may close now."""
        self._close_retired()
        return result

    def _close_retired(self) -> None:
        waiting = []
        for protocol in self._retired:
            if protocol.transport is None:
                continue
            if protocol.liveMessages:
                waiting.append(protocol)
            else:
                protocol.transport.stopListening()
        self._retired = waiting

    def close_sockets(self) -> None:
        """Close every socket (a stopping balancer); a later query opens new ones."""
        sockets, self._sockets = [*self._sockets.values(), *self._retired], {}
        self._retired = []
        self._sent = {}
        for protocol in sockets:
            if protocol.transport is not None:
                protocol.transport.stopListening()


class SystemResolver(resolve.ResolverChain):
    """
    ``/etc/hosts``, then the servers of ``/etc/resolv.conf``, as the system asks, with
    its search list: ``dns:vllm:8000`` in a Kubernetes pod is
    ``vllm.<namespace>.svc.cluster.local``.
    """

    def __init__(self, reactor: Any) -> None:
        self.dns = QuietResolver(reactor, resolv="/etc/resolv.conf", timeout=QUERY_TIMEOUT)
        super().__init__([hosts.Resolver(), self.dns])

    def names(self, name: str) -> list[str]:
        return self.dns.names(name)

    def close_sockets(self) -> None:
        self.dns.close_sockets()


def system_resolver(servers: tuple[tuple[str, int], ...], reactor: Any) -> ResolverBase:
    """
    ``--resolver``'s servers, or (none given) ``/etc/hosts`` then the servers of
    ``/etc/resolv.conf``, as the system resolves a name.
    """
    if servers:
        return QuietResolver(reactor, servers=list(servers), timeout=QUERY_TIMEOUT)
    return SystemResolver(reactor)


def describe_failure(failure: Failure) -> str:
    """A resolution's failure in a few words, for the log and ``/status``."""
    error = failure.value
    if isinstance(error, DNSNameError):
        return "no such name (NXDOMAIN)"
    if isinstance(error, DNSQueryRefusedError):
        return "the DNS server refused the query"
    if isinstance(error, DNSServerError):
        return "the DNS server failed (SERVFAIL)"
    if isinstance(error, LookupTimeout | DeferredTimeout):
        return "no answer (timed out)"
    if isinstance(error, DomainError):
        return "no such name"
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 200 else text[:197] + "..."


#: resolv.conf(5)'s bound on ``ndots``; and at most this many search domains are used
MAX_NDOTS = 15
MAX_SEARCH = 6


def search_names(name: str, search: Sequence[str], ndots: int) -> list[str]:
    """
    The names to ask for ``name``, in turn, as the system's resolver does (resolv.conf(5)):
    a name with at least ``ndots`` dots as it is first, then with each search domain; one
    with fewer, with each search domain first, then as it is.  A name ending in ``.`` is
    only itself.  Names longer than DNS allows are left out.
    """
    if name.endswith("."):
        return [name.rstrip(".")]
    suffixed = [f"{name}.{domain.strip('.')}" for domain in search[:MAX_SEARCH]
                if domain.strip(".")]
    ordered = [name, *suffixed] if name.count(".") >= ndots else [*suffixed, name]
    return [candidate for index, candidate in enumerate(ordered)
            if len(candidate) <= 253 and candidate not in ordered[:index]]


class NoAddresses(Exception):
    """The name resolved, but to no address a backend can have."""

    def __str__(self) -> str:
        return "the answer holds no usable address"


def lookup(resolver: Any, entry: DnsBackendSpec) -> Deferred[Resolved]:
    """
    Resolve ``entry`` once: its members, or a failure (the caller keeps the last set).
    A part that failed (a SERVFAIL or timeout on A while AAAA answered, one SRV target's
    lookup) marks the result ``partial``: only "no such name" and "no records" mean a
    part is truly empty.
    """
    names = getattr(resolver, "names", None)
    candidates = names(entry.name) if callable(names) else [entry.name]

    def ask(name: str) -> Deferred[Resolved]:
        if entry.kind == "srv":
            return _lookup_srv(resolver, name)
        return _addresses(resolver, name).addCallback(
            lambda found: _as_resolved([Member(0, host, entry.port) for host in found.hosts],
                                       found.skipped, found.ttls, found.failed))

    return _first(candidates, ask)


def _first(names: list[str], ask: Callable[[str], Deferred[Resolved]]) -> Deferred[Resolved]:
    """
    The first of ``names`` that resolves: the next is asked only when one is not there
    (no such name, or nothing usable); any other failure ends the resolution, as a
    failed part does.
    """
    asked = ask(names[0])
    if len(names) == 1:
        return asked

    def next_one(failure: Failure) -> Deferred[Resolved]:
        if not (_empty(failure) or failure.check(NoAddresses)):
            return failure  # type: ignore[return-value]
        return _first(names[1:], ask)

    return asked.addErrback(next_one)


@attrs.frozen
class Addresses:
    """A name's A and AAAA answers together, and the failure of a part if one failed."""

    hosts: list[str]
    skipped: int
    ttls: list[float]
    #: a part that failed other than "no such name"/"no records": the rest is not whole
    failed: Failure | None = None


def _empty(failure: Failure) -> bool:
    """
    Whether a lookup's failure means "nothing there" (NXDOMAIN, or a plain
    ``DomainError``: no resolver of the chain knows the name) rather than "could not ask"
    (SERVFAIL, refused, a timeout, a malformed answer: its subclasses and the rest).
    """
    return failure.check(DNSNameError) is not None or type(failure.value) is DomainError


def _as_resolved(members: list[Member], skipped: int, ttls: list[float],
                 failed: Failure | None = None) -> Resolved:
    if not members:
        if failed is not None:
            failed.raiseException()
        raise NoAddresses()
    return capped(members, skipped, ttls,
                  None if failed is None else describe_failure(failed))


def _addresses(resolver: Any, name: str) -> Deferred[Addresses]:
    """
    A and AAAA of ``name`` asked together; a failure only when neither answers.  One
    that fails for another reason than "no such name" leaves the result ``failed``.
    """
    asked = DeferredList([resolver.lookupAddress(name, timeout=QUERY_TIMEOUT),
                          resolver.lookupIPV6Address(name, timeout=QUERY_TIMEOUT)],
                         consumeErrors=True)

    def combine(results: list[tuple[bool, Any]]) -> Addresses:
        addresses: list[str] = []
        skipped, ttls = 0, []
        failed: Failure | None = None  # could not ask
        missing: Failure | None = None  # no such name
        for ok, result in results:
            if ok:
                found, bad, times = address_records(result[0])
                addresses += found
                skipped += bad
                ttls += times
            elif _empty(result):
                missing = missing or result
            else:
                failed = failed or result
        if not any(ok for ok, _ in results):
            (failed or missing or Failure(NoAddresses())).raiseException()
        return Addresses(addresses, skipped, ttls, failed)

    return asked.addCallback(combine)


def _lookup_srv(resolver: Any, service: str) -> Deferred[Resolved]:
    def targets(result: tuple[list[dns.RRHeader], list[dns.RRHeader], list[dns.RRHeader]],
                ) -> Deferred[Resolved]:
        answers, _, additional = result
        found, skipped = srv_targets(answers)
        # the addresses the server sent along (the additional section)
        known: dict[str, tuple[list[str], list[float]]] = {}
        for record in additional:
            addresses, _, times = address_records([record])
            if addresses:
                name = record.name.name.decode("ascii", "replace").rstrip(".").lower()
                known.setdefault(name, ([], []))
                known[name][0].extend(addresses)
                known[name][1].extend(times)
        names = sorted({target.name for target in found if target.name not in known})
        asked = DeferredList([_addresses(resolver, name) for name in names],
                             consumeErrors=True)

        def members(results: list[tuple[bool, Any]]) -> Resolved:
            resolved = dict(known)
            bad = skipped
            failed: Failure | None = None  # a target that could not be asked
            for name, (ok, result) in zip(names, results, strict=True):
                if ok:
                    resolved[name] = (result.hosts, result.ttls)
                    bad += result.skipped
                    failed = failed or result.failed
                elif not _empty(result):
                    failed = failed or result
            every, ttls = [], [t.ttl for t in found]
            for target in found:
                addresses, times = resolved.get(target.name, ([], []))
                ttls += times
                every += [Member(target.priority, host, target.port, target.weight)
                          for host in addresses]
            return _as_resolved(every, bad, ttls, failed)

        return asked.addCallback(members)

    return resolver.lookupService(service, timeout=QUERY_TIMEOUT).addCallback(targets)
