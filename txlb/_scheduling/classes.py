"""
Priority classes: which class a request belongs to, and each class's queue settings.

A class is named by the request's priority header, bound to API keys, or matched by the
model or path the request names (``[[classes]]``; without one, ``interactive``, ``default``
and ``batch``).  Their order is their precedence: the router's queue serves the first class
first (:mod:`txlb._scheduling.router`).

Resolution, in order:

1. A request whose bearer token's sha256 is bound to a class may ask, in the header, for
   that class or a lower one -- never a higher one.
2. When some class is bound to keys, any other request gets the class its model or path
   matches, else the default class, and again the header may only lower it: an anonymous
   client must not jump ahead of the keys the operator ranked.
3. When no class is bound to keys (a fleet with one tenant), the header is honoured as sent;
   without it (or with a name no class has), the model/path match, else the default class.

With ``--auth keys`` the keys file binds instead: a tenant's ``class`` is what its requests
get at most (without one, the model/path match, else the default class), and the header
may only lower it, as in 1.

The token is digested at once (:func:`~txlb._scheduling.ratelimit.bearer_digest`) and only
the digest is compared: nothing here keeps or logs a key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
from twisted.web.server import Request

from txlb._config.classes import ClassSpec
from txlb._config.config import Config, class_specs
from txlb._scheduling.ratelimit import bearer_digest

#: Longest header value read as a class name (longer ones are no class).
_MAX_HEADER = 64


@attrs.frozen
class QueueClass:
    """What the queue needs of one class: its rank, its timeout, the guard and shedding."""

    name: str
    #: 0 is the highest
    rank: int
    queue_timeout: float
    #: seconds after which a waiter of this class is served next (``None``: never)
    starvation_age: float | None
    #: new requests of this class are refused (503) when this many wait, of every class
    shed_at: int | None


class PriorityClasses:
    """
    The classes in force, built from a :class:`~txlb._config.Config`: resolves a request's
    class (:meth:`resolve`) and gives the router each class's settings (:attr:`order`).
    :meth:`reconfigure` swaps them in place and tells the listeners (the router, which
    regroups its waiters).
    """

    def __init__(self, config: Config) -> None:
        #: told after every :meth:`reconfigure` (the router regroups its queue)
        self.on_change: list[Callable[[], object]] = []
        self._load(config)

    def _load(self, config: Config) -> None:
        specs = class_specs(config)
        self.header = (config.priority_header.lower().encode("ascii")
                       if config.priority_header else None)
        self.default = config.default_class
        #: ``--queue-timeout``: a class's own ``queue_timeout`` is in :attr:`order`
        self.queue_timeout = config.queue_timeout
        self.order: tuple[QueueClass, ...] = tuple(
            QueueClass(spec.name, rank, spec.queue_timeout or config.queue_timeout,
                       spec.starvation_age, spec.shed_at)
            for rank, spec in enumerate(specs))
        self._by_name = {c.name: c for c in self.order}
        self._by_lower = {c.name.lower(): c.name for c in self.order}
        self._by_key = {key: spec.name for spec in specs for key in spec.keys}
        self._rules: Sequence[ClassSpec] = [s for s in specs if s.models or s.paths]

    def reconfigure(self, config: Config) -> None:
        """Take the classes of ``config`` (validated); the router keeps every waiter."""
        self._load(config)
        for listener in list(self.on_change):
            listener()

    def get(self, name: str) -> QueueClass:
        """The class called ``name``; the default class for a name no class has."""
        found = self._by_name.get(name)
        return found if found is not None else self._by_name[self.default]

    def resolve(self, request: Request, path: bytes, models: Sequence[str],
                bound: str | None = None, ranked: bool = False) -> str:
        """
        The class of ``request`` (see the module's docstring).  ``models`` holds the model
        the client named and, for an alias, the one it resolved to.  ``ranked``: the
        request's tenant is known (``--auth keys``), and ``bound`` is its class, if any.
        """
        asked = self._asked(request)
        if ranked or self._by_key:
            if not ranked:
                digest = bearer_digest(request)
                bound = self._by_key.get(digest) if digest is not None else None
            if bound is not None and bound not in self._by_name:
                bound = None  # checked at load; a class a reload took away meanwhile
            allowed = bound if bound is not None else self._matched(path, models)
            if asked is not None and self._by_name[asked].rank > self._by_name[allowed].rank:
                return asked  # lower than allowed: a key may give way, never jump ahead
            return allowed
        return asked if asked is not None else self._matched(path, models)

    def _asked(self, request: Request) -> str | None:
        """The class the header names, if it names one (case does not matter)."""
        if self.header is None:
            return None
        value = request.getHeader(self.header)
        if not value or len(value) > _MAX_HEADER:
            return None
        return self._by_lower.get(value.decode("ascii", "replace").strip().lower())

    def _matched(self, path: bytes, models: Sequence[str]) -> str:
        """The first class whose models and paths match, else the default class."""
        if self._rules:
            text = path.decode("utf-8", "replace")
            for spec in self._rules:
                if spec.models and not any(m in spec.models for m in models):
                    continue
                if spec.paths and not any(text.startswith(p) for p in spec.paths):
                    continue
                return spec.name
        return self.default
