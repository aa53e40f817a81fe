"""Every policy, max_conns queueing, model-aware routing, aliases and bounded affinity."""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.server import Site

from txlb import BackendSpec, LoadBalancer, Pool
from txlb._cluster.health import prometheus_sum
from txlb._cluster.models import MAX_MODEL_NAME, MAX_MODEL_NAMES
from txlb._config import ConfigError, build_config
from txlb._scheduling.affinity import BoundedLoadRing
from txlb._scheduling.policies.p2c import PowerOfTwoChoices
from txlb._scheduling.policies.peak_ewma import PeakEwmaLatency
from txlb._scheduling.policies.queue_depth import QueueDepth
from txlb._scheduling.policies.round_robin import SmoothWeightedRoundRobin
from txlb._scheduling.policies.weighted_random import WeightedRandom

from ..helpers import ClientConnection, FakeResponse, FakeUpstream


def backends(*weights: int) -> list[Any]:
    pool = Pool(tuple(BackendSpec("127.0.0.1", 9000 + n, weight=w)
                      for n, w in enumerate(weights)))
    return list(pool)


class PolicyTests(SynchronousTestCase):
    def test_smooth_weighted_round_robin_like_nginx(self) -> None:
        a, b, c = backends(5, 1, 1)
        policy = SmoothWeightedRoundRobin()
        names = {a.key: "a", b.key: "b", c.key: "c"}
        sequence = [names[policy.choose([a, b, c]).key] for _ in range(14)]
        self.assertEqual(sequence, list("aabacaa") * 2)

    def test_weighted_random_follows_weights(self) -> None:
        heavy, light = backends(3, 1)
        policy = WeightedRandom(random.Random(7))
        counts = Counter(policy.choose([heavy, light]).key for _ in range(4000))
        self.assertLess(abs(counts[heavy.key] / 4000 - 0.75), 0.03)

    def test_p2c_never_takes_the_busier_of_its_two(self) -> None:
        idle, busy = backends(1, 1)
        busy.counts.counted(10)
        policy = PowerOfTwoChoices(random.Random(1))
        self.assertEqual({policy.choose([idle, busy]).key for _ in range(50)}, {idle.key})
        three = backends(1, 1, 1)
        for backend, active in zip(three, (5, 0, 9), strict=True):
            backend.counts.counted(active)
        policy = PowerOfTwoChoices(random.Random(3))
        picks = Counter(policy.choose(three).key for _ in range(300))
        self.assertEqual(picks[three[2].key], 0)  # the busiest never wins a pair
        self.assertGreater(picks[three[1].key], picks[three[0].key])

    def test_latency_cold_start_then_peak_ewma(self) -> None:
        clock = Clock()
        a, b = backends(1, 1)
        policy = PeakEwmaLatency(clock, decay=10)
        policy.sample(a, 0.1)
        self.assertIs(policy.choose([a, b]), b)  # b has no sample: it gets tried
        policy.sample(b, 0.5)
        self.assertIs(policy.choose([a, b]), a)
        policy.sample(a, 2.0)  # a slow sample replaces the average at once
        self.assertEqual(policy.estimate(a), 2.0)
        self.assertIs(policy.choose([a, b]), b)
        clock.advance(10)
        policy.sample(a, 0.1)  # fast samples pull it down with time
        self.assertAlmostEqual(policy.estimate(a),
                               2.0 / 2.718281828 + 0.1 * (1 - 1 / 2.718281828), places=3)
        clock.advance(60)
        policy.sample(a, 0.1)
        self.assertLess(policy.estimate(a), 0.2)
        self.assertIs(policy.choose([a, b]), a)

    def test_latency_counts_in_flight(self) -> None:
        a, b = backends(1, 1)
        policy = PeakEwmaLatency(Clock())
        policy.sample(a, 0.1)
        policy.sample(b, 0.15)
        a.counts.counted(3)  # 0.1 * 4 > 0.15 * 1
        self.assertIs(policy.choose([a, b]), b)
        a.counts.counted(0)
        policy = PeakEwmaLatency(Clock())
        policy.sample(a, 0.1)
        policy.sample(b, 0.1)
        self.assertEqual(policy.estimate(b), policy.estimate(a))
        b.counts.counted(1)  # equal latency: fewer in flight wins
        self.assertIs(policy.choose([a, b]), a)

    def test_queue_depth_uses_engine_counts(self) -> None:
        pool = Pool((BackendSpec("127.0.0.1", 1), BackendSpec("127.0.0.1", 2)))
        a, b = list(pool)
        policy = QueueDepth()
        pool.set_engine_depth(a, running=10, waiting=5)  # busy with other replicas' work
        pool.set_engine_depth(b, running=2, waiting=0)
        self.assertIs(policy.choose([a, b]), b)
        for _ in range(12):  # what this balancer sends after the scrape counts too
            pool.slots.acquire(b)
        self.assertIs(policy.choose([a, b]), b)  # 2 + 12 < 15
        pool.slots.acquire(b)
        pool.slots.acquire(b)
        self.assertIs(policy.choose([a, b]), a)  # 2 + 14 > 15
        pool.set_engine_depth(b, running=0, waiting=0)  # new scrape: local count restarts
        self.assertEqual(b.counts.started_since_scrape, 0)
        self.assertIs(policy.choose([a, b]), b)

    def test_queue_depth_subtracts_what_ended_since_the_scrape(self) -> None:
        pool = Pool((BackendSpec("127.0.0.1", 1), BackendSpec("127.0.0.1", 2)))
        a, b = list(pool)
        pool.set_engine_depth(a, running=4, waiting=0)
        pool.set_engine_depth(b, running=3, waiting=0)
        leases = [pool.slots.acquire(b) for _ in range(3)]  # b: 3 + 3 = 6 > 4
        self.assertIs(QueueDepth().choose([a, b]), a)
        for lease in leases:
            lease.release()  # they ended: b is back to what its engine said
        self.assertEqual(QueueDepth.depth(b), 3)
        self.assertIs(QueueDepth().choose([a, b]), b)

    def test_prometheus_sum(self) -> None:
        text = ('# HELP vllm:num_requests_running x\n'
                'vllm:num_requests_running{model_name="a"} 3.0\n'
                'vllm:num_requests_running{model_name="b"} 2.0\n'
                'vllm:num_requests_running_total 99\n'
                'vllm:num_requests_waiting 4\n')
        self.assertEqual(prometheus_sum(text, "vllm:num_requests_running"), 5.0)
        self.assertEqual(prometheus_sum(text, "vllm:num_requests_waiting"), 4.0)
        self.assertIsNone(prometheus_sum(text, "vllm:nothing"))


class BalancerTestCase(SynchronousTestCase):
    def build(self, specs: str | list[str] | None = None, **options: Any) -> None:
        self.clock = Clock()
        self.upstream = FakeUpstream()
        self.probes = FakeUpstream()
        options.setdefault("log_file", "none")
        if specs is not None:
            options["backends"] = specs
        if "config_file" in options:
            options = {"config": build_config({"config": options["config_file"]}, {})}
        self.lb = LoadBalancer(reactor=self.clock, agent=self.upstream,
                               probe_agent=self.probes, rng=random.Random(5), **options)
        self.site = Site(self.lb.resource(), reactor=self.clock)

    def config_file(self, text: str) -> str:
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write(text)
        return path

    def post(self, body: object, path: bytes = b"/v1/chat/completions",
             headers: list[tuple[bytes, bytes]] | None = None) -> ClientConnection:
        client = ClientConnection(self.site)
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        client.request(b"POST", path, headers=headers, body=raw)
        return client

    def target(self, n: int = -1) -> str:
        return self.upstream.calls[n].uri.split(b"/")[2].decode()

    def finish(self, n: int = -1) -> None:
        self.upstream.calls[n].respond(FakeResponse(200, length=0)).end()


class QueueTests(BalancerTestCase):
    def setUp(self) -> None:
        self.build(config_file=self.config_file(
            'queue-timeout = 5\n'
            '[[backends]]\nurl = "127.0.0.1:8002"\nmax_conns = 1\n'
            '[[backends]]\nurl = "127.0.0.1:8003"\nmax_conns = 1\n'))

    def status(self) -> dict[str, Any]:
        client = ClientConnection(self.site)
        client.request(b"GET", b"/__lb_status")
        result: dict[str, Any] = json.loads(client.response().body)
        return result

    def test_full_backends_queue_fifo_and_dispatch_on_release(self) -> None:
        for n in range(4):
            self.post({"n": n})
        self.assertEqual(len(self.upstream.calls), 2)  # two slots, two waiting
        self.assertEqual(self.status()["queue"]["length"], 2)
        self.clock.advance(1.5)
        self.assertEqual(self.status()["queue"]["oldest_wait_s"], 1.5)
        self.finish(0)  # a slot frees: the oldest waiter goes at once, on that backend
        self.assertEqual(len(self.upstream.calls), 3)
        self.assertEqual(json.loads(self.upstream.calls[2].body or b""), {"n": 2})
        self.assertEqual(self.target(2), self.target(0))
        self.finish(1)
        self.assertEqual(json.loads(self.upstream.calls[3].body or b""), {"n": 3})
        self.assertEqual(self.status()["queue"]["length"], 0)
        self.assertEqual(self.lb.metrics.registry.get_sample_value(
            "txlb_queue_wait_seconds_sum"), 3.0)  # 1.5 + 1.5

    def test_queue_timeout_is_503_with_retry_after(self) -> None:
        self.post({})
        self.post({})
        waiting = self.post({})
        self.clock.advance(4.9)
        self.assertEqual(waiting.transport.value(), b"")
        self.clock.advance(0.2)
        response = waiting.response()
        self.assertEqual(response.status, 503)
        self.assertTrue(response.header(b"retry-after"))
        self.assertIn(b"max_conns", response.body)
        self.assertEqual(len(self.upstream.calls), 2)

    def test_client_leaving_the_queue(self) -> None:
        self.post({})
        self.post({})
        gone = self.post({"n": "gone"})
        kept = self.post({"n": "kept"})
        gone.disconnect()
        self.assertEqual(self.status()["queue"]["length"], 1)
        self.finish(0)
        self.assertEqual(json.loads(self.upstream.last.body or b""), {"n": "kept"})
        self.assertEqual(kept.transport.value(), b"")  # waiting for its backend's answer

    def test_queued_request_answered_at_once_when_its_backends_go(self) -> None:
        self.post({})
        self.post({})
        queued = self.post({})
        for backend in self.lb.pool:
            self.lb.pool.mark_down(backend, "test")
        self.assertEqual(queued.response().status, 503)  # not after the queue timeout
        self.assertEqual(self.status()["queue"]["length"], 0)

    def test_shutdown_timeout_answers_the_queue(self) -> None:
        self.post({})
        self.post({})
        queued = self.post({})
        self.lb.router.abandon_queue("the balancer is shutting down")
        self.assertEqual(queued.response().status, 503)
        self.assertIn(b"shutting down", queued.response().body)
        self.assertEqual(self.status()["queue"]["length"], 0)

    def test_max_conns_respected_with_no_queue_needed(self) -> None:
        self.post({})
        self.post({})
        self.assertEqual(sorted(self.target(n) for n in range(2)),
                         ["127.0.0.1:8002", "127.0.0.1:8003"])


class ModelRoutingTests(BalancerTestCase):
    def setUp(self) -> None:
        self.build(config_file=self.config_file(
            '[[backends]]\nurl = "127.0.0.1:8002"\nmodels = ["llama"]\n'
            '[[backends]]\nurl = "127.0.0.1:8003"\nmodels = ["qwen", "llama"]\n'
            '[[backends]]\nurl = "127.0.0.1:8004"\nmodels = ["qwen"]\n'
            '[[routes]]\nmodel = "chat"\nto = { "llama" = 9, "qwen" = 1 }\n'))

    def test_model_goes_only_where_it_is_served(self) -> None:
        for _ in range(6):
            self.post({"model": "qwen"})
        self.assertEqual({self.target(n) for n in range(6)},
                         {"127.0.0.1:8003", "127.0.0.1:8004"})

    def test_unknown_model_is_404_naming_served_models(self) -> None:
        response = self.post({"model": "gpt-9"}).response()
        self.assertEqual(response.status, 404)
        error = json.loads(response.body)["error"]
        self.assertEqual(error["code"], 404)
        self.assertIn("gpt-9", error["message"])
        self.assertIn("chat, llama, qwen", error["message"])
        self.assertEqual(self.upstream.calls, [])

    def test_model_whose_backends_are_down_is_503(self) -> None:
        for key in ("127.0.0.1:8003", "127.0.0.1:8004"):
            backend = self.lb.pool.get(key)
            assert backend is not None
            self.lb.pool.mark_down(backend, "test")
        self.assertEqual(self.post({"model": "qwen"}).response().status, 503)
        self.post({"model": "llama"})
        self.assertEqual(self.target(), "127.0.0.1:8002")

    def test_no_model_or_no_json_goes_anywhere_untouched(self) -> None:
        self.post(b"not json at all", path=b"/v1/audio")
        self.assertEqual(self.upstream.last.body, b"not json at all")
        self.post({"prompt": "x"})
        self.assertEqual(len(self.upstream.calls), 2)

    def test_alias_split_by_weight_and_rewritten(self) -> None:
        for _ in range(200):
            self.post({"model": "chat", "messages": []})
            self.finish()
        models = Counter(json.loads(c.body or b"")["model"] for c in self.upstream.calls)
        self.assertEqual(set(models), {"llama", "qwen"})
        self.assertLess(abs(models["llama"] / 200 - 0.9), 0.06)
        for call in self.upstream.calls:
            model = json.loads(call.body or b"")["model"]
            self.assertIn(model, self.lb.pool.get(  # type: ignore[union-attr]
                call.uri.split(b"/")[2].decode()).models)

    def test_models_list_is_union_over_healthy(self) -> None:
        backend = self.lb.pool.get("127.0.0.1:8002")
        assert backend is not None
        self.lb.pool.mark_down(backend, "test")
        client = ClientConnection(self.site)
        client.request(b"GET", b"/v1/models")
        listing = json.loads(client.response().body)
        self.assertEqual(listing["object"], "list")
        self.assertEqual([m["id"] for m in listing["data"]], ["chat", "llama", "qwen"])
        self.assertEqual(self.upstream.calls, [])


class LearnedModelsTests(BalancerTestCase):
    def test_prober_learns_models_and_routing_follows(self) -> None:
        self.build(["127.0.0.1:8002", "127.0.0.1:8003"])
        service = self.lb.service()
        service.startService()
        self.addCleanup(service.stopService)
        for n, model in enumerate(("alpha", "beta")):
            health = [c for c in self.probes.calls if c.uri.endswith(b"/health")][n]
            health.respond(FakeResponse(200, length=0)).end()
            listing = self.probes.last
            self.assertTrue(listing.uri.endswith(b"/v1/models"))
            body = json.dumps({"data": [{"id": model, "max_model_len": 8192}]}).encode()
            response = listing.respond(FakeResponse(200, [(b"Content-Type",
                                                           b"application/json")]))
            response.send(body)
            response.end()
        self.post({"model": "beta"})
        self.assertEqual(self.target(), "127.0.0.1:8003")
        client = ClientConnection(self.site)
        client.request(b"GET", b"/v1/models")
        data = json.loads(client.response().body)["data"]
        self.assertEqual(data, [{"id": "alpha", "max_model_len": 8192},
                                {"id": "beta", "max_model_len": 8192}])
        self.assertEqual(self.post({"model": "gamma"}).response().status, 404)


class AliasTests(BalancerTestCase):
    """llama.cpp's ``/v1/models`` lists ``aliases``: each is a name clients may ask for."""

    LISTING = {"object": "list", "data": [{"id": "tiny.gguf", "aliases": ["tiny", "t", 7, ""],
                                           "object": "model", "owned_by": "llamacpp"}]}

    def setUp(self) -> None:
        self.build(["127.0.0.1:8002", "127.0.0.1:8003"])
        a, b = self.lb.pool
        self.lb.pool.set_models(a, self.LISTING["data"])
        self.lb.pool.set_models(b, [{"id": "other"}])

    def test_an_alias_routes_to_the_backend_that_lists_it(self) -> None:
        for model in ("tiny", "t", "tiny.gguf"):
            self.post({"model": model})
            self.assertEqual(self.target(), "127.0.0.1:8002")
            self.assertEqual(json.loads(self.upstream.last.body or b"")["model"], model)

    def test_only_string_aliases_count(self) -> None:
        self.assertEqual(self.post({"model": ""}).response().status, 404)
        self.assertEqual(self.lb.pool.get("127.0.0.1:8002").models,  # type: ignore[union-attr]
                         ("tiny.gguf", "tiny", "t"))

    def test_models_list_keeps_aliases_inside_their_entry(self) -> None:
        client = ClientConnection(self.site)
        client.request(b"GET", b"/v1/models")
        data = json.loads(client.response().body)["data"]
        self.assertEqual([entry["id"] for entry in data], ["other", "tiny.gguf"])
        self.assertEqual(data[1]["aliases"], ["tiny", "t", 7, ""])

    def test_a_404_names_the_aliases_too(self) -> None:
        message = json.loads(self.post({"model": "gpt-9"}).response().body)["error"]["message"]
        self.assertIn("other, t, tiny, tiny.gguf", message)


class HostileModelListTests(BalancerTestCase):
    """A backend's /v1/models may hold 4 MiB of names: txlb learns a bounded number."""

    def test_at_most_max_model_names_each_at_most_max_model_name_long(self) -> None:
        self.build(["127.0.0.1:8002", "127.0.0.1:8003"])
        a, b = self.lb.pool
        aliases = [f"alias-{n}" for n in range(200_000)]
        self.lb.pool.set_models(a, [{"id": "x" * (MAX_MODEL_NAME + 1)},
                                    {"id": "m", "aliases": ["y" * (MAX_MODEL_NAME + 1),
                                                            *aliases]}])
        self.lb.pool.set_models(b, [{"id": "other"}])
        self.assertEqual(len(a.models or ()), MAX_MODEL_NAMES)
        self.assertEqual(a.models[:2], ("m", "alias-0"))  # type: ignore[index]
        self.post({"model": "alias-998"})
        self.assertEqual(self.target(), "127.0.0.1:8002")
        self.finish()
        response = self.post({"model": "alias-999"}).response()
        self.assertEqual(response.status, 404)
        self.assertLess(len(response.body), 64 * 1024)  # not every name it sent
        client = ClientConnection(self.site)
        client.request(b"GET", b"/v1/models")
        data = json.loads(client.response().body)["data"]
        self.assertEqual([entry["id"] for entry in data], ["m", "other"])
        self.assertEqual(len(data[0]["aliases"]), MAX_MODEL_NAMES - 1)


class UnknownModelTests(BalancerTestCase):
    """``--unknown-model forward``: what no backend lists goes anywhere, as nginx would."""

    def setUp(self) -> None:
        self.build(config_file=self.config_file(
            'unknown-model = "forward"\n'
            '[[backends]]\nurl = "127.0.0.1:8002"\nmodels = ["llama"]\n'
            '[[backends]]\nurl = "127.0.0.1:8003"\nmodels = ["qwen"]\n'))

    def test_an_unlisted_model_is_forwarded_by_the_policy(self) -> None:
        for _ in range(4):
            self.post({"model": "gpt-9", "messages": []})
        self.assertEqual({self.target(n) for n in range(4)},
                         {"127.0.0.1:8002", "127.0.0.1:8003"})
        self.assertEqual(json.loads(self.upstream.last.body or b"")["model"], "gpt-9")

    def test_a_listed_model_still_goes_only_to_its_backends(self) -> None:
        for _ in range(4):
            self.post({"model": "qwen"})
        self.assertEqual({self.target(n) for n in range(4)}, {"127.0.0.1:8003"})

    def test_a_listed_model_whose_backends_are_down_is_still_503(self) -> None:
        backend = self.lb.pool.get("127.0.0.1:8003")
        assert backend is not None
        self.lb.pool.mark_down(backend, "test")
        self.assertEqual(self.post({"model": "qwen"}).response().status, 503)
        self.assertEqual(self.upstream.calls, [])

    def test_the_default_stays_404(self) -> None:
        self.build(["127.0.0.1:8002"])
        self.lb.pool.set_models(next(iter(self.lb.pool)), [{"id": "llama"}])
        self.assertEqual(self.post({"model": "gpt-9"}).response().status, 404)

    def test_bad_values_are_refused(self) -> None:
        self.assertEqual(build_config({"unknown-model": "FORWARD"}, {}).unknown_model,
                         "forward")
        self.assertEqual(build_config({}, {"LB_UNKNOWN_MODEL": "404"}).unknown_model, "404")
        with self.assertRaises(ConfigError) as caught:
            build_config({"unknown-model": "drop"}, {})
        self.assertIn("--unknown-model", str(caught.exception))


class AffinityTests(BalancerTestCase):
    def test_same_session_same_backend(self) -> None:
        self.build([f"127.0.0.1:{p}" for p in range(8002, 8006)], affinity="header:X-Session")
        homes = {}
        for session in ("s1", "s2", "s3", "s4", "s5", "s6"):
            for _ in range(3):
                self.post({}, headers=[(b"X-Session", session.encode())])
                homes.setdefault(session, set()).add(self.target())
                self.finish()
        self.assertTrue(all(len(h) == 1 for h in homes.values()), homes)
        self.assertGreater(len({next(iter(h)) for h in homes.values()}), 1)

    def test_user_affinity(self) -> None:
        self.build([f"127.0.0.1:{p}" for p in range(8002, 8006)], affinity="user")
        for _ in range(4):
            self.post({"user": "alice"})
            self.finish()
        self.assertEqual(len({self.target(n) for n in range(4)}), 1)

    def test_load_bound_holds_for_a_hot_session(self) -> None:
        """One session sending 40 concurrent requests to 4 backends: none above the bound."""
        self.build([f"127.0.0.1:{p}" for p in range(8002, 8006)], affinity="user")
        peak = 0
        for n in range(40):
            self.post({"user": "hot"})
            peak = max(peak, max(b.counts.active for b in self.lb.pool))
            # the bound for the request just placed: ceil(1.25 * (n + 1) / 4)
            self.assertLessEqual(max(b.counts.active for b in self.lb.pool),
                                 -(-5 * (n + 1) // 16))
        self.assertLessEqual(peak, 13)  # ceil(1.25 * 40 / 4)

    def test_ring_is_stable_when_a_backend_leaves(self) -> None:
        ring = BoundedLoadRing(epsilon=100)  # no load bound: pure consistent hashing
        fleet = backends(1, 1, 1, 1)
        before = {s: ring.choose(s, fleet).key for s in map(str, range(400))}
        after = {s: ring.choose(s, fleet[:3]).key for s in map(str, range(400))}
        moved = [s for s in before if before[s] != after[s]]
        self.assertTrue(all(before[s] == fleet[3].key for s in moved))


class SchedulingConfigTests(SynchronousTestCase):
    def write(self, text: str) -> str:
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write(text)
        return path

    def test_policy_and_affinity_values(self) -> None:
        self.assertEqual(build_config({"policy": "P2C"}, {}).policy, "p2c")
        self.assertEqual(build_config({}, {"LB_POLICY": "latency"}).policy, "latency")
        self.assertRaises(ConfigError, build_config, {"policy": "fastest"}, {})
        self.assertEqual(build_config({"affinity": "header:X-Session"}, {}).affinity,
                         "header:X-Session")
        self.assertRaises(ConfigError, build_config, {"affinity": "cookie:x"}, {})

    def test_routes_validated(self) -> None:
        for text, word in (
            ('[[routes]]\nmodel = "a"\n', "routes.to"),
            ('[[routes]]\nto = { "b" = 1 }\n', "routes.model"),
            ('[[routes]]\nmodel = "a"\nto = { "b" = 0 }\n', "weight"),
            ('[[routes]]\nmodel = "a"\nto = { "b" = 1 }\nsplit = 2\n', "'split'"),
            ('[[routes]]\nmodel = "a"\nto = { "b" = 1 }\n[[routes]]\nmodel = "a"\n'
             'to = { "c" = 1 }\n', "twice"),
        ):
            error = self.assertRaises(ConfigError, build_config,
                                      {"config": self.write(text)}, {})
            self.assertIn(word, str(error))
