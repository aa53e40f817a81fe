"""
Live reconfiguration in memory: what a reload changes, what it keeps, what it refuses.

Each test starts a balancer from a config file, rewrites the file and reloads, the way
``kill -HUP`` does; the balancer runs on a Clock with fake upstreams, so each request in
flight is one the test holds open and finishes when it chooses.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from treq.testing import StubTreq
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorThreads
from twisted.internet.task import Clock
from twisted.logger import formatEvent, globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from txlb import LoadBalancer
from txlb._config import Config, build_config
from txlb._reload import ConfigSource, ReloadRefused

from ..helpers import ClientConnection, FakeResponse, FakeUpstream

A, B, C = "127.0.0.1:8002", "127.0.0.1:8003", "127.0.0.1:8004"


def backend_tables(*rows: tuple[str, int, int, list[str]]) -> str:
    return "".join(
        f'[[backends]]\nurl = "http://{key}"\nweight = {weight}\nmax_conns = {max_conns}\n'
        f"models = {json.dumps(models)}\n\n"
        for key, weight, max_conns, models in rows)


class ReloadTestCase(SynchronousTestCase):
    """A balancer started from ``lb.toml``; :meth:`rewrite` then :meth:`reload`."""

    first = backend_tables((A, 1, 0, []), (B, 1, 0, []))
    command_line: dict[str, object | None] = {}
    environ: dict[str, str] = {}

    def setUp(self) -> None:
        self.path = Path(self.mktemp())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text('log-file = "none"\nretries = 0\n' + self.first)
        self.source = ConfigSource.snapshot(
            {"config": str(self.path), **self.command_line}, self.environ)
        self.clock = Clock()
        self.upstream = FakeUpstream()
        self.probes = FakeUpstream()
        self.lb = LoadBalancer(config=self.source.read(), source=self.source,
                               reactor=self.clock, agent=self.upstream,
                               probe_agent=self.probes)
        self.site = self.lb.site()
        self.events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def rewrite(self, text: str) -> None:
        self.path.write_text('log-file = "none"\nretries = 0\n' + text)

    def reload(self) -> int:
        """A reload on the Clock: the file is read at once, so it has its result."""
        return self.successResultOf(self.lb.reload_from_source())

    def refused(self, trigger: str | None = None) -> ReloadRefused:
        """A reload that must be refused: its refusal."""
        failure = self.failureResultOf(self.lb.reload_from_source(trigger), ReloadRefused)
        assert isinstance(failure.value, ReloadRefused)
        return failure.value

    def lines(self, level: str | None = None) -> list[str]:
        return [formatEvent(e) for e in self.events
                if level is None or e.get("log_level") is not None
                and e["log_level"].name == level]

    def proxy(self, path: bytes = b"/", body: bytes = b"") -> ClientConnection:
        client = ClientConnection(self.site)
        method = b"POST" if body else b"GET"
        client.request(method, path, headers=[(b"content-type", b"application/json")]
                       if body else None, body=body)
        return client

    def backend_of(self, call_index: int) -> str:
        return self.upstream.calls[call_index].uri.split(b"/")[2].decode()

    def finish(self, call_index: int, body: bytes = b"ok") -> None:
        response = self.upstream.calls[call_index].respond(FakeResponse(200, length=len(body)))
        response.send(body)
        response.end()


class MembershipTests(ReloadTestCase):
    def test_an_added_backend_joins_and_is_probed_at_once(self) -> None:
        self.rewrite(backend_tables((A, 1, 0, []), (B, 1, 0, []), (C, 3, 4, ["m"])))
        probed = len(self.probes.calls)
        self.assertEqual(self.reload(), 2)
        backend = self.lb.pool.get(C)
        assert backend is not None
        self.assertEqual((backend.spec.weight, backend.spec.max_conns, backend.models),
                         (3, 4, ("m",)))
        self.assertEqual([c.uri for c in self.probes.calls[probed:]],
                         [f"http://{C}/health".encode()])

    def test_a_removed_backend_drains_its_stream_finishes_then_it_leaves(self) -> None:
        streaming = self.proxy()  # least-conn: on A
        self.assertEqual(self.backend_of(0), A)
        self.rewrite(backend_tables((B, 1, 0, [])))
        self.reload()
        backend = self.lb.pool.get(A)
        assert backend is not None
        self.assertTrue(backend.health.removing)
        for _ in range(3):
            self.proxy()
        self.assertEqual([self.backend_of(i) for i in (1, 2, 3)], [B, B, B])
        self.finish(0, b"the whole answer")
        response = streaming.response()
        self.assertEqual((response.body, response.complete), (b"the whole answer", True))
        self.assertIsNone(self.lb.pool.get(A))

    def test_an_idle_removed_backend_leaves_at_once(self) -> None:
        self.rewrite(backend_tables((B, 1, 0, [])))
        self.reload()
        self.assertEqual([b.key for b in self.lb.pool], [B])

    def test_a_backend_the_admin_drained_stays_drained(self) -> None:
        backend = self.lb.pool.get(A)
        assert backend is not None
        self.lb.pool.drain(backend)
        self.rewrite(backend_tables((A, 2, 0, []), (B, 1, 0, [])))
        self.reload()
        self.assertIs(self.lb.pool.get(A), backend)
        self.assertTrue(backend.health.draining)
        self.assertEqual(backend.spec.weight, 2)

    def test_a_backend_added_at_runtime_and_absent_from_the_file_is_removed(self) -> None:
        admin = StubTreq(self.lb.admin_resource())
        response = self.successResultOf(admin.post(
            "http://127.0.0.1/backends", json={"backend": C}))
        self.assertEqual(response.code, 201)
        self.reload()
        self.assertIsNone(self.lb.pool.get(C))

    def test_a_backend_being_removed_that_the_file_lists_again_stays(self) -> None:
        self.proxy()  # in flight on A: its removal waits
        backend = self.lb.pool.get(A)
        assert backend is not None
        self.lb.pool.remove(backend)
        self.assertTrue(backend.health.removing)
        self.reload()  # the file still lists A
        self.assertIs(self.lb.pool.get(A), backend)
        self.assertFalse(backend.health.removing or backend.health.draining)
        self.finish(0)
        self.assertIs(self.lb.pool.get(A), backend)


class AppliedLineTests(ReloadTestCase):
    def test_a_worker_says_its_backends_are_the_supervisors_not_none(self) -> None:
        """A --workers worker's config names no backends: '0 backends' read as emptied."""
        import attrs

        config = attrs.evolve(self.lb.config, backends=(), policy="p2c")
        self.lb.reloader.apply(config, membership=False, trigger="the supervisor")
        applied = [line for line in self.lines() if "applied" in line]
        self.assertEqual(applied, ["reload (the supervisor): generation 2 applied "
                                   "(the supervisor's backends, policy p2c)"])
        self.assertEqual(len(self.lb.pool), 2)  # and they are still there

    def test_a_reload_says_how_many_backends_it_applied(self) -> None:
        self.reload()
        self.assertIn("generation 2 applied (2 backends, policy least-conn)",
                      " ".join(self.lines()))


class BackendSettingsTests(ReloadTestCase):
    first = backend_tables((A, 1, 2, []))

    def test_weight_max_conns_and_models_change_in_place(self) -> None:
        backend = self.lb.pool.get(A)
        self.proxy()
        self.rewrite(backend_tables((A, 5, 7, ["llama"])))
        self.reload()
        self.assertIs(self.lb.pool.get(A), backend)
        assert backend is not None
        self.assertEqual((backend.spec.weight, backend.spec.max_conns, backend.models,
                          backend.counts.active), (5, 7, ("llama",), 1))

    def test_a_lowered_max_conns_strands_no_request_in_flight(self) -> None:
        first, second = self.proxy(), self.proxy()
        self.rewrite(backend_tables((A, 1, 1, [])))
        self.reload()
        backend = self.lb.pool.get(A)
        assert backend is not None
        self.assertFalse(backend.eligible)
        queued = self.proxy()
        self.assertEqual(len(self.upstream.calls), 2)
        self.finish(0, b"one")
        self.assertEqual(len(self.upstream.calls), 2)  # still 1 in flight: at the new cap
        self.finish(1, b"two")
        self.assertEqual((first.response().body, second.response().body), (b"one", b"two"))
        self.assertEqual(len(self.upstream.calls), 3)  # the queued one went
        self.finish(2, b"three")
        self.assertEqual(queued.response().body, b"three")

    def test_a_raised_max_conns_wakes_the_queue(self) -> None:
        self.proxy(), self.proxy()
        queued = self.proxy()
        self.assertEqual((len(self.upstream.calls), self.lb.router.queue_length), (2, 1))
        self.rewrite(backend_tables((A, 1, 3, [])))
        self.reload()
        self.assertEqual((len(self.upstream.calls), self.lb.router.queue_length), (3, 0))
        self.finish(2, b"woken")
        self.assertEqual(queued.response().body, b"woken")

    def test_a_queued_request_keeps_its_arrival_time_under_a_new_queue_timeout(self) -> None:
        self.proxy(), self.proxy()
        self.clock.advance(5)
        queued = self.proxy()
        self.clock.advance(10)  # waited 10 s of the default 30
        self.rewrite("queue-timeout = 12\n" + backend_tables((A, 1, 2, [])))
        self.reload()
        self.clock.advance(1.9)
        self.assertEqual(queued.transport.value(), b"")
        self.clock.advance(0.2)  # 12 s after it arrived, not 12 s after the reload
        self.assertEqual(queued.response().status, 503)

    def test_a_queue_timeout_already_past_answers_at_once(self) -> None:
        self.proxy(), self.proxy()
        queued = self.proxy()
        self.clock.advance(10)
        self.rewrite("queue-timeout = 3\n" + backend_tables((A, 1, 2, [])))
        self.reload()
        self.clock.advance(0)
        self.assertEqual(queued.response().status, 503)


class RoutingTests(ReloadTestCase):
    first = backend_tables((A, 1, 0, ["small"]), (B, 1, 0, ["big"]))

    def test_routes_change(self) -> None:
        self.rewrite('[[routes]]\nmodel = "chat"\nto = { "big" = 1 }\n\n' + self.first)
        self.reload()
        self.proxy(b"/v1/chat/completions", b'{"model": "chat"}')
        self.assertEqual(self.backend_of(0), B)
        self.assertEqual(json.loads(self.upstream.calls[0].body or b"")["model"], "big")

    def test_a_new_policy_chooses_learns_and_gets_its_engine_scrapes(self) -> None:
        old = self.lb.policy
        self.rewrite('policy = "queue-depth"\n' + self.first)
        self.reload()
        self.assertIsNot(self.lb.policy, old)
        self.assertEqual(self.lb.policy.name, "queue-depth")
        self.assertIs(self.lb.router.policy, self.lb.policy)
        self.assertTrue(self.lb.health.scrape_engine_queue)
        learners = [c for c in self.lb.summaries.consumers if c.name == "the policy"]
        self.assertEqual(len(learners), 1)

    def test_the_same_policy_keeps_what_it_learned(self) -> None:
        old = self.lb.policy
        self.reload()
        self.assertIs(self.lb.policy, old)
        self.assertIs(self.lb.router.policy, old)

    def test_an_embedders_policy_object_is_kept(self) -> None:
        from txlb._scheduling.policies.round_robin import SmoothWeightedRoundRobin

        mine = SmoothWeightedRoundRobin()
        lb = LoadBalancer(config=self.source.read(), source=self.source, reactor=self.clock,
                          agent=self.upstream, probe_agent=self.probes, policy=mine)
        self.rewrite('policy = "p2c"\n' + self.first)
        self.successResultOf(lb.reload_from_source())
        self.assertIs(lb.router.policy, mine)


class SettingsTests(ReloadTestCase):
    def test_timeouts_and_retries_reach_new_requests(self) -> None:
        self.rewrite("read-timeout = 7\nsend-timeout = 8\nretry-window = 9\n" + self.first)
        self.path.write_text(self.path.read_text().replace("retries = 0", "retries = 4"))
        self.reload()
        context = self.lb.proxy.context
        self.assertEqual((context.read_timeout, context.send_timeout, context.retries,
                          context.retry_window), (7, 8, 4, 9))
        self.proxy()
        self.clock.advance(7.1)  # the new read timeout ends a silent backend's request
        self.assertEqual(self.lb.pool.slots.in_flight, 0)

    def test_a_new_health_interval_restarts_the_probe_loop(self) -> None:
        def health_probes(path: bytes) -> list[Any]:
            return [c for c in self.probes.calls if c.uri.endswith(path)]

        def answer(path: bytes) -> None:
            for call in health_probes(path):
                if not call.deferred.called:
                    call.respond(FakeResponse(503, length=0)).end()

        self.lb.health.startService()
        self.addCleanup(self.lb.health.stopService)
        answer(b"/health")
        self.rewrite("health-interval = 2\nhealth-path = \"/ready\"\n" + self.first)
        self.reload()
        self.assertEqual(len(health_probes(b"/ready")), 2)  # a round at once, on the new path
        answer(b"/ready")
        self.clock.advance(2)
        self.assertEqual(len(health_probes(b"/ready")), 4)  # every 2 s, not every 10
        self.assertEqual(len(health_probes(b"/health")), 2)

    def test_outlier_and_slow_start_settings(self) -> None:
        self.rewrite("outlier-5xx = 2\noutlier-cooldown = 4\nslow-start = 60\n" + self.first)
        self.reload()
        self.assertEqual((self.lb.pool.outliers.consecutive_5xx,
                          self.lb.pool.outliers.base_cooldown, self.lb.pool.slow_start),
                         (2, 4, 60))
        backend = self.lb.pool.get(A)
        assert backend is not None
        self.assertEqual(backend.slow_start.length, 60)

    def test_a_rate_limit_set_by_a_reload_applies(self) -> None:
        self.rewrite('rate-limit = "1/s"\nrate-burst = 1\n' + self.first)
        self.reload()
        self.proxy()
        refused = self.proxy()
        self.assertEqual(refused.response().status, 429)

    def test_new_bucket_parameters_keep_what_clients_have_used(self) -> None:
        self.rewrite('rate-limit = "1/s"\nrate-burst = 3\n' + self.first)
        self.reload()
        buckets = self.lb.proxy.rate_limiter.buckets if self.lb.proxy.rate_limiter else None
        for _ in range(3):
            self.proxy()  # this client's 3 tokens used
        self.rewrite('rate-limit = "1/s"\nrate-burst = 10\n' + self.first)
        self.reload()
        assert self.lb.proxy.rate_limiter is not None
        self.assertIs(self.lb.proxy.rate_limiter.buckets, buckets)
        self.assertEqual(self.proxy().response().status, 429)  # a bigger burst is no refill

    def test_log_content_changes_without_reopening(self) -> None:
        self.rewrite("log-content = 0\nlog-user = \"drop\"\n" + self.first)
        self.reload()
        self.assertEqual((self.lb.privacy.content, self.lb.privacy.user), (0, "drop"))

    def test_new_admin_hosts_are_answered(self) -> None:
        admin = StubTreq(self.lb.admin_resource())

        def status() -> int:
            response = self.successResultOf(admin.get(
                "http://127.0.0.1/status", headers={"Host": "lb-admin.internal"}))
            return int(response.code)

        self.assertEqual(status(), 403)
        self.rewrite('admin-hosts = ["lb-admin.internal"]\n' + self.first)
        self.reload()
        self.assertEqual(status(), 200)

    def test_a_random_user_digest_key_stays_across_reloads(self) -> None:
        self.rewrite('log-user = "hash"\n' + self.first)
        self.reload()
        key = self.lb.config.log_user_key
        self.assertIsNotNone(key)
        self.reload()
        self.assertEqual(self.lb.config.log_user_key, key)
        self.rewrite(f'log-user = "hash"\nlog-user-key = "{"k" * 20}"\n' + self.first)
        self.reload()
        self.assertEqual(self.lb.config.log_user_key, "k" * 20)

    def test_the_main_ports_own_answers_and_headers_follow(self) -> None:
        self.rewrite('lb-status = "off"\nx-backend = "off"\nmax-body = 10\n' + self.first)
        self.reload()
        self.proxy(b"/__lb_status")  # now a path like any other: to a backend
        self.assertEqual(self.upstream.calls[-1].uri.split(b"/", 3)[3], b"__lb_status")
        self.finish(0)
        self.assertNotIn(b"x-backend", self.proxy(b"/").transport.value().lower())
        self.assertEqual((self.lb.sites[0].max_body, self.lb.proxy.max_body), (10, 10))

    def test_a_new_connect_timeout_reaches_new_connections(self) -> None:
        from twisted.internet.testing import MemoryReactorClock

        reactor = MemoryReactorClock()
        lb = LoadBalancer(config=self.source.read(), source=self.source, reactor=reactor,
                          probe_agent=self.probes)
        self.rewrite("connect-timeout = 1.5\n" + self.first)
        self.successResultOf(lb.reload_from_source())
        client = ClientConnection(lb.site())
        client.request(b"GET", b"/")
        self.assertEqual(reactor.tcpClients[-1][3], 1.5)

    def test_the_hang_detector_turns_off_and_on_without_a_restart(self) -> None:
        service = self.lb.service()
        service.startService()
        self.addCleanup(service.stopService)
        self.assertTrue(self.lb.hung.watching)
        self.rewrite("hung-after = 0\nretry-window = 4\n" + self.first)
        self.reload()
        self.assertEqual(self.lines("warn"), [])
        self.assertEqual((self.lb.config.hung_after, self.lb.config.retry_window), (0, 4))
        self.assertFalse(self.lb.hung.watching)
        self.assertEqual(self.lb.hung.stall, 0)
        self.rewrite("hung-after = 3\n" + self.first)
        self.reload()
        self.assertEqual((self.lb.config.hung_after, self.lb.hung.stall), (3, 3))
        self.assertTrue(self.lb.hung.watching)

    def test_the_admin_token_can_be_rotated(self) -> None:
        admin = StubTreq(self.lb.admin_resource())
        self.rewrite('admin-token = "s3cret"\n' + self.first)
        self.reload()
        response = self.successResultOf(admin.get("http://127.0.0.1/status"))
        self.assertEqual(response.code, 401)
        response = self.successResultOf(admin.get(
            "http://127.0.0.1/status", headers={"Authorization": "Bearer s3cret"}))
        self.assertEqual(response.code, 200)


class RegistryTests(ReloadTestCase):
    def test_every_registered_part_gets_the_new_config(self) -> None:
        seen: list[Config] = []

        class Part:
            def reconfigure(self, config: Config) -> None:
                seen.append(config)

        self.lb.reconfigurable.append(Part())
        self.rewrite("queue-timeout = 4\n" + self.first)
        self.reload()
        self.assertEqual([c.queue_timeout for c in seen], [4])
        self.assertIs(seen[0], self.lb.config)

    def test_a_part_that_fails_is_logged_and_the_rest_applies(self) -> None:
        seen: list[Config] = []

        class Broken:
            def reconfigure(self, config: Config) -> None:
                raise RuntimeError("boom")

        class Part:
            def reconfigure(self, config: Config) -> None:
                seen.append(config)

        self.lb.reconfigurable.extend([Broken(), Part()])
        self.rewrite("queue-timeout = 4\n" + self.first)
        self.assertEqual(self.reload(), 2)
        self.assertEqual(len(seen), 1)
        self.assertEqual(self.lb.router.queue_timeout, 4)
        self.flushLoggedErrors(RuntimeError)


class RefusalTests(ReloadTestCase):
    def assert_refused_and_kept(self, text: str | bytes, words: str) -> None:
        before = self.lb.config
        backends = list(self.lb.pool)
        if isinstance(text, bytes):
            self.path.write_bytes(text)
        else:
            self.path.write_text(text)
        refused = self.refused()
        self.assertIn(words, refused.message)
        self.assertEqual(refused.status, 400)
        self.assertIs(self.lb.config, before)
        self.assertEqual(list(self.lb.pool), backends)
        errors = self.lines("error")
        self.assertEqual(len(errors), 1, errors)
        self.assertEqual(errors[0].count("\n"), 0)
        self.assertIn("still running generation 1", errors[0])
        status = self.lb.reloader.generation.status()
        self.assertEqual((status["generation"], status["last_error"]),
                         (1, refused.message))
        self.assertIn('txlb_config_reload_total{result="refused"} 1.0',
                      self.lb.metrics.exposition().decode())

    def test_bad_toml(self) -> None:
        self.assert_refused_and_kept("retries = [\n", "is not valid TOML")

    def test_a_bad_value(self) -> None:
        self.assert_refused_and_kept(
            'log-file = "none"\nqueue-timeout = -1\n' + backend_tables((C, 1, 0, [])),
            "--queue-timeout")

    def test_an_unknown_key(self) -> None:
        self.assert_refused_and_kept('log-file = "none"\nretrys = 1\n', "did you mean")

    def test_an_unreadable_file(self) -> None:
        self.path.unlink()
        self.assertIn("cannot read", self.refused().message)
        self.assertEqual(len(self.lb.pool), 2)

    def test_a_byte_that_is_not_utf8(self) -> None:
        self.assert_refused_and_kept(b'retries = 1\nadmin-token = "\xfe"\n' +
                                     self.first.encode(), "is not UTF-8 text")

    def test_arrays_nested_5000_deep(self) -> None:
        self.assert_refused_and_kept(self.first + "retries = " + "[" * 5000,
                                     "nested too deeply")

    def test_inline_tables_nested_5000_deep(self) -> None:
        self.assert_refused_and_kept(self.first + "retries = " + "{a = " * 5000,
                                     "nested too deeply")

    def test_a_file_without_backends_keeps_the_running_ones(self) -> None:
        """What a truncated save leaves is no fleet of 127.0.0.1:8002-8009."""
        self.assert_refused_and_kept('log-file = "none"\nretries = 0\n',
                                     "has no 'backends' key")

    def test_an_empty_file(self) -> None:
        self.assert_refused_and_kept("", "has no 'backends' key")

    def test_a_fifo_is_refused_without_waiting_for_a_writer(self) -> None:
        self.path.unlink()
        os.mkfifo(self.path)
        self.assertIn("not a regular file (a FIFO)", self.refused().message)
        self.assertEqual([b.key for b in self.lb.pool], [A, B])

    def test_a_file_past_the_size_bound(self) -> None:
        self.assert_refused_and_kept(self.first + "#" * (4 * 1024**2), "larger than 4 MiB")

    def test_an_explicit_empty_list_empties_the_fleet(self) -> None:
        self.rewrite("backends = []\n")
        self.assertEqual(self.reload(), 2)
        self.assertEqual([b.key for b in self.lb.pool], [])

    def test_a_bug_reading_the_file_is_loud_refused_and_counted(self) -> None:
        from unittest.mock import patch

        with patch("txlb._reload.build_config", side_effect=RuntimeError("bug")):
            refused = self.refused()
        self.assertEqual(refused.status, 500)
        self.assertIn("see txlb's log", refused.message)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertEqual(self.lb.reloader.generation.last_error, refused.message)
        self.assertIn('txlb_config_reload_total{result="refused"} 1.0',
                      self.lb.metrics.exposition().decode())
        self.assertEqual(self.reload(), 2)  # nothing stays stuck

    def test_a_policy_that_cannot_be_built_changes_nothing(self) -> None:
        from unittest.mock import patch

        self.rewrite('policy = "p2c"\nqueue-timeout = 3\n' + backend_tables((C, 1, 0, [])))
        with patch("txlb._reload.make_policy", side_effect=RuntimeError("no GPU")):
            refused = self.refused()
        self.assertIn("no GPU", refused.message)
        self.assertEqual((self.lb.router.queue_timeout, [b.key for b in self.lb.pool]),
                         (30, [A, B]))

    def test_a_bug_part_way_is_a_500_that_says_so(self) -> None:
        from unittest.mock import patch

        self.rewrite("queue-timeout = 3\n" + self.first)
        with patch.object(self.lb.proxy, "limit_rate", side_effect=RuntimeError("bug")):
            refused = self.refused("POST /reload")
        self.assertEqual(refused.status, 500)
        self.assertIn("failed part-way", refused.message)
        self.assertEqual(self.lb.reloader.generation.generation, 1)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_a_refusal_is_counted_and_a_later_reload_applies(self) -> None:
        self.path.write_text("nonsense = [")
        self.refused()
        self.rewrite(self.first)
        self.assertEqual(self.reload(), 2)
        self.assertIsNone(self.lb.reloader.generation.last_error)
        text = self.lb.metrics.exposition().decode()
        self.assertIn('txlb_config_reload_total{result="refused"} 1.0', text)
        self.assertIn('txlb_config_reload_total{result="ok"} 1.0', text)
        self.assertIn("txlb_config_generation 2.0", text)

    def test_without_a_config_file_there_is_nothing_to_reload(self) -> None:
        lb = LoadBalancer([A], reactor=self.clock, agent=FakeUpstream(),
                          probe_agent=FakeUpstream(), log_file="none")
        failure = self.failureResultOf(lb.reload_from_source(), ReloadRefused)
        self.assertEqual(failure.value.status, 409)


class RestartOnlyTests(ReloadTestCase):
    def test_one_line_names_each_and_the_rest_is_applied(self) -> None:
        self.rewrite('listen = "tcp:9999"\nadmin = "none"\nworkers = 2\n'
                     'log-file = "elsewhere.log"\nqueue-timeout = 5\n' + self.first)
        self.path.write_text(self.path.read_text().replace('log-file = "none"\n', "", 1))
        self.reload()
        warnings = self.lines("warn")
        self.assertEqual(len(warnings), 1, warnings)
        for name in ("--listen", "--admin", "--workers", "--log-file"):
            self.assertIn(name, warnings[0])
        self.assertEqual((self.lb.config.listen, self.lb.config.admin, self.lb.config.workers,
                          self.lb.config.log_file), ("tcp:8000", "tcp:8001:interface=127.0.0.1",
                                                     1, "none"))
        self.assertEqual(self.lb.router.queue_timeout, 5)

    def test_an_unchanged_file_warns_of_nothing(self) -> None:
        self.reload()
        self.assertEqual(self.lines("warn"), [])


class PrecedenceTests(ReloadTestCase):
    command_line = {"queue-timeout": "7"}
    environ = {"LB_POLICY": "round-robin"}

    def test_the_command_line_and_environment_still_win_over_the_file(self) -> None:
        self.rewrite('queue-timeout = 99\npolicy = "p2c"\nretry-window = 3\n' + self.first)
        self.reload()
        self.assertEqual((self.lb.config.queue_timeout, self.lb.config.policy,
                          self.lb.config.retry_window), (7, "round-robin", 3))

    def test_the_environment_is_the_one_at_start(self) -> None:
        import os
        from unittest.mock import patch

        with patch.dict(os.environ, {"LB_POLICY": "p2c"}):
            self.reload()
        self.assertEqual(self.lb.config.policy, "round-robin")


class OverlapTests(ReloadTestCase):
    def test_a_reload_asked_for_while_one_applies_runs_once_after_it(self) -> None:
        lb = self.lb
        calls: list[int] = []
        asked: list[Deferred[int]] = []
        test = self

        class AsksAgain:
            def reconfigure(self, config: Config) -> None:
                calls.append(lb.reloader.generation.generation)
                if len(calls) == 1:
                    test.rewrite("queue-timeout = 6\n" + test.first)
                    # merged into one more, after this one
                    asked.extend([lb.reload_from_source(), lb.reload_from_source()])
                    test.assertNoResult(asked[0])

        lb.reconfigurable.append(AsksAgain())
        self.rewrite("queue-timeout = 5\n" + self.first)
        self.reload()
        self.assertEqual([self.successResultOf(d) for d in asked], [3, 3])
        self.assertEqual(len(calls), 2)
        self.assertEqual(lb.router.queue_timeout, 6)


    def test_a_config_given_while_one_applies_is_applied_after_it(self) -> None:
        lb = self.lb
        later = build_config({"backends": A, "log-file": "none", "queue-timeout": "9"}, {})

        class GivesAnother:
            def reconfigure(self, config: Config) -> None:
                if config.queue_timeout != 9:
                    lb.reload(later)

        lb.reconfigurable.append(GivesAnother())
        self.assertEqual(lb.reload(build_config({"backends": B, "log-file": "none"}, {})), 3)
        self.assertEqual((lb.router.queue_timeout, [b.key for b in lb.pool]), (9, [A]))


@implementer(IReactorThreads)
class ThreadedClock(Clock):
    """
    A Clock with a thread pool the test runs by hand: what runs "in a thread" waits in
    :attr:`work` until :meth:`run_threads`, and what a thread hands back to the reactor
    waits in :attr:`from_thread` until :meth:`run_reactor_turn`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.work: list[tuple[Any, Any]] = []
        self.from_thread: list[tuple[Any, tuple[Any, ...]]] = []
        self.on_reactor_thread = True

    def getThreadPool(self) -> ThreadedClock:
        return self

    def callInThreadWithCallback(self, on_result: Any, f: Any, *args: Any,
                                 **kwargs: Any) -> None:
        self.work.append((on_result, lambda: f(*args, **kwargs)))

    def callInThread(self, f: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def suggestThreadPoolSize(self, size: int) -> None:
        raise NotImplementedError

    def callFromThread(self, f: Any, *args: Any, **kwargs: Any) -> None:
        self.from_thread.append((lambda *a: f(*a, **kwargs), args))

    def run_threads(self) -> None:
        work, self.work = self.work, []
        self.on_reactor_thread = False
        try:
            for on_result, call in work:
                try:
                    result = call()
                except BaseException:
                    on_result(False, Failure())
                else:
                    on_result(True, result)
        finally:
            self.on_reactor_thread = True

    def run_reactor_turn(self) -> None:
        calls, self.from_thread = self.from_thread, []
        for f, args in calls:
            f(*args)


class OffThreadTests(ReloadTestCase):
    """With a reactor that has a thread pool, the file is read in it."""

    def setUp(self) -> None:
        super().setUp()
        self.clock = ThreadedClock()
        self.lb = LoadBalancer(config=self.source.read(), source=self.source,
                               reactor=self.clock, agent=self.upstream,
                               probe_agent=self.probes)
        self.reads: list[bool] = []  # for each read: whether on the reactor thread
        read = ConfigSource.load

        def load(source: ConfigSource) -> Any:
            self.reads.append(self.clock.on_reactor_thread)
            return read(source)

        self.patch(ConfigSource, "load", load)
        self.applied: list[bool] = []
        self.lb.reconfigurable.append(self)  # type: ignore[arg-type]

    def reconfigure(self, config: Config) -> None:
        self.applied.append(self.clock.on_reactor_thread)

    def test_the_file_is_read_in_the_thread_pool_and_applied_on_the_reactor(self) -> None:
        self.rewrite(backend_tables((A, 1, 0, []), (C, 1, 0, [])))
        reloaded = self.lb.reload_from_source()
        self.assertNoResult(reloaded)
        self.assertEqual((self.reads, len(self.clock.work)), ([], 1))  # nothing read yet
        self.clock.run_threads()
        self.assertEqual(self.reads, [False])
        self.assertEqual([b.key for b in self.lb.pool], [A, B])  # not applied in the thread
        self.clock.run_reactor_turn()
        self.assertEqual(self.successResultOf(reloaded), 2)
        self.assertEqual((self.applied, [b.key for b in self.lb.pool]), ([True], [A, C]))

    def test_a_bad_file_read_in_the_pool_is_refused_on_the_reactor(self) -> None:
        self.path.write_bytes(b"retries = " + b"[" * 5000)
        reloaded = self.lb.reload_from_source("SIGHUP")
        self.clock.run_threads()
        self.clock.run_reactor_turn()
        refused = self.failureResultOf(reloaded, ReloadRefused).value
        self.assertIn("nested too deeply", str(refused))
        self.assertEqual(self.lb.reloader.generation.last_error, str(refused))

    def test_reloads_asked_for_while_one_is_read_are_one_more(self) -> None:
        first = self.lb.reload_from_source()
        storm = [self.lb.reload_from_source("SIGHUP") for _ in range(1000)]
        self.assertEqual(len(self.clock.work), 1)  # one read at a time
        self.rewrite("queue-timeout = 7\n" + self.first)  # written after the first read began
        self.clock.run_threads()
        self.clock.run_reactor_turn()
        self.assertEqual(self.successResultOf(first), 2)
        for waiting in storm:
            self.assertNoResult(waiting)
        self.assertEqual(len(self.clock.work), 1)  # the one more, reading the file as now
        self.clock.run_threads()
        self.clock.run_reactor_turn()
        self.assertEqual({self.successResultOf(waiting) for waiting in storm}, {3})
        self.assertEqual((len(self.reads), self.lb.router.queue_timeout), (2, 7))
        self.assertEqual(self.clock.work, [])

    def test_a_refusal_of_the_merged_reload_reaches_every_asker(self) -> None:
        first = self.lb.reload_from_source()
        waiting = [self.lb.reload_from_source() for _ in range(3)]
        self.clock.run_threads()
        self.path.write_text("retries = [")
        self.clock.run_reactor_turn()
        self.successResultOf(first)
        self.clock.run_threads()
        self.clock.run_reactor_turn()
        for each in waiting:
            self.failureResultOf(each, ReloadRefused)


class StormLogTests(ReloadTestCase):
    """Many reloads write a line each kind a minute, and a summary; each is counted."""

    def test_the_same_config_applied_again_and_again_is_one_line_and_a_summary(self) -> None:
        for _ in range(100):
            self.reload()
        applied = [line for line in self.lines() if "applied" in line]
        self.assertEqual(len(applied), 1, applied)
        self.clock.advance(60)
        applied = [line for line in self.lines() if "applied" in line]
        self.assertEqual(len(applied), 2, applied)
        self.assertIn("99 more like this in the last 60s", applied[1])
        self.assertIn('txlb_config_reload_total{result="ok"} 100.0',
                      self.lb.metrics.exposition().decode())

    def test_a_config_that_changes_something_is_a_line_at_once(self) -> None:
        self.reload()
        self.rewrite("queue-timeout = 4\n" + self.first)
        self.reload()
        applied = [line for line in self.lines() if "applied" in line]
        self.assertEqual(len(applied), 2, applied)
        self.assertIn("generation 3 applied", applied[1])

    def test_the_same_refusal_again_and_again_is_one_line_and_a_summary(self) -> None:
        self.path.write_bytes(b"\xff")
        for _ in range(100):
            self.refused("SIGHUP")
        self.assertEqual(len(self.lines("error")), 1)
        self.clock.advance(60)
        errors = self.lines("error")
        self.assertEqual(len(errors), 2, errors)
        self.assertIn("not UTF-8 text", errors[1])
        self.assertIn("99 more like this in the last 60s", errors[1])
        self.assertIn('txlb_config_reload_total{result="refused"} 100.0',
                      self.lb.metrics.exposition().decode())


class AdminReloadTests(ReloadTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.admin = StubTreq(self.lb.admin_resource())

    def post(self, headers: dict[str, str] | None = None, data: bytes | None = None,
             ) -> tuple[int, Any]:
        response = self.successResultOf(self.admin.post(
            "http://127.0.0.1/reload", data=data, headers=headers or {}))
        return response.code, json.loads(self.successResultOf(response.content()))

    def test_post_reload_applies_and_answers_the_generation(self) -> None:
        self.rewrite(backend_tables((A, 1, 0, []), (C, 1, 0, [])))
        code, body = self.post()
        self.assertEqual((code, body["generation"], body["config"]["generation"]), (200, 2, 2))
        self.assertEqual([b.key for b in self.lb.pool], [A, C])

    def test_a_bad_file_is_400_with_the_reason(self) -> None:
        self.path.write_text("retries = [\n")
        code, body = self.post()
        self.assertEqual(code, 400)
        self.assertIn("is not valid TOML", body["error"]["message"])

    def test_a_file_that_cannot_be_parsed_or_names_no_backends_is_400(self) -> None:
        for raw in (b'backends = ["\xff"]\n', b"retries = " + b"[" * 5000,
                    b'log-file = "none"\n'):
            self.path.write_bytes(raw)
            code, body = self.post()
            self.assertEqual(code, 400, body)
            self.assertIn("refused, still running generation 1", body["error"]["message"])
        self.assertEqual([b.key for b in self.lb.pool], [A, B])
        self.assertIn('txlb_config_reload_total{result="refused"} 3.0',
                      self.lb.metrics.exposition().decode())

    def test_without_a_file_it_is_409(self) -> None:
        lb = LoadBalancer([A], reactor=self.clock, agent=FakeUpstream(),
                          probe_agent=FakeUpstream(), log_file="none")
        response = self.successResultOf(StubTreq(lb.admin_resource()).post(
            "http://127.0.0.1/reload"))
        self.assertEqual(response.code, 409)

    def test_a_web_page_cannot_trigger_it(self) -> None:
        self.rewrite(backend_tables((C, 1, 0, [])))
        code, _ = self.post({"Content-Type": "application/x-www-form-urlencoded"}, b"a=b")
        self.assertEqual(code, 415)
        code, _ = self.post({"Content-Type": "text/plain"}, b"")
        self.assertEqual(code, 415)
        code, _ = self.post({"Origin": "http://evil.example"})
        self.assertEqual(code, 403)
        self.assertEqual(self.lb.reloader.generation.generation, 1)
        self.assertEqual([b.key for b in self.lb.pool], [A, B])

    def test_get_is_not_a_reload(self) -> None:
        response = self.successResultOf(self.admin.get("http://127.0.0.1/reload"))
        self.assertEqual(response.code, 405)
        self.assertEqual(self.lb.reloader.generation.generation, 1)

    def test_the_token_guards_it(self) -> None:
        self.rewrite('admin-token = "s3cret"\n' + self.first)
        self.post()  # generation 2 sets the token
        code, _ = self.post()
        self.assertEqual(code, 401)
        code, body = self.post({"Authorization": "Bearer s3cret"})
        self.assertEqual((code, body["generation"]), (200, 3))

    def test_status_says_which_config_runs(self) -> None:
        self.clock.advance(1_700_000_000)
        self.post()
        response = self.successResultOf(self.admin.get("http://127.0.0.1/status"))
        config = json.loads(self.successResultOf(response.content()))["config"]
        self.assertEqual(config, {"generation": 2, "loaded_at": 1_700_000_000,
                                  "loaded_at_iso": "2023-11-14T22:13:20Z",
                                  "path": str(self.path), "last_error": None})


class ConfigBuiltInMemoryTests(SynchronousTestCase):
    def test_reload_takes_a_config_object(self) -> None:
        """``LoadBalancer.reload(config)``: an embedder's own config, no file needed."""
        lb = LoadBalancer([A], reactor=Clock(), agent=FakeUpstream(),
                          probe_agent=FakeUpstream(), log_file="none")
        config = build_config({"backends": f"{A},{B}", "log-file": "none",
                               "queue-timeout": "3"}, environ={})
        self.assertEqual(lb.reload(config), 2)
        self.assertEqual(([b.key for b in lb.pool], lb.router.queue_timeout), ([A, B], 3))


class ReloadBudgetsTests(ReloadTestCase):
    """The token budgets are one of the parts a reload reconfigures."""

    budget = '[[budgets]]\nname = "per-ip"\nkey = "ip"\ntokens_per_minute = {tpm}\n'
    first = backend_tables((A, 1, 0, [])) + budget.format(tpm=1000)

    def test_a_reload_changes_the_budget_requests_meet(self) -> None:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 100}).encode()
        first = self.proxy(b"/v1/chat/completions", body)
        answer = self.upstream.last.respond(FakeResponse(200, length=2))
        answer.send(b"{}")
        answer.end()
        self.assertEqual(first.response().status, 200)
        self.rewrite(backend_tables((A, 1, 0, [])) + self.budget.format(tpm=50))
        self.reload()
        self.assertEqual(self.lb.budgets.status()["budgets"],
                         [{"name": "per-ip", "key": "ip", "one_client": False,
                           "class": None, "tokens_per_minute": 50}])
        refused = self.proxy(b"/v1/chat/completions", body)
        self.assertEqual(refused.response().status, 429)
        self.assertEqual(len(self.upstream.calls), 1)  # never forwarded


class ReloadClassesTests(ReloadTestCase):
    """The priority classes are one of the parts a reload reconfigures."""

    classes = ('[[classes]]\nname = "{first}"\nqueue_timeout = {timeout}\n'
               '[[classes]]\nname = "{second}"\n')
    first = backend_tables((A, 1, 1, [])) + classes.format(
        first="interactive", second="default", timeout=20)

    def test_a_reload_reorders_the_classes_and_moves_a_queued_request(self) -> None:
        """
        A queued request of a class the reload removed joins the default class, with that
        class's deadline (arrival + --queue-timeout's 30 s), not its old class's 20 s.
        """
        self.proxy(b"/v1/completions", b'{"prompt": "a"}')  # takes the one slot
        client = ClientConnection(self.site)
        client.request(b"POST", b"/v1/completions",
                       headers=[(b"content-type", b"application/json"),
                                (b"x-priority", b"interactive")], body=b'{"prompt": "b"}')
        self.assertEqual(self.lb.router.queue_status()["classes"]["interactive"]["length"], 1)
        self.rewrite(backend_tables((A, 1, 1, [])) + self.classes.format(
            first="urgent", second="default", timeout=5))
        self.reload()
        self.assertEqual([c.name for c in self.lb.classes.order], ["urgent", "default"])
        self.assertEqual(self.lb.router.queue_status()["classes"]["default"]["length"], 1)
        self.clock.advance(21)  # past the removed class's 20 s: still waiting
        self.assertEqual(self.lb.router.queue_length, 1)
        self.clock.advance(10)  # past the default class's 30 s
        self.assertEqual(client.response().status, 503)
        self.assertEqual(len(self.upstream.calls), 1)
