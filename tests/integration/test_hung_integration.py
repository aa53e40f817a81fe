"""
Hung-backend detection in the real ``twistd -n llmlb`` process, in front of simulated
engines on real sockets: a backend that answers nothing (not even ``/health``) is out
within 3 s under traffic, also when it is a ``twistd vllm-sim`` process stopped with
``SIGSTOP`` behind clients that give up after 1 s; one whose ``/health`` hangs while its
streams flow, or one slow to its first token while ``/health`` answers, stays in.  Each
test prints its figure.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.interfaces import IListeningPort
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from txlb.testing import SimulatedVLLM

from ..processes import Client, TwistdProcess, chat_body, header, wait_until
from .test_faults import SimProcess

JSON = {b"content-type": [b"application/json"]}


class Gate(Resource):
    """A simulated engine whose ``/health`` can be made to hang (accepted, never answered)."""

    isLeaf = True

    def __init__(self, sim: SimulatedVLLM) -> None:
        super().__init__()
        self.sim = sim
        self.inner = sim.resource()
        self.hang_health = False

    def render(self, request: Request) -> bytes | int:
        if self.hang_health and request.path == b"/health":
            return NOT_DONE_YET
        return self.inner.render(request)  # type: ignore[no-any-return]


class HungIntegrationTests(TestCase):
    timeout = 60

    async def start(self, *lb_args: str, ttft: tuple[float, ...] = (0.02, 0.02, 0.02)) -> None:
        self.gates = [Gate(SimulatedVLLM(reactor, tokens_per_second=100, ttft=t))
                      for t in ttft]
        ports: list[IListeningPort] = []
        for gate in self.gates:
            port = reactor.listenTCP(0, Site(gate), interface="127.0.0.1")
            self.addCleanup(port.stopListening)
            ports.append(port)
        self.keys = [f"127.0.0.1:{p.getHost().port}" for p in ports]
        self.lb = TwistdProcess("--backends", ",".join(self.keys), "--shutdown-timeout", "1",
                                *lb_args)
        self.addCleanup(self.lb.stop)
        await self.lb.started()
        self.client = Client()
        self.addCleanup(self.client.pool.closeCachedConnections)
        self.stopping = False
        self.codes: list[int] = []
        self.pending: set[defer.Deferred[Any]] = set()

    async def healthy(self) -> dict[str, bool]:
        _, chunks = await self.client.fetch(self.lb.url + "/__lb_status")
        return {b["backend"]: b["healthy"] for b in json.loads(chunks.body)["backends"]}

    async def loop(self) -> None:
        """Streams of 20 tokens (0.2 s) one after the other, each given at most 8 s."""
        deadline = time.monotonic() + 30
        while not self.stopping and time.monotonic() < deadline:
            fetch = defer.ensureDeferred(self.client.fetch(
                self.lb.url + "/v1/chat/completions", b"POST", chat_body(), {
                    **JSON, b"x-sim-tokens": [b"20"]}))
            fetch.addTimeout(8, reactor)
            self.pending.add(fetch)
            try:
                response, _ = await fetch
                self.codes.append(response.code)
            except Exception:
                if not self.stopping:  # else: cancelled by end()
                    self.codes.append(-1)  # held by a hung backend, then given up
            finally:
                self.pending.discard(fetch)

    async def traffic(self, count: int = 6) -> list[defer.Deferred[None]]:
        loops = [defer.ensureDeferred(self.loop()) for _ in range(count)]
        await wait_until(lambda: len(self.codes) > 20, what="traffic to flow")
        return loops

    async def stays_up(self, key: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.assertTrue((await self.healthy())[key], self.lb.output())
            await defer.Deferred.fromCoroutine(_pause(0.05))

    async def end(self, loops: list[defer.Deferred[None]]) -> None:
        self.stopping = True
        for fetch in list(self.pending):
            fetch.cancel()  # a request a hung backend holds: the client leaves
        await defer.gatherResults(loops)

    async def test_answering_nothing_is_out_within_3s(self) -> None:
        """Requests and /health accepted and never answered (a wedged engine)."""
        await self.hung_out_within_3s()

    async def test_answering_nothing_is_out_within_3s_with_workers(self) -> None:
        """The same with ``--workers 2``: each worker judges from its own requests and
        the supervisor takes its verdict."""
        await self.hung_out_within_3s("--workers", "2")

    async def hung_out_within_3s(self, *lb_args: str) -> None:
        await self.start(*lb_args)
        loops = await self.traffic()
        gate = self.gates[0]
        gate.sim.hang = gate.hang_health = True
        hung = time.monotonic()
        while (await self.healthy())[self.keys[0]]:
            self.assertLess(time.monotonic() - hung, 10, self.lb.output())
            await defer.Deferred.fromCoroutine(_pause(0.02))
        detected = time.monotonic() - hung
        before = len(self.codes)
        await wait_until(lambda: len(self.codes) > before + 20, what="the others to serve")
        await self.end(loops)
        self.assertLess(detected, 3.0)
        self.assertIn("hung: no byte from any of", self.lb.output())
        print(f"\nhung engine and /health{' '.join(('', *lb_args))}: out in {detected:.2f}s",
              file=sys.stderr)

    async def test_hung_health_while_streams_flow_stays_in(self) -> None:
        """/health hangs but the engine streams (SGLang during a long prefill): busy, not
        dead -- even with a prober that takes a silent backend out in about 2 s."""
        await self.start("--health-interval", "0.5", "--health-timeout", "0.5",
                         "--fall", "2")
        loops = await self.traffic()
        self.gates[0].hang_health = True
        await self.stays_up(self.keys[0], 6)
        await self.end(loops)
        self.assertEqual(set(self.codes), {200})
        self.assertIn("but its responses flow; not counted", self.lb.output())
        print("\nhung /health, streams flowing: in rotation after 6 s", file=sys.stderr)

    async def test_slow_first_tokens_while_health_answers_stays_in(self) -> None:
        """Every request of one engine takes 3 s to its first token; /health answers."""
        await self.start(ttft=(3.0, 0.02, 0.02))
        loops = await self.traffic()
        await self.stays_up(self.keys[0], 6)
        await self.end(loops)
        self.assertEqual(set(self.codes), {200})
        self.assertIn("but /health answers: slow, not hung", self.lb.output())
        print("\nslow first tokens, /health answering: in rotation after 6 s",
              file=sys.stderr)


class ImpatientClientsTests(TestCase):
    """A stopped engine behind clients that give up after 1 s, one request at a time."""

    timeout = 90

    async def test_a_stopped_engine_behind_impatient_clients_is_out_within_3s(self) -> None:
        await self.stopped_out_within_3s()

    async def test_the_same_with_workers(self) -> None:
        """
        Each worker judges from its own clients' requests, about half of them here, and
        the supervisor takes its verdict: a worker may need one more request to the
        stopped engine before its silence is long enough, so within 4 s.
        """
        await self.stopped_out_within_3s("--workers", "2", bound=4.0)

    async def stopped_out_within_3s(self, *lb_args: str, bound: float = 3.0) -> None:
        sims = [SimProcess(0, "--tokens-per-second", "200", "--ttft", "0.02")
                for _ in range(2)]
        for sim in sims:
            self.addCleanup(sim.cleanup)
        for sim in sims:
            await sim.started()
        stopped, other = sims
        lb = TwistdProcess("--backends", ",".join(sim.key for sim in sims),
                           "--shutdown-timeout", "1", *lb_args)
        self.addCleanup(lb.stop)
        await lb.started()
        client = Client()
        self.addCleanup(client.pool.closeCachedConnections)
        #: (when sent, X-Backend or None when the client gave up after 1 s)
        answers: list[tuple[float, str | None]] = []
        done = False

        async def one_at_a_time() -> None:
            deadline = time.monotonic() + 40
            while not done and time.monotonic() < deadline and len(answers) < 3000:
                sent = time.monotonic()
                fetch = defer.ensureDeferred(client.fetch(
                    lb.url + "/v1/chat/completions", b"POST", chat_body(),
                    {**JSON, b"x-sim-tokens": [b"5"]}))
                fetch.addTimeout(1.0, reactor)
                try:
                    response, _ = await fetch
                    answers.append((sent, header(response, b"x-backend")))
                except Exception:
                    answers.append((sent, None))

        async def status() -> dict[str, bool]:
            _, chunks = await client.fetch(lb.url + "/__lb_status")
            return {b["backend"]: b["healthy"] for b in json.loads(chunks.body)["backends"]}

        loops = [defer.ensureDeferred(one_at_a_time()) for _ in range(3)]
        await wait_until(lambda: {key for _, key in answers} >= {stopped.key, other.key},
                         timeout=20, what="both engines to answer")
        stopped.process.send_signal(signal.SIGSTOP)
        stop = time.monotonic()
        try:
            while (await status())[stopped.key]:
                self.assertLess(time.monotonic() - stop, 10, lb.output())
                await deferLater(reactor, 0.02)
            detected = time.monotonic() - stop
            counted = len(answers)
            await wait_until(lambda: len(answers) >= counted + 30, timeout=20,
                             what="30 more requests")
        finally:
            done = True
            await defer.gatherResults(loops)
            stopped.process.send_signal(signal.SIGCONT)
        gave_up = sum(1 for sent, key in answers if sent > stop and key is None)
        after = [key for sent, key in answers if sent > stop + detected]
        self.assertLess(detected, bound, lb.output())
        self.assertIn("hung: no byte from any of", lb.output())
        # from the verdict on, every request goes to the other engine and is answered
        self.assertEqual(set(after), {other.key})
        print(f"\nSIGSTOPped vllm-sim behind 1 s clients{' '.join(('', *lb_args))}: "
              f"out in {detected:.2f}s "
              f"({gave_up} requests given up on)", file=sys.stderr)


async def _pause(seconds: float) -> None:
    await deferLater(reactor, seconds)
