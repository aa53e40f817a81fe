"""
The one bookkeeper (txlb._records.bookkeeper) and the request observer the proxy reports
to (txlb._records.observer): what each event does to the books, the declared summary
consumers, and how LoadBalancer wires them.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from txlb import LoadBalancer
from txlb._cluster.outlier import OutlierRule
from txlb._cluster.pool import Pool
from txlb._config import BackendSpec
from txlb._records.bookkeeper import (
    Bookkeeper,
    SummaryConsumer,
    SummaryFeed,
    policy_learns,
    pool_results,
)
from txlb._records.metrics import Metrics
from txlb._records.observer import IRequestObserver, NullObserver
from txlb._records.summary import RequestRecord, Summary, summarize
from txlb._scheduling.outcome import RequestOutcome
from txlb._scheduling.policies.least_conn import LeastConnections
from txlb._scheduling.policies.peak_ewma import PeakEwmaLatency

from ..helpers import ClientConnection, FakeResponse, FakeUpstream

A, B, C, D = "127.0.0.1:8002", "127.0.0.1:8003", "127.0.0.1:8004", "127.0.0.1:8005"


def a_record(backend: str | None = A, status: int | None = 200) -> RequestRecord:
    return RequestRecord(started=0.0, method=b"POST", path=b"/v1/completions",
                         orid_header=None, request_body=b"{}", backend=backend,
                         status=status, ended=0.5, first_byte=0.25)


def broken_record() -> RequestRecord:
    record = a_record()
    record.response = [None]  # type: ignore[list-item]  # summarize() raises TypeError
    return record


def a_summary(backend: str = A, status: int = 200, ttft: float | None = 0.25) -> Summary:
    return Summary(time=0.0, orid="-", backend=backend, method="POST",
                   path="/v1/completions", status=status, kind="other", outcome="ok",
                   dur=0.5, ttft=ttft)


def a_pool(*keys: str, consecutive_5xx: int = 0) -> Pool:
    specs = [key.rsplit(":", 1) for key in keys]
    return Pool(tuple(BackendSpec(host, int(port)) for host, port in specs),
                clock=Clock(), outliers=OutlierRule(consecutive_5xx=consecutive_5xx))


def counter(metrics: Metrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    return 0.0 if value is None else value


class SummaryFeedTests(SynchronousTestCase):
    def test_nothing_is_summarised_when_nobody_reads_summaries(self) -> None:
        feed = SummaryFeed()
        feed.ended(broken_record())  # would raise inside summarize(), were it called
        self.assertEqual(feed.summarised, 0)
        self.assertEqual(self.flushLoggedErrors(TypeError), [])

    def test_each_record_is_summarised_once_for_every_consumer_in_order(self) -> None:
        heard: list[tuple[str, Summary, bool]] = []
        feed = SummaryFeed(consumers=[
            SummaryConsumer("first", lambda s, answered: heard.append(("first", s, answered)))])
        feed.add(SummaryConsumer("second", lambda s, answered: heard.append(("second", s,
                                                                             answered))))
        record = a_record()
        feed.ended(record)
        self.assertEqual(feed.summarised, 1)
        self.assertEqual([name for name, _, _ in heard], ["first", "second"])
        self.assertIs(heard[0][1], heard[1][1])  # one summary, not one per consumer
        self.assertEqual(heard[0][1], summarize(record))
        self.assertEqual([answered for _, _, answered in heard], [True, True])
        self.assertEqual([c.name for c in feed.consumers], ["first", "second"])

    def test_a_request_no_backend_answered_is_fed_as_unanswered(self) -> None:
        heard: list[bool] = []
        feed = SummaryFeed(consumers=[SummaryConsumer("x", lambda s, a: heard.append(a))])
        feed.ended(a_record(backend=None, status=None))
        self.assertEqual(heard, [False])

    def test_a_failing_consumer_is_logged_and_the_others_still_fed(self) -> None:
        heard: list[Summary] = []

        def explode(summary: Summary, answered: bool) -> None:
            raise ZeroDivisionError("a consumer's bug")

        feed = SummaryFeed(consumers=[SummaryConsumer("broken", explode),
                                      SummaryConsumer("kept", lambda s, a: heard.append(s))])
        feed.ended(a_record())
        self.assertEqual(len(heard), 1)
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)

    def test_a_summariser_bug_is_logged_and_feeds_nobody(self) -> None:
        heard: list[Summary] = []
        feed = SummaryFeed(consumers=[SummaryConsumer("x", lambda s, a: heard.append(s))])
        feed.ended(broken_record())
        feed.ended(a_record())
        self.assertEqual(len(heard), 1)
        self.assertEqual(len(self.flushLoggedErrors(TypeError)), 1)


class ConsumerTests(SynchronousTestCase):
    def test_pool_results_count_answered_requests_of_known_backends(self) -> None:
        pool = a_pool(A)
        consume = pool_results(pool).consume
        consume(a_summary(status=500), True)
        consume(a_summary(status=502), False)  # txlb's own answer: not the backend's
        consume(a_summary(backend=B), True)  # no such backend (any more): ignored
        backend = pool.get(A)
        assert backend is not None
        self.assertEqual(backend.counts.responses, {"5xx": 1})
        self.assertEqual(backend.pace.ewma_duration, 0.5)

    def test_the_latency_policy_learns_answered_times_to_first_byte(self) -> None:
        pool = a_pool(A)
        backend = pool.get(A)
        assert backend is not None
        policy = PeakEwmaLatency(Clock())
        feed = SummaryFeed(consumers=[policy_learns(pool, policy)])
        feed.feed(a_summary(ttft=3.0), False)
        feed.feed(a_summary(ttft=None), True)
        self.assertIsNone(policy.estimate(backend))
        feed.feed(a_summary(ttft=0.75), True)
        self.assertEqual(policy.estimate(backend), 0.75)

    def test_every_answered_request_reaches_observe_as_an_outcome(self) -> None:
        pool = a_pool(A)
        seen: list[tuple[object, RequestOutcome]] = []
        policy = LeastConnections()
        self.patch(policy, "observe", lambda backend, outcome: seen.append((backend, outcome)))
        feed = SummaryFeed(consumers=[policy_learns(pool, policy)])
        feed.feed(a_summary(ttft=0.5), True)
        feed.feed(a_summary(ttft=0.5), False)  # no answer: nothing to learn
        self.assertEqual([(backend, outcome.ttfb, outcome.answered) for backend, outcome in seen],
                         [(pool.get(A), 0.5, True)])

    def test_the_outcome_carries_the_requests_client_key(self) -> None:
        """What a policy or a budget learns says who sent the request (``--rate-key``)."""
        pool = a_pool(A)
        seen: list[RequestOutcome] = []
        policy = LeastConnections()
        self.patch(policy, "observe", lambda backend, outcome: seen.append(outcome))
        record = a_record()
        record.client = "10.0.0.7"
        SummaryFeed(consumers=[policy_learns(pool, policy)]).ended(record)
        self.assertEqual([outcome.client for outcome in seen], ["10.0.0.7"])


class BookkeeperTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.pool = a_pool(A, B, C, D, consecutive_5xx=2)
        self.metrics = Metrics(self.pool)
        self.probed: list[str] = []
        self.fed: list[tuple[Summary, bool]] = []
        feed = SummaryFeed(consumers=[
            SummaryConsumer("test", lambda s, a: self.fed.append((s, a)))])
        self.books = Bookkeeper(self.pool, self.metrics, feed,
                                lambda backend: self.probed.append(backend.key))

    def backend(self, key: str) -> Any:
        backend = self.pool.get(key)
        assert backend is not None
        return backend

    def test_it_is_a_request_observer(self) -> None:
        self.assertTrue(verifyObject(IRequestObserver, self.books))
        self.assertTrue(verifyObject(IRequestObserver, NullObserver()))

    def test_ended_and_finished_feed_the_same_consumers(self) -> None:
        self.books.ended(a_record())
        self.books.finished(a_summary(B), False)
        self.assertEqual([(s.backend, a) for s, a in self.fed], [(A, True), (B, False)])

    def test_answers_feed_the_outlier_detector(self) -> None:
        backend = self.backend(A)
        self.books.answered(backend, 500, "ip:10.0.0.1")
        self.books.answered(backend, 500, "ip:10.0.0.2")
        self.assertFalse(backend.health.healthy)
        self.assertEqual(backend.verdicts.outlier_ejections, 1)

    def test_a_suspect_is_probed(self) -> None:
        self.books.suspect(self.backend(B))
        self.assertEqual(self.probed, [B])

    def test_retries_and_queue_waits_reach_the_metrics(self) -> None:
        self.books.retried()
        self.books.retried()
        self.books.waited(1.5)
        self.assertEqual(counter(self.metrics, "txlb_retries_total"), 2.0)
        self.assertEqual(counter(self.metrics, "txlb_queue_wait_seconds_sum"), 1.5)
        self.assertEqual(counter(self.metrics, "txlb_queue_wait_seconds_count"), 1.0)

    def test_a_reported_down_takes_the_backend_out_once(self) -> None:
        backend = self.backend(A)
        self.books.down(backend, "proxy: connection refused", reporter="worker 1")
        self.books.down(backend, "proxy: connection refused", reporter="worker 0")
        self.assertFalse(backend.health.healthy)
        self.assertEqual(backend.health.ejections, 1)
        self.assertEqual(backend.verdicts.hung_ejections, 0)

    def test_a_hang_verdict_goes_through_the_half_the_fleet_guard(self) -> None:
        first, second, third = self.backend(A), self.backend(B), self.backend(C)
        self.books.down(first, "hung: no byte from any of 2 requests")
        self.books.down(second, "hung: no byte from any of 2 requests")
        self.assertEqual((first.verdicts.hung_ejections, second.verdicts.hung_ejections), (1, 1))
        self.books.down(third, "hung: no byte from any of 2 requests")
        self.assertTrue(third.health.healthy)  # half the fleet is out already
        self.assertEqual(third.verdicts.hung_ejections, 0)


class WiringTests(SynchronousTestCase):
    """LoadBalancer builds the bookkeeper and wires it; nothing climbs back to it."""

    def build(self, **options: Any) -> LoadBalancer:
        self.upstream = FakeUpstream()
        lb = LoadBalancer([A], reactor=Clock(), agent=self.upstream,
                          probe_agent=FakeUpstream(), log_file="none", **options)
        return lb

    def serve_one(self, lb: LoadBalancer) -> None:
        client = ClientConnection(lb.site())
        client.request(b"POST", b"/v1/completions", body=b'{"prompt": "x"}')
        self.upstream.last.respond(FakeResponse(200, length=0)).end()
        self.assertEqual(client.response().status, 200)

    def test_the_proxy_reports_to_the_bookkeeper(self) -> None:
        lb = self.build()
        self.assertIs(lb.observer, lb.bookkeeper)
        self.assertIs(lb.proxy.context.observer, lb.bookkeeper)
        self.assertEqual([c.name for c in lb.summaries.consumers],
                         ["the pool's result counts", "the policy", "the token budgets",
                          "the fair shares", "the metrics", "the history"])
        self.serve_one(lb)
        self.assertEqual(lb.summaries.summarised, 1)
        backend = lb.pool.get(A)
        assert backend is not None
        self.assertEqual(backend.counts.responses, {"2xx": 1})
        self.assertEqual(lb.metrics.registry.get_sample_value(
            "txlb_requests_total", {"backend": A, "method": "POST", "status_class": "2xx"}),
            1.0)

    def test_the_result_log_is_a_declared_consumer(self) -> None:
        path = self.mktemp()
        lb = LoadBalancer([A], reactor=Clock(), agent=FakeUpstream(),
                          probe_agent=FakeUpstream(), log_file=path)
        self.addCleanup(lambda: lb.result_log and lb.result_log.close())
        self.assertEqual(lb.summaries.consumers[-1].name, "the result log")

    def test_a_given_observer_hears_everything_and_nothing_is_counted_here(self) -> None:
        heard: list[tuple[str, Any]] = []

        class Recorder(NullObserver):
            def ended(self, record: RequestRecord) -> None:
                heard.append(("ended", record.status))

            def answered(self, backend: Any, status: int, client: str | None) -> None:
                heard.append(("answered", status))

            def waited(self, seconds: float) -> None:
                heard.append(("waited", seconds))

            def down(self, backend: Any, reason: str) -> None:
                heard.append(("down", reason))

        lb = self.build(observer=Recorder())
        self.assertIsInstance(lb.proxy.context.observer, Recorder)
        self.serve_one(lb)
        self.assertEqual(heard, [("answered", 200), ("ended", 200)])
        self.assertEqual(lb.summaries.summarised, 0)  # the bookkeeper heard nothing
        backend = lb.pool.get(A)
        assert backend is not None
        self.assertEqual(backend.counts.responses, {})
        lb.router.on_queue_wait(0.5)
        lb.pool.mark_down(backend, "proxy: connection refused")
        self.assertEqual(heard[2:], [("waited", 0.5), ("down", "proxy: connection refused")])
