"""
``--shared-state``'s exact ``max_conns`` and the queue's wake, on a Clock with a fake Redis:
a capped pick is counted first and confirmed by the slot script; a refusal gives the slot
back unseen and chooses again, or queues; an unanswered script admits on the local view
within the link's timeout; a queued request's slot is confirmed too; a slot freed on another
replica, announced on ``<prefix>:freed``, wakes the queue at once.  The script itself runs
against a real Redis in ``tests/integration/test_shared_state_process.py``.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from txlb import LoadBalancer
from txlb._cluster.pool import Pool
from txlb._cluster.slots import Lease
from txlb._config import BackendSpec, build_config
from txlb._scheduling.policies.least_conn import LeastConnections
from txlb._scheduling.router import MAX_REFUSALS, Router, RoutingError
from txlb._shared.counts import FleetCounts
from txlb._shared.link import COMMAND_TIMEOUT
from txlb._shared.slots import ACQUIRE, SharedSlots
from txlb._shared.store import FLUSH_DELAY, POLL_INTERVAL, RedisStore
from txlb._shared.wake import MAX_MESSAGE, parse_freed

from .test_shared_state import SCRIPT_ANSWERS, SPEC, redis_answer


class SlotRedis:
    """A fake Redis: the poll answers at once, the slot script when the test says."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []
        self.scripts: list[Deferred[Any]] = []

    def execute_command(self, *args: Any, **kwargs: Any) -> Deferred[Any]:
        self.sent.append(args)
        if args[:2] == ("EVALSHA", ACQUIRE.sha):
            script: Deferred[Any] = Deferred()
            self.scripts.append(script)
            return script
        if args[0] == "EVALSHA" and args[1] not in SCRIPT_ANSWERS:
            return succeed(["2", "0"])  # the poll: two replicas, no other rows
        return succeed(redis_answer(args))

    def asked(self) -> list[tuple[Any, ...]]:
        """The slot scripts sent: (backend, own count, max_conns) each."""
        return [tuple(c[6:9]) for c in self.sent if c[:2] == ("EVALSHA", ACQUIRE.sha)]

    def answer(self, admitted: int, others: int) -> None:
        self.scripts.pop(0).callback([admitted, others])

    def published(self) -> list[tuple[Any, ...]]:
        return [c[1:] for c in self.sent if c[0] == "PUBLISH"]


class SlotTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.build(max_conns=1)

    def build(self, max_conns: int, started: bool = True, backends: int = 2) -> None:
        self.clock = Clock()
        self.redis = SlotRedis()
        self.store = RedisStore(SPEC, self.clock, self.redis, replica="r1")
        self.pool = Pool(tuple(BackendSpec("h", port, max_conns=max_conns)
                               for port in range(1, backends + 1)),
                         clock=self.clock, store=self.store)
        self.slots = SharedSlots(self.store, self.pool.slots.capacity_changed)
        self.pool.slots.confirm_with(self.slots)
        self.router = Router(self.pool, LeastConnections(), self.clock, queue_timeout=30)
        if started:
            self.store.start()  # the first poll answers: the link is up
            self.addCleanup(self.store._loop.stop)  # type: ignore[union-attr]
        self.counts = self.store.counts
        assert isinstance(self.counts, FleetCounts)

    def lease(self, result: Deferred[Lease]) -> Lease:
        lease: Lease = self.successResultOf(result)
        return lease

    # -- a pick ----------------------------------------------------------------------

    def test_a_capped_pick_is_counted_first_then_confirmed(self) -> None:
        result = self.router.acquire()
        self.assertNoResult(result)
        [(key, mine, cap)] = self.redis.asked()
        self.assertEqual((mine, cap), (1, 1))
        self.assertEqual(self.counts.mine(key), 1)
        # the row written meanwhile already holds the tentative slot
        self.clock.advance(FLUSH_DELAY)
        self.assertIn(("HSET", "txlb:inflight:r1", key, 1), self.redis.sent)
        self.redis.answer(1, 0)
        self.assertEqual(self.lease(result).backend.key, key)
        self.assertEqual(self.slots.status()["admitted"], 1)

    def test_a_refusal_gives_the_slot_back_unseen_and_chooses_again(self) -> None:
        changes: list[int] = []
        self.pool.on_change.append(lambda: changes.append(1))
        result = self.router.acquire()
        [(refused, _, _)] = self.redis.asked()
        self.redis.answer(0, 1)  # another replica holds its only slot
        backend = self.pool.get(refused)
        assert backend is not None
        # as if never taken: no request started or finished, nobody told of a freed slot
        self.assertEqual((self.counts.mine(refused), self.counts.started(refused)), (0, 0))
        self.assertEqual((backend.counts.requests, backend.counts.started_since_scrape,
                          backend.counts.finished_since_scrape), (0, 0, 0))
        self.assertEqual(self.counts.total(refused), 1)  # reads as full now
        self.assertEqual(changes, [])
        [_, (other, mine, _)] = self.redis.asked()
        self.assertNotEqual(other, refused)
        self.assertEqual(mine, 1)
        self.redis.answer(1, 0)
        self.assertEqual(self.lease(result).backend.key, other)
        self.clock.advance(FLUSH_DELAY)
        self.assertEqual(self.redis.published(), [])

    def test_when_every_backend_refuses_the_request_queues(self) -> None:
        result = self.router.acquire()
        self.redis.answer(0, 1)
        self.redis.answer(0, 1)
        self.assertNoResult(result)
        self.assertEqual(self.router.queue_length, 1)
        self.assertEqual(len(self.redis.asked()), 2)  # each backend asked once, then queued
        self.assertEqual(self.pool.slots.in_flight, 0)

    def test_choosing_again_is_bounded(self) -> None:
        self.build(max_conns=1, backends=MAX_REFUSALS + 3)
        result = self.router.acquire()
        for _ in range(MAX_REFUSALS):
            self.redis.answer(0, 1)
        self.assertNoResult(result)
        self.assertEqual(len(self.redis.asked()), MAX_REFUSALS)
        self.assertEqual(self.router.queue_length, 1)

    def test_an_unanswered_script_admits_on_the_local_view_within_the_timeout(self) -> None:
        result = self.router.acquire()
        self.clock.advance(COMMAND_TIMEOUT - 0.01)
        self.assertNoResult(result)
        self.clock.advance(0.01)
        lease = self.lease(result)
        self.assertEqual(self.counts.mine(lease.backend.key), 1)
        self.assertEqual(self.slots.status()["unconfirmed"], 1)

    def test_an_answer_that_is_not_the_scripts_admits_on_the_local_view(self) -> None:
        link = self.store.link
        for reply in ("OK", [2, 0], [1, -1], ["x", "y"], [1], None, b"10"):
            self.clock.advance(POLL_INTERVAL)  # the next poll answers: the link is up
            self.assertTrue(link.connected)
            result = self.router.acquire()
            self.redis.scripts.pop(0).callback(reply)
            self.lease(result).release()
            if not isinstance(reply, list) or len(reply) != 2:
                # not the script's shape at all: this Redis shares nothing until it does
                self.assertFalse(link.connected)
                self.assertIn("the max_conns slot script answered", str(link.last_error))
        self.assertEqual(self.slots.status(), {"admitted": 0, "refused": 0,
                                               "unconfirmed": 7, "wakes_heard": 0})

    def test_link_down_picks_at_once_on_the_local_view(self) -> None:
        self.build(max_conns=1, started=False)
        self.assertFalse(self.store.link.connected)
        self.lease(self.router.acquire())
        self.assertEqual(self.redis.asked(), [])

    def test_backends_without_max_conns_take_no_round_trip(self) -> None:
        self.build(max_conns=0)
        for _ in range(3):
            self.lease(self.router.acquire())
        self.assertEqual(self.redis.asked(), [])

    def test_a_client_gone_while_its_slot_is_confirmed_gives_it_back(self) -> None:
        result = self.router.acquire()
        [(key, _, _)] = self.redis.asked()
        result.cancel()
        self.failureResultOf(result, CancelledError)
        self.redis.answer(1, 0)
        self.assertEqual(self.counts.mine(key), 0)
        self.assertEqual(self.pool.slots.in_flight, 0)
        refused = self.router.acquire()
        refused.cancel()
        self.failureResultOf(refused, CancelledError)
        self.redis.answer(0, 1)
        self.assertEqual(len(self.redis.asked()), 2)  # gone: no other choice made
        self.assertEqual(self.pool.slots.in_flight, 0)

    def test_a_withdrawn_slot_is_never_released(self) -> None:
        backend = self.pool.get("h:1")
        assert backend is not None
        lease = self.pool.slots.acquire(backend)
        self.pool.slots.withdraw(lease)
        lease.release()
        self.pool.slots.withdraw(lease)
        self.assertEqual(
            (self.counts.mine("h:1"), backend.counts.active, self.pool.slots.in_flight), (0, 0, 0))
        self.clock.advance(FLUSH_DELAY)
        self.assertEqual(self.redis.published(), [])

    def test_a_withdrawn_slot_lets_shutdown_finish(self) -> None:
        backend = self.pool.get("h:1")
        assert backend is not None
        lease = self.pool.slots.acquire(backend)
        idle = self.pool.slots.when_idle()
        self.assertNoResult(idle)
        self.pool.slots.withdraw(lease)
        self.successResultOf(idle)

    # -- the queue -------------------------------------------------------------------

    def fill(self) -> Lease:
        """One backend at max_conns 1, its slot confirmed and held."""
        self.build(max_conns=1, backends=1)
        first = self.router.acquire()
        self.redis.answer(1, 0)
        return self.lease(first)

    def test_a_locally_freed_slot_goes_to_a_waiter_only_once_confirmed(self) -> None:
        held = self.fill()
        waiting = self.router.acquire()
        self.assertEqual(len(self.redis.asked()), 1)  # full on the local view: queued
        self.assertEqual(self.router.queue_length, 1)
        held.release()
        self.assertEqual(self.redis.asked()[-1], ("h:1", 1, 1))
        self.assertNoResult(waiting)
        self.pool.slots.capacity_changed()  # another dispatch meanwhile asks nothing more
        self.assertEqual(len(self.redis.asked()), 2)
        self.redis.answer(0, 1)  # another replica's waiter got it first
        self.assertNoResult(waiting)
        self.assertEqual((self.router.queue_length, self.pool.slots.in_flight), (1, 0))
        # that replica ends its request and says so: the waiter looks again at once
        self.slots.channel.received("txlb:freed", b"r2 h:1")
        self.assertEqual(len(self.redis.asked()), 3)
        self.redis.answer(1, 0)
        lease = self.lease(waiting)
        self.assertEqual((lease.backend.key, self.router.queue_length), ("h:1", 0))

    def test_a_waiter_being_confirmed_is_given_no_second_slot(self) -> None:
        self.build(max_conns=1, backends=2)
        held = []
        for _ in range(2):
            result = self.router.acquire()
            self.redis.answer(1, 0)
            held.append(self.lease(result))
        waiting = self.router.acquire()
        held[0].release()
        self.assertEqual(len(self.redis.asked()), 3)
        held[1].release()  # the other backend frees while the first slot is confirmed
        self.assertEqual(len(self.redis.asked()), 3)
        self.redis.answer(1, 0)
        self.assertEqual(self.lease(waiting).backend.key, held[0].backend.key)
        self.assertEqual(self.pool.slots.in_flight, 1)

    def test_a_waiter_gone_while_confirming_gives_its_slot_back(self) -> None:
        held = self.fill()
        waiting = self.router.acquire()
        held.release()
        waiting.cancel()
        self.failureResultOf(waiting, CancelledError)
        self.redis.answer(1, 0)
        self.assertEqual(self.pool.slots.in_flight, 0)
        self.clock.advance(FLUSH_DELAY)
        # both slots were confirmed in Redis and then freed: both announced
        self.assertEqual(self.redis.published(), [("txlb:freed", "r1 h:1")] * 2)

    def test_a_waiter_whose_backend_goes_away_while_confirming_is_refused(self) -> None:
        held = self.fill()
        waiting = self.router.acquire()
        held.release()
        self.redis.answer(0, 1)
        backend = self.pool.get("h:1")
        assert backend is not None
        self.pool.drain(backend)
        self.failureResultOf(waiting, RoutingError)

    def test_a_message_from_another_replica_wakes_the_queue(self) -> None:
        self.build(max_conns=1, backends=1)
        result = self.router.acquire()
        self.redis.answer(0, 1)
        self.assertEqual(self.router.queue_length, 1)
        # our own announcement, one for an unknown backend, garbage: nothing happens
        for message in (b"r1 h:1", b"r2 other:9", b"\xff", b"r2", b"x" * (MAX_MESSAGE + 1)):
            self.slots.channel.received("txlb:freed", message)
        self.slots.channel.received("elsewhere", b"r2 h:1")
        self.assertEqual(len(self.redis.asked()), 1)
        self.slots.channel.received(b"txlb:freed", b"r2 h:1")
        self.assertEqual(len(self.redis.asked()), 2)
        self.redis.answer(1, 0)
        self.lease(result)
        # well-formed messages of other replicas (the unknown backend's included)
        self.assertEqual(self.slots.status()["wakes_heard"], 2)

    def test_a_release_announces_the_slot_after_its_row(self) -> None:
        held = self.fill()
        self.clock.advance(FLUSH_DELAY)
        del self.redis.sent[:]
        held.release()
        self.clock.advance(FLUSH_DELAY)
        writes = [c[0] for c in self.redis.sent if c[0] in ("HSET", "PEXPIRE", "PUBLISH")]
        self.assertEqual(writes, ["HSET", "PEXPIRE", "PUBLISH"])
        self.assertEqual(self.redis.published(), [("txlb:freed", "r1 h:1")])

    def test_uncapped_releases_and_a_down_link_announce_nothing(self) -> None:
        self.build(max_conns=0)
        self.lease(self.router.acquire()).release()
        self.clock.advance(FLUSH_DELAY)
        self.assertEqual(self.redis.published(), [])
        self.build(max_conns=1, started=False)
        self.lease(self.router.acquire()).release()
        self.clock.advance(FLUSH_DELAY)
        self.assertEqual(self.redis.published(), [])


class CountsTests(SynchronousTestCase):
    def test_noted_and_freed_counts_of_the_others(self) -> None:
        counts = FleetCounts()
        counts.register("a:1")
        counts.note_others("a:1", 3)
        counts.note_others("unknown:1", 3)
        self.assertEqual((counts.total("a:1"), counts.others()), (3, {"a:1": 3}))
        self.assertTrue(counts.other_freed("a:1"))
        self.assertEqual(counts.total("a:1"), 2)
        counts.note_others("a:1", 0)
        self.assertFalse(counts.other_freed("a:1"))
        self.assertEqual(counts.total("a:1"), 0)

    def test_untake_is_as_if_never_taken(self) -> None:
        counts = FleetCounts()
        counts.register("a:1")
        counts.take("a:1")
        counts.take("a:1")
        counts.untake("a:1")
        self.assertEqual((counts.mine("a:1"), counts.started("a:1"), counts.row()),
                         (1, 1, {"a:1": 1}))


class MessageTests(SynchronousTestCase):
    def test_only_other_replicas_well_formed_messages_count(self) -> None:
        self.assertEqual(parse_freed(b"r2 h:1", "r1"), "h:1")
        self.assertEqual(parse_freed("r2 [::1]:8000", "r1"), "[::1]:8000")
        for message in (b"r1 h:1", b"r2 ", b" h:1", b"r2 h:1 x", b"\xff\xfe", 7, None,
                        "r2 " + "h" * MAX_MESSAGE):
            self.assertIsNone(parse_freed(message, "r1"), message)


class WiringTests(SynchronousTestCase):
    def test_the_balancer_gates_its_pool_and_counts_the_answers(self) -> None:
        config = build_config({"backends": "127.0.0.1:9",
                               "shared-state": "redis://h:1/0"}, environ={})
        lb = LoadBalancer(config=config, reactor=Clock())
        self.assertIsInstance(lb.pool.slots.gate, SharedSlots)
        from prometheus_client import generate_latest

        text = generate_latest(lb.metrics.registry).decode()
        self.assertIn('txlb_shared_state_slots_total{answer="refused"} 0.0', text)
        self.assertIn("txlb_shared_state_wakes_total 0.0", text)

    def test_one_process_has_no_gate(self) -> None:
        lb = LoadBalancer(["127.0.0.1:9"], reactor=Clock())
        self.assertIsNone(lb.pool.slots.gate)
