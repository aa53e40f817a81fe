"""
:class:`DnsMembership`: the pool's members that ``dns:``/``srv:`` names yield.

Each name is resolved at start, then again when its records' TTL runs out (within
:data:`~txlb._discovery.answers.MIN_TTL` and ``MAX_TTL``).  A new address joins through
``Pool.add`` (slow start applies, probed at once); a vanished one leaves through
``Pool.remove`` (drained, forgotten once idle), as the admin API's ``DELETE`` does.  A
failed or empty resolution keeps the last good set, and so does one that failed in part
(a SERVFAIL on A while AAAA answered, one SRV target not resolving): a missing part is not
an empty one.

Who wins (docs/scale-out.md, "Membership from DNS"):

* an address the file (or command line) lists is the file's: DNS neither adds, changes
  nor removes it;
* an address a name yields is that name's: a reload leaves it alone while the name is
  still configured (it does not remove what the file does not list);
* an operator's drain of a DNS address holds (DNS never drains or undrains);
* an operator's removal (admin ``DELETE``) holds until the address leaves the answer; if
  it comes back later, it joins again;
* with shared state, an address another replica's DNS put in the store is adopted by this
  replica's name that yields it too (so this replica removes it when the name drops it),
  and another replica's removal of it is refused while a name here still yields it
  (``Pool.ask_before_store_removal``) -- unless the store marks that removal as an operator's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from txlb._cluster.backend import Backend
from txlb._cluster.pool import Pool
from txlb._config.backends import BackendSpec, DnsBackendSpec
from txlb._config.config import Config
from txlb._discovery.answers import (
    MAX_ADDRESSES_PER_NAME,
    Member,
    Resolved,
    in_rotation,
    retry_delay,
)
from txlb._discovery.resolver import describe_failure, lookup

log = Logger()

#: a lookup that has not ended after this many seconds is given up (the resolver's own
#: timeouts end it sooner; this bounds any resolver)
LOOKUP_LIMIT = 10.0
#: seconds between looks at SRV tiers' health (a lower tier down lets the next one in)
TIER_CHECK = 1.0


@attrs.define
class NameWatch:
    """One configured name: its last good answer, its last error, its next resolution."""

    entry: DnsBackendSpec
    members: tuple[Member, ...] = ()
    resolved_at: float | None = None
    ttl: float | None = None
    error: str | None = None
    failed_at: float | None = None
    failures: int = 0
    skipped: int = 0
    cut: int = 0
    next_at: float | None = None
    call: IDelayedCall | None = None
    pending: Deferred[Any] | None = None

    @property
    def key(self) -> str:
        return self.entry.key

    def status(self, active: list[str]) -> dict[str, object]:
        """``/status``'s ``dns`` entry for this name."""
        return {
            "name": self.key,
            "addresses": [m.key for m in self.members],
            "in_pool": active,
            "tiers": sorted({m.priority for m in self.members}) if self.entry.kind == "srv"
            else None,
            "resolved_at": None if self.resolved_at is None else round(self.resolved_at, 3),
            "ttl_s": self.ttl,
            "next_at": None if self.next_at is None else round(self.next_at, 3),
            "error": self.error,
            "failures": self.failures,
            "skipped": self.skipped,
            "cut": self.cut,
        }


class DnsMembership(Service):
    """
    Keeps the pool's DNS-sourced members equal to what the configured names resolve to.
    Runs where membership is owned: the single process, or a ``--workers`` supervisor
    (workers mirror its pool and resolve nothing).
    """

    def __init__(self, pool: Pool, config: Config, resolver: Any, clock: IReactorTime,
                 on_added: Callable[[Backend], object],
                 make_resolver: Callable[[], Any] | None = None) -> None:
        self._pool = pool
        #: the resolver, or ``None`` until a name needs one (``make_resolver`` makes it:
        #: a reload may add the first name)
        self._resolver = resolver
        self._make_resolver = make_resolver
        self._clock = clock
        self._on_added = on_added
        self._watches: dict[str, NameWatch] = {}
        self._static: frozenset[str] = frozenset()
        #: address -> the name it came from, for the members DNS put in the pool
        self._owned: dict[str, str] = {}
        #: addresses DNS removed that are still draining
        self._leaving: set[str] = set()
        #: addresses an operator removed: DNS does not bring them back while answered
        self._suppressed: set[str] = set()
        #: the next look at SRV tiers' health, while a name has several tiers
        self._tier_check: IDelayedCall | None = None
        #: address -> name, for the addresses the names' last good answers put in rotation
        #: here (a removal another replica's DNS made does not take them out)
        self._yielded: dict[str, str] = {}
        pool.ask_before_store_removal(self._keeps)
        self._take(config)

    # -- what the rest of the balancer asks ----------------------------------------------

    @property
    def names(self) -> tuple[DnsBackendSpec, ...]:
        return tuple(watch.entry for watch in self._watches.values())

    def owns(self, key: str) -> bool:
        """Whether the pool's ``key`` came from DNS (a reload leaves it to DNS)."""
        return key in self._owned or key in self._leaving

    def status(self) -> dict[str, object]:
        """``/status``'s ``dns``: one entry per name (nothing when there are none)."""
        if not self._watches:
            return {}
        by_name: dict[str, list[str]] = {}
        for key, name in self._owned.items():
            by_name.setdefault(name, []).append(key)
        return {"dns": [watch.status(sorted(by_name.get(watch.key, [])))
                        for watch in self._watches.values()]}

    def reconfigure(self, config: Config) -> None:
        """
        A reload: resolvers start for new names and stop for gone ones (whose members
        leave); a changed ``max_conns``/models/weight applies to every member in place;
        an address the file now lists becomes the file's.
        """
        before = set(self._watches)
        self._take(config)
        for key in set(self._watches) - before:
            log.info("{name}: added by the new config, resolving it", name=key)
            if self.running:
                self._resolve(self._watches[key])
        for key in before - set(self._watches):
            log.info("{name}: not in the new config; its backends leave", name=key)
        self._reconcile()

    # -- the life cycle ------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        for watch in list(self._watches.values()):
            self._resolve(watch)

    def stopService(self) -> None:
        super().stopService()
        for watch in self._watches.values():
            self._stop(watch)
        self._stop_tier_checks()
        close = getattr(self._resolver, "close_sockets", None)
        if callable(close):
            close()

    def _take(self, config: Config) -> None:
        self._static = frozenset(spec.key for spec in config.backends)
        for key in self._static:  # the file lists it now: the file's, not DNS's
            self._owned.pop(key, None)
            self._leaving.discard(key)
        wanted = {entry.key: entry for entry in config.dns_backends}
        for key, watch in list(self._watches.items()):
            if key not in wanted:
                self._stop(watch)
                del self._watches[key]
            else:
                watch.entry = wanted[key]
        for key, entry in wanted.items():
            self._watches.setdefault(key, NameWatch(entry))
        # in the config's order
        self._watches = {key: self._watches[key] for key in wanted}

    @staticmethod
    def _stop(watch: NameWatch) -> None:
        if watch.call is not None and watch.call.active():
            watch.call.cancel()
        watch.call = None
        pending, watch.pending = watch.pending, None
        if pending is not None:
            pending.cancel()

    # -- resolving -----------------------------------------------------------------------

    def _resolve(self, watch: NameWatch) -> None:
        watch.call = None
        watch.next_at = None
        try:
            if self._resolver is None and self._make_resolver is not None:
                self._resolver = self._make_resolver()
            asked = lookup(self._resolver, watch.entry)
        except Exception:
            asked = Deferred()
            asked.errback(Failure())
        watch.pending = asked
        asked.addTimeout(LOOKUP_LIMIT, self._clock)
        asked.addCallbacks(self._resolved, self._failed, callbackArgs=(watch,),
                           errbackArgs=(watch,))
        asked.addErrback(lambda failure: log.failure("resolving {name} failed", failure,
                                                     name=watch.key))

    def _resolved(self, resolved: Resolved, watch: NameWatch) -> None:
        if watch.pending is None or self._watches.get(watch.key) is not watch:
            return  # stopped meanwhile
        watch.pending = None
        if resolved.partial is not None and watch.resolved_at is not None:
            # part of the answer is missing: not the whole set, so not a reason to
            # remove what that part held; the last good set stays
            self._gave_up(f"part of the answer failed: {resolved.partial}", watch)
            return
        now = self._clock.seconds()
        if watch.failures:
            log.info("{name} resolves again after {count} failed tries",
                     name=watch.key, count=watch.failures)
        before = {m.key for m in watch.members}
        after = {m.key for m in resolved.members}
        if before != after:
            log.info("{name} yields {count} addresses{more}{less}{cut}", name=watch.key,
                     count=len(after),
                     more=_listed(" (joining: ", after - before),
                     less=_listed(" (leaving: ", before - after),
                     cut=f"; {resolved.cut} more cut at {MAX_ADDRESSES_PER_NAME}"
                     if resolved.cut else "")
        watch.members = resolved.members
        watch.resolved_at = now
        watch.ttl = resolved.ttl
        watch.error = None
        watch.failures = 0
        watch.skipped = resolved.skipped
        watch.cut = resolved.cut
        if resolved.partial is not None:
            # a first answer with a part missing: better than no backends, asked again
            # soon (a missing part after this keeps this set)
            watch.error = f"part of the answer failed: {resolved.partial}"
            log.warn("{name}: part of the answer failed ({error}); starting with the "
                     "{count} addresses that did resolve", name=watch.key,
                     error=resolved.partial, count=len(resolved.members))
            self._schedule(watch, retry_delay(1))
        else:
            self._schedule(watch, resolved.ttl)
        self._reconcile()

    def _failed(self, failure: Failure, watch: NameWatch) -> None:
        if watch.pending is None or self._watches.get(watch.key) is not watch:
            return
        watch.pending = None
        self._gave_up(describe_failure(failure), watch)

    def _gave_up(self, error: str, watch: NameWatch) -> None:
        """A resolution that does not count: the last good set stays; try again later."""
        watch.failures += 1
        watch.error = error
        watch.failed_at = self._clock.seconds()
        delay = retry_delay(watch.failures)
        if watch.failures == 1:  # once per streak, not per try
            if watch.resolved_at is None:
                log.warn("{name} does not resolve ({error}): no backends from it yet; "
                         "trying again, every {max:g}s at most", name=watch.key,
                         error=watch.error, max=retry_delay(99))
            else:
                log.warn("{name} does not resolve ({error}): keeping its last {count} "
                         "addresses; trying again, every {max:g}s at most", name=watch.key,
                         error=watch.error, count=len(watch.members), max=retry_delay(99))
        self._schedule(watch, delay)

    def _schedule(self, watch: NameWatch, delay: float) -> None:
        if self.running:
            watch.next_at = self._clock.seconds() + delay
            watch.call = self._clock.callLater(delay, self._resolve, watch)

    # -- the pool ------------------------------------------------------------------------

    def _available(self, key: str) -> bool:
        """Whether an address can take requests (for SRV tiers): not yet in the pool counts."""
        backend = self._pool.get(key)
        if backend is None:
            return key not in self._suppressed
        health = backend.health
        return health.healthy and not health.draining and not health.removing

    def _desired(self) -> dict[str, tuple[str, BackendSpec]]:
        desired: dict[str, tuple[str, BackendSpec]] = {}
        several_tiers = False
        for watch in self._watches.values():
            several_tiers |= len({m.priority for m in watch.members}) > 1
            for member in in_rotation(watch.members, self._available):
                desired.setdefault(member.key, (watch.key, member.spec(watch.entry)))
        if several_tiers and self.running and self._tier_check is None:
            self._tier_check = self._clock.callLater(TIER_CHECK, self._check_tiers)
        elif not several_tiers:
            self._stop_tier_checks()
        return desired

    def _check_tiers(self) -> None:
        self._tier_check = None
        self._reconcile()

    def _stop_tier_checks(self) -> None:
        call, self._tier_check = self._tier_check, None
        if call is not None and call.active():
            call.cancel()

    def _keeps(self, backend: Backend) -> bool:
        """
        The shared store removes ``backend`` (not an operator's removal): another
        replica's DNS let it go (a brief answer without it, or its own view of the name).
        While a name of ours still yields it, it stays, and is ours.
        """
        key = backend.key
        name = self._yielded.get(key)
        if name is None or key in self._static or key in self._suppressed \
                or key not in self._owned and key not in self._pool.learned:
            return False
        self._owned[key] = name
        self._leaving.discard(key)
        log.info("backend {backend} was removed on another replica; {name} still yields "
                 "it here, so it stays", backend=key, name=name)
        return True

    def _reconcile(self) -> None:
        """Make the pool's DNS members what the names' last good answers say."""
        pool = self._pool
        desired = self._desired()
        self._yielded = {key: name for key, (name, _) in desired.items()}
        self._suppressed &= set(desired)  # left the answer: may join again when back
        self._leaving = {key for key in self._leaving
                         if (b := pool.get(key)) is not None and b.health.removing}
        for key, (name, spec) in desired.items():
            if key in self._static or key in self._suppressed:
                continue
            backend = pool.get(key)
            if key in self._leaving and backend is not None:
                self._leaving.discard(key)
                pool.keep(backend, why=f"{name} yields it again")
            elif key in self._owned:
                if backend is None or backend.health.removing:
                    # an operator removed it: that holds while the name still yields it
                    del self._owned[key]
                    self._suppressed.add(key)
                    log.info("backend {backend} of {name} was removed by an operator; "
                             "it stays out until {name} stops yielding it", backend=key,
                             name=name)
                    continue
            elif backend is not None:
                if key not in pool.learned:
                    continue  # the admin API's: not DNS's to change
                # another replica's DNS put it in the shared store; ours yields it too,
                # so ours owns it here (and removes it when the name stops yielding it)
                log.info("backend {backend} (from the shared store) is {name}'s here too",
                         backend=key, name=name)
                if backend.health.removing:
                    pool.keep(backend, why=f"{name} yields it here")
            else:
                if not self._add(spec, name):
                    continue
                backend = pool.get(key)
            self._owned[key] = name
            if backend is not None and backend.spec != spec:
                pool.respecify(backend, spec)
        for key in [key for key in self._owned if key not in desired]:
            name = self._owned.pop(key)
            backend = pool.get(key)
            if backend is not None and not backend.health.removing:
                log.info("backend {backend} left {name}'s answer: draining it, removed "
                         "once idle", backend=key, name=name)
                pool.remove(backend)
                if pool.get(key) is not None:
                    self._leaving.add(key)

    def _add(self, spec: BackendSpec, name: str) -> bool:
        try:
            backend = self._pool.add(spec, ramp=True)
        except ValueError as error:  # --workers' shared table is full
            log.error("backend {backend} of {name} cannot join: {error}", backend=spec.key,
                      name=name, error=str(error))
            return False
        log.info("backend {backend} joins from {name} (weight {weight}, max_conns "
                 "{max_conns})", backend=spec.key, name=name, weight=spec.weight,
                 max_conns=spec.max_conns)
        try:
            self._on_added(backend)
        except Exception:
            log.failure("could not start the first probe of {backend}", backend=spec.key)
        return True


def _listed(lead: str, keys: set[str]) -> str:
    if not keys:
        return ""
    shown = sorted(keys)
    more = f" and {len(shown) - 8} more" if len(shown) > 8 else ""
    return f"{lead}{', '.join(shown[:8])}{more})"
