"""
What a DNS answer means for membership, pure: which records are usable addresses, how an
SRV answer's priorities become tiers, how long until the next resolution.  No I/O and no
clock here, so every rule is tested with plain values.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Sequence

import attrs
from twisted.names import dns

from txlb._config.backends import MAX_ADDRESSES_PER_NAME, BackendSpec, DnsBackendSpec
from txlb._config.hosts import is_host_name

__all__ = ["MAX_ADDRESSES_PER_NAME", "Member", "Resolved"]

#: Re-resolution follows the records' TTL, within these bounds: a zero TTL does not turn
#: into a query per reactor turn, and a TTL of a year still notices a change in 5 minutes.
MIN_TTL = 1.0
MAX_TTL = 300.0
#: after a failed resolution the next try waits 1, 2, 4 ... seconds, up to this
MAX_RETRY = 30.0


@attrs.frozen(order=True)
class Member:
    """One address a name yields: where, and (SRV) its priority tier and weight."""

    priority: int
    host: str
    port: int
    weight: int | None = None  # None: the entry's own weight (dns:)

    @property
    def key(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def spec(self, entry: DnsBackendSpec) -> BackendSpec:
        """The backend this address is, with the entry's ``max_conns`` and models."""
        return entry.backend(self.host, self.port, self.weight)


@attrs.frozen
class Resolved:
    """One resolution's members (sorted, capped), their TTL and what was left out."""

    members: tuple[Member, ...]
    ttl: float
    #: records whose address cannot be a backend (0.0.0.0, multicast, broadcast, ...)
    skipped: int = 0
    #: usable addresses beyond :data:`MAX_ADDRESSES_PER_NAME`
    cut: int = 0
    #: why part of the answer is missing (the A query failed while AAAA answered, one SRV
    #: target did not resolve), or ``None``: such an answer is not the whole set, so it
    #: never replaces a good one (it only starts a name that has none yet)
    partial: str | None = None


def usable_address(address: str) -> str | None:
    """
    ``address`` in its one spelling if a backend can live there, else ``None``: the
    unspecified address, multicast, broadcast and reserved space are no engine's, and an
    IPv6 link-local one needs an interface txlb cannot name in ``host:port``.
    """
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    if ip.is_unspecified or ip.is_multicast or ip.is_link_local:
        return None
    if isinstance(ip, ipaddress.IPv4Address) and (ip.is_reserved
                                                  or ip == ipaddress.IPv4Address(
                                                      "255.255.255.255")):
        return None
    return ip.compressed


def bounded_ttl(ttl: float) -> float:
    """The seconds until the next resolution for records of ``ttl``."""
    return min(MAX_TTL, max(MIN_TTL, float(ttl)))


def retry_delay(failures: int) -> float:
    """The seconds until the next try after ``failures`` failed resolutions in a row."""
    return min(MAX_RETRY, MIN_TTL * 2 ** max(0, min(failures - 1, 16)))


def capped(members: Iterable[Member], skipped: int, ttls: Sequence[float],
           partial: str | None = None) -> Resolved:
    """The members sorted and de-duplicated, the lowest :data:`MAX_ADDRESSES_PER_NAME` kept."""
    unique = sorted(set(members))
    seen: set[str] = set()
    kept = []
    for member in unique:  # an address twice (two SRV records): its lowest priority
        if member.key not in seen:
            seen.add(member.key)
            kept.append(member)
    cut = max(0, len(kept) - MAX_ADDRESSES_PER_NAME)
    ttl = bounded_ttl(min(ttls)) if ttls else MIN_TTL
    return Resolved(tuple(kept[:MAX_ADDRESSES_PER_NAME]), ttl, skipped, cut, partial)


def address_records(answers: Iterable[dns.RRHeader]) -> tuple[list[str], int, list[float]]:
    """The A/AAAA addresses of an answer section, how many were unusable, their TTLs."""
    addresses: list[str] = []
    ttls: list[float] = []
    skipped = 0
    for record in answers:
        payload = record.payload
        if isinstance(payload, dns.Record_A):
            address = usable_address(payload.dottedQuad())
        elif isinstance(payload, dns.Record_AAAA):
            address = usable_address(_ipv6_text(payload))
        else:
            continue  # the CNAME chain, or anything a server added
        if address is None:
            skipped += 1
            continue
        addresses.append(address)
        ttls.append(float(record.ttl))
    return addresses, skipped, ttls


def _ipv6_text(payload: dns.Record_AAAA) -> str:
    return str(ipaddress.IPv6Address(payload.address))


@attrs.frozen
class Target:
    """One SRV record: a host name to resolve, on its port, with its priority and weight."""

    name: str
    port: int
    priority: int
    weight: int
    ttl: float


def srv_targets(answers: Iterable[dns.RRHeader]) -> tuple[list[Target], int]:
    """
    The usable SRV records of an answer section and how many were not: a target of
    ``.`` ("no such service here", RFC 2782), port 0, or a name no backend can have.
    The lowest :data:`MAX_ADDRESSES_PER_NAME` by priority and name are kept.
    """
    targets: list[Target] = []
    skipped = 0
    for record in answers:
        payload = record.payload
        if not isinstance(payload, dns.Record_SRV):
            continue
        name = payload.target.name.decode("ascii", "replace").rstrip(".").lower()
        if not name or not payload.port or not is_host_name(name):
            skipped += 1
            continue
        targets.append(Target(name, payload.port, payload.priority,
                              # weight 0 is "rarely" in RFC 2782; a backend needs 1 or more
                              max(1, payload.weight), float(record.ttl)))
    targets.sort(key=lambda t: (t.priority, t.name, t.port))
    return targets[:MAX_ADDRESSES_PER_NAME], skipped


def in_rotation(members: Sequence[Member], available: Callable[[str], bool]) -> list[Member]:
    """
    The members that belong in the pool, as SRV clients use priorities: the lowest tier
    always, and each next tier too while no member of every lower tier is ``available``.
    Plain ``dns:`` members are all one tier.
    """
    chosen: list[Member] = []
    for priority in sorted({member.priority for member in members}):
        tier = [member for member in members if member.priority == priority]
        chosen.extend(tier)
        if any(available(member.key) for member in tier):
            break
    return chosen
