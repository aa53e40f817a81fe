"""
Selection policies: given the backends eligible for a request, pick one.

A policy is one module: a class providing :class:`IPolicy` and a :class:`PolicyFactory`
that names it.  The registry (:mod:`txlb._scheduling.policies.registry`) knows the built-in
ones and finds third parties' through Twisted's plugin system: a ``PolicyFactory`` in any
``twisted/plugins/*.py`` file on the path is a valid ``--policy`` value.

A policy only chooses; it never changes backend state.  The caller takes the in-flight slot
(:meth:`txlb._cluster.slots.Slots.acquire`) immediately after ``choose`` returns, in the same
synchronous step, which is what keeps a burst of simultaneous requests spread out.  What a
policy learns from traffic arrives through :meth:`IPolicy.observe` and stays in the policy
(keyed by backend), so the backend's state is only what every policy shares.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
from twisted.internet.interfaces import IReactorTime
from twisted.plugin import IPlugin
from twisted.python.reflect import namedAny
from zope.interface import Attribute, Interface, implementer

from txlb._scheduling.request import ANY_REQUEST, RoutingRequest

if TYPE_CHECKING:
    import random

    from txlb._cluster.backend import Backend
    from txlb._config.option import OptionSpec
    from txlb._scheduling.outcome import RequestOutcome


class IPolicy(Interface):
    """Chooses one backend among eligible candidates, and may learn from each request."""

    name = Attribute("The ``--policy`` value that selects this policy (str).")
    needs_engine_metrics = Attribute(
        "Whether the health checker must scrape each engine's ``/metrics`` for its queue "
        "(``Backend.engine_depth``) for this policy to work (bool).")

    def choose(candidates: Sequence[Backend], request: RoutingRequest = ANY_REQUEST
               ) -> Backend:
        """
        Return one of ``candidates`` (never empty, in pool order) for ``request``.
        """

    def observe(backend: Backend, outcome: RequestOutcome) -> None:
        """
        ``backend`` answered a request, which ended as ``outcome``: what a policy that
        learns from traffic folds into its estimates.  Called once per answered request,
        in the process that routes (each ``--workers`` worker has its own policy).
        """

    def describe(backend: Backend) -> Mapping[str, object]:
        """
        What this policy knows of ``backend``, JSON-ready: added to the backend's entry in
        the admin API's ``/status``.
        """


class IPreparesRequests(Interface):
    """
    A policy that does per-request work the choice can reuse (hashing a prompt) and would
    rather not do inside the choice: with ``--workers`` the choice runs under the lock all
    workers share, and everything done there delays every worker's routing.
    """

    def prepare(request: RoutingRequest) -> None:
        """
        Called by the router once each time ``request`` is routed (its first try and each
        retry), before any lock is taken and before :meth:`IPolicy.choose`; what it works
        out belongs in ``request.memo``.  ``choose`` must still work for a request that was
        never prepared.  An exception is logged and the request routed as usual.
        """


class IPolicyFactory(Interface):
    """
    Makes a policy by name: what the registry holds, and what a plugin provides (as a
    ``twisted.plugin.IPlugin``) to add a policy to ``--policy``.
    """

    name = Attribute("The ``--policy`` value (str, lower case).")
    summary = Attribute("One line for ``--help`` and the docs (str).")
    nginx = Attribute(
        "The nginx ``upstream`` directive that behaves the same (str), or ``None`` when "
        "nginx has none (``python -m txlb.nginx`` then writes ``least_conn`` and says so).")
    rank = Attribute(
        "Where ``--help`` lists it (int, lower first; ties by name): a built-in policy's "
        "place, 100 for a plugin's unless it says otherwise.")

    def __call__(clock: IReactorTime, rng: random.Random) -> IPolicy:
        """A new policy, timed by ``clock``, drawing random numbers from ``rng``."""


@implementer(IPlugin, IPolicyFactory)
@attrs.frozen
class PolicyFactory:
    """
    A policy under a name.  ``build`` is called with ``(clock, rng)``; it may be given as
    a dotted name (``"mypackage.policy.Fewest"``), imported only when the policy is made,
    so that scanning plugins stays cheap -- as Twisted's own ``ServiceMaker`` does.

    A built-in policy with options of its own declares them in its module, as ``options``
    (:class:`~txlb._config.option.OptionSpec` entries): the registry adds them to the
    option table -- command line, environment, config file and ``--help`` alike -- and
    ``build`` is called with ``(clock, rng, values)``, ``values`` mapping each option's
    attribute name (``cache_block``) to its value (its default when the policy is made
    without a config).  Only the built-in policies' options reach the table: each has its
    typed field in ``Config``, which a plugin cannot add.
    """

    name: str
    build: Callable[..., IPolicy] | str
    summary: str = ""
    nginx: str | None = None
    rank: int = 100
    options: tuple[OptionSpec, ...] = ()

    @property
    def takes_config(self) -> bool:
        """Whether the policy reads options of its own: a change of them builds a new one."""
        return bool(self.options)

    def __call__(self, clock: IReactorTime, rng: random.Random,
                 values: Mapping[str, Any] | None = None) -> IPolicy:
        build = namedAny(self.build) if isinstance(self.build, str) else self.build
        if self.options:
            given = values or {}
            policy = build(clock, rng, {spec.attribute: given.get(spec.attribute,
                                                                  spec.default_value)
                                        for spec in self.options})
        else:
            policy = build(clock, rng)
        if not IPolicy.providedBy(policy):
            raise TypeError(f"policy {self.name!r}: {policy!r} does not provide IPolicy")
        return policy


@implementer(IPolicy)
class Policy:
    """
    A convenient base: a policy that needs no engine metrics, learns nothing and shows
    nothing.  Subclasses set :attr:`name` and implement :meth:`choose`.
    """

    name: str = ""
    needs_engine_metrics: bool = False

    def choose(self, candidates: Sequence[Backend],
               request: RoutingRequest = ANY_REQUEST) -> Backend:
        raise NotImplementedError

    def observe(self, backend: Backend, outcome: RequestOutcome) -> None:
        pass

    def describe(self, backend: Backend) -> Mapping[str, object]:
        return {}


__all__ = ["IPolicy", "IPolicyFactory", "IPreparesRequests", "Policy", "PolicyFactory",
           "RoutingRequest"]
