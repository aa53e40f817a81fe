"""
Priority classes through the real ``twistd -n llmlb`` over a ``twistd vllm-sim`` engine:
one backend at ``max_conns = 1`` held busy, requests of several classes queued behind it,
and the order in which they are then served (never their latency: that bound comes from
the simulator, bench/classes.py).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor, task

from ..processes import Client, TwistdProcess, chat_body, wait_until
from .test_faults import FaultTestCase
from .test_integration import JSON

BATCH_KEY = "sk-batch-tenant-integration"


class QueueProcessCase(FaultTestCase):
    """A balancer before one simulated engine at max_conns 1, and how to watch its queue."""

    async def start(self, classes: str = "") -> tuple[TwistdProcess, Path]:
        (sim,) = await self.sims(1, "--tokens-per-second", "20", "--ttft", "0.01")
        directory = Path(tempfile.mkdtemp(prefix="txlb-classes-"))
        self.addCleanup(shutil.rmtree, directory, True)
        config = directory / "lb.toml"
        config.write_text(f'[[backends]]\nurl = "{sim.key}"\nmax_conns = 1\n' + classes)
        log = directory / "results.log"
        # the backends come from the file (with their max_conns), not from --backends
        lb = TwistdProcess("--config", str(config), "--log-file", str(log),
                           "--log-format", "json", "--health-interval", "5")
        self.addCleanup(lambda: defer.ensureDeferred(lb.stop()))
        await lb.started()
        self.client = Client()
        self.addCleanup(self.client.pool.closeCachedConnections)
        return lb, log

    def send(self, lb: TwistdProcess, orid: str, tokens: int, **headers: str,
             ) -> defer.Deferred[Any]:
        extra = {name.replace("_", "-").encode(): [value.encode()]
                 for name, value in headers.items()}
        return defer.ensureDeferred(self.client.fetch(
            lb.url + "/v1/chat/completions", b"POST", chat_body(stream=False),
            {**JSON, b"x-orid": [orid.encode()], b"x-sim-tokens": [str(tokens).encode()],
             **extra}))

    async def holding(self, lb: TwistdProcess) -> None:
        """Until the first request holds the one slot: later ones must queue behind it."""
        deadline = time.monotonic() + 10
        while sum(b["active"] for b in (await self.status(lb))["backends"]) != 1:
            if time.monotonic() > deadline:
                raise AssertionError("the first request never took the slot")
            await task.deferLater(reactor, 0.02)

    async def queued(self, lb: TwistdProcess, length: int) -> dict[str, Any]:
        deadline = time.monotonic() + 10
        while True:
            queue: dict[str, Any] = (await self.status(lb))["queue"]
            if queue["length"] == length:
                return queue
            if time.monotonic() > deadline:
                raise AssertionError(f"the queue never reached {length}: {queue}")
            await task.deferLater(reactor, 0.02)

    async def served(self, log: Path, count: int) -> list[tuple[str, str]]:
        """(orid, class) of each logged chat request, in the order they ended."""
        def chats() -> list[dict[str, Any]]:
            # the /__lb_status polls that watched the queue have their lines too
            lines = [json.loads(line) for line in log.read_text().splitlines()]
            return [line for line in lines if line["path"] == "/v1/chat/completions"]

        await wait_until(lambda: log.exists() and len(chats()) >= count,
                         timeout=20, what=f"{count} result-log lines")
        return [(line["orid"], line["class"]) for line in chats()]


class ClassOrderTests(QueueProcessCase):
    @defer.inlineCallbacks
    def test_interactive_requests_are_served_before_batch_ones_queued_earlier(self) -> Any:
        lb, log = yield defer.ensureDeferred(self.start())
        # the one slot: 40 tokens at 20/s hold it for about 2 s
        answers = [self.send(lb, "busy", 40)]
        yield defer.ensureDeferred(self.holding(lb))
        for n in range(3):
            answers.append(self.send(lb, f"b{n}", 1, x_priority="batch"))
            yield defer.ensureDeferred(self.queued(lb, n + 1))
        for n in range(3):
            answers.append(self.send(lb, f"i{n}", 1, x_priority="interactive"))
            yield defer.ensureDeferred(self.queued(lb, n + 4))
        queue = yield defer.ensureDeferred(self.queued(lb, 6))
        self.assertEqual(queue["classes"]["batch"]["length"], 3)
        self.assertEqual(queue["classes"]["interactive"]["length"], 3)
        results = yield defer.gatherResults(answers, consumeErrors=True)
        self.assertEqual([response.code for response, _ in results], [200] * 7)
        order = yield defer.ensureDeferred(self.served(log, 7))
        self.assertEqual(order, [("busy", "default"), ("i0", "interactive"),
                                 ("i1", "interactive"), ("i2", "interactive"),
                                 ("b0", "batch"), ("b1", "batch"), ("b2", "batch")])

    @defer.inlineCallbacks
    def test_a_key_bound_to_batch_claiming_interactive_is_queued_as_batch(self) -> Any:
        digest = hashlib.sha256(BATCH_KEY.encode()).hexdigest()
        lb, log = yield defer.ensureDeferred(self.start(
            '[[classes]]\nname = "interactive"\n[[classes]]\nname = "default"\n'
            f'[[classes]]\nname = "batch"\nkeys = ["{digest}"]\n'))
        answers = [self.send(lb, "busy", 40)]
        yield defer.ensureDeferred(self.holding(lb))
        answers.append(self.send(lb, "claims", 1, x_priority="interactive",
                                 authorization=f"Bearer {BATCH_KEY}"))
        queue = yield defer.ensureDeferred(self.queued(lb, 1))
        self.assertEqual(queue["classes"]["batch"]["length"], 1)
        answers.append(self.send(lb, "plain", 1))
        yield defer.ensureDeferred(self.queued(lb, 2))
        results = yield defer.gatherResults(answers, consumeErrors=True)
        self.assertEqual([response.code for response, _ in results], [200] * 3)
        order = yield defer.ensureDeferred(self.served(log, 3))
        self.assertEqual(order, [("busy", "default"), ("plain", "default"),
                                 ("claims", "batch")])
        output = lb.output()
        self.assertNotIn(BATCH_KEY, output)
        self.assertNotIn(BATCH_KEY, log.read_text())
