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

import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
from twisted.logger import Logger
from zope.interface import implementer

from txlb._cluster.store import IBackendMarks, Marks
from txlb._config import BackendSpec

log = Logger()

#: Entries of the shared hash a replica takes at most (a hostile hash cannot grow its pool
#: without bound).
MAX_MEMBERS = 4096
#: Longest entry read (a spec with its models).
MAX_ENTRY = 16_384


@attrs.frozen
class Entry:
    """One backend's entry in the shared hash."""

    spec: BackendSpec
    draining: bool
    removing: bool
    healthy: bool
    by: str

    def encode(self) -> str:
        spec = self.spec
        return json.dumps({
            "spec": [spec.host, spec.port, spec.weight, spec.max_conns, list(spec.models)],
            "draining": self.draining, "removing": self.removing,
            "healthy": self.healthy, "by": self.by,
        }, separators=(",", ":"))

    @classmethod
    def decode(cls, key: str, text: str) -> Entry | None:
        """The entry of ``key``, or ``None`` for anything that is not one txlb wrote."""
        if len(text) > MAX_ENTRY:
            return None
        try:
            data = json.loads(text)
            host, port, weight, max_conns, models = data["spec"]
            spec = BackendSpec(str(host), int(port), int(weight), int(max_conns),
                               tuple(str(model)[:512] for model in models[:256]))
            entry = cls(spec, bool(data["draining"]), bool(data["removing"]),
                        bool(data["healthy"]), str(data["by"]))
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        if spec.key != key or not 0 < spec.port < 65536 or not 0 < spec.weight <= 10_000 \
                or spec.max_conns < 0:
            return None
        return entry


def _refused(reason: str) -> bool:
    return "connection refused" in reason


@implementer(IBackendMarks)
class SharedMarks:
    """One replica's side of the shared hash: what it wrote, what it read, what changed."""

    def __init__(self, replica: str) -> None:
        self.replica = replica
        #: the hash as last read or written here, per backend key
        self._known: dict[str, Entry] = {}
        #: entries other replicas changed, not handed to the pool yet
        self._pending: dict[str, tuple[Entry, bool]] = {}
        #: written before the first contact with Redis: added only where Redis has none
        self.claims: dict[str, Entry] = {}
        #: written since, not yet sent (Redis unreachable meanwhile): the latest per key
        self.unsent: dict[str, Entry] = {}
        #: whether Redis was reached once (saves before are claims)
        self.started = False
        #: told when a save left something to send (the store writes it this turn)
        self.on_saved: Callable[[], object] = lambda: None

    def save(self, spec: BackendSpec, marks: Marks, reason: str = "") -> None:
        known = self._known.get(spec.key)
        healthy = True if known is None else known.healthy
        if marks.healthy is False and _refused(reason):
            healthy = False
        elif marks.healthy:
            healthy = True
        entry = Entry(spec, marks.draining, marks.removing, healthy, self.replica)
        if known is not None and attrs.evolve(known, by=self.replica) == entry:
            return
        if not self.started:
            self.claims[spec.key] = entry
            return
        self._known[spec.key] = entry
        self.unsent[spec.key] = entry
        self.on_saved()

    def members(self) -> Sequence[tuple[BackendSpec, Marks]]:
        pending, self._pending = self._pending, {}
        return [(entry.spec, Marks(healthy=entry.healthy if health else None,
                                   draining=entry.draining, removing=entry.removing))
                for entry, health in pending.values()]

    def read(self, fields: Iterable[tuple[str, str]], *, whole: bool = False) -> bool:
        """
        The hash as a poll read it: what other replicas changed becomes pending for the
        pool (its health only when that changed).  ``whole``: a resync after an outage or
        at start, when every entry that differs from this replica's view counts, whoever
        wrote it.  ``True`` if anything is pending.
        """
        for count, (key, text) in enumerate(fields):
            if count >= MAX_MEMBERS:
                log.warn("shared state: more than {count} backends in the shared marks; "
                         "the rest are ignored", count=MAX_MEMBERS)
                break
            entry = Entry.decode(key, text)
            if entry is None:
                continue
            known = self._known.get(key)
            self._known[key] = entry
            if known is not None and attrs.evolve(known, by="") == attrs.evolve(entry, by=""):
                continue
            if entry.by == self.replica and not whole:
                continue
            health = known is None or known.healthy != entry.healthy
            self._pending[key] = (entry, health)
        return bool(self._pending)

    def entries(self, source: dict[str, Entry]) -> list[tuple[str, str]]:
        """``source``'s entries as hash fields to write."""
        return [(key, entry.encode()) for key, entry in source.items()]

    def status(self) -> dict[str, Any]:
        return {"members": len(self._known), "unsent": len(self.unsent)}
