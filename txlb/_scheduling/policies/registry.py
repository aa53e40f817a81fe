"""
The policies ``--policy`` may name: the built-in ones, then those of plugins.

A third party adds a policy the way Twisted applications add ``twistd`` subcommands: a
:class:`~txlb._scheduling.policies.PolicyFactory` (any object providing ``IPlugin`` and
:class:`~txlb._scheduling.policies.IPolicyFactory`) at the top level of a module in a
``twisted/plugins/`` directory on the path, found with :func:`twisted.plugin.getPlugins`.
Plugins are looked for when a name is not built in and for the full list in ``--policy``'s
help, which ``txlb.tap`` writes when it is imported (so ``twistd llmlb`` and
``python -m txlb.nginx`` scan once as they start, a read of Twisted's plugin cache); a
``LoadBalancer`` built on a built-in policy, and every ``--workers`` worker, never scans
them.  A plugin cannot replace a built-in policy: the built-in name wins.
"""

from __future__ import annotations

import importlib
import pkgutil
import random
from types import ModuleType
from typing import TYPE_CHECKING

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.plugin import getPlugins

from txlb._scheduling import policies
from txlb._scheduling.policies import IPolicy, IPolicyFactory, PolicyFactory

if TYPE_CHECKING:
    from txlb._config.option import OptionSpec

log = Logger()


def built_in(package: ModuleType = policies) -> tuple[IPolicyFactory, ...]:
    """
    The policies of ``package``'s own modules, in the order ``--help`` lists them (their
    ``rank``): every public module of it whose top level defines ``factory``, an
    :class:`~txlb._scheduling.policies.IPolicyFactory`.  So a new built-in policy is one new
    module, and nothing else names it.
    """
    found = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_") or info.name == __name__.rpartition(".")[2]:
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        factory = getattr(module, "factory", None)
        if IPolicyFactory.providedBy(factory):
            found.append(factory)
    return tuple(sorted(found, key=lambda factory: (factory.rank, factory.name)))


#: The built-in policies, in the order ``--help`` lists them.
BUILT_IN: tuple[IPolicyFactory, ...] = built_in()

#: The policy used when none is configured: the first listed.
DEFAULT_POLICY: str = BUILT_IN[0].name

_BUILT_IN = {factory.name: factory for factory in BUILT_IN}


def policy_options() -> tuple[OptionSpec, ...]:
    """
    The options the built-in policies declare (``cache-aware``'s ``--cache-*``), in the
    policies' ``--help`` order: what the option table lists after ``--unknown-model``.
    """
    return tuple(spec for factory in BUILT_IN if isinstance(factory, PolicyFactory)
                 for spec in factory.options)


def plugin_factories(package: ModuleType | None = None) -> dict[str, IPolicyFactory]:
    """
    The policies plugins provide (``package``: where to look, ``twisted.plugins`` by
    default), by name; built-in names and repeated names are left out (the first wins).
    """
    found: dict[str, IPolicyFactory] = {}
    plugins = getPlugins(IPolicyFactory, package)  # None: twisted.plugins
    for factory in sorted(plugins, key=lambda f: (getattr(f, "rank", 100), str(f.name))):
        name = str(factory.name).strip().lower()
        if name in _BUILT_IN or name in found:
            log.warn("policy plugin {plugin!r}: the name {name!r} is taken; left out",
                     plugin=factory, name=name)
            continue
        found[name] = factory
    return found


def policy_factories() -> dict[str, IPolicyFactory]:
    """Every policy by name: the built-in ones first, then the plugins'."""
    return {**_BUILT_IN, **plugin_factories()}


def policy_names() -> tuple[str, ...]:
    """Every valid ``--policy`` value, built-in ones first."""
    return tuple(policy_factories())


def find_factory(name: str) -> IPolicyFactory | None:
    """The factory of policy ``name``; plugins are scanned only for a name not built in."""
    factory = _BUILT_IN.get(name)
    if factory is None:
        factory = plugin_factories().get(name)
    return factory


def make_policy(name: str, clock: IReactorTime, rng: random.Random | None = None,
                config: object | None = None) -> IPolicy:
    """
    A new policy called ``name`` (one of :func:`policy_names`).  One that declares options
    of its own is given their values, each read from ``config`` (a
    :class:`~txlb._config.config.Config`: an attribute per option) -- or their defaults,
    without one.
    """
    factory = find_factory(name)
    if factory is None:
        raise KeyError(f"no policy called {name!r}; known: {', '.join(policy_names())}")
    if isinstance(factory, PolicyFactory) and factory.options:
        values = None if config is None else {
            spec.attribute: getattr(config, spec.attribute) for spec in factory.options}
        return factory(clock, rng or random.Random(), values)
    return factory(clock, rng or random.Random())
