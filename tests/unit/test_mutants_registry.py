"""
How ``make_policy`` calls a factory and in which order plugins are listed -- the behaviour
the survivors of ``_scheduling/policies/registry``'s full mutation run showed no test
pinned down: a plain :class:`IPolicyFactory` (a third party's own class, not
``PolicyFactory``) is called as the interface says, a built-in policy with options of its
own reads them from the config, the given random generator is the one drawn from, and a
plugin without a ``rank`` sorts as rank 100.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import Clock
from twisted.plugin import IPlugin
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from txlb import PolicyFactory
from txlb._config import build_config
from txlb._scheduling.policies import IPolicy, IPolicyFactory, Policy, registry
from txlb._scheduling.policies.cache_aware import OPTIONS as CACHE_OPTIONS
from txlb._scheduling.policies.cache_aware import CacheAware
from txlb._scheduling.policies.registry import make_policy, plugin_factories


class First(Policy):
    name = "first"

    def choose(self, candidates: Sequence[Any], request: Any = None) -> Any:
        return candidates[0]


@implementer(IPlugin, IPolicyFactory)
class PlainFactory:
    """A third party's factory: what the interface asks for, and nothing of PolicyFactory's."""

    summary = ""
    nginx = None

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[tuple[object, ...]] = []

    def __call__(self, clock: IReactorTime, rng: random.Random) -> IPolicy:
        self.calls.append((clock, rng))
        return First()


class MakePolicyTests(SynchronousTestCase):
    def test_a_plain_factory_is_called_with_the_clock_and_the_rng(self) -> None:
        plain = PlainFactory("plain")
        config = build_config({}, {})
        self.patch(registry, "_BUILT_IN", {"plain": plain})
        clock, rng = Clock(), random.Random(3)
        policy = make_policy("plain", clock, rng, config=config)
        self.assertIsInstance(policy, First)
        self.assertEqual(plain.calls, [(clock, rng)])

    def test_cache_aware_reads_its_options_from_the_config(self) -> None:
        config = build_config({"cache-block": 64, "cache-entries": 1000, "cache-load": 1.5}, {})
        policy = make_policy("cache-aware", Clock(), config=config)
        assert isinstance(policy, CacheAware)
        self.assertEqual(policy.hasher.block_chars, 64)
        self.assertEqual(policy.load_factor, 1.5)
        default = make_policy("cache-aware", Clock())
        assert isinstance(default, CacheAware)
        self.assertNotEqual(default.hasher.block_chars, 64)

    def test_a_factory_with_options_draws_from_the_given_rng(self) -> None:
        given: list[random.Random] = []

        def build(clock: IReactorTime, rng: random.Random, values: object) -> IPolicy:
            given.append(rng)
            return First()

        factory = PolicyFactory("configured", build, options=CACHE_OPTIONS)
        config = build_config({}, {})
        self.patch(registry, "_BUILT_IN", {"configured": factory})
        rng = random.Random(5)
        make_policy("configured", Clock(), rng, config=config)
        self.assertIs(given[0], rng)
        make_policy("configured", Clock())
        self.assertIsInstance(given[1], random.Random)


class PluginOrderTests(SynchronousTestCase):
    def test_a_plugin_without_a_rank_sorts_as_rank_100(self) -> None:
        """``--help`` lists plugins by rank, then name; no ``rank`` is the default 100."""
        plugins = [PolicyFactory("omega", First, rank=100), PlainFactory("alpha"),
                   PolicyFactory("zeta", First, rank=99)]
        self.patch(registry, "getPlugins", lambda interface, package=None: iter(plugins))
        self.assertEqual(list(plugin_factories()), ["zeta", "alpha", "omega"])
