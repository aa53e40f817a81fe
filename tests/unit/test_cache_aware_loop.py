"""
The closed loop's plumbing: the RoutingRequest a policy chose with reaches its ``observe``
on the request's outcome -- through the proxy and the bookkeeper in one process, and in a
``--workers`` worker, where the policy routes and learns -- so a policy can match what an
engine reported to what it predicted for that very request.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from twisted.internet import error as neterror
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from txlb import LoadBalancer
from txlb._cluster.backend import Backend
from txlb._records.bookkeeper import SummaryFeed, policy_learns
from txlb._scheduling.outcome import RequestOutcome
from txlb._scheduling.policies.cache_aware import CacheAware
from txlb._scheduling.policies.least_conn import LeastConnections
from txlb._scheduling.request import ANY_REQUEST, RoutingRequest
from txlb._workers.reports import SupervisorForwarder

from ..helpers import ClientConnection, FakeResponse, FakeUpstream
from .test_bookkeeper import A, a_pool, a_record, a_summary
from .test_cache_aware import facts

B = "127.0.0.1:8003"
PROMPT = "You are the billing assistant of a large company. " * 40


class Recording(LeastConnections):
    """least-conn, keeping what it chose with and what it observed."""

    def __init__(self) -> None:
        super().__init__()
        self.chosen_for: list[RoutingRequest] = []
        self.observed: list[RequestOutcome] = []

    def choose(self, candidates: Sequence[Backend],
               request: RoutingRequest = ANY_REQUEST) -> Backend:
        self.chosen_for.append(request)
        return super().choose(candidates, request)

    def observe(self, backend: Backend, outcome: RequestOutcome) -> None:
        self.observed.append(outcome)


def answer(prompt_tokens: int = 500) -> bytes:
    return json.dumps({"choices": [{"text": "ok", "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1}}
                      ).encode()


class ThreadingTests(SynchronousTestCase):
    def serve(self, lb: LoadBalancer, upstream: FakeUpstream, body: dict[str, Any]) -> None:
        client = ClientConnection(lb.site())
        client.request(b"POST", b"/v1/completions", body=json.dumps(body).encode())
        payload = answer()
        response = upstream.last.respond(FakeResponse(
            200, [(b"content-type", b"application/json")], length=len(payload)))
        response.send(payload)
        response.end()
        self.assertEqual(client.response().status, 200)

    def test_observe_sees_the_very_request_choose_saw(self) -> None:
        upstream, policy = FakeUpstream(), Recording()
        lb = LoadBalancer([A, B], reactor=Clock(), agent=upstream, probe_agent=FakeUpstream(),
                          log_file="none", policy=policy)
        self.serve(lb, upstream, {"model": "m", "prompt": "hello"})
        self.assertEqual(len(policy.chosen_for), 1)
        self.assertEqual([o.routing for o in policy.observed], policy.chosen_for)
        routing = policy.observed[0].routing
        self.assertIs(routing, policy.chosen_for[0])
        assert routing is not None and routing.json is not None
        self.assertEqual(routing.json["prompt"], "hello")

    def test_the_cache_aware_policy_learns_from_its_own_predictions(self) -> None:
        upstream, policy = FakeUpstream(), CacheAware()
        lb = LoadBalancer([A, B], reactor=Clock(), agent=upstream, probe_agent=FakeUpstream(),
                          log_file="none", policy=policy)
        for n in range(3):
            self.serve(lb, upstream, {"model": "m", "prompt": PROMPT + f" question {n}"})
        described = {b.key: facts(policy, b) for b in lb.pool}
        # all three went to the backend holding the prefix, and each outcome found its
        # prediction (reported or not, every one was counted there)
        learned = {key: d["reports"] + d["unreported"] for key, d in described.items()}
        self.assertEqual(sorted(learned.values()), [0, 3])
        home = next(b for b in lb.pool if learned[b.key] == 3)
        self.assertEqual(home.counts.requests, 3)
        # the answers said nothing of cached tokens: the loop stays open, and says so
        self.assertEqual(described[home.key]["unreported"], 3)

    def test_a_worker_routes_and_learns_in_its_own_process(self) -> None:
        """The worker's forwarder builds the outcome where the policy lives, with the request."""
        pool, policy = a_pool(A), Recording()
        forwarder = SupervisorForwarder(lambda message: None)
        forwarder.summaries.add(policy_learns(pool, policy))
        record = a_record()
        record.routing = RoutingRequest(model="m", json={"prompt": "p"})
        forwarder.ended(record)
        self.assertEqual([o.routing for o in policy.observed], [record.routing])

    def test_a_summary_from_another_process_has_no_routing_request(self) -> None:
        pool, policy = a_pool(A), Recording()
        SummaryFeed(consumers=[policy_learns(pool, policy)]).feed(a_summary(), True)
        self.assertEqual([o.routing for o in policy.observed], [None])

    def test_outcomes_compare_without_their_routing_request(self) -> None:
        """The request rides along for the policy; it is not part of the outcome's value."""
        plain = RequestOutcome(backend=A, status=200, answered=True, ttfb=0.1, duration=1.0)
        routed = RequestOutcome(backend=A, status=200, answered=True, ttfb=0.1, duration=1.0,
                                routing=RoutingRequest(model="m"))
        self.assertEqual(plain, routed)
        self.assertNotIn("routing", repr(routed))

    def test_a_refused_try_leaves_nothing_on_the_backend_that_refused(self) -> None:
        """Through the proxy: the retry's choice takes the prediction to where it was served."""
        upstream, policy = FakeUpstream(), CacheAware()
        lb = LoadBalancer([A, B], reactor=Clock(), agent=upstream, probe_agent=FakeUpstream(),
                          log_file="none", policy=policy)
        client = ClientConnection(lb.site())
        client.request(b"POST", b"/v1/completions", body=json.dumps(
            {"model": "m", "prompt": PROMPT}).encode())
        refused = upstream.last.uri.split(b"/")[2].decode()
        upstream.last.fail(neterror.ConnectionRefusedError())
        payload = answer()
        response = upstream.last.respond(FakeResponse(
            200, [(b"content-type", b"application/json")], length=len(payload)))
        response.send(payload)
        response.end()
        self.assertEqual(client.response().status, 200)
        left = next(b for b in lb.pool if b.key == refused)
        served = next(b for b in lb.pool if b.key != refused)
        self.assertEqual(facts(policy, left)["index_blocks"], 0)
        self.assertGreater(facts(policy, served)["index_blocks"], 0)
        self.assertEqual(facts(policy, served)["unreported"], 1)
