"""
The hung-backend detector (txlb._cluster.hung), in memory on a Clock: a backend whose every request
stops getting bytes is out within 3 s at the default settings; a slow one is not.
"""

from __future__ import annotations

import random
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from txlb import LoadBalancer
from txlb._cluster.backend import Backend

from ..helpers import ClientConnection, FakeResponse, FakeUpstream

THREE = ["127.0.0.1:8002", "127.0.0.1:8003", "127.0.0.1:8004"]
TWO = THREE[:2]
STEP = 0.05


class TurnClock(Clock):
    """
    A Clock that runs, at each advance, only the calls due when it began, as the reactor
    runs its timed calls once a turn: a call scheduled from one of them waits for the next
    advance -- the reads of a turn come between.
    """

    def advance(self, amount: float) -> None:
        self.rightNow += amount
        due = sorted((call for call in self.calls if call.getTime() <= self.seconds()),
                     key=lambda call: call.getTime())
        for call in due:
            if call in self.calls:
                self.calls.remove(call)
                call.called = 1
                call.func(*call.args, **call.kw)


class HungTestCase(SynchronousTestCase):
    #: the fleet of each test
    backends = THREE
    #: the reactor's time
    clock_factory: Any = Clock

    def setUp(self) -> None:
        self.clock = self.clock_factory()
        self.upstream = FakeUpstream()
        self.probes = FakeUpstream()
        self.lb = LoadBalancer(self.backends, reactor=self.clock, agent=self.upstream,
                               probe_agent=self.probes, rng=random.Random(3),
                               log_file="none", retries=0)
        self.lb.hung.startService()
        self.addCleanup(self.lb.hung.stopService)
        self.site = self.lb.site()
        self.reasons: list[str] = []
        self.lb.pool.on_down.append(lambda backend, reason: self.reasons.append(reason))
        #: the body of each stream the test drives, by the backend it went to
        self.streams: dict[str, list[FakeResponse]] = {key: [] for key in self.backends}
        self.waiting: dict[str, list[Any]] = {key: [] for key in self.backends}

    def backend(self, key: str) -> Backend:
        backend = self.lb.pool.get(key)
        assert backend is not None
        return backend

    def post(self) -> tuple[ClientConnection, str]:
        client = ClientConnection(self.site)
        client.request(b"POST", b"/v1/chat/completions",
                       body=b'{"model": "m", "stream": true}')
        call = self.upstream.last
        key = call.uri.split(b"/")[2].decode()
        return client, key

    def open_streams(self, count: int) -> None:
        """``count`` streaming requests, spread over the backends, each with its head."""
        for _ in range(count):
            _, key = self.post()
            self.streams[key].append(self.upstream.last.respond(FakeResponse(
                200, [(b"Content-Type", b"text/event-stream")])))

    def open_waiting(self, key: str) -> None:
        """A request that ``key`` has and has not answered yet (a long prefill)."""
        while True:
            _, got = self.post()
            if got == key:
                self.waiting[key].append(self.upstream.last)
                return
            self.streams[got].append(self.upstream.last.respond(FakeResponse(
                200, [(b"Content-Type", b"text/event-stream")])))

    def flow(self, seconds: float, flowing: set[str], answer_probes: int | None = None,
            ) -> float | None:
        """
        Let ``seconds`` pass in small steps, the streams of ``flowing`` backends sending a
        token at each; answer each hung-detector probe with ``answer_probes`` (None: never).
        Returns when the first backend went down (or None).
        """
        elapsed = 0.0
        down_at = None
        answered = 0
        while elapsed < seconds:
            for key in flowing:
                for stream in self.streams[key]:
                    stream.send(b'data: {"x": 1}\n\n')
            self.clock.advance(STEP)
            elapsed += STEP
            if answer_probes is not None:
                for call in self.probes.calls[answered:]:
                    if not call.deferred.called:
                        call.respond(FakeResponse(answer_probes, length=0)).end()
                answered = len(self.probes.calls)
            if down_at is None and not all(b.health.healthy for b in self.lb.pool):
                down_at = elapsed
        return down_at

    def probed(self, key: str) -> int:
        return sum(1 for call in self.probes.calls if call.uri.split(b"/")[2].decode() == key)


class HungTests(HungTestCase):
    def test_a_stopped_backend_is_out_within_3s(self) -> None:
        """Every request on it stalls, the others flow: probed, no answer, marked down."""
        self.open_streams(6)
        hung = THREE[0]
        self.assertEqual(len(self.streams[hung]), 2)
        self.flow(1, flowing=set(THREE))
        down_at = self.flow(5, flowing=set(THREE[1:]))
        assert down_at is not None
        self.assertLess(down_at, 3.0)
        backend = self.backend(hung)
        self.assertFalse(backend.health.healthy)
        self.assertEqual(backend.verdicts.hung_ejections, 1)
        self.assertIn("hung: no byte from any of 2 requests for", " ".join(self.reasons))
        self.assertEqual(self.probed(hung), 1)
        self.assertTrue(all(self.backend(key).health.healthy for key in THREE[1:]))
        # new requests go elsewhere; those it has are left to finish or time out
        for _ in range(4):
            self.assertNotEqual(self.post()[1], hung)
        self.assertFalse(any(call.cancelled for call in self.upstream.calls))
        metrics = self.lb.metrics.registry.get_sample_value(
            "txlb_backend_hung_ejections_total", {"backend": hung})
        self.assertEqual(metrics, 1)

    def test_a_confirming_probe_that_stalls_is_closed(self) -> None:
        """
        A stopped engine's kernel may still take the probe and a half-sent head may come
        back: the 1 s timeout cancels the body read, which must close that connection, not
        leave one open per confirmation.
        """
        self.open_streams(6)
        hung = THREE[0]
        self.flow(1, flowing=set(THREE))
        stalled = []
        while not stalled:
            self.flow(STEP, flowing=set(THREE[1:]))
            for call in self.probes.calls:
                if not call.deferred.called:
                    stalled.append(call.respond(FakeResponse(200)))  # a head, no body end
        self.flow(2, flowing=set(THREE[1:]))
        self.assertFalse(self.backend(hung).health.healthy)
        self.assertIn("/health did not answer in 1s", " ".join(self.reasons))
        self.assertTrue(stalled[0].transport.stopped)

    def test_a_hung_backend_with_requests_waiting_for_their_head(self) -> None:
        """Requests sent to it that never get a head count as much as stalled streams."""
        self.open_streams(2)  # one stream each on two backends
        hung = next(key for key in THREE if not self.streams[key])
        self.open_waiting(hung)
        down_at = self.flow(5, flowing=set(THREE))
        assert down_at is not None
        self.assertLess(down_at, 3.0)
        self.assertFalse(self.backend(hung).health.healthy)

    def test_slow_prefill_while_its_other_streams_flow(self) -> None:
        """A long prefill stalls one request; its other streams flow: never suspected."""
        self.open_streams(3)
        slow = THREE[0]
        self.open_waiting(slow)
        self.assertIsNone(self.flow(30, flowing=set(THREE)))
        self.assertEqual(self.probed(slow), 0)

    def test_silent_but_health_answers(self) -> None:
        """
        Every stream of it silent (a prefill stalling the batch), /health answers: slow,
        not hung; probed again only after another stall of silence.
        """
        self.open_streams(3)
        slow = THREE[0]
        self.assertIsNone(self.flow(10, flowing=set(THREE[1:]), answer_probes=200))
        self.assertTrue(self.backend(slow).health.healthy)
        self.assertGreaterEqual(self.probed(slow), 3)
        self.assertLessEqual(self.probed(slow), 10 / 1.25)

    def test_health_answering_503_confirms(self) -> None:
        self.open_streams(3)
        self.assertIsNotNone(self.flow(5, flowing=set(THREE[1:]), answer_probes=503))
        self.assertIn("/health answered 503", " ".join(self.reasons))

    def test_a_byte_during_the_probe_clears_it(self) -> None:
        self.open_streams(3)
        slow = THREE[0]
        self.flow(1.6, flowing=set(THREE[1:]))
        self.assertEqual(self.probed(slow), 1)
        self.streams[slow][0].send(b"data: {}\n\n")  # it was only slow
        self.assertIsNone(self.flow(0.9, flowing=set(THREE)))
        self.assertTrue(self.backend(slow).health.healthy)

    def test_all_silent_at_once_is_not_one_backends_fault(self) -> None:
        self.open_streams(3)
        self.assertIsNone(self.flow(10, flowing=set()))
        self.assertEqual(len(self.probes.calls), 0)

    def test_its_own_slow_first_bytes_raise_the_bar(self) -> None:
        """A backend whose first bytes take 2 s on average is quiet only after 8 s."""
        self.open_streams(2)
        slow = next(key for key in THREE if not self.streams[key])
        self.backend(slow).pace.timed(2.0, ttft=2.0)
        self.open_waiting(slow)
        self.assertIsNone(self.flow(7.5, flowing=set(THREE)))
        self.assertEqual(self.probed(slow), 0)
        self.assertIsNotNone(self.flow(2.0, flowing=set(THREE)))

    def test_a_stall_of_txlb_itself_says_nothing(self) -> None:
        """After the reactor was held up itself, the unread sockets are not silence."""
        self.open_streams(3)
        self.clock.advance(5)  # one late tick: everything looks silent
        self.assertEqual(len(self.probes.calls), 0)

    def test_never_more_than_half_the_fleet(self) -> None:
        self.open_streams(3)
        self.lb.pool.mark_down(self.backend(THREE[1]), "health")
        self.flow(5, flowing={THREE[2]})
        self.assertTrue(self.backend(THREE[0]).health.healthy)
        self.assertEqual(self.probed(THREE[0]), 2)  # suspected twice in 5 s; it stays in

    def test_a_client_reading_slowly_is_not_backend_silence(self) -> None:
        """While txlb holds a stream back for its slow client, the backend may be quiet."""
        self.open_streams(3)
        slow = THREE[0]
        exchange = next(e for e in self.lb.proxy.live if e.backend.key == slow)
        exchange.pauseProducing()
        self.assertIsNone(self.flow(5, flowing=set(THREE[1:])))
        self.assertEqual(self.probed(slow), 0)

    def test_off(self) -> None:
        lb = LoadBalancer(THREE, reactor=self.clock, agent=self.upstream,
                          probe_agent=self.probes, log_file="none", hung_after=0)
        service = lb.service()
        service.startService()
        self.addCleanup(service.stopService)
        self.assertTrue(lb.hung.running)
        self.assertFalse(lb.hung.watching)
        self.assertIsNone(lb.hung._loop)  # no tick is ever scheduled


class ImpatientClientsTestCase(HungTestCase):
    """
    Clients that send one request at a time and leave when no byte came within their
    ``patience`` (an interactive feature's 1 s timeout): a stopped engine never holds a
    request long enough for the in-flight silence alone to reach ``--hung-after``.
    """

    backends = TWO

    def setUp(self) -> None:
        super().setUp()
        #: per client slot: its connection, the call upstream, the backend, when it was sent
        self.slots: list[tuple[ClientConnection, Any, str, float] | None] = []
        #: (when, backend) of every request the clients sent
        self.sent: list[tuple[float, str]] = []

    def impatient(self, seconds: float, patience: float, answering: set[str],
                  clients: int = 3, answer_probes: int | None = None,
                  answer_after: float = STEP, flowing_slowly: frozenset[str] = frozenset(),
                  ) -> float | None:
        """
        ``clients`` clients, one request each at a time, for ``seconds``: a backend of
        ``answering`` answers each request it gets ``answer_after`` seconds after it was
        sent (head, a token, the end); the others send nothing, and a client that got no
        byte within ``patience`` leaves and sends its next request.  The streams opened
        before (:meth:`open_streams`) send a token every step on ``answering`` backends,
        every half second on ``flowing_slowly`` ones (a decode batch slowed by prefills).
        Probes are answered with ``answer_probes`` (None: never).  Returns the clock's
        time when a backend first went down (or None).
        """
        if len(self.slots) < clients:
            self.slots += [None] * (clients - len(self.slots))
        end = self.clock.seconds() + seconds
        down_at = None
        answered = len(self.probes.calls)
        while self.clock.seconds() < end:
            for index, slot in enumerate(self.slots):
                if slot is None:
                    client, key = self.post()
                    self.slots[index] = (client, self.upstream.last, key, self.clock.seconds())
                    self.sent.append((self.clock.seconds(), key))
            steps = round(self.clock.seconds() / STEP)
            for key in answering | (flowing_slowly if steps % 10 == 0 else set()):
                for stream in self.streams[key]:  # streams opened before
                    stream.send(b'data: {"x": 1}\n\n')
            self.clock.advance(STEP)
            now = self.clock.seconds()
            for index, slot in enumerate(self.slots):
                assert slot is not None
                client, call, key, sent = slot
                if key in answering and now - sent >= answer_after - 1e-9:
                    response = call.respond(FakeResponse(
                        200, [(b"Content-Type", b"text/event-stream")]))
                    response.send(b'data: {"x": 1}\n\n')
                    response.end()
                    self.slots[index] = None
                elif now - sent >= patience - 1e-9:
                    client.disconnect()
                    self.slots[index] = None
            if answer_probes is not None:
                for probe in self.probes.calls[answered:]:
                    if not probe.deferred.called:
                        probe.respond(FakeResponse(answer_probes, length=0)).end()
                answered = len(self.probes.calls)
            if down_at is None and not all(b.health.healthy for b in self.lb.pool):
                down_at = now
        return down_at

    def sent_to(self, key: str, after: float) -> int:
        return sum(1 for when, got in self.sent if got == key and when > after)


class ImpatientClientTests(ImpatientClientsTestCase):
    def stopped_is_out_within_3s(self, patience: float, clients: int) -> None:
        """Both answer, then one stops: out within 3 s of its last byte, new requests spared."""
        stopped, other = TWO
        self.impatient(2, patience, answering=set(TWO), clients=clients)
        last_byte = self.backend(stopped).pace.last_byte
        assert last_byte is not None
        down_at = self.impatient(5, patience, answering={other}, clients=clients)
        assert down_at is not None, f"never ejected; probed {self.probed(stopped)} times"
        self.assertLess(down_at - last_byte, 3.0)
        self.assertEqual(self.backend(stopped).pace.last_byte, last_byte)
        self.assertEqual(self.backend(stopped).verdicts.hung_ejections, 1)
        self.assertIn("hung: no byte from any of", " ".join(self.reasons))
        self.assertEqual(self.sent_to(stopped, after=down_at), 0)
        self.assertTrue(self.backend(other).health.healthy)

    def test_clients_leaving_after_1s_one_at_a_time(self) -> None:
        self.stopped_is_out_within_3s(1.0, clients=3)

    def test_clients_leaving_after_300ms_one_at_a_time(self) -> None:
        self.stopped_is_out_within_3s(0.3, clients=3)

    def test_clients_leaving_after_2s_one_at_a_time(self) -> None:
        self.stopped_is_out_within_3s(2.0, clients=3)

    def test_a_single_client_leaving_after_1s(self) -> None:
        self.stopped_is_out_within_3s(1.0, clients=1)

    def test_a_single_client_leaving_after_300ms(self) -> None:
        self.stopped_is_out_within_3s(0.3, clients=1)

    def test_slow_engine_whose_other_streams_flow_stays_in(self) -> None:
        """
        SGLang during long prefills: its new requests get no byte for 4 s (their clients
        leave after 1 s), its /health times out, but the streams it already has keep
        flowing: alive, never suspected.
        """
        slow, other = TWO
        self.impatient(1, 1.0, answering=set(TWO))
        self.open_streams(4)
        self.assertTrue(self.streams[slow])
        self.assertIsNone(self.impatient(30, 1.0, answering={other}, clients=3,
                                         flowing_slowly=frozenset({slow})))
        self.assertTrue(self.backend(slow).health.healthy)
        self.assertGreater(self.sent_to(slow, after=2.0), 10)
        self.assertEqual(self.probed(slow), 0)

    def test_slow_engine_whose_health_answers_stays_in(self) -> None:
        """Its new requests all left unanswered, no other stream, /health answers: slow."""
        slow, other = TWO
        self.impatient(1, 1.0, answering=set(TWO))
        self.assertIsNone(self.impatient(10, 1.0, answering={other}, answer_probes=200))
        self.assertTrue(self.backend(slow).health.healthy)
        self.assertGreaterEqual(self.probed(slow), 3)

    def test_nobody_answering_accuses_nobody(self) -> None:
        """No backend answers within the clients' 1 s: the cause is shared, or the clients
        too impatient for this fleet; their leaving says nothing of one backend."""
        self.impatient(10, 1.0, answering=set())
        self.assertEqual(len(self.probes.calls), 0)
        self.assertTrue(all(b.health.healthy for b in self.lb.pool))

    def test_answers_elsewhere_not_much_faster_say_nothing(self) -> None:
        """
        The other backend's heads take 0.5 s: a client leaving after 1 s waited only twice
        that, which says nothing of the silent one (it may be a little slower).  Much less
        time means 4 times less (the detector's factor).
        """
        silent, other = TWO
        self.impatient(2, 1.0, answering=set(TWO), answer_after=0.5)
        self.assertIsNone(self.impatient(10, 1.0, answering={other}, answer_after=0.5))
        self.assertEqual(self.probed(silent), 0)

    def test_answers_elsewhere_only_before_say_nothing(self) -> None:
        """
        The other backend answered fast once, but no new request of its gets a head now
        either (its old streams flow): clients leaving one backend unanswered say nothing
        when no one else answers new requests meanwhile -- sending them all elsewhere
        would not answer them sooner.
        """
        silent, other = TWO
        self.impatient(2, 1.0, answering=set(TWO))
        self.open_streams(4)
        for stream in self.streams[silent]:  # the silent one's streams end
            stream.end()
        self.streams[silent].clear()
        # the other answers no new request from here; the silent one stops half a second later
        self.impatient(0.5, 1.0, answering={silent}, flowing_slowly=frozenset({other}))
        self.assertIsNone(self.impatient(10, 1.0, answering=set(),
                                         flowing_slowly=frozenset({other})))
        self.assertEqual(self.probed(silent), 0)


class ClientsCannotAccuseTests(ImpatientClientsTestCase):
    """
    What clients alone can do to a healthy engine, choosing when to leave, which backend
    (least-conn puts a request where none is in flight, and ``X-Backend`` says where it
    went) and what the other backend answers: none of it is a silence of the engine's.
    """

    backends = TWO

    def attack(self, seconds: float, answer_probes: int | None) -> float | None:
        """
        One client, again and again: a request that least-conn puts on the target; while
        it waits, four that go to the other backend and get a 400 head in 2 ms each; the
        client leaves after 28 ms, before the target could answer, and pauses 0.3 s.  A
        request that goes to the other backend first gets a 200 head in 5 ms.  Probes are
        answered with ``answer_probes`` (None: never).  Returns when a backend first went
        down (or None).
        """
        target, other = TWO
        end = self.clock.seconds() + seconds
        answered = 0
        down_at = None
        while self.clock.seconds() < end:
            client, key = self.post()
            call = self.upstream.last
            if key == other:
                self.clock.advance(0.005)
                call.respond(FakeResponse(200, [(b"Content-Type", b"text/event-stream")])).end()
            else:
                for _ in range(4):  # the target has one in flight: these go elsewhere
                    _, got = self.post()
                    self.assertEqual(got, other)
                    self.clock.advance(0.002)
                    self.upstream.last.respond(FakeResponse(400, length=0)).end()
                self.clock.advance(0.02)
                client.disconnect()
            for _ in range(6):
                self.clock.advance(STEP)
                if answer_probes is not None:
                    for probe in self.probes.calls[answered:]:
                        if not probe.deferred.called:
                            probe.respond(FakeResponse(answer_probes, length=0)).end()
                    answered = len(self.probes.calls)
                if down_at is None and not all(b.health.healthy for b in self.lb.pool):
                    down_at = self.clock.seconds()
        return down_at

    def test_short_waits_far_apart_never_get_it_probed(self) -> None:
        """
        The target has never answered here; each of its requests waits 28 ms, a thirtieth
        of the time: no silence of 1.25 s, however long this goes on -- not even one probe,
        although its /health would answer.
        """
        target, _ = TWO
        self.attack(20, answer_probes=200)
        self.assertGreater(self.backend(target).counts.requests, 20)
        self.assertEqual(self.probed(target), 0)

    def test_leaving_before_its_usual_first_byte_with_fast_errors_elsewhere(self) -> None:
        """
        The target's heads take 0.3 s, its /health is slow (does not answer in 1 s): its
        clients leave after 28 ms, long before an answer was due, and the other's 400s in
        2 ms say nothing of how fast an engine answers.  Not ejected, not probed.
        """
        target, other = TWO
        for _ in range(10):  # warm: the target answers in 0.3 s, the other in 0.05 s
            _, key = self.post()
            call = self.upstream.last
            self.clock.advance(0.3 if key == target else STEP)
            response = call.respond(FakeResponse(200, [(b"Content-Type", b"text/event-stream")]))
            response.send(b'data: {"x": 1}\n\n')
            response.end()
        self.assertAlmostEqual(self.backend(target).pace.head_wait or 0, 0.3)
        self.assertIsNone(self.attack(10, answer_probes=None))
        self.assertEqual(self.reasons, [])
        self.assertEqual(self.probed(target), 0)

    def test_back_to_back_but_before_4_times_its_usual_first_byte(self) -> None:
        """
        The target's heads take 0.3 s; clients keep a request on it all the time, each
        leaving after 0.5 s, while the other answers 200s in 50 ms: 4 times its own pace
        (1.2 s) is when an answer is due, so none of them is evidence.
        """
        target, other = TWO
        self.impatient(3, 2.0, answering=set(TWO), answer_after=0.3)
        self.assertIsNone(self.impatient(10, 0.5, answering={other}))
        self.assertGreater(self.sent_to(target, after=3.0), 10)
        self.assertEqual(self.probed(target), 0)


class SingleBackendImpatientTests(ImpatientClientsTestCase):
    """One backend: nothing to compare its silence with."""

    backends = THREE[:1]

    def test_a_silent_only_backend_is_left_to_the_prober(self) -> None:
        """
        Its clients leave after 1 s with nothing, but no other backend answers faster: the
        cause may as well be shared (the network, txlb, prompts too long for such clients),
        and taking the only backend out would turn waits into errors.  Not probed, not
        ejected by the detector; the prober's ``--fall`` decides.
        """
        only = self.backends[0]
        self.impatient(1, 1.0, answering={only})
        self.assertIsNone(self.impatient(10, 1.0, answering=set()))
        self.assertTrue(self.backend(only).health.healthy)
        self.assertEqual(len(self.probes.calls), 0)
        self.assertGreater(self.sent_to(only, after=1.0), 20)


class HeadPaceTests(SynchronousTestCase):
    """What a response head teaches of a backend's pace (``Pace.head_came``)."""

    def test_any_head_is_a_byte_only_a_success_sets_the_pace(self) -> None:
        from txlb._config import BackendSpec

        backend = Backend(BackendSpec("127.0.0.1", 8002))
        backend.pace.head_came(10.0, 0.3, 200)
        backend.pace.head_came(11.0, 0.002, 400)  # an error head, at once
        backend.pace.head_came(12.0, 0.001, 503)
        self.assertEqual(backend.pace.last_byte, 12.0)  # alive: a byte is a byte
        self.assertEqual((backend.pace.last_head, backend.pace.head_wait), (10.0, 0.3))
        backend.pace.head_came(13.0, 0.1, 206)
        self.assertEqual(backend.pace.last_head, 13.0)
        self.assertAlmostEqual(backend.pace.head_wait or 0, 0.3 + 0.2 * (0.1 - 0.3))


class UnansweredRunTests(SynchronousTestCase):
    """How requests left unanswered add up, told to the detector directly."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(100)
        self.lb = LoadBalancer(TWO, reactor=self.clock, agent=FakeUpstream(),
                               probe_agent=FakeUpstream(), log_file="none")
        self.hung = self.lb.hung
        self.hung.startService()
        self.addCleanup(self.hung.stopService)
        backends = list(self.lb.pool)
        self.silent, self.other = backends
        # both answered before: the silent one's heads take 0.1 s, the other's 0.05 s
        self.silent.pace.head_came(99.0, 0.1, 200)
        self.other.pace.head_came(99.0, 0.05, 200)

    def left(self, sent: float, left: float) -> None:
        self.hung.left_unanswered(self.silent, sent, left)

    def quiet(self, at: float) -> dict[Backend, tuple[float, int]]:
        """The silences at ``at``, the other backend answering in 50 ms all along (the
        clock moved in steps, so the detector's looks are on time)."""
        while self.clock.seconds() < at:
            self.clock.advance(min(STEP, at - self.clock.seconds()))
        self.other.pace.head_came(at, 0.05, 200)
        return {backend: (round(silent, 3), requests)
                for backend, (silent, requests) in self.hung.quiet_for().items()}

    def test_one_after_another_within_the_stall_is_one_silence(self) -> None:
        self.left(100.0, 101.0)
        self.left(102.2, 103.2)  # 1.2 s later: still the same silence
        self.assertEqual(self.quiet(103.2)[self.silent][1], 2)

    def test_the_gaps_between_them_are_not_silence(self) -> None:
        """From 101 to 102.2 nobody asked it anything: 2 s of silence, not 3.2."""
        self.left(100.0, 101.0)
        self.left(102.2, 103.2)
        self.assertEqual(self.quiet(103.2), {self.silent: (2.0, 2)})

    def test_overlapping_ones_count_their_union(self) -> None:
        """Three clients at once, and one that waited across two others: the time the
        backend had one waiting at least."""
        self.left(100.0, 101.0)
        self.left(100.5, 101.5)
        self.left(102.0, 102.5)  # after a gap
        self.left(99.5, 103.0)  # sent first, left last: covers the gap too
        self.assertEqual(self.quiet(103.0), {self.silent: (3.5, 4)})

    def test_a_silence_spread_thin_is_none(self) -> None:
        """Two half-second waits 1.1 s apart: it had one waiting less than half of those
        2.1 s, so the second starts a silence of its own rather than adding up."""
        self.left(100.0, 100.5)
        self.left(101.6, 102.1)
        self.assertEqual(self.quiet(102.1), {self.silent: (0.5, 1)})
        self.left(102.2, 102.7)  # right after: the same silence again
        self.assertEqual(self.quiet(102.7), {self.silent: (1.0, 2)})

    def test_one_that_left_before_its_due_time_says_nothing(self) -> None:
        """Its heads take 0.1 s: a client that left after 0.3 s left before 4 times that,
        however many such clients, one after another."""
        at = 100.0
        for _ in range(10):
            self.left(at, at + 0.3)
            at += 0.3
        self.assertEqual(self.quiet(at), {})
        self.left(at, at + 0.4)  # 4 times its pace: that one counts
        self.assertEqual(self.quiet(at + 0.4), {self.silent: (0.4, 1)})

    def test_before_it_ever_answered_the_fastest_others_pace_is_due(self) -> None:
        """A backend with no answer here yet: due when 4 times the other's 0.05 s is."""
        lb = LoadBalancer(TWO, reactor=self.clock, agent=FakeUpstream(),
                          probe_agent=FakeUpstream(), log_file="none")
        cold, other = list(lb.pool)
        lb.hung.startService()
        self.addCleanup(lb.hung.stopService)
        self.assertIsNone(lb.hung.due(cold))  # nobody answered: nothing to judge by
        other.pace.head_came(99.0, 0.05, 200)
        self.assertEqual(lb.hung.due(cold), 0.2)
        cold.pace.head_came(99.5, 0.5, 200)
        self.assertEqual(lb.hung.due(cold), 2.0)  # its own, once it has one

    def test_error_heads_elsewhere_are_no_faster_answer(self) -> None:
        """The other answers only 400s in 2 ms now: not an answer the silent one owed."""
        self.clock.advance(1.0)
        self.left(100.0, 101.0)
        self.other.pace.head_came(101.0, 0.002, 400)
        self.assertEqual(self.hung.quiet_for(), {})
        self.other.pace.head_came(101.0, 0.05, 200)
        self.assertEqual(self.hung.quiet_for(), {self.silent: (1.0, 1)})

    def test_a_longer_gap_starts_another(self) -> None:
        self.left(100.0, 101.0)
        self.left(102.5, 103.5)
        self.assertEqual(self.quiet(103.5), {self.silent: (1.0, 1)})

    def test_a_byte_since_ends_it(self) -> None:
        self.left(100.0, 101.0)
        self.silent.pace.heard(101.1)
        self.left(101.0, 102.0)  # counted from the byte on
        self.assertEqual(self.quiet(102.0), {self.silent: (0.9, 1)})

    def test_an_old_one_is_forgotten(self) -> None:
        self.left(100.0, 101.0)
        self.assertEqual(self.quiet(101.0 + self.hung.stall), {self.silent: (1.0, 1)})
        self.assertEqual(self.quiet(101.01 + self.hung.stall), {})

    def test_no_faster_answer_since_it_began_says_nothing(self) -> None:
        self.other.pace.head_came(100.0, 0.05, 200)
        self.left(100.5, 101.5)
        self.clock.advance(1.5)
        self.assertEqual(self.hung.quiet_for(), {})

    def test_a_stall_of_txlb_itself_forgets_them(self) -> None:
        """Clients that gave up while txlb was held up say nothing of the backends."""
        self.left(100.0, 101.0)
        self.assertEqual(self.quiet(101.0), {self.silent: (1.0, 1)})
        self.clock.advance(1.0)  # one look, late
        self.assertEqual(self.quiet(102.0), {})

    def test_not_while_off(self) -> None:
        self.hung.stopService()
        self.left(100.0, 101.0)
        self.hung.startService()
        self.assertEqual(self.quiet(101.0), {})


class ProbeTimeoutWhileFlowingTests(HungTestCase):
    """The active prober: a /health timeout while the backend's streams flow is busy-ness."""

    def test_health_timing_out_while_streams_flow(self) -> None:
        self.lb.health.startService()
        self.addCleanup(self.lb.health.stopService)
        self.open_streams(3)
        busy = THREE[0]
        for call in self.probes.calls:  # the first round, at start: all fine
            call.respond(FakeResponse(200, length=0)).end()
        answered = len(self.probes.calls)
        elapsed = 0.0
        while elapsed < 60:  # /health of `busy` never answers again; its streams flow
            for key in THREE:
                for stream in self.streams[key]:
                    stream.send(b"data: {}\n\n")
            for call in self.probes.calls[answered:]:
                if call.uri.split(b"/")[2].decode() != busy and not call.deferred.called:
                    call.respond(FakeResponse(200, length=0)).end()
            answered = len(self.probes.calls)
            self.clock.advance(0.1)
            elapsed += 0.1
        self.assertTrue(self.backend(busy).health.healthy)
        self.assertGreaterEqual(self.probed(busy), 5)
        self.assertEqual(self.backend(busy).health.failures_in_a_row, 0)

    def test_health_timing_out_while_silent_still_counts(self) -> None:
        self.lb.health.startService()
        self.addCleanup(self.lb.health.stopService)
        self.lb.hung.stopService()
        for _ in range(8):
            self.clock.advance(5)
        self.assertFalse(any(b.health.healthy for b in self.lb.pool))


class TimedOutTests(SynchronousTestCase):
    """A probe's timeout, however Twisted's Agent words it."""

    def test_kinds(self) -> None:
        from twisted.internet.defer import CancelledError, TimeoutError
        from twisted.internet.error import ConnectionRefusedError
        from twisted.python.failure import Failure
        from twisted.web.client import ResponseFailed, ResponseNeverReceived

        from txlb._cluster.hung import timed_out

        cancelled = Failure(CancelledError())
        self.assertTrue(timed_out(Failure(TimeoutError())))
        self.assertTrue(timed_out(Failure(ResponseNeverReceived([cancelled]))))
        self.assertTrue(timed_out(Failure(ResponseFailed([cancelled]))))
        self.assertFalse(timed_out(Failure(ConnectionRefusedError())))
        self.assertFalse(timed_out(Failure(ResponseNeverReceived(
            [Failure(ConnectionRefusedError())]))))


class RobustnessTests(HungTestCase):
    def test_a_failing_look_does_not_stop_the_looks(self) -> None:
        calls = []

        def broken() -> None:
            calls.append(1)
            raise RuntimeError("boom")

        self.lb.hung.check = broken  # type: ignore[method-assign]
        self.clock.advance(0.25)
        self.clock.advance(0.25)
        self.assertEqual(len(calls), 2)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 2)


class LateTurnTests(HungTestCase):
    clock_factory = TurnClock

    def test_a_probe_answered_while_txlb_was_held_up_clears_it(self) -> None:
        """
        txlb itself held up past the probe's 1 s (a long collection, a heavy request): the
        engine's 200 is in the socket, unread, when the time runs out.  The verdict waits a
        turn, whose reads take it: slow, not hung.
        """
        self.open_streams(6)
        quiet = THREE[0]
        self.flow(1, flowing=set(THREE))
        while not self.probes.calls:
            self.flow(STEP, flowing=set(THREE[1:]))
        (probe,) = self.probes.calls
        self.clock.advance(1.5)  # one late turn: the timers due run ...
        if not probe.deferred.called:  # (given up already, the answer would go unread)
            probe.respond(FakeResponse(200, length=0)).end()  # ... then its reads
        self.clock.advance(0)
        self.assertTrue(self.backend(quiet).health.healthy, self.reasons)
