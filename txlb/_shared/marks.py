"""
Backend membership and marks shared through Redis: drains, undrains, adds and removals done
on any replica's admin port, and connection refusals (and their clearing by a successful
probe), in effect on every replica at its next poll.

Redis keeps one hash, ``<prefix>:marks``, a field per backend (``host:port``) holding its
spec, its marks and the replica that wrote them last; ``<prefix>:marks:version`` counts the
writes, so a poll reads the hash only when something changed.  Which writer wins (see
docs/scale-out.md, "Which writer wins"):

* the last admin change, on any replica, holds -- across restarts -- until another one;
* a replica's start adds the backends of its config to the hash only where the hash has no
  entry for them yet (a drain or removal stored earlier stays);
* a reload that adds a backend, or lists a removed one again, writes it as a member;
* health is shared only as a connection refusal, cleared by any replica's next successful
  probe; every other verdict (5xx ejection, a hung engine) stays with the replica that
  made it.

:meth:`SharedMarks.members` hands the pool what *changed* since it last asked, written by
other replicas -- not the whole hash -- so a replica's own local verdicts are never
overwritten by an older shared copy.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
from twisted.logger import Logger
from zope.interface import implementer

from txlb._cluster.store import IBackendMarks, Marks
from txlb._config.backends import BackendSpec
from txlb._config.hosts import is_host_name
from txlb._discovery.answers import usable_address

log = Logger()

#: Entries of the shared hash a replica takes at most (a hostile hash cannot grow its pool
#: without bound).
MAX_MEMBERS = 4096
#: Longest entry read (a spec with its models).
MAX_ENTRY = 16_384
#: Fields of one read looked at at most, removed backends' entries included.
MAX_FIELDS = 65_536


#: Longest ``origin`` kept ("dns:" and a DNS name fit well within).
MAX_ORIGIN = 300
#: Origins whose entry is deleted from the hash once every replica let the backend go: a
#: DNS name adds it again whenever it answers it again, and an admin-added one has no
#: config to hold it.  A removed backend of a config keeps its entry, so its removal holds
#: across a replica's restart (one entry per such backend: bounded by the configs).
FORGOTTEN_ORIGINS = ("dns:", "admin")


def _usable_host(host: str) -> bool:
    """
    Whether ``host`` is one a backend can have: an RFC 1123 name or an address that can be
    connected to -- never a control character (a host is logged and sent as a URL), never
    0.0.0.0, multicast or a link-local address without its interface.
    """
    if not is_host_name(host):
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return True  # a name
    return usable_address(host) is not None


@attrs.frozen
class Entry:
    """One backend's entry in the shared hash."""

    spec: BackendSpec
    draining: bool
    removing: bool
    healthy: bool
    by: str
    #: where the backend came from as its writer knows it -- ``"config"``, ``"admin"``,
    #: ``"dns:NAME"`` -- or ``None`` (unknown: an entry of an older txlb)
    origin: str | None = None
    #: a replica's start-up entry, written only where the hash had none: it may add a
    #: backend another replica does not know, never undrain or un-remove one it knows
    claim: bool = False

    def encode(self) -> str:
        spec = self.spec
        data: dict[str, object] = {
            "spec": [spec.host, spec.port, spec.weight, spec.max_conns, list(spec.models)],
            "draining": self.draining, "removing": self.removing,
            "healthy": self.healthy, "by": self.by,
        }
        if self.origin is not None:
            data["origin"] = self.origin
        if self.claim:
            data["claim"] = True
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def decode(cls, key: str, text: str) -> Entry | None:
        """
        The entry of ``key``, or ``None`` for anything that is not one txlb wrote.  Whatever
        the text holds -- a huge number, nesting deep enough to exhaust the parser, a host
        nobody could connect to -- it is ``None``, never an exception: one bad field must
        not stop the others from being read.
        """
        if not isinstance(text, str) or len(text) > MAX_ENTRY:
            return None
        try:
            data = json.loads(text)
            host, port, weight, max_conns, models = data["spec"]
            if not isinstance(host, str) or not _usable_host(host):
                return None
            spec = BackendSpec(host, int(port), int(weight), int(max_conns),
                               tuple(str(model)[:512] for model in models[:256]))
            origin = data.get("origin")
            if origin is not None and not (isinstance(origin, str)
                                           and len(origin) <= MAX_ORIGIN
                                           and origin.isprintable()):
                origin = None
            entry = cls(spec, bool(data["draining"]), bool(data["removing"]),
                        bool(data["healthy"]), str(data["by"])[:200], origin,
                        data.get("claim") is True)
            if spec.key != key or not 0 < spec.port < 65536 \
                    or not 0 < spec.weight <= 10_000 or spec.max_conns < 0:
                return None
        except Exception:  # noqa: BLE001 -- see the docstring: garbage is None
            return None
        return entry

    def forgettable(self) -> bool:
        """Whether this entry goes from the hash once its backend is forgotten."""
        return self.removing and self.origin is not None \
            and self.origin.startswith(FORGOTTEN_ORIGINS)


def _refused(reason: str) -> bool:
    return "connection refused" in reason


def _marks_of(entry: Entry) -> tuple[BackendSpec, bool, bool, bool]:
    """What a pool acts on in an entry (not who wrote it, nor how)."""
    return entry.spec, entry.draining, entry.removing, entry.healthy


@implementer(IBackendMarks)
class SharedMarks:
    """One replica's side of the shared hash: what it wrote, what it read, what changed."""

    def __init__(self, replica: str) -> None:
        self.replica = replica
        #: the hash as last read or written here, per backend key
        self._known: dict[str, Entry] = {}
        #: entries other replicas changed, not handed to the pool yet
        self._pending: dict[str, tuple[Entry, bool]] = {}
        #: the pool's configured backends, saved while it was built: added only where
        #: Redis has no entry (a drain or removal stored earlier stays)
        self.claims: dict[str, Entry] = {}
        #: saved since, not yet sent (Redis unreachable meanwhile): the latest per key;
        #: ``None`` deletes the key's field
        self.unsent: dict[str, Entry | None] = {}
        #: whether the pool is still being built (its saves are claims: see :meth:`configured`)
        self.configuring = True
        #: told when a save left something to send (the store writes it this turn)
        self.on_saved: Callable[[], object] = lambda: None
        #: kinds of unreadable data already logged (each is logged once)
        self._garbled: set[str] = set()
        #: unreadable fields and replies ignored
        self.garbled_total = 0

    def tell_saved(self, told: Callable[[], object]) -> None:
        """Tell ``told`` when a save left something to send (the store writes it)."""
        self.on_saved = told

    def take_unsent(self) -> dict[str, Entry | None]:
        """What was saved and not yet sent, handed over to send (and no longer held)."""
        unsent, self.unsent = self.unsent, {}
        return unsent

    def still_unsent(self, unsent: dict[str, Entry | None]) -> None:
        """``unsent`` could not be sent: held again, under anything saved since."""
        self.unsent = {**unsent, **self.unsent}

    def take_claims(self) -> dict[str, Entry]:
        """The configured backends' claims, handed over to write (and no longer held)."""
        claims, self.claims = self.claims, {}
        return claims

    # -- IBackendMarks ------------------------------------------------------------------

    def save(self, spec: BackendSpec, marks: Marks, reason: str = "",
             origin: str | None = None) -> None:
        known = self._known.get(spec.key) or self.claims.get(spec.key)
        healthy = True if known is None else known.healthy
        if marks.healthy is False and _refused(reason):
            healthy = False
        elif marks.healthy:
            healthy = True
        if origin is None and known is not None:
            origin = known.origin
        entry = Entry(spec, marks.draining, marks.removing, healthy, self.replica, origin)
        claim = self.claims.get(spec.key)
        if self.configuring or (claim is not None and (claim.draining, claim.removing)
                                == (entry.draining, entry.removing)):
            # the pool being built, or a health verdict before Redis answered: still a
            # claim -- written as a change, its draining=False would undo a stored drain
            self.claims[spec.key] = attrs.evolve(entry, claim=True)
            return
        if known is not None and _marks_of(known) == _marks_of(entry) \
                and known.origin == entry.origin and not known.claim:
            return
        self._known[spec.key] = entry
        self.unsent[spec.key] = entry
        self.on_saved()

    def configured(self) -> None:
        """
        The pool is built: its configured backends are the claims.  Every later save --
        an admin drain, a reload -- is a change, sent as such even if Redis has not
        answered yet: it must win over whatever older entry Redis holds.
        """
        self.configuring = False

    def forget(self, key: str) -> None:
        """
        The pool let the backend of ``key`` go (removed, and idle).  Its entry leaves the
        hash when its origin says nothing would hold it (:meth:`Entry.forgettable`), so
        DNS churn and admin adds leave no entry behind; a config's backend keeps its
        removal (a replica restarting with that config must not bring it back).
        """
        entry = self._known.pop(key, None)
        self.claims.pop(key, None)
        if entry is not None and entry.forgettable():
            self.unsent[key] = None
            self.on_saved()

    def origin(self, key: str) -> str | None:
        """Where the backend of ``key`` came from, as the last entry seen says."""
        entry = self._known.get(key) or self.claims.get(key)
        return None if entry is None else entry.origin

    def members(self) -> Sequence[tuple[BackendSpec, Marks]]:
        pending, self._pending = self._pending, {}
        return [(entry.spec, Marks(healthy=entry.healthy if health else None,
                                   draining=entry.draining, removing=entry.removing))
                for entry, health in pending.values()]

    # -- what the store read and writes ---------------------------------------------------

    def read(self, fields: Iterable[tuple[str, str]], *, whole: bool = False) -> bool:
        """
        Fields of the hash as a poll read them (an empty value: the field was deleted):
        what other replicas changed becomes pending for the pool (its health only when
        that changed).  ``whole``: a resync after an outage or at start, when every entry
        that differs from this replica's view counts, whoever wrote it.  Another
        replica's start-up claim never changes a backend known here: where it disagrees
        with what this replica knows (Redis lost the hash, and that replica started
        before this one wrote it back), what this replica knows is written back.
        ``True`` if anything is pending.
        """
        live = sum(not known.removing for known in self._known.values())
        written_back = False
        for count, (key, text) in enumerate(fields):
            if count >= MAX_FIELDS:
                self.garbled("fields", f"more than {MAX_FIELDS} fields in the shared "
                             "marks; the rest are ignored")
                break
            if text == "":
                self._deleted(key)
                continue
            entry = Entry.decode(key, text)
            if entry is None:
                self.garbled("entry", f"an entry txlb did not write is ignored "
                             f"(the first: {key[:80]!r})")
                continue
            known = self._known.get(key)
            if not entry.removing and (known is None or known.removing):
                # a backend new to this replica: within the bound (removed ones do not
                # count, so old entries never crowd out a live one)
                if live >= MAX_MEMBERS:
                    self.garbled("members", f"more than {MAX_MEMBERS} backends in the "
                                 "shared marks; the rest are ignored")
                    continue
                live += 1
            if entry.claim and known is not None:
                if not known.claim and _marks_of(known) != _marks_of(entry):
                    self.unsent[key] = known
                    written_back = True
                continue
            self._known[key] = entry
            if known is not None and _marks_of(known) == _marks_of(entry):
                continue
            if entry.by == self.replica and not whole:
                continue
            health = known is None or known.healthy != entry.healthy
            self._pending[key] = (entry, health)
        if written_back:
            self.on_saved()
        return bool(self._pending)

    def _deleted(self, key: str) -> None:
        """Another replica deleted the field: its backend was removed (if not seen yet)."""
        known = self._known.pop(key, None)
        if known is not None and not known.removing:
            self._pending[key] = (attrs.evolve(known, removing=True), False)

    def known(self) -> dict[str, Entry]:
        """
        What this replica knows of the hash, for a Redis that lost it: every entry but
        those that are to leave it anyway.
        """
        return {key: entry for key, entry in self._known.items()
                if not entry.forgettable() and self.unsent.get(key, entry) is not None}

    def entries(self, source: dict[str, Entry] | dict[str, Entry | None]
                ) -> list[tuple[str, str]]:
        """``source``'s entries as hash fields to write (an empty value deletes one)."""
        return [(key, "" if entry is None else entry.encode())
                for key, entry in source.items()]

    def garbled(self, kind: str, words: str) -> None:
        """Something unreadable in Redis was ignored: said once per ``kind``, counted."""
        self.garbled_total += 1
        if kind not in self._garbled:
            self._garbled.add(kind)
            log.warn("shared state: {words} (said once)", words=words)

    def status(self) -> dict[str, Any]:
        return {"members": len(self._known), "unsent": len(self.unsent),
                "ignored": self.garbled_total}
