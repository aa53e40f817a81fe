"""
``--shared-state rediss://`` for real: a ``redis-server`` speaking TLS only, on a free
loopback port, with a throwaway certificate.  Two replicas that trust its CA (``?ca=PATH``)
share their state through it; a replica given a CA whose certificate names another host
refuses the server, keeps to its local view (said once) and serves every request; the
password in the URL never shows in the log or ``/status``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from twisted.internet import defer
from twisted.trial.unittest import TestCase

from ..processes import Client, TwistdProcess, throwaway_certificate, wait_until
from ..redis import RedisServer
from . import test_shared_state_process as single
from .test_integration import Fleet
from .test_shared_state_process import _until

PASSWORD = "tls-s3cret-pass"


class TLSSharedStateTests(TestCase):
    timeout = 120

    status = single.SharedStateProcessTests.status
    in_flight = single.SharedStateProcessTests.in_flight
    open_stream = single.SharedStateProcessTests.open_stream
    small_request = single.SharedStateProcessTests.small_request

    def setUp(self) -> None:
        directory = Path(self.mktemp()).resolve()  # redis-server runs in its own directory
        directory.mkdir(parents=True)
        (directory / "other").mkdir()
        self.key, self.cert = throwaway_certificate(directory)
        # a certificate (its own CA) for another host: right CA, wrong name
        _, self.other_cert = throwaway_certificate(directory / "other", ip=None,
                                                   name="redis.elsewhere.test")
        self.redis = RedisServer(password=PASSWORD, tls=(self.cert, self.key))
        self.addCleanup(self.redis.stop)
        self.client = Client()
        self.addCleanup(self.client.pool.closeCachedConnections)

    def url(self, ca: Path) -> str:
        return f"rediss://:{PASSWORD}@127.0.0.1:{self.redis.port}/0?ca={ca}"

    async def replica(self, url: str, *args: str, config: str | None = None) -> TwistdProcess:
        backends = ("--config", config) if config else ("--backends", ",".join(self.fleet.keys))
        process = TwistdProcess("--admin", "tcp:0:interface=127.0.0.1",
                                "--health-interval", "0.5", "--shutdown-timeout", "2",
                                *backends, "--shared-state", url, *args)
        self.addCleanup(lambda: defer.ensureDeferred(process.stop()))
        await process.started()
        return process

    async def test_replicas_share_through_tls_and_a_wrong_name_is_refused(self) -> None:
        self.fleet = Fleet(self, 4, tokens_per_second=20)
        a = await self.replica(self.url(self.cert), "--policy", "least-conn")
        b = await self.replica(self.url(self.cert), "--policy", "least-conn")
        wrong = await self.replica(self.url(self.other_cert))
        for process in (a, b):
            await wait_until(lambda p=process: "shared state: connected" in p.output(),
                             timeout=10, what="the replica to reach Redis over TLS")
        # shared: A's two streams are counted by B, whose two go elsewhere
        landed = [(await self.open_stream(a))[0] for _ in range(2)]

        async def b_sees_two() -> bool:
            return sum((await self.in_flight(b)).values()) == 2

        await _until(b_sees_two, "B to count A's streams")
        landed += [(await self.open_stream(b))[0] for _ in range(2)]
        self.assertEqual(len(set(landed)), 4, landed)
        # the certificate names another host: refused, the local view, said once
        await wait_until(lambda: "uses its local view" in wrong.output(), timeout=10,
                         what="the wrong-name replica to give up on Redis")
        state = (await self.status(wrong))["shared_state"]
        self.assertFalse(state["connected"])
        self.assertTrue(state["last_error"])
        began = time.monotonic()
        for _ in range(10):
            self.assertEqual((await self.small_request(wrong))[0], 200)
        self.assertLess(time.monotonic() - began, 5)
        self.assertFalse((await self.status(wrong))["shared_state"]["connected"])
        self.assertEqual(wrong.output().count("uses its local view"), 1, wrong.output())
        for process in (a, b, wrong):
            shown = process.output() + json.dumps(await self.status(process))
            self.assertNotIn(PASSWORD, shown)
            self.assertIn(f"rediss://:***@127.0.0.1:{self.redis.port}/0", shown)

    async def test_a_freed_slot_wakes_the_other_replica_over_tls_with_a_private_ca(self) -> None:
        """
        The wake-up's subscription is a second connection: it must trust the URL's ``ca``
        as the first does (it used the system's CAs, so a private CA left it unsubscribed
        and every queued request waited for the next poll).
        """
        import os

        self.fleet = Fleet(self, 1, tokens_per_second=20)
        config = os.path.abspath(self.mktemp())
        with open(config, "w") as handle:
            handle.write(f'backends = [{{url = "http://{self.fleet.keys[0]}", '
                         "max_conns = 1}]\n")
        a = await self.replica(self.url(self.cert), config=config)
        b = await self.replica(self.url(self.cert), config=config)
        for process in (a, b):
            await wait_until(lambda p=process: "shared state: connected" in p.output(),
                             timeout=10, what="the replica to reach Redis over TLS")
        for _ in range(3):
            _, stream = await self.open_stream(a, tokens=8)
            waiting = defer.ensureDeferred(self.small_request(b))
            await stream.done
            self.assertEqual((await waiting)[0], 200)
        slots = (await self.status(b))["shared_state"]["slots"]
        self.assertGreaterEqual(slots["wakes_heard"], 3, slots)
