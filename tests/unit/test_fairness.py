"""
The fair queue (``--fairness vtc``): among tenants with requests waiting, the one that has
received the least weighted service is served first; a tenant back from idle starts at the
lowest counter of those waiting; weights divide the cost; FIFO is kept on request.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from txlb._config import build_config
from txlb._scheduling.budgets import Estimate
from txlb._scheduling.fairness import STREAM_STEP, FairShares, cost_of
from txlb._scheduling.outcome import RequestOutcome
from txlb._scheduling.request import RoutingRequest
from txlb._scheduling.tenants import key_digest

from ..helpers import FakeResponse
from .test_failover import FailoverTestCase
from .test_tenants import ALPHA, BETA, keys_file


class _Waiter:
    def __init__(self, tenant: str | None, label: str) -> None:
        self.request = RoutingRequest(tenant=tenant)
        self.label = label


def queue(fair: FairShares, tenant: str) -> RoutingRequest:
    """A request of ``tenant`` that arrives and waits in the default class."""
    request = RoutingRequest(tenant=tenant)
    fair.arrived("default", request)
    fair.joined("default", request)
    return request


def vtc() -> FairShares:
    return FairShares(enabled=True, default_completion=100)


def served(fair: FairShares, request: RoutingRequest, prompt: int, completion: int,
           status: int = 200) -> None:
    """``request`` priced at ``prompt``/``completion``, granted, and ended as reported."""
    fair.price(request, b"/v1/completions", b"POST")
    fair.granted(request)
    fair.settle(RequestOutcome(backend="b:1", status=status, answered=True, ttfb=0.1,
                               duration=1.0, prompt_tokens=prompt,
                               completion_tokens=completion, routing=request))


class OrderTests(SynchronousTestCase):
    def test_the_least_served_tenant_goes_first(self) -> None:
        fair = vtc()
        fair.counters.update({"heavy": 500.0, "light": 10.0})
        waiters = [_Waiter("heavy", "h1"), _Waiter("heavy", "h2"), _Waiter("light", "l1")]
        self.assertEqual(next(iter(fair.order(waiters))).label, "l1")

    def test_fifo_keeps_arrival_order(self) -> None:
        fair = FairShares(enabled=False)
        fair.counters.update({"heavy": 500.0, "light": 10.0})
        waiters = [_Waiter("heavy", "h1"), _Waiter("light", "l1")]
        self.assertEqual([w.label for w in fair.order(waiters)], ["h1", "l1"])

    def test_the_order_reads_counters_as_they_change(self) -> None:
        """Serving one waiter charges its tenant: the next pick sees it."""
        fair = vtc()
        waiters = [_Waiter("a", "a1"), _Waiter("a", "a2"), _Waiter("b", "b1")]
        order = fair.order(waiters)
        first = next(order)
        self.assertEqual(first.label, "a1")  # a tie at 0: the earliest arrival
        fair.counters["a"] = 50.0  # what a1's grant charged
        self.assertEqual(next(order).label, "b1")
        self.assertEqual(next(order).label, "a2")

    def test_a_tenant_back_from_idle_starts_at_the_lowest_waiting(self) -> None:
        fair = vtc()
        queue(fair, "a")
        queue(fair, "b")
        fair.counters.update({"a": 1000.0, "b": 800.0, "idle": 5.0})  # served meanwhile
        queue(fair, "idle")
        self.assertEqual(fair.counters["idle"], 800.0)  # no credit saved up while idle

    def test_a_backlogged_tenant_is_not_lifted_again(self) -> None:
        fair = vtc()
        fair.counters.update({"a": 100.0, "b": 10.0})
        queue(fair, "b")
        queue(fair, "a")
        queue(fair, "b")  # b already waits: stays
        self.assertEqual(fair.counters["b"], 10.0)

    def test_no_one_waiting_lifts_to_the_last_served(self) -> None:
        fair = vtc()
        served(fair, RoutingRequest(tenant="a", body=b"x" * 400), 100, 50)
        queue(fair, "new")
        self.assertGreater(fair.counters["new"], 0.0)

    def test_leaving_the_queue_ends_the_backlog(self) -> None:
        fair = vtc()
        first = queue(fair, "a")
        fair.left("default", first)
        fair.counters["b"] = 70.0
        queue(fair, "b")
        queue(fair, "a")  # idle again: lifted to b's
        self.assertEqual(fair.counters["a"], 70.0)


    def test_credit_built_while_nothing_queued_is_not_kept(self) -> None:
        """
        Served at once, a tenant still arrives: while nothing queues, every arrival is
        lifted to the last one served, so no tenant carries a lead into the queue.
        """
        fair = vtc()

        def at_once(tenant: str) -> None:
            request = RoutingRequest(tenant=tenant, body=b"x" * 400, json={"max_tokens": 100})
            fair.arrived("default", request)
            fair.price(request, b"/v1/completions", b"POST")
            fair.granted(request)

        for _ in range(100):
            at_once("steady")
        at_once("bursty")
        self.assertGreaterEqual(fair.counters["bursty"], fair.counters["steady"])

    def test_a_failovers_second_slot_is_no_arrival(self) -> None:
        fair = vtc()
        request = RoutingRequest(tenant="a", body=b"{}", json={})
        fair.price(request, b"/v1/completions", b"POST")
        fair.granted(request)
        fair.counters["b"] = 10_000.0
        queue(fair, "b")
        fair.arrived("default", request)  # retried elsewhere: not lifted again
        self.assertLess(fair.counters["a"], 10_000.0)


class ChargeTests(SynchronousTestCase):
    def test_input_costs_one_output_two_over_the_weight(self) -> None:
        self.assertEqual(cost_of(100, 50, 1.0), 200.0)
        self.assertEqual(cost_of(100, 50, 2.0), 100.0)

    def test_usage_replaces_the_estimate(self) -> None:
        fair = vtc()
        body = {"prompt": "x" * 400, "max_tokens": 1000}
        request = RoutingRequest(tenant="a", weight=2.0, body=json.dumps(body).encode(),
                                 json=body)
        fair.price(request, b"/v1/completions", b"POST")
        fair.granted(request)
        self.assertGreater(fair.counters["a"], 1000.0)  # the whole max_tokens, for now
        fair.settle(RequestOutcome(backend="b:1", status=200, answered=True, ttfb=0.1,
                                   duration=1.0, prompt_tokens=100, completion_tokens=10,
                                   routing=request))
        self.assertAlmostEqual(fair.counters["a"], cost_of(100, 10, 2.0))

    def test_a_second_slot_is_not_charged_again(self) -> None:
        fair = vtc()
        request = RoutingRequest(tenant="a", body=b'{"prompt": "hi", "max_tokens": 10}')
        fair.price(request, b"/v1/completions", b"POST")
        fair.granted(request)
        once = fair.counters["a"]
        fair.granted(request)  # a failover's second backend
        self.assertEqual(fair.counters["a"], once)

    def test_an_error_costs_nothing(self) -> None:
        fair = vtc()
        served(fair, RoutingRequest(tenant="a", body=b'{"max_tokens": 99}'), 10, 0,
               status=400)
        self.assertEqual(fair.counters["a"], 0.0)

    def test_without_a_tenant_nothing_is_counted(self) -> None:
        fair = vtc()
        served(fair, RoutingRequest(body=b"{}"), 10, 10)
        self.assertEqual(fair.counters, {})

    def test_estimate_is_the_budgets_estimate(self) -> None:
        fair = vtc()
        request = RoutingRequest(tenant="a", body=b'{"max_tokens": 7}', json={"max_tokens": 7})
        fair.price(request, b"/v1/completions", b"POST")
        charge = request.memo[fair]
        self.assertIsInstance(charge.estimate, Estimate)
        self.assertEqual(charge.estimate.completion, 7)


def streamed_request(fair: FairShares, tenant: str = "a") -> RoutingRequest:
    """A streamed request of ``tenant``, priced and granted: 100 prompt tokens' body."""
    body = {"prompt": "x" * 400, "max_tokens": 1000, "stream": True}
    request = RoutingRequest(tenant=tenant, body=json.dumps(body).encode(), json=body)
    fair.price(request, b"/v1/completions", b"POST")
    fair.granted(request)
    return request


def sse(count: int) -> bytes:
    return b"".join(b'data: {"choices": [{"text": "t"}]}\n\n' for _ in range(count))


class StreamChargeTests(SynchronousTestCase):
    """A streamed answer's output is charged as it streams, not at the grant."""

    def test_the_grant_charges_the_prompt_alone(self) -> None:
        fair = vtc()
        request = streamed_request(fair)
        prompt = request.memo[fair].estimate.prompt
        self.assertEqual(fair.counters["a"], cost_of(prompt, 0, 1.0))

    def test_each_step_of_events_is_charged_as_it_passes(self) -> None:
        fair = vtc()
        request = streamed_request(fair)
        start = fair.counters["a"]
        meter = fair.meter(request)
        assert meter is not None
        meter.feed(sse(STREAM_STEP - 1))
        self.assertEqual(fair.counters["a"], start)  # not a step yet
        meter.feed(sse(1))
        self.assertEqual(fair.counters["a"], start + cost_of(0, STREAM_STEP, 1.0))
        meter.feed(sse(3 * STREAM_STEP + 2))  # one chunk of several steps: charged at once
        self.assertEqual(fair.counters["a"], start + cost_of(0, 4 * STREAM_STEP + 2, 1.0))

    def test_events_split_across_chunks_still_count(self) -> None:
        fair = vtc()
        meter = fair.meter(streamed_request(fair))
        assert meter is not None
        start = fair.counters["a"]
        data = sse(STREAM_STEP)
        for index in range(0, len(data), 7):  # boundaries inside "data:" lose a few
            meter.feed(data[index:index + 7])
        meter.feed(sse(STREAM_STEP))
        self.assertGreater(fair.counters["a"], start)

    def test_usage_settles_what_streamed(self) -> None:
        fair = vtc()
        request = streamed_request(fair)
        meter = fair.meter(request)
        assert meter is not None
        meter.feed(sse(5 * STREAM_STEP))
        fair.settle(RequestOutcome(backend="b:1", status=200, answered=True, ttfb=0.1,
                                   duration=1.0, prompt_tokens=90, completion_tokens=77,
                                   routing=request))
        self.assertAlmostEqual(fair.counters["a"], cost_of(90, 77, 1.0))
        meter.feed(sse(4 * STREAM_STEP))  # late bytes after the end charge nothing
        self.assertAlmostEqual(fair.counters["a"], cost_of(90, 77, 1.0))

    def test_a_client_that_left_mid_stream_keeps_what_streamed(self) -> None:
        fair = vtc()
        request = streamed_request(fair)
        meter = fair.meter(request)
        assert meter is not None
        meter.feed(sse(3 * STREAM_STEP))
        prompt = request.memo[fair].estimate.prompt
        fair.settle(RequestOutcome(backend="b:1", status=200, answered=False, ttfb=0.1,
                                   duration=1.0, end="client_abort", routing=request))
        self.assertAlmostEqual(fair.counters["a"], cost_of(prompt, 3 * STREAM_STEP, 1.0))

    def test_a_non_streamed_answer_has_no_meter_and_pays_its_estimate(self) -> None:
        fair = vtc()
        body = {"prompt": "x" * 400, "max_tokens": 1000}
        request = RoutingRequest(tenant="a", body=json.dumps(body).encode(), json=body)
        fair.price(request, b"/v1/completions", b"POST")
        self.assertIsNone(fair.meter(request))
        fair.granted(request)
        self.assertGreaterEqual(fair.counters["a"], cost_of(0, 1000, 1.0))

    def test_no_tenant_no_meter(self) -> None:
        fair = vtc()
        request = RoutingRequest(body=b'{"stream": true}', json={"stream": True})
        fair.price(request, b"/v1/completions", b"POST")
        self.assertIsNone(fair.meter(request))


def gap(order: list[str]) -> int:
    """The most one tenant was ahead of the other in requests served, over ``order``."""
    most = ahead = 0
    for label in order:
        ahead += 1 if label.startswith("a") else -1
        most = max(most, abs(ahead))
    return most


class QueueTests(FailoverTestCase):
    """Through the balancer: one backend at max_conns 1, two tenants queued."""

    def build_queue(self, fairness: str) -> None:
        keys = keys_file(self, '[tenants.alpha]\n[tenants.beta]\n'
                               f'[[keys]]\nsha256 = "{key_digest(ALPHA)}"\ntenant = "alpha"\n'
                               f'[[keys]]\nsha256 = "{key_digest(BETA)}"\ntenant = "beta"\n')
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write(f'auth = "keys"\nkeys-file = "{keys}"\nfairness = "{fairness}"\n'
                         'queue-timeout = 100\n'
                         '[[backends]]\nurl = "10.0.0.1:8000"\nmax_conns = 1\n')
        self.build(config=build_config({"config": path, "log-file": "none"}, {}),
                   backends=None)

    def send(self, key: bytes, label: str) -> Any:
        client = self.client()
        client.request(b"POST", b"/v1/completions",
                       headers=[(b"Authorization", b"Bearer " + key)],
                       body=json.dumps({"prompt": label, "max_tokens": 100}).encode())
        return client

    def finish_all(self) -> list[str]:
        """Answer each forwarded request in turn; the prompts in the order they were sent."""
        order = []
        for n in range(20):
            if n >= len(self.upstream.calls):
                break
            order.append(json.loads(self.upstream.calls[n].body)["prompt"])
            self.answer(n, 200, json.dumps({"usage": {"prompt_tokens": 10,
                                                      "completion_tokens": 100}}).encode())
        return order

    def test_vtc_shares_the_backend_between_two_backlogs(self) -> None:
        """
        alpha queues five before beta's four arrive: beta starts at alpha's counter (no
        credit for having been idle), and from then on neither gets more than a request's
        worth ahead of the other -- FIFO would serve alpha's whole backlog first.
        """
        self.build_queue("vtc")
        for n in range(5):
            self.send(ALPHA, f"a{n}")
        for n in range(4):
            self.send(BETA, f"b{n}")
        self.assertEqual(self.lb.router.queue_length, 8)
        order = self.finish_all()
        self.assertEqual(order[:2], ["a0", "a1"])  # a0 had the slot; a1 wins the tie
        self.assertLessEqual(gap(order[1:8]), 2)
        self.assertEqual(sorted(order), sorted(f"a{n}" for n in range(5))
                         + sorted(f"b{n}" for n in range(4)))

    def test_fifo_serves_in_arrival_order(self) -> None:
        self.build_queue("fifo")
        for n in range(5):
            self.send(ALPHA, f"a{n}")
        for n in range(4):
            self.send(BETA, f"b{n}")
        order = self.finish_all()
        self.assertEqual(order, ["a0", "a1", "a2", "a3", "a4", "b0", "b1", "b2", "b3"])
        self.assertEqual(gap(order[1:8]), 4)

    def test_auto_is_vtc_with_keys(self) -> None:
        self.build_queue("auto")
        self.assertTrue(self.lb.fairness.enabled)

    def test_a_stream_charges_its_tenant_while_it_runs(self) -> None:
        """
        Through the proxy: alpha's streamed answer moves alpha's counter as its events
        pass (what a freed slot's choice reads meanwhile), and its usage settles it.
        """
        self.build_queue("vtc")
        client = self.client()
        client.request(b"POST", b"/v1/completions",
                       headers=[(b"Authorization", b"Bearer " + ALPHA)],
                       body=json.dumps({"prompt": "a0", "max_tokens": 100,
                                        "stream": True}).encode())
        fairness = self.lb.fairness
        granted = fairness.counters["alpha"]
        response = self.upstream.calls[0].respond(
            FakeResponse(200, [(b"Content-Type", b"text/event-stream")]))
        response.send(sse(4 * STREAM_STEP))
        self.assertEqual(fairness.counters["alpha"],
                         granted + cost_of(0, 4 * STREAM_STEP, 1.0))
        self.assertIn(sse(1), client.transport.value())  # relayed as it came
        response.send(b'data: {"choices": [], "usage": {"prompt_tokens": 3, '
                      b'"completion_tokens": 70}}\n\ndata: [DONE]\n\n')
        response.end()
        self.assertAlmostEqual(fairness.counters["alpha"], cost_of(3, 70, 1.0))

    def test_a_queued_requests_deadline_still_ends_its_wait(self) -> None:
        self.build_queue("vtc")
        self.send(ALPHA, "a0")
        waiting = self.send(BETA, "b0")
        self.clock.advance(100)
        self.assertEqual(waiting.response().status, 503)
