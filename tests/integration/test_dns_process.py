"""
Membership from DNS for real: a ``twisted.names`` authority serving a zone on a free
loopback port (UDP and TCP, started by the test, changed by it), real ``twistd vllm-sim``
engines on 127.0.0.2, 127.0.0.3 and 127.0.0.4 (one port, several loopback addresses, as a
headless service's pods), and a real ``twistd -n llmlb --backends dns:... --resolver``
whose backends follow the zone -- and stay bounded when the zone turns hostile.
"""

from __future__ import annotations

import json
import socket
import time
from collections import Counter
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.error import CannotListenError
from twisted.names import authority, dns, server
from twisted.trial.unittest import TestCase

from txlb._config import MAX_ADDRESSES_PER_NAME
from txlb._discovery.resolver import QUERIES_PER_SOCKET

from ..processes import Client, TwistdProcess, chat_body, header, wait_until
from ..redis import RedisServer
from .test_faults import SimProcess

ZONE = "fleet.test"
NAME = f"vllm.{ZONE}"
ENGINES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
#: requests per check that traffic reaches exactly the addresses DNS gives
REQUESTS = 12


class ZoneAuthority(authority.FileAuthority):
    """An authority for :data:`ZONE` held in memory: the test sets its records, and it
    counts the queries it answers (per name), so a test sees how often txlb asks."""

    def __init__(self) -> None:
        self.asked: Counter[str] = Counter()
        #: names whose every query the server fails (SERVFAIL), as a broken server does
        self.failing: set[str] = set()
        super().__init__(ZONE)

    def loadFile(self, filename: str) -> None:
        self.soa = (ZONE.encode(), dns.Record_SOA(
            mname=f"ns.{ZONE}", rname=f"admin.{ZONE}", serial=1, refresh=1, retry=1,
            expire=1, minimum=1, ttl=1))
        self.records = {ZONE.encode(): [self.soa[1]]}

    def set(self, name: str, *records: Any) -> None:
        self.records[name.lower().encode()] = list(records)
        self._cache = {}

    def _lookup(self, name: bytes, cls: int, type: int, timeout: Any = None) -> Any:
        self.asked[name.decode("ascii", "replace").lower()] += 1
        if name.decode("ascii", "replace").lower() in self.failing:
            return defer.fail(RuntimeError("broken"))  # not a DomainError: SERVFAIL
        return super()._lookup(name, cls, type, timeout)


def free_port_on(*hosts: str) -> int:
    """A TCP port free on every one of ``hosts`` (checked by binding; retried on a clash)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = probe.getsockname()[1]
        try:
            for host in hosts:
                with socket.socket() as other:
                    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    other.bind((host, port))
        except OSError:
            continue
        return port
    raise AssertionError("no port free on every engine address")


class DnsMembershipProcessTests(TestCase):
    timeout = 120

    async def setUp(self) -> None:  # type: ignore[override]
        self.zone, self.dns_port = self.zone_server()
        self.port = free_port_on(*ENGINES)
        self.engines = [SimProcess(0, "--port", f"tcp:{self.port}:interface={host}",
                                   "--ttft", "0", "--tokens-per-second", "1000")
                        for host in ENGINES]
        for engine in self.engines:
            self.addCleanup(engine.cleanup)
        await defer.gatherResults([defer.ensureDeferred(e.started()) for e in self.engines])
        self.client = Client()
        self.addCleanup(self.client.pool.closeCachedConnections)

    def zone_server(self) -> tuple[ZoneAuthority, int]:
        """A DNS server for :data:`ZONE` on a free loopback port (UDP and TCP)."""
        zone = ZoneAuthority()
        factory = server.DNSServerFactory(authorities=[zone])
        factory.noisy = False
        for _ in range(20):  # the UDP port's number may be taken on TCP: another one
            udp = reactor.listenUDP(0, dns.DNSDatagramProtocol(factory),
                                    interface="127.0.0.1")
            port = udp.getHost().port
            # answers too big for a datagram are truncated; txlb asks again on TCP
            try:
                tcp = reactor.listenTCP(port, factory, interface="127.0.0.1")
            except CannotListenError:
                udp.stopListening()
                continue
            self.addCleanup(udp.stopListening)
            self.addCleanup(tcp.stopListening)
            return zone, port
        raise AssertionError("no loopback port free on both UDP and TCP")

    def serve(self, *addresses: str, ttl: int = 0, name: str = NAME,
              zone: ZoneAuthority | None = None) -> None:
        (zone or self.zone).set(name, *[dns.Record_A(address, ttl) for address in addresses])

    async def start(self, *extra: str, names: str | None = None,
                    dns_port: int | None = None) -> TwistdProcess:
        lb = TwistdProcess("--backends", names or f"dns:{NAME}:{self.port}",
                           "--resolver", f"127.0.0.1:{dns_port or self.dns_port}",
                           "--admin", "tcp:0:interface=127.0.0.1",
                           "--health-interval", "1", *extra)
        self.addCleanup(lambda: defer.ensureDeferred(lb.stop()))
        await lb.started()
        return lb

    async def status(self, lb: TwistdProcess) -> dict[str, Any]:
        _, body = await self.client.fetch(lb.admin_url + "/status")
        return json.loads(body.body)

    async def healthy_backends(self, lb: TwistdProcess) -> list[str]:
        status = await self.status(lb)
        return sorted(b["backend"] for b in status["backends"]
                      if b["healthy"] and not b.get("removing") and not b["draining"])

    async def until_backends(self, lb: TwistdProcess, expected: list[str],
                             timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        while time.monotonic() < deadline:
            status = await self.status(lb)
            seen = sorted(b["backend"] for b in status["backends"])
            if seen == sorted(expected) and await self.healthy_backends(lb) == sorted(expected):
                return
            await _sleep(0.1)  # poll /status, bounded by the deadline
        raise AssertionError(f"backends {seen}, expected {sorted(expected)}\n{lb.output()}")

    async def served_by(self, lb: TwistdProcess) -> set[str]:
        seen = set()
        for _ in range(REQUESTS):
            response, chunks = await self.client.fetch(
                lb.url + "/v1/chat/completions", b"POST", chat_body(stream=False),
                {b"content-type": [b"application/json"]})
            self.assertEqual(response.code, 200, chunks.body)
            seen.add(header(response, b"x-backend") or "")
        return seen

    def keys(self, *hosts: str) -> list[str]:
        return [f"{host}:{self.port}" for host in hosts]

    async def test_the_backends_follow_the_zone(self) -> None:
        self.serve("127.0.0.2", "127.0.0.3")
        lb = await self.start()
        await self.until_backends(lb, self.keys("127.0.0.2", "127.0.0.3"))
        self.assertEqual(await self.served_by(lb), set(self.keys("127.0.0.2", "127.0.0.3")))

        # one pod leaves, another comes: the balancer follows within the (bounded) TTL
        self.serve("127.0.0.3", "127.0.0.4")
        await self.until_backends(lb, self.keys("127.0.0.3", "127.0.0.4"))
        self.assertEqual(await self.served_by(lb), set(self.keys("127.0.0.3", "127.0.0.4")))
        entry = (await self.status(lb))["dns"][0]
        self.assertEqual(entry["name"], f"dns:{NAME}:{self.port}")
        self.assertIsNone(entry["error"])
        self.assertEqual(entry["ttl_s"], 1.0)  # a zero TTL is asked again every second

        # the name disappears: the last good set stays, and serves
        self.zone.records.pop(NAME.encode())
        self.zone._cache = {}
        await wait_until(lambda: "does not resolve" in lb.output(), timeout=10,
                         what="the failure to be logged")
        self.assertEqual(await self.served_by(lb), set(self.keys("127.0.0.3", "127.0.0.4")))
        entry = (await self.status(lb))["dns"][0]
        self.assertEqual(entry["error"], "no such name (NXDOMAIN)")
        self.assertEqual(lb.output().count("does not resolve"), 1)

        # a zero TTL does not become a flood of queries: about one A + one AAAA a second
        before = self.zone.asked[NAME]
        started = time.monotonic()
        await _sleep(3)
        per_second = (self.zone.asked[NAME] - before) / (time.monotonic() - started)
        self.assertLess(per_second, 6, self.zone.asked)
        # ... and the service log says little of them: a socket (two lines) per 16
        # queries, each socket on its own source port
        output = lb.output()
        queries = sum(self.zone.asked.values())
        sockets = output.count("DNSDatagramProtocol starting on")
        self.assertGreaterEqual(sockets, 1, output)
        self.assertLessEqual(sockets, 1 + queries // QUERIES_PER_SOCKET, output)
        self.assertLessEqual(output.count("UDP Port"), sockets)

    async def test_a_hostile_zone_is_bounded(self) -> None:
        # thousands of addresses (a TCP-sized answer), odd addresses, a huge TTL
        many = [f"127.1.{i // 250}.{i % 250 + 1}" for i in range(3000)]
        self.serve("127.0.0.2", "0.0.0.0", "255.255.255.255", "224.0.0.1", ttl=2**31 - 1)
        self.serve(*many, name=f"many.{ZONE}", ttl=0)
        lb = await self.start(names=f"dns:{NAME}:{self.port},dns:many.{ZONE}:{self.port}")
        await wait_until(lambda: "more cut at" in lb.output(), timeout=20,
                         what="the big answer to be cut")
        status = await self.status(lb)
        entries = {entry["name"]: entry for entry in status["dns"]}
        odd = entries[f"dns:{NAME}:{self.port}"]
        self.assertEqual((odd["addresses"], odd["skipped"], odd["ttl_s"]),
                         (self.keys("127.0.0.2"), 3, 300.0))
        big = entries[f"dns:many.{ZONE}:{self.port}"]
        self.assertEqual(len(big["addresses"]), MAX_ADDRESSES_PER_NAME)
        # (how many of the 3,000 arrive depends on what one DNS message carries)
        self.assertGreater(big["cut"], 0)
        self.assertEqual(status["total"], 1 + MAX_ADDRESSES_PER_NAME)
        # the dead addresses are refused and marked down by their first probe; the engine
        # still serves
        deadline = time.monotonic() + 20
        while (await self.status(lb))["healthy"] != 1:
            self.assertLess(time.monotonic(), deadline, "the dead addresses stay up")
            await _sleep(0.1)
        self.assertEqual(await self.served_by(lb), set(self.keys("127.0.0.2")))

    async def test_srv_priorities_fail_over_to_the_next_tier(self) -> None:
        service = f"_http._tcp.{ZONE}"
        self.zone.set(service,
                      dns.Record_SRV(10, 5, self.port, f"a.{ZONE}", ttl=1),
                      dns.Record_SRV(20, 1, self.port, f"c.{ZONE}", ttl=1))
        self.serve("127.0.0.2", name=f"a.{ZONE}")
        self.serve("127.0.0.4", name=f"c.{ZONE}")
        lb = await self.start(names=f"srv:{service}")
        await self.until_backends(lb, self.keys("127.0.0.2"))
        status = await self.status(lb)
        self.assertEqual(status["backends"][0]["weight"], 5)
        self.assertEqual(status["dns"][0]["tiers"], [10, 20])
        self.assertEqual(await self.served_by(lb), set(self.keys("127.0.0.2")))

        self.engines[0].kill()  # the whole first tier is gone: the second takes over
        deadline = time.monotonic() + 15
        while await self.healthy_backends(lb) != self.keys("127.0.0.4"):
            self.assertLess(time.monotonic(), deadline, lb.output())
            await _sleep(0.1)
        self.assertEqual(await self.served_by(lb), set(self.keys("127.0.0.4")))

    async def test_with_shared_state_one_replica_s_blip_removes_nothing(self) -> None:
        # two replicas sharing Redis, each asking its own DNS server for the same name
        redis = RedisServer()
        self.addCleanup(redis.stop)
        other, other_port = self.zone_server()
        self.serve("127.0.0.2", "127.0.0.3")
        self.serve("127.0.0.2", "127.0.0.3", zone=other)
        shared = ("--shared-state", redis.url)
        a = await self.start(*shared)
        b = await self.start(*shared, dns_port=other_port)
        both = self.keys("127.0.0.2", "127.0.0.3")
        await self.until_backends(a, both)
        await self.until_backends(b, both)
        await wait_until(lambda: "shared state: connected" in b.output(), timeout=10)

        # A's answer lacks .3 for a moment: A lets it go; B's own DNS still yields it
        self.serve("127.0.0.2")
        await wait_until(lambda: "was removed on another replica" in b.output(), timeout=10,
                         what=f"B to keep .3\n{b.output()}")
        self.serve("127.0.0.2", "127.0.0.3")
        self.assertEqual(await self.healthy_backends(b), both)
        self.assertEqual((await self.status(b))["dns"][0]["in_pool"], both)
        await self.until_backends(a, both)  # back on A too
        self.assertNotIn("by an operator", b.output())

        # gone from every replica's answer: gone from every replica
        self.serve("127.0.0.2")
        self.serve("127.0.0.2", zone=other)
        await self.until_backends(a, self.keys("127.0.0.2"))
        await self.until_backends(b, self.keys("127.0.0.2"))

    async def test_one_srv_target_failing_keeps_its_backends(self) -> None:
        service = f"_http._tcp.{ZONE}"
        self.zone.set(service, dns.Record_SRV(0, 1, self.port, f"a.{ZONE}", ttl=0),
                      dns.Record_SRV(0, 1, self.port, f"b.{ZONE}", ttl=0))
        self.serve("127.0.0.2", name=f"a.{ZONE}")
        self.serve("127.0.0.3", name=f"b.{ZONE}")
        lb = await self.start(names=f"srv:{service}")
        both = self.keys("127.0.0.2", "127.0.0.3")
        await self.until_backends(lb, both)
        self.zone.failing.add(f"b.{ZONE}")  # the server fails b's lookups; a's answer
        self.zone._cache = {}
        asked = self.zone.asked[f"b.{ZONE}"]
        # two resolutions at least (A + AAAA each) with b failing
        await wait_until(lambda: self.zone.asked[f"b.{ZONE}"] >= asked + 4, timeout=10,
                         what="two resolutions")
        await _sleep(0.2)  # (the last answer reaches txlb)
        self.assertEqual(await self.healthy_backends(lb), both)  # nothing drained
        self.assertEqual(await self.served_by(lb), set(both))
        self.assertIn("part of the answer failed", lb.output())
        self.flushLoggedErrors(RuntimeError)  # the DNS server logs each failure it sends

    async def test_under_workers_only_the_supervisor_resolves(self) -> None:
        self.serve("127.0.0.2")
        lb = await self.start("--workers", "2")
        await self.until_backends(lb, self.keys("127.0.0.2"))
        before = self.zone.asked[NAME]
        started = time.monotonic()
        self.serve("127.0.0.2", "127.0.0.3")
        await self.until_backends(lb, self.keys("127.0.0.2", "127.0.0.3"))
        # the workers serve the new member too (they mirror the supervisor's pool)
        self.assertEqual(await self.served_by(lb), set(self.keys("127.0.0.2", "127.0.0.3")))
        await _sleep(2)
        per_second = (self.zone.asked[NAME] - before) / (time.monotonic() - started)
        # one resolver: ~2 queries a second (A + AAAA); three processes would ask ~6
        self.assertLess(per_second, 4, self.zone.asked)


async def _sleep(seconds: float) -> None:
    from twisted.internet import task

    await task.deferLater(reactor, seconds)

