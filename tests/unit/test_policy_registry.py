"""
The policy seams: the registry the config, ``--help``, nginx.py and make_policy read,
third-party policies found as Twisted plugins, ``LoadBalancer(policy=...)``, and what the
balancer asks of a policy (``observe``, ``needs_engine_metrics``, ``describe``).

And how ``make_policy`` calls a factory and in which order plugins are listed (written for
the survivors of ``_scheduling/policies/registry``'s full mutation run): a plain
:class:`IPolicyFactory` (a third party's own class, not ``PolicyFactory``) is called as the
interface says, a built-in policy with options of its own reads them from the config, the
given random generator is the one drawn from, and a plugin without a ``rank`` sorts as
rank 100.
"""

from __future__ import annotations

import gc
import json
import random
import re
import sys
import textwrap
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import Clock
from twisted.plugin import IPlugin
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.server import Site
from zope.interface import implementer
from zope.interface.verify import verifyObject

import txlb
from txlb import BackendSpec, LoadBalancer, Policy, PolicyFactory, Pool, RequestOutcome
from txlb._cluster.backend import Backend
from txlb._config import OPTIONS, ConfigError, build_config
from txlb._records.summary import Summary
from txlb._scheduling.policies import IPolicy, IPolicyFactory, registry
from txlb._scheduling.policies.cache_aware import OPTIONS as CACHE_OPTIONS
from txlb._scheduling.policies.cache_aware import CacheAware
from txlb._scheduling.policies.registry import (
    BUILT_IN,
    DEFAULT_POLICY,
    built_in,
    find_factory,
    make_policy,
    plugin_factories,
    policy_names,
    policy_options,
)
from txlb._scheduling.request import ANY_REQUEST, RoutingRequest
from txlb.nginx import upstream_block

from ..helpers import ClientConnection, FakeResponse, FakeUpstream

BUILT_IN_NAMES = ("least-conn", "round-robin", "random", "p2c", "latency", "queue-depth",
                  "cache-aware")
TXLB = Path(txlb.__file__).parent


class Learning(Policy):
    """The first candidate; keeps every outcome it is told and says how many."""

    name = "learning"
    needs_engine_metrics = True

    def __init__(self) -> None:
        self.outcomes: list[tuple[Backend, RequestOutcome]] = []

    def choose(self, candidates: Sequence[Backend],
               request: RoutingRequest = ANY_REQUEST) -> Backend:
        return candidates[0]

    def observe(self, backend: Backend, outcome: RequestOutcome) -> None:
        self.outcomes.append((backend, outcome))

    def describe(self, backend: Backend) -> Mapping[str, object]:
        return {"learned": sum(1 for b, _ in self.outcomes if b is backend)}


def admin_status(lb: LoadBalancer) -> dict[str, Any]:
    """``GET /status`` of ``lb``'s admin API, over a real channel."""
    client = ClientConnection(Site(lb.admin_resource(), reactor=Clock()))
    client.send(b"GET /status HTTP/1.1\r\nHost: 10.0.0.1:8001\r\n\r\n")  # its own address
    response = client.response()
    assert response.status == 200, response.body
    result: dict[str, Any] = json.loads(response.body)
    return result


def summary(backend: str = "127.0.0.1:8002", status: int = 200,
            ttft: float | None = 0.25) -> Summary:
    return Summary(time=1.0, orid="-", backend=backend, method="POST",
                   path="/v1/completions", status=status, kind="completion",
                   outcome="ok", dur=2.0, ttft=ttft)


class RegistryTests(SynchronousTestCase):
    def test_the_built_in_policies_in_help_order(self) -> None:
        self.assertEqual(tuple(f.name for f in BUILT_IN), BUILT_IN_NAMES)
        self.assertEqual(policy_names()[:len(BUILT_IN_NAMES)], BUILT_IN_NAMES)
        self.assertEqual(DEFAULT_POLICY, "least-conn")
        self.assertEqual(build_config({}, {}).policy, "least-conn")

    def test_a_new_module_is_a_new_built_in_policy(self) -> None:
        """
        A built-in policy is found from its module alone: every public module of the
        package with a top-level ``factory``, in ``rank`` order -- no list to edit.
        """
        root = Path(self.mktemp())
        package = root / f"txlb_test_policies_{id(self)}"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("")
        factory = ("from txlb import PolicyFactory\n"
                   "factory = PolicyFactory({name!r}, 'x.y', rank={rank})\n")
        (package / "late.py").write_text(factory.format(name="late", rank=90))
        (package / "early.py").write_text(factory.format(name="early", rank=5))
        (package / "_shared.py").write_text(factory.format(name="private", rank=1))
        (package / "helpers.py").write_text("factory = 'not a policy factory'\n")
        sys.path.insert(0, str(root))
        self.addCleanup(sys.path.remove, str(root))
        module = __import__(package.name)
        self.assertEqual([f.name for f in built_in(module)], ["early", "late"])

    def test_each_factory_makes_its_policy(self) -> None:
        for factory in BUILT_IN:
            self.assertTrue(verifyObject(IPolicyFactory, factory))
            policy = make_policy(factory.name, Clock(), random.Random(1))
            self.assertTrue(verifyObject(IPolicy, policy), factory.name)
            self.assertEqual(policy.name, factory.name)
            self.assertIsInstance(policy.needs_engine_metrics, bool)

    def test_only_queue_depth_and_cache_aware_need_engine_metrics(self) -> None:
        needing = [f.name for f in BUILT_IN if make_policy(f.name, Clock()).needs_engine_metrics]
        self.assertEqual(needing, ["queue-depth", "cache-aware"])

    def test_the_given_rng_draws(self) -> None:
        backends = list(Pool(tuple(BackendSpec("127.0.0.1", p) for p in range(1, 9))))

        def draws(name: str) -> list[str]:
            policy = make_policy(name, Clock(), random.Random(7))
            return [policy.choose(backends).key for _ in range(30)]

        for name in ("random", "p2c"):
            self.assertEqual(draws(name), draws(name), name)

    def test_an_unknown_name(self) -> None:
        self.assertIsNone(find_factory("fastest"))
        with self.assertRaises(KeyError):
            make_policy("fastest", Clock())
        with self.assertRaises(ConfigError) as raised:
            build_config({"policy": "fastest"}, {})
        self.assertIn("least-conn, round-robin, random, p2c, latency, queue-depth, cache-aware",
                      str(raised.exception))

    def test_help_lists_the_registry(self) -> None:
        (spec,) = [s for s in OPTIONS if s.name == "policy"]
        self.assertEqual(spec.help_text, "Backend choice: " + ", ".join(policy_names()) + ".")

    def test_a_policy_s_own_options_come_from_its_module(self) -> None:
        """
        ``--cache-*`` are declared by ``cache_aware.py`` alone: the registry collects them
        and the option table lists them where ``--help`` always had them.
        """
        from txlb._scheduling.policies import cache_aware

        declared = policy_options()
        self.assertEqual([spec.name for spec in declared],
                         ["cache-block", "cache-entries", "cache-load"])
        self.assertEqual(declared, cache_aware.factory.options)
        names = [spec.name for spec in OPTIONS]
        start = names.index("unknown-model") + 1
        self.assertEqual(OPTIONS[start:start + len(declared)], declared)
        self.assertEqual(names[start + len(declared)], "affinity")

    def test_nginx_reads_the_factory(self) -> None:
        for factory in BUILT_IN:
            block = "\n".join(upstream_block(build_config({"policy": factory.name}, {})))
            if factory.nginx is not None:
                self.assertIn(f"    {factory.nginx}\n", block)
            else:
                self.assertIn(f"--policy {factory.name}: no nginx equivalent", block)

    def test_a_policy_name_is_written_only_in_its_own_module(self) -> None:
        """Adding a policy is one module: no other file of txlb lists policy names."""
        for factory in BUILT_IN:
            quoted = re.compile("[\"']" + re.escape(factory.name) + "[\"']")
            policy = make_policy(factory.name, Clock())
            home = Path(sys.modules[type(policy).__module__].__file__ or "")
            found = sorted(str(path.relative_to(TXLB)) for path in TXLB.rglob("*.py")
                           if quoted.search(path.read_text()))
            self.assertEqual(found, [str(home.relative_to(TXLB))], factory.name)

    def test_a_dotted_build_is_imported_when_made(self) -> None:
        factory = PolicyFactory(
            "rr", "txlb._scheduling.policies.round_robin.SmoothWeightedRoundRobin")
        with self.assertRaises(TypeError):  # it takes no (clock, rng): told at make time
            factory(Clock(), random.Random())
        lazy = PolicyFactory("lc", "txlb._scheduling.policies.least_conn.factory")
        self.assertEqual(lazy(Clock(), random.Random()).name, "least-conn")

    def test_a_factory_that_makes_no_policy_is_refused(self) -> None:
        factory = PolicyFactory("nothing", lambda clock, rng: object())  # type: ignore
        with self.assertRaises(TypeError):
            factory(Clock(), random.Random())


PLUGIN = """
    from txlb import PolicyFactory

    a_taken = PolicyFactory("p2c", "{module}.Fewest")  # a built-in name: left out
    b_fewest = PolicyFactory("Test-Fewest", "{module}.Fewest",
                             "the backend with the fewest requests ever", nginx="least_conn;")
    c_missing = PolicyFactory("test-missing", "{module}.Absent")  # a name its module lacks
    d_junk = PolicyFactory("test-junk", "{module}.junk")  # makes something else
"""

IMPLEMENTATION = """
    from txlb import Policy


    class Fewest(Policy):
        name = "test-fewest"

        def __init__(self, clock, rng):
            self.clock = clock

        def choose(self, candidates, request=None):
            return min(candidates, key=lambda b: b.counts.requests)


    def junk(clock, rng):
        return object()
"""


class PluginTests(SynchronousTestCase):
    """
    A third party's policy: a ``PolicyFactory`` in a ``twisted/plugins/`` module on the
    path, found by the real ``twisted.plugin.getPlugins``.
    """

    def setUp(self) -> None:
        import twisted.plugins

        root = Path(self.mktemp())
        plugins = root / "twisted" / "plugins"
        plugins.mkdir(parents=True)
        suffix = str(id(self))
        module = f"txlb_test_fewest_{suffix}"
        (root / f"{module}.py").write_text(textwrap.dedent(IMPLEMENTATION))
        (plugins / f"txlb_test_policy_{suffix}.py").write_text(
            textwrap.dedent(PLUGIN.format(module=module)))
        # what twisted.plugins' __init__ does at import for each twisted/plugins on sys.path
        sys.path.insert(0, str(root))
        twisted.plugins.__path__.append(str(plugins))

        def clean() -> None:
            sys.path.remove(str(root))
            twisted.plugins.__path__.remove(str(plugins))
            for name in list(sys.modules):
                if suffix in name:
                    del sys.modules[name]

        self.addCleanup(clean)

    def test_a_plugin_adds_a_valid_policy_value(self) -> None:
        self.assertIn("test-fewest", plugin_factories())
        self.assertEqual(policy_names()[:len(BUILT_IN_NAMES)], BUILT_IN_NAMES)
        self.assertIn("test-fewest", policy_names()[6:])
        self.assertEqual(build_config({"policy": "TEST-fewest"}, {}).policy, "test-fewest")
        (spec,) = [s for s in OPTIONS if s.name == "policy"]
        self.assertIn("test-fewest", spec.help_text)

    def test_a_plugin_cannot_take_a_built_in_name(self) -> None:
        self.assertEqual(plugin_factories().get("p2c"), None)
        self.assertIs(find_factory("p2c"), BUILT_IN[3])

    def test_the_balancer_routes_with_it(self) -> None:
        lb = LoadBalancer(["127.0.0.1:8002", "127.0.0.1:8003"], reactor=Clock(),
                          agent=FakeUpstream(), probe_agent=FakeUpstream(),
                          log_file="none", policy="test-fewest")
        self.assertEqual(lb.policy.name, "test-fewest")
        first, second = list(lb.pool)
        first.counts.counted(0, requests=5)
        self.assertIs(lb.policy.choose([first, second]), second)

    def test_a_plugin_policy_that_cannot_be_made_is_a_config_error(self) -> None:
        """One line naming the option and why, as for a misspelt name; not a traceback."""
        for name, why in (("test-missing", "AttributeError: "),
                          ("test-junk", "TypeError: policy 'test-junk': ")):
            with self.assertRaises(ConfigError) as raised:
                build_config({"policy": name}, {})
            message = str(raised.exception)
            self.assertTrue(message.startswith(f"--policy: {name!r} is a plugin's policy "
                                               "that could not be made: " + why), message)
        self.assertEqual(build_config({"policy": "test-fewest"}, {}).policy, "test-fewest")

    def test_nginx_reads_the_plugin_directive(self) -> None:
        block = upstream_block(build_config({"policy": "test-fewest"}, {}))
        self.assertIn("    least_conn;", block)
        self.assertFalse(any("no nginx equivalent" in line for line in block))


class EmbedderPolicyTests(SynchronousTestCase):
    """``LoadBalancer(policy=...)``, and everything the balancer asks of its policy."""

    def build(self, **options: Any) -> LoadBalancer:
        self.clock = Clock()
        self.upstream = FakeUpstream()
        self.probes = FakeUpstream()
        options.setdefault("log_file", "none")
        return LoadBalancer(["127.0.0.1:8002", "127.0.0.1:8003"], reactor=self.clock,
                            agent=self.upstream, probe_agent=self.probes, **options)

    def test_an_instance_overrides_config_policy(self) -> None:
        policy = Learning()
        lb = self.build(policy=policy)
        self.assertIs(lb.policy, policy)
        self.assertIs(lb.router.policy, policy)
        self.assertEqual(lb.config.policy, "least-conn")

    def test_a_name_is_the_option(self) -> None:
        self.assertEqual(self.build(policy="p2c").config.policy, "p2c")
        self.assertEqual(self.build(policy="p2c").policy.name, "p2c")
        with self.assertRaises(ConfigError):
            self.build(policy="fastest")

    def test_something_else_is_refused(self) -> None:
        with self.assertRaises(TypeError):
            self.build(policy=object())

    def test_the_policy_decides_the_engine_scrape(self) -> None:
        self.assertTrue(self.build(policy=Learning()).health.scrape_engine_queue)
        self.assertFalse(self.build().health.scrape_engine_queue)
        self.assertTrue(self.build(policy="queue-depth").health.scrape_engine_queue)

    def test_observe_gets_each_answered_request(self) -> None:
        policy = Learning()
        lb = self.build(policy=policy)
        lb.bookkeeper.finished(summary(ttft=0.25), answered=True)
        lb.bookkeeper.finished(summary(), answered=False)  # no answer: nothing to learn
        lb.bookkeeper.finished(summary(backend="10.0.0.1:1"))  # not (any more) in the pool
        ((backend, outcome),) = policy.outcomes
        self.assertIs(backend, lb.pool.get("127.0.0.1:8002"))
        self.assertEqual((outcome.backend, outcome.status, outcome.ttfb, outcome.duration),
                         ("127.0.0.1:8002", 200, 0.25, 2.0))
        self.assertTrue(outcome.answered)

    def test_a_failing_observe_does_not_fail_the_bookkeeping(self) -> None:
        class Broken(Learning):
            def observe(self, backend: Backend, outcome: RequestOutcome) -> None:
                raise RuntimeError("boom")

        lb = self.build(policy=Broken())
        lb.bookkeeper.finished(summary())
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertEqual(lb.pool.get("127.0.0.1:8002").counts.responses, {"2xx": 1})  # type: ignore

    def test_describe_is_shown_in_the_admin_status(self) -> None:
        policy = Learning()
        lb = self.build(policy=policy)
        lb.bookkeeper.finished(summary())
        backends = admin_status(lb)["backends"]
        self.assertEqual([b["learned"] for b in backends], [1, 0])
        self.assertEqual([b["latency_peak_ewma_s"] for b in backends], [None, None])

    def test_the_latency_estimate_reaches_the_admin_status(self) -> None:
        lb = self.build(policy="latency")
        lb.bookkeeper.finished(summary(ttft=0.123456))
        backends = admin_status(lb)["backends"]
        self.assertEqual([b["latency_peak_ewma_s"] for b in backends], [0.1235, None])


class OutcomeThroughTheProxyTests(SynchronousTestCase):
    def test_the_policy_learns_who_sent_each_request(self) -> None:
        """A request through the proxy reaches observe with its ``--rate-key`` client key."""
        upstream = FakeUpstream()
        policy = Learning()
        lb = LoadBalancer(["127.0.0.1:8002"], reactor=Clock(), agent=upstream,
                          probe_agent=FakeUpstream(), log_file="none", policy=policy)
        for backend in lb.pool:
            lb.pool.mark_up(backend)
        client = ClientConnection(lb.site(), peer="10.9.8.7")
        client.request(b"POST", b"/v1/completions", body=b'{"prompt": "hi"}')
        upstream.last.respond(FakeResponse(200, length=0)).end()
        self.assertEqual(client.response().status, 200)
        self.assertEqual([(b.key, o.client, o.status) for b, o in policy.outcomes],
                         [("127.0.0.1:8002", "ip:10.9.8.7", 200)])


class PeakEwmaStateTests(SynchronousTestCase):
    """The latency policy owns its estimates (they used to live on Backend)."""

    def test_observe_folds_the_ttfb(self) -> None:
        pool = Pool((BackendSpec("127.0.0.1", 1),))
        (backend,) = list(pool)
        policy = make_policy("latency", Clock())
        policy.observe(backend, RequestOutcome.of(summary(ttft=None), True))
        self.assertEqual(policy.describe(backend), {"latency_peak_ewma_s": None})
        policy.observe(backend, RequestOutcome.of(summary(ttft=0.5), True))
        self.assertEqual(policy.describe(backend), {"latency_peak_ewma_s": 0.5})
        self.assertFalse(hasattr(backend, "peak_ewma"))

    def test_a_forgotten_backend_takes_its_estimate_along(self) -> None:
        pool = Pool((BackendSpec("127.0.0.1", 1),))
        (backend,) = list(pool)
        policy = make_policy("latency", Clock())
        policy.observe(backend, RequestOutcome.of(summary(ttft=0.5), True))
        gone = weakref.ref(backend)
        pool.remove(backend)
        del backend
        gc.collect()
        self.assertIsNone(gone())  # the policy did not keep it alive
        again = pool.add(BackendSpec("127.0.0.1", 1))  # the same address, a new backend
        self.assertEqual(policy.describe(again), {"latency_peak_ewma_s": None})


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
