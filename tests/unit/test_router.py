"""
The router (:mod:`txlb._scheduling.router`): what a client or an operator sees of its
choices and its waiting queue -- the queue wait a request's lease and the queue-wait metric
carry, the 503's message, which waiter a freed slot goes to (the starvation guard, the
precedence, waiters passed over), the slots given back or announced under
``--shared-state``'s exact ``max_conns``, the second take with ``--workers``, a shutdown's
refusals, ``/__lb_status``'s queue, affinity without a session key, a policy's ``prepare``
and failures, and the model list.  The queue runs on a Clock far from 0 (a queue's arrival
times are the reactor's wall-clock seconds).

Many of these tests were written against mutants that survived ``python -m bench.mutation``
(bench/results/mutation.md): each pins a behaviour the rest of the suite ran but never checked.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from txlb import IPreparesRequests, Policy, build_config
from txlb._cluster.backend import Backend
from txlb._cluster.pool import Pool
from txlb._cluster.slots import Lease
from txlb._config import BackendSpec, Config
from txlb._scheduling.affinity import BoundedLoadRing
from txlb._scheduling.policies.least_conn import LeastConnections
from txlb._scheduling.request import ANY_REQUEST, RoutingRequest
from txlb._scheduling.router import ModelRoute, Router, RoutingError

from . import test_failover
from .test_failover import FailoverTestCase
from .test_proxy import ProxyTestCase

#: where the tests' clocks start: the reactor's seconds are the wall clock's, never 0
EPOCH = 1_700_000_000.0


class Gate:
    """A pool's slot gate (``--shared-state``): each confirmation answered by the test."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.pending: list[Deferred[bool]] = []
        self.freed: list[str] = []

    def needs(self, backend: Backend) -> bool:
        return bool(backend.spec.max_conns)

    def confirm(self, backend: Backend) -> Deferred[bool]:
        self.asked.append(backend.key)
        answer: Deferred[bool] = Deferred()
        self.pending.append(answer)
        return answer

    def released(self, backend: Backend) -> None:
        self.freed.append(backend.key)

    def answer(self, admitted: bool) -> None:
        self.pending.pop(0).callback(admitted)


class WorkerCounts:
    """``--workers``' shared in-flight counts, with another worker's requests in them."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.slots: dict[str, int] = {}

    def register(self, key: str) -> int:
        slot = self.slots.setdefault(key, len(self.slots))
        self.counts.setdefault(slot, 0)
        return slot

    def assign(self, key: str, slot: int) -> None:
        self.slots[key] = slot

    def slot(self, key: str) -> int:
        return self.slots[key]

    def lock(self) -> None:
        pass

    def unlock(self) -> None:
        pass

    def totals(self) -> dict[int, int]:
        return dict(self.counts)

    def take(self, key: str) -> None:
        self.counts[self.slots[key]] += 1

    def give_back(self, key: str) -> None:
        self.counts[self.slots[key]] -= 1

    def untake(self, key: str) -> None:
        self.counts[self.slots[key]] -= 1

    def started(self, key: str) -> int:
        return 0

    def mine(self, key: str) -> int:
        return 0


class StrictClock(Clock):
    """A Clock that refuses a negative delay, as the reactor does (``ReactorBase.callLater``)."""

    def callLater(self, delay: float, callable: Any, *args: Any, **kw: Any) -> Any:
        assert delay >= 0, f"{delay} is not greater than or equal to 0 seconds"
        return super().callLater(delay, callable, *args, **kw)


class WaitingQueueTests(SynchronousTestCase):
    """Who waits, for how long, and which waiter a freed slot goes to."""

    def build(self, *specs: BackendSpec, gate: Gate | None = None,
              clock: Clock | None = None, shared: WorkerCounts | None = None) -> None:
        self.clock = clock if clock is not None else Clock()
        self.clock.advance(EPOCH)
        self.pool = Pool(specs or (BackendSpec("h", 1, max_conns=1),), clock=self.clock,
                         shared=shared)  # type: ignore[arg-type]
        if gate is not None:
            self.pool.slots.confirm_with(gate)
        self.router = Router(self.pool, LeastConnections(), self.clock, queue_timeout=30,
                             retry_after=1)

    def backend(self, key: str = "h:1") -> Backend:
        backend = self.pool.get(key)
        assert backend is not None
        return backend

    def hold(self, key: str = "h:1") -> Lease:
        """A slot taken outside the router (a request in flight)."""
        return self.pool.slots.acquire(self.backend(key))

    def lease(self, result: Deferred[Lease]) -> Lease:
        lease: Lease = self.successResultOf(result)
        return lease

    # -- the queue's waits, on the reactor's clock ---------------------------------------

    def test_a_served_waiter_waited_since_its_arrival(self) -> None:
        self.build()
        waits: list[float] = []
        self.router.on_queue_wait = waits.append
        held = self.hold()
        waiting = self.router.acquire()
        self.clock.advance(2.5)
        held.release()
        self.assertEqual(self.lease(waiting).waited, 2.5)
        self.assertEqual(waits, [2.5])

    def test_an_expired_waiter_says_how_long_it_waited(self) -> None:
        self.build()
        waits: list[float] = []
        self.router.on_queue_wait = waits.append
        self.hold()
        waiting = self.router.acquire()
        self.clock.advance(30)
        error = self.failureResultOf(waiting, RoutingError).value
        self.assertEqual((error.status, error.message, error.retry_after),
                         (503, "every backend stayed at its max_conns for 30s", 1))
        self.assertEqual(waits, [30.0])

    def test_queue_status_reports_the_oldest_waiter(self) -> None:
        self.build()
        status = self.router.queue_status()
        self.assertEqual(status["oldest_wait_s"], 0.0)
        self.hold()
        self.router.acquire()
        self.clock.advance(3)
        self.router.acquire()
        self.clock.advance(2)
        status = self.router.queue_status()
        self.assertEqual((status["length"], status["oldest_wait_s"]), (2, 5.0))
        classes: Any = status["classes"]
        self.assertEqual(classes["default"]["oldest_wait_s"], 5.0)
        self.assertEqual(classes["batch"]["oldest_wait_s"], 0.0)

    # -- the starvation guard and the precedence ----------------------------------------

    def test_a_young_batch_waiter_goes_after_interactive(self) -> None:
        self.build()
        held = self.hold()
        batch = self.router.acquire(RoutingRequest(priority="batch"))
        self.clock.advance(1)
        interactive = self.router.acquire(RoutingRequest(priority="interactive"))
        self.clock.advance(1)
        held.release()
        self.lease(interactive)
        self.assertNoResult(batch)

    def test_the_first_slot_goes_to_a_starving_waiter(self) -> None:
        self.build()
        held = self.hold()
        batch = self.router.acquire(RoutingRequest(priority="batch"))
        self.clock.advance(20)  # past batch's starvation age (15 s)
        interactive = self.router.acquire(RoutingRequest(priority="interactive"))
        held.release()
        self.lease(batch)
        self.assertNoResult(interactive)

    def test_a_starving_waiter_that_cannot_be_served_holds_up_no_one_behind_it(self) -> None:
        self.build(BackendSpec("h", 1, max_conns=1, models=("a",)),
                   BackendSpec("h", 2, max_conns=1, models=("b",)))
        self.hold("h:1")
        held = self.hold("h:2")
        old = self.router.acquire(RoutingRequest(model="a", priority="batch"))
        self.clock.advance(20)
        young = self.router.acquire(RoutingRequest(model="b", priority="batch"))
        held.release()
        self.assertEqual(self.lease(young).backend.key, "h:2")
        self.assertNoResult(old)

    def test_the_guard_looks_at_each_class_in_arrival_order(self) -> None:
        """
        Only a class's waiters from its head on, up to the first one younger than the age,
        count as starving -- even when the wall clock stepped back and a later arrival
        reads older.
        """
        self.build()
        held = self.hold()
        first = self.router.acquire(RoutingRequest(priority="batch"))
        self.clock.rightNow -= 500  # the wall clock stepped back (NTP)
        behind = self.router.acquire(RoutingRequest(priority="batch"))
        self.clock.advance(20)
        interactive = self.router.acquire(RoutingRequest(priority="interactive"))
        held.release()
        self.lease(interactive)
        self.assertNoResult(first)
        self.assertNoResult(behind)

    # -- waiters passed over, answered, served -------------------------------------------

    def test_waiters_nothing_can_serve_are_all_answered_at_once(self) -> None:
        self.build(BackendSpec("h", 1, max_conns=1, models=("a",)))
        self.hold()
        waiting = [self.router.acquire(RoutingRequest(model="a")) for _ in range(2)]
        self.pool.drain(self.backend())
        for result in waiting:
            error = self.failureResultOf(result, RoutingError).value
            self.assertEqual((error.status, error.message),
                             (503, "no backend is available for model `a`"))
        self.assertEqual(self.router.queue_length, 0)

    def test_waiters_passed_over_hold_up_no_other_model(self) -> None:
        self.build(BackendSpec("h", 1, max_conns=1, models=("a",)),
                   BackendSpec("h", 2, max_conns=1, models=("b",)))
        self.hold("h:1")
        held = self.hold("h:2")
        first_a = self.router.acquire(RoutingRequest(model="a"))
        second_a = self.router.acquire(RoutingRequest(model="a"))
        b = self.router.acquire(RoutingRequest(model="b"))
        held.release()
        self.assertEqual(self.lease(b).backend.key, "h:2")
        self.assertNoResult(first_a)
        self.assertNoResult(second_a)

    def test_a_waiter_served_by_a_nested_dispatch_is_served_once(self) -> None:
        self.build(BackendSpec("h", 1, max_conns=2))
        self.hold()
        held = self.hold()
        served: list[Lease] = []

        def done(lease: Lease) -> None:  # a request over at once (a client gone)
            served.append(lease)
            lease.release()

        for _ in range(2):
            self.router.acquire().addCallback(done)
        held.release()
        self.assertEqual(len(served), 2)
        self.assertEqual((self.router.queue_length, self.pool.slots.in_flight), (0, 1))

    def test_a_shutdown_refuses_only_who_is_still_waiting(self) -> None:
        self.build()
        held = self.hold()
        first = self.router.acquire()
        second = self.router.acquire()
        # the first refusal ends a request in flight: its slot goes to the second waiter
        first.addErrback(lambda failure: held.release())
        self.router.abandon_queue("the balancer is shutting down")
        self.assertEqual(self.lease(second).backend.key, "h:1")
        self.assertEqual(self.router.queue_length, 0)

    def test_a_reload_past_a_waiters_new_timeout_expires_it_on_the_next_turn(self) -> None:
        self.build(clock=StrictClock())
        self.hold()
        waiting = self.router.acquire()
        self.clock.advance(20)
        self.router.classes.reconfigure(Config(backends=(), queue_timeout=10))
        self.assertNoResult(waiting)
        self.clock.advance(0)
        error = self.failureResultOf(waiting, RoutingError).value
        self.assertEqual(error.message, "every backend stayed at its max_conns for 20s")

    # -- --workers: the second take ------------------------------------------------------

    def test_a_slot_freed_by_another_worker_before_the_queue_shows_is_taken(self) -> None:
        counts = WorkerCounts()
        self.build(shared=counts)
        slot = counts.slot("h:1")
        counts.counts[slot] = 1  # another worker's request holds the only slot

        def published(length: int) -> None:
            if length:  # the other worker's request ends before it sees the queue
                counts.counts[slot] = 0

        self.router.on_queue_length = published
        lease = self.lease(self.router.acquire())
        self.assertEqual((lease.backend.key, self.router.queue_length), ("h:1", 0))
        self.assertEqual(counts.counts[slot], 1)

    def test_with_workers_a_request_still_full_after_the_second_take_queues(self) -> None:
        counts = WorkerCounts()
        self.build(shared=counts)
        counts.counts[counts.slot("h:1")] = 1
        waiting = self.router.acquire()
        self.assertNoResult(waiting)
        self.assertEqual(self.router.queue_length, 1)

    # -- --shared-state: slots the gate confirms -----------------------------------------

    def test_a_slot_admitted_after_its_client_left_is_released_to_the_queue(self) -> None:
        gate = Gate()
        self.build(gate=gate)
        gone = self.router.acquire()
        waiting = self.router.acquire()  # full on the local view (the tentative slot)
        self.assertEqual(self.router.queue_length, 1)
        gone.cancel()
        self.failureResultOf(gone, CancelledError)
        gate.answer(True)  # confirmed in the fleet's count: it must be freed there too
        self.assertEqual(gate.freed, ["h:1"])
        self.assertEqual(gate.asked, ["h:1", "h:1"])  # the freed slot goes to the waiter
        gate.answer(True)
        self.assertEqual(self.lease(waiting).backend.key, "h:1")

    def test_a_client_gone_after_a_refusal_gives_back_the_second_choice(self) -> None:
        gate = Gate()
        self.build(BackendSpec("h", 1, max_conns=1), BackendSpec("h", 2, max_conns=1),
                   gate=gate)
        result = self.router.acquire()
        gate.answer(False)
        self.assertEqual(len(gate.asked), 2)
        result.cancel()
        self.failureResultOf(result, CancelledError)
        gate.answer(True)
        self.assertEqual(self.pool.slots.in_flight, 0)
        self.assertEqual(len(gate.freed), 1)

    def test_four_refusals_in_a_row_queue_the_request(self) -> None:
        gate = Gate()
        self.build(*(BackendSpec("h", port, max_conns=1) for port in range(1, 8)), gate=gate)
        result = self.router.acquire()
        for _ in range(4):
            gate.answer(False)
        self.assertNoResult(result)
        self.assertEqual(len(gate.asked), 4)
        self.assertEqual(self.router.queue_length, 1)

    def test_a_waiter_being_confirmed_holds_up_no_one_behind_it(self) -> None:
        gate = Gate()
        self.build(BackendSpec("h", 1, max_conns=1), BackendSpec("h", 2, max_conns=1),
                   gate=gate)
        first_held, second_held = self.hold("h:1"), self.hold("h:2")
        first = self.router.acquire()
        second = self.router.acquire()
        first_held.release()
        self.assertEqual(gate.asked, ["h:1"])
        second_held.release()
        self.assertEqual(gate.asked, ["h:1", "h:2"])
        gate.answer(True)
        gate.answer(True)
        self.assertEqual((self.lease(first).backend.key, self.lease(second).backend.key),
                         ("h:1", "h:2"))

    def test_one_change_with_room_for_two_confirms_both(self) -> None:
        gate = Gate()
        self.build(gate=gate)
        self.hold()
        first = self.router.acquire()
        second = self.router.acquire()
        self.pool.respecify(self.backend(), BackendSpec("h", 1, max_conns=3))
        self.assertEqual(gate.asked, ["h:1", "h:1"])
        gate.answer(True)
        gate.answer(True)
        self.lease(first)
        self.lease(second)
        self.assertEqual(self.pool.slots.in_flight, 3)


class RefusalAndAliasTests(ProxyTestCase):
    def test_an_empty_queue_reports_no_wait(self) -> None:
        status = self.lb.router.queue_status()
        self.assertEqual((status["length"], status["oldest_wait_s"]), (0, 0.0))

    def test_503_names_the_model_or_says_this_request(self) -> None:
        for backend in self.lb.pool:
            self.lb.pool.mark_down(backend, "test")
        for body, expected in ((b'{"model": "m"}', "model `m`"), (b"{}", "this request")):
            client = self.client()
            client.request(b"POST", b"/v1/completions", body=body)
            answer = client.response()
            self.assertEqual(answer.status, 503)
            self.assertIn(expected, json.loads(answer.body)["error"]["message"])

    def test_an_alias_routes_without_a_given_rng(self) -> None:
        from txlb._scheduling.router import ModelRoute, Router

        router = Router(self.lb.pool, self.lb.policy, self.clock, queue_timeout=1,
                        retry_after=1, routes={"chat": ModelRoute("chat", (("m", 1),))})
        self.assertEqual(router.resolve("chat"), "m")


class AffinityAndQueueWaitTests(FailoverTestCase):
    def test_requests_without_a_session_key_rotate(self) -> None:
        self.build(affinity="header:X-Session")
        seen = []
        for n in range(3):
            self.post()
            seen.append(self.backend_of(n))
            self.answer(n, 200)
        self.assertEqual(sorted(seen), sorted(test_failover.THREE))

    def test_queue_wait_is_reported_to_the_millisecond(self) -> None:
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write('[[backends]]\nurl = "127.0.0.1:8002"\nmax_conns = 1\n')
        self.build(config=build_config({"config": path, "log-file": "none"}, {}),
                   backends=None)
        self.post()
        self.post()  # queued
        self.clock.advance(1.23456)
        self.assertEqual(self.lb.router.queue_status()["oldest_wait_s"], 1.235)


@implementer(IPreparesRequests)
class _CountsPrepares(Policy):
    """Counts ``prepare`` calls and picks the first candidate."""

    name = "counts-prepares"

    def __init__(self) -> None:
        self.prepared = 0

    def prepare(self, request: RoutingRequest) -> None:
        self.prepared += 1

    def choose(self, candidates: Sequence[Backend],
               request: RoutingRequest = ANY_REQUEST) -> Backend:
        return candidates[0]


class _FailingChoice(Policy):
    name = "failing-choice"

    def choose(self, candidates: Sequence[Backend],
               request: RoutingRequest = ANY_REQUEST) -> Backend:
        raise RuntimeError("the policy broke")


class PrepareLogAndModelListTests(SynchronousTestCase):
    """Mutants of ``_scheduling/router`` that survived its full run (mutation-full/)."""

    def router(self, policy: Policy, *specs: BackendSpec,
               affinity: bool = False) -> Router:
        self.clock = Clock()
        pool = Pool(specs or (BackendSpec("127.0.0.1", 8002),), clock=self.clock)
        return Router(pool, policy, self.clock,
                      affinity=BoundedLoadRing() if affinity else None)

    def test_prepare_is_skipped_only_when_affinity_chooses(self) -> None:
        """
        Affinity routes a request with a session key by its hash, so the policy's
        per-request work (hashing a whole prompt, for cache-aware) is wasted on it -- and
        only on it: every other request must be prepared.
        """
        for affinity, session, prepared in ((False, None, 1), (False, "s", 1),
                                            (True, None, 1), (True, "s", 0)):
            policy = _CountsPrepares()
            router = self.router(policy, affinity=affinity)
            self.successResultOf(router.acquire(RoutingRequest(session=session))).release()
            self.assertEqual(policy.prepared, prepared, (affinity, session))

    def test_a_failing_policy_is_logged_once_a_minute_from_any_start(self) -> None:
        router = self.router(_FailingChoice())
        self.clock.advance(1000)  # a process that has run a while: the stamp is not 0

        def fail_at(seconds: float) -> int:
            self.clock.advance(seconds - self.clock.seconds())
            self.successResultOf(router.acquire()).release()
            return len(self.flushLoggedErrors(RuntimeError))

        self.assertEqual(fail_at(1000), 1)
        self.assertEqual(fail_at(1001), 0)
        self.assertEqual(fail_at(1059.5), 0)  # still within the minute
        self.assertEqual(fail_at(1060), 1)

    def test_models_of_every_healthy_backend_are_listed_past_a_down_one(self) -> None:
        router = self.router(_CountsPrepares(),
                             BackendSpec("127.0.0.1", 8002, models=("a",)),
                             BackendSpec("127.0.0.1", 8003, models=("b",)),
                             BackendSpec("127.0.0.1", 8004, models=("c",)))
        down = router.pool.get("127.0.0.1:8002")
        assert down is not None
        router.pool.mark_down(down, "refused")
        listed = router.model_list()
        self.assertEqual([entry["id"] for entry in listed["data"]], ["b", "c"])  # type: ignore[index]

    def test_listed_models_txlb_describes_itself_have_the_openai_shape(self) -> None:
        """
        A model known only from the config, and an alias, are listed as OpenAI's API lists
        a model: ``created`` 0 (no date is known), owned by txlb.
        """
        router = self.router(_CountsPrepares(),
                             BackendSpec("127.0.0.1", 8002, models=("m",)))
        router.routes = {"alias": ModelRoute("alias", (("m", 1),))}
        self.assertEqual(router.model_list(), {"object": "list", "data": [
            {"id": "alias", "object": "model", "created": 0, "owned_by": "txlb"},
            {"id": "m", "object": "model", "created": 0, "owned_by": "txlb"}]})

    def test_an_alias_in_a_configured_list_hides_no_model_after_it(self) -> None:
        """
        An alias is listed inside its model's entry, not as an entry of its own -- and
        skipping it must not skip the models the config lists after it.
        """
        router = self.router(_CountsPrepares(),
                             BackendSpec("127.0.0.1", 8002, models=("short", "other")))
        backend = router.pool.get("127.0.0.1:8002")
        assert backend is not None
        router.pool.set_models(backend, [{"id": "long", "object": "model",
                                          "aliases": ["short"]}])
        listed = router.model_list()["data"]
        self.assertEqual([entry["id"] for entry in listed], ["other"])  # type: ignore[attr-defined]
