"""
Membership from DNS, in memory: ``dns:``/``srv:`` entries parsed, answers turned into
members, and the pool following a fake resolver on a Clock -- joins, leaves, TTLs and
their bounds, failures that keep the last set, SRV weights and priority tiers, the other
writers (the file, the admin API, a reload), and hostile answers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from treq.testing import StubTreq
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.logger import formatEvent, globalLogPublisher
from twisted.names import dns
from twisted.names.error import DNSNameError, DNSServerError
from twisted.trial.unittest import SynchronousTestCase

from txlb import LoadBalancer
from txlb._config import (
    MAX_ADDRESSES_PER_NAME,
    BackendSpec,
    ConfigError,
    DnsBackendSpec,
    build_config,
)
from txlb._discovery.answers import (
    MAX_RETRY,
    MAX_TTL,
    MIN_TTL,
    Member,
    bounded_ttl,
    in_rotation,
    retry_delay,
    usable_address,
)
from txlb._reload import RESTART_ONLY, ConfigSource

from ..helpers import FakeUpstream

NONE: dict[str, str] = {}


def a(name: str, address: str, ttl: int = 30) -> dns.RRHeader:
    return dns.RRHeader(name, dns.A, dns.IN, ttl, dns.Record_A(address, ttl))


def aaaa(name: str, address: str, ttl: int = 30) -> dns.RRHeader:
    return dns.RRHeader(name, dns.AAAA, dns.IN, ttl, dns.Record_AAAA(address, ttl))


def srv(name: str, target: str, port: int, priority: int = 0, weight: int = 1,
        ttl: int = 30) -> dns.RRHeader:
    return dns.RRHeader(name, dns.SRV, dns.IN, ttl,
                        dns.Record_SRV(priority, weight, port, target, ttl))


class FakeResolver:
    """
    The three ``IResolver`` lookups txlb makes, answered from ``zone`` (type, name) ->
    records, or failing with ``errors[(type, name)]``; ``hold`` keeps lookups unanswered.
    """

    def __init__(self) -> None:
        self.zone: dict[tuple[str, str], list[dns.RRHeader]] = {}
        self.errors: dict[tuple[str, str], Exception] = {}
        self.asked: list[tuple[str, str]] = []
        self.hold = False
        self.held: list[Deferred[Any]] = []

    def _answer(self, kind: str, name: str) -> Deferred[Any]:
        self.asked.append((kind, name))
        if self.hold:
            waiting: Deferred[Any] = Deferred()
            self.held.append(waiting)
            return waiting
        if (kind, name) in self.errors:
            return fail(self.errors[(kind, name)])
        if (kind, name) not in self.zone:
            return fail(DNSNameError(name))
        return succeed((self.zone[(kind, name)], [], []))

    def lookupAddress(self, name: str, timeout: object = None) -> Deferred[Any]:
        return self._answer("A", name)

    def lookupIPV6Address(self, name: str, timeout: object = None) -> Deferred[Any]:
        return self._answer("AAAA", name)

    def lookupService(self, name: str, timeout: object = None) -> Deferred[Any]:
        return self._answer("SRV", name)

    def serve(self, name: str, *addresses: str, ttl: int = 30) -> None:
        self.zone[("A", name)] = [a(name, address, ttl) for address in addresses]
        self.zone.setdefault(("AAAA", name), [])


class ParsingTests(SynchronousTestCase):
    """``--backends`` takes names beside addresses; ``--resolver`` takes DNS servers."""

    def test_dns_and_srv_entries_mix_with_addresses(self) -> None:
        config = build_config({"backends": "dns:vllm.default.svc.cluster.local:8000,"
                                           "10.0.0.1:8002,srv:_http._tcp.gpu.example"}, NONE)
        self.assertEqual(config.backends, (BackendSpec("10.0.0.1", 8002),))
        self.assertEqual(config.dns_backends, (
            DnsBackendSpec("dns", "vllm.default.svc.cluster.local", 8000),
            DnsBackendSpec("srv", "_http._tcp.gpu.example")))

    def test_only_names_is_a_valid_fleet(self) -> None:
        config = build_config({"backends": "dns:vllm.example:8000"}, NONE)
        self.assertEqual(config.backends, ())
        self.assertEqual(len(config.dns_backends), 1)

    def test_a_table_applies_to_every_address_of_its_name(self) -> None:
        path = Path(self.mktemp())
        path.write_text('[[backends]]\nurl = "dns:vllm.example:8000"\nmax_conns = 4\n'
                        'weight = 2\nmodels = ["llama"]\n')
        config = build_config({"config": str(path)}, NONE)
        self.assertEqual(config.dns_backends, (
            DnsBackendSpec("dns", "vllm.example", 8000, 2, 4, ("llama",)),))
        self.assertEqual(config.dns_backends[0].backend("10.0.0.7", 8000),
                         BackendSpec("10.0.0.7", 8000, 2, 4, ("llama",)))

    def test_bad_entries_are_refused_in_one_line_naming_them(self) -> None:
        for bad in ("dns:vllm.example", "dns:vllm.example:0", "dns:vllm.example:70000",
                    "dns:10.0.0.1:8000", "dns:bad_name:8000", "dns::8000",
                    "srv:vllm.example", "srv:_http._tcp.", "srv:_http._sctp.x.example",
                    "dns:" + "a" * 300 + ":80"):
            with self.assertRaises(ConfigError, msg=bad) as raised:
                build_config({"backends": bad}, NONE)
            message = str(raised.exception)
            self.assertTrue(message.startswith("--backends: "), message)
            self.assertNotIn("\n", message)
            self.assertLess(len(message), 200, message)

    def test_an_srv_table_takes_weights_from_its_records(self) -> None:
        path = Path(self.mktemp())
        path.write_text('[[backends]]\nurl = "srv:_http._tcp.x.example"\nweight = 3\n')
        with self.assertRaises(ConfigError) as raised:
            build_config({"config": str(path)}, NONE)
        self.assertIn("SRV record", str(raised.exception))

    def test_an_unknown_key_in_a_dns_table_is_refused(self) -> None:
        path = Path(self.mktemp())
        path.write_text('[[backends]]\nurl = "dns:x.example:80"\nmax_con = 3\n')
        with self.assertRaises(ConfigError) as raised:
            build_config({"config": str(path)}, NONE)
        self.assertIn("max_conns", str(raised.exception))

    def test_a_name_listed_twice_is_refused(self) -> None:
        with self.assertRaises(ConfigError) as raised:
            build_config({"backends": "dns:x.example:80,DNS:X.example.:80"}, NONE)
        self.assertIn("listed twice", str(raised.exception))

    def test_resolver_servers(self) -> None:
        config = build_config({"backends": "dns:x.example:80",
                               "resolver": "127.0.0.1:5353, 10.0.0.53,[::1]:53"}, NONE)
        self.assertEqual(config.resolver,
                         (("127.0.0.1", 5353), ("10.0.0.53", 53), ("::1", 53)))
        self.assertEqual(build_config({}, {"LB_RESOLVER": "127.0.0.9"}).resolver,
                         (("127.0.0.9", 53),))
        for bad in ("dns.example", "127.0.0.1:0", "127.0.0.1:99999", "::1", "1.2.3"):
            with self.assertRaises(ConfigError, msg=bad) as raised:
                build_config({"resolver": bad}, NONE)
            self.assertTrue(str(raised.exception).startswith("--resolver: "))

    def test_the_resolver_needs_a_restart(self) -> None:
        self.assertIn("resolver", RESTART_ONLY)

    def test_the_admin_api_cannot_add_a_name(self) -> None:
        from txlb._config.table import backend_entry as _backend_item

        with self.assertRaises(ConfigError):
            _backend_item("backend", {"url": "dns:x.example:80"})


class AnswerTests(SynchronousTestCase):
    """What an answer is worth: usable addresses, TTL bounds, tiers."""

    def test_odd_addresses_are_no_backends(self) -> None:
        for odd in ("0.0.0.0", "255.255.255.255", "224.0.0.1", "240.0.0.1", "::",
                    "ff02::1", "fe80::1", "169.254.1.1", "not-an-ip"):
            self.assertIsNone(usable_address(odd), odd)
        for fine in ("127.0.0.2", "10.1.2.3", "192.0.2.7", "2001:db8::1", "::1"):
            self.assertIsNotNone(usable_address(fine), fine)
        self.assertEqual(usable_address("2001:db8:0::1"), "2001:db8::1")

    def test_ttl_bounds(self) -> None:
        self.assertEqual(bounded_ttl(0), MIN_TTL)
        self.assertEqual(bounded_ttl(7), 7)
        self.assertEqual(bounded_ttl(2**31), MAX_TTL)
        self.assertEqual((MIN_TTL, MAX_TTL), (1.0, 300.0))

    def test_retries_back_off_to_a_bound(self) -> None:
        self.assertEqual([retry_delay(n) for n in range(1, 8)],
                         [1, 2, 4, 8, 16, MAX_RETRY, MAX_RETRY])
        self.assertEqual(retry_delay(10**6), MAX_RETRY)

    def test_a_lower_tier_takes_over_only_when_every_higher_one_is_out(self) -> None:
        members = [Member(10, "10.0.0.1", 80), Member(10, "10.0.0.2", 80),
                   Member(20, "10.0.0.3", 80), Member(30, "10.0.0.4", 80)]
        up = {"10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80", "10.0.0.4:80"}
        keys = lambda chosen: [m.key for m in chosen]  # noqa: E731
        self.assertEqual(keys(in_rotation(members, up.__contains__)),
                         ["10.0.0.1:80", "10.0.0.2:80"])
        up -= {"10.0.0.1:80"}
        self.assertEqual(len(in_rotation(members, up.__contains__)), 2)
        up -= {"10.0.0.2:80"}
        self.assertEqual(keys(in_rotation(members, up.__contains__))[-1], "10.0.0.3:80")
        up -= {"10.0.0.3:80"}
        self.assertEqual(len(in_rotation(members, up.__contains__)), 4)


class MembershipTestCase(SynchronousTestCase):
    """A balancer on a Clock whose ``dns:`` names a :class:`FakeResolver` answers."""

    backends = "dns:vllm.example:8000"
    extra: dict[str, object] = {}

    def setUp(self) -> None:
        self.clock = Clock()
        self.resolver = FakeResolver()
        self.probes = FakeUpstream()
        self.events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)
        self.zone()

    def zone(self) -> None:
        self.resolver.serve("vllm.example", "10.0.0.1", "10.0.0.2")

    def start(self, **options: object) -> LoadBalancer:
        self.lb = LoadBalancer([b.strip() for b in self.backends.split(",")],
                               reactor=self.clock, agent=FakeUpstream(),
                               probe_agent=self.probes, resolver=self.resolver,
                               log_file="none", health_interval=1000,
                               **{**self.extra, **options})
        self.service = self.lb.service()
        self.service.startService()
        self.addCleanup(self.service.stopService)
        return self.lb

    def keys(self) -> list[str]:
        return sorted(b.key for b in self.lb.pool)

    def live(self) -> list[str]:
        return sorted(b.key for b in self.lb.pool if not b.health.removing)

    def lines(self, level: str | None = None) -> list[str]:
        return [formatEvent(e) for e in self.events
                if level is None or e.get("log_level") is not None
                and e["log_level"].name == level]

    def status(self) -> dict[str, Any]:
        admin = self.lb.admin_resource()
        response = self.successResultOf(StubTreq(admin).get("http://127.0.0.1:8001/status"))
        return json.loads(self.successResultOf(response.content()))


class JoinAndLeaveTests(MembershipTestCase):
    """The pool follows the answer: new addresses join, vanished ones drain and leave."""

    def test_the_addresses_join_at_start_and_are_probed_at_once(self) -> None:
        self.start()
        self.assertEqual(self.keys(), ["10.0.0.1:8000", "10.0.0.2:8000"])
        probed = sorted(call.uri.split(b"/")[2].decode() for call in self.probes.calls)
        self.assertEqual(probed, ["10.0.0.1:8000", "10.0.0.2:8000"])

    def test_a_new_address_joins_on_the_next_resolution_with_slow_start(self) -> None:
        self.start(slow_start=30)
        self.resolver.serve("vllm.example", "10.0.0.1", "10.0.0.2", "10.0.0.3")
        self.clock.advance(29)
        self.assertNotIn("10.0.0.3:8000", self.keys())
        self.clock.advance(1)  # the TTL: 30 s
        self.assertIn("10.0.0.3:8000", self.keys())
        joined = self.lb.pool.get("10.0.0.3:8000")
        assert joined is not None
        self.assertLess(joined.slow_start.ramp, 0.1)
        self.assertIn("10.0.0.3:8000", [c.uri.split(b"/")[2].decode()
                                        for c in self.probes.calls])

    def test_a_vanished_address_drains_and_leaves_once_idle(self) -> None:
        lb = self.start()
        leaving = lb.pool.get("10.0.0.2:8000")
        assert leaving is not None
        lease = lb.pool.slots.acquire(leaving)
        self.resolver.serve("vllm.example", "10.0.0.1")
        self.clock.advance(30)
        self.assertTrue(leaving.health.removing)
        self.assertIn("10.0.0.2:8000", self.keys())  # a request still runs there
        lease.release()
        self.assertEqual(self.keys(), ["10.0.0.1:8000"])

    def test_an_address_back_while_draining_stays(self) -> None:
        lb = self.start()
        backend = lb.pool.get("10.0.0.2:8000")
        assert backend is not None
        lease = lb.pool.slots.acquire(backend)
        self.resolver.serve("vllm.example", "10.0.0.1")
        self.clock.advance(30)
        self.assertTrue(backend.health.removing)
        self.resolver.serve("vllm.example", "10.0.0.1", "10.0.0.2")
        self.clock.advance(30)
        self.assertFalse(backend.health.removing)
        lease.release()
        self.assertEqual(self.live(), ["10.0.0.1:8000", "10.0.0.2:8000"])

    def test_a_and_aaaa_together(self) -> None:
        self.resolver.zone[("AAAA", "vllm.example")] = [aaaa("vllm.example", "2001:db8::5")]
        self.start()
        self.assertEqual(self.keys(), ["10.0.0.1:8000", "10.0.0.2:8000",
                                       "[2001:db8::5]:8000"])

    def test_a_table_s_max_conns_and_models_reach_every_address(self) -> None:
        lb = LoadBalancer(config=build_config(
            {"backends": [{"url": "dns:vllm.example:8000", "max_conns": 3,
                           "models": ["m"]}], "log-file": "none"}, NONE),
            reactor=self.clock, agent=FakeUpstream(), probe_agent=self.probes,
            resolver=self.resolver)
        service = lb.service()
        service.startService()
        self.addCleanup(service.stopService)
        self.assertEqual({b.spec for b in lb.pool},
                         {BackendSpec("10.0.0.1", 8000, 1, 3, ("m",)),
                          BackendSpec("10.0.0.2", 8000, 1, 3, ("m",))})


class TtlTests(MembershipTestCase):
    """Re-resolution follows the TTL, bounded to 1 s .. 300 s."""

    def asked_at(self, ttl: int, advance: float) -> int:
        self.resolver.serve("vllm.example", "10.0.0.1", ttl=ttl)
        self.start()
        before = len(self.resolver.asked)
        self.clock.advance(advance)
        return len(self.resolver.asked) - before

    def test_the_ttl_decides_the_next_resolution(self) -> None:
        self.assertEqual(self.asked_at(ttl=7, advance=6.9), 0)
        self.clock.advance(0.1)
        self.assertEqual(len(self.resolver.asked), 4)  # A and AAAA, twice

    def test_a_zero_ttl_is_one_second(self) -> None:
        self.assertEqual(self.asked_at(ttl=0, advance=0.9), 0)
        for _ in range(10):
            self.clock.advance(1)
        self.assertEqual(len(self.resolver.asked), 2 + 2 * 10)

    def test_a_huge_ttl_is_five_minutes(self) -> None:
        self.assertEqual(self.asked_at(ttl=2**31 - 1, advance=299), 0)
        self.clock.advance(1)
        self.assertEqual(len(self.resolver.asked), 4)

    def test_status_shows_each_name(self) -> None:
        self.start()
        entry = self.status()["dns"][0]
        self.assertEqual(entry["name"], "dns:vllm.example:8000")
        self.assertEqual(entry["addresses"], ["10.0.0.1:8000", "10.0.0.2:8000"])
        self.assertEqual(entry["in_pool"], ["10.0.0.1:8000", "10.0.0.2:8000"])
        self.assertEqual((entry["error"], entry["ttl_s"], entry["next_at"]),
                         (None, 30.0, 30.0))


class FailureTests(MembershipTestCase):
    """A failed or empty resolution keeps the last good set, and says so once."""

    def test_a_failure_keeps_the_last_set_and_is_logged_once_per_streak(self) -> None:
        self.start()
        self.resolver.errors[("A", "vllm.example")] = DNSServerError("vllm.example")
        self.resolver.errors[("AAAA", "vllm.example")] = DNSServerError("vllm.example")
        self.clock.advance(30)
        for _ in range(20):
            self.clock.advance(MAX_RETRY)
        self.assertEqual(self.live(), ["10.0.0.1:8000", "10.0.0.2:8000"])
        warned = [line for line in self.lines("warn") if "vllm.example" in line]
        self.assertEqual(len(warned), 1, warned)
        self.assertIn("keeping its last 2 addresses", warned[0])
        entry = self.status()["dns"][0]
        self.assertEqual(entry["error"], "the DNS server failed (SERVFAIL)")
        self.assertGreater(entry["failures"], 10)
        self.assertEqual(entry["addresses"], ["10.0.0.1:8000", "10.0.0.2:8000"])
        # back: one line, and the new answer applies
        del self.resolver.errors[("A", "vllm.example")]
        del self.resolver.errors[("AAAA", "vllm.example")]
        self.resolver.serve("vllm.example", "10.0.0.1")
        self.clock.advance(MAX_RETRY)
        self.assertEqual(self.live(), ["10.0.0.1:8000"])
        self.assertEqual(len([line for line in self.lines() if "resolves again" in line]), 1)
        self.assertIsNone(self.status()["dns"][0]["error"])

    def test_an_empty_answer_keeps_the_last_set(self) -> None:
        self.start()
        self.resolver.serve("vllm.example")
        self.clock.advance(30)
        self.assertEqual(self.live(), ["10.0.0.1:8000", "10.0.0.2:8000"])
        self.assertEqual(self.status()["dns"][0]["error"],
                         "NoAddresses: the answer holds no usable address")

    def test_an_answer_of_odd_addresses_only_keeps_the_last_set(self) -> None:
        self.start()
        self.resolver.serve("vllm.example", "0.0.0.0", "224.0.0.1")
        self.clock.advance(30)
        self.assertEqual(self.live(), ["10.0.0.1:8000", "10.0.0.2:8000"])

    def test_a_failed_a_query_beside_an_aaaa_answer_keeps_the_last_set(self) -> None:
        self.resolver.zone[("AAAA", "vllm.example")] = [aaaa("vllm.example", "fd00::1")]
        self.start()
        every = ["10.0.0.1:8000", "10.0.0.2:8000", "[fd00::1]:8000"]
        self.assertEqual(self.live(), every)
        self.resolver.errors[("A", "vllm.example")] = DNSServerError("vllm.example")
        self.resolver.zone[("AAAA", "vllm.example")] = [aaaa("vllm.example", "fd00::2")]
        self.clock.advance(30)
        for _ in range(5):
            self.clock.advance(MAX_RETRY)
        self.assertEqual(self.live(), every)  # neither half replaces the set alone
        entry = self.status()["dns"][0]
        self.assertEqual(entry["error"],
                         "part of the answer failed: the DNS server failed (SERVFAIL)")
        self.assertEqual(len([line for line in self.lines("warn")
                              if "keeping its last 3 addresses" in line]), 1)
        del self.resolver.errors[("A", "vllm.example")]
        self.clock.advance(MAX_RETRY)
        self.assertEqual(self.live(), ["10.0.0.1:8000", "10.0.0.2:8000", "[fd00::2]:8000"])
        self.assertIsNone(self.status()["dns"][0]["error"])

    def test_no_such_name_for_one_family_is_an_empty_half_not_a_failure(self) -> None:
        self.start()
        del self.resolver.zone[("AAAA", "vllm.example")]  # NXDOMAIN for AAAA
        self.resolver.serve("vllm.example", "10.0.0.1")
        del self.resolver.zone[("AAAA", "vllm.example")]
        self.clock.advance(30)
        self.assertEqual(self.live(), ["10.0.0.1:8000"])
        self.assertIsNone(self.status()["dns"][0]["error"])

    def test_a_first_answer_with_a_part_missing_starts_the_name(self) -> None:
        self.resolver.errors[("AAAA", "vllm.example")] = DNSServerError("vllm.example")
        self.start()
        self.assertEqual(self.live(), ["10.0.0.1:8000", "10.0.0.2:8000"])
        self.assertIn("part of the answer failed", self.status()["dns"][0]["error"])
        self.assertEqual(self.status()["dns"][0]["next_at"], 1.0)  # asked again soon
        del self.resolver.errors[("AAAA", "vllm.example")]
        self.resolver.zone[("AAAA", "vllm.example")] = [aaaa("vllm.example", "fd00::1")]
        self.clock.advance(1)
        self.assertEqual(self.live(), ["10.0.0.1:8000", "10.0.0.2:8000", "[fd00::1]:8000"])

    def test_both_halves_failing_with_no_good_set_yet_is_a_failure(self) -> None:
        self.resolver.errors[("A", "vllm.example")] = DNSServerError("vllm.example")
        del self.resolver.zone[("AAAA", "vllm.example")]
        self.start()
        self.assertEqual(self.keys(), [])
        self.assertEqual(self.status()["dns"][0]["error"],
                         "the DNS server failed (SERVFAIL)")

    def test_a_name_that_never_resolved_starts_empty_and_keeps_trying(self) -> None:
        self.resolver.zone.clear()
        self.start()
        self.assertEqual(self.keys(), [])
        warned = self.lines("warn")
        self.assertEqual(len(warned), 1)
        self.assertIn("no backends from it yet", warned[0])
        self.resolver.serve("vllm.example", "10.0.0.9")
        self.clock.advance(1)
        self.assertEqual(self.keys(), ["10.0.0.9:8000"])

    def test_a_lookup_that_never_ends_is_given_up(self) -> None:
        self.resolver.hold = True
        self.start()
        self.clock.advance(10)
        self.assertEqual(self.status()["dns"][0]["error"], "no answer (timed out)")
        self.resolver.hold = False
        self.clock.advance(1)
        self.assertEqual(self.keys(), ["10.0.0.1:8000", "10.0.0.2:8000"])

    def test_stopping_leaves_nothing_scheduled(self) -> None:
        self.start()
        self.lb.dns.stopService()
        self.assertEqual([c for c in self.clock.getDelayedCalls()
                          if "resolve" in repr(c.func)], [])


class HostileAnswerTests(MembershipTestCase):
    """Thousands of records are cut to the cap; odd ones are skipped and counted."""

    def test_thousands_of_addresses_are_cut_to_the_cap(self) -> None:
        self.resolver.serve("vllm.example",
                            *[f"10.{i // 256}.{i % 256}.1" for i in range(5000)])
        self.start()
        self.assertEqual(len(self.lb.pool), MAX_ADDRESSES_PER_NAME)
        entry = self.status()["dns"][0]
        self.assertEqual(entry["cut"], 5000 - MAX_ADDRESSES_PER_NAME)
        self.assertTrue(any("more cut at" in line for line in self.lines()))
        # the same answer in another order is the same members: no churn
        before = self.keys()
        self.resolver.zone[("A", "vllm.example")].reverse()
        self.clock.advance(30)
        self.assertEqual(self.keys(), before)

    def test_odd_addresses_are_skipped_and_counted(self) -> None:
        self.resolver.serve("vllm.example", "10.0.0.1", "0.0.0.0", "255.255.255.255",
                            "239.1.1.1")
        self.start()
        self.assertEqual(self.keys(), ["10.0.0.1:8000"])
        self.assertEqual(self.status()["dns"][0]["skipped"], 3)

    def test_records_of_other_types_are_ignored(self) -> None:
        name = "vllm.example"
        cname = dns.RRHeader(name, dns.CNAME, dns.IN, 30, dns.Record_CNAME(b"x.example"))
        self.resolver.zone[("A", name)] = [cname, a("x.example", "10.0.0.4")]
        self.start()
        self.assertEqual(self.keys(), ["10.0.0.4:8000"])


class SrvTests(MembershipTestCase):
    """SRV: each target on its port, its weight the backend's, priorities as tiers."""

    backends = "srv:_http._tcp.gpu.example"

    def zone(self) -> None:
        name = "_http._tcp.gpu.example"
        self.resolver.zone[("SRV", name)] = [
            srv(name, "a.gpu.example", 8001, priority=10, weight=5),
            srv(name, "b.gpu.example", 8002, priority=10, weight=0),
            srv(name, "c.gpu.example", 8003, priority=20, weight=1),
        ]
        self.resolver.serve("a.gpu.example", "10.0.1.1")
        self.resolver.serve("b.gpu.example", "10.0.1.2")
        self.resolver.serve("c.gpu.example", "10.0.1.3")

    def test_targets_ports_and_weights(self) -> None:
        self.start()
        self.assertEqual({b.key: b.spec.weight for b in self.lb.pool},
                         {"10.0.1.1:8001": 5, "10.0.1.2:8002": 1})

    def test_the_next_tier_joins_when_the_first_is_down_and_leaves_when_it_is_back(
            self) -> None:
        lb = self.start()
        for key in ("10.0.1.1:8001", "10.0.1.2:8002"):
            backend = lb.pool.get(key)
            assert backend is not None
            lb.pool.mark_down(backend, "test")
        self.clock.advance(1)
        self.assertIn("10.0.1.3:8003", self.live())
        first = lb.pool.get("10.0.1.1:8001")
        assert first is not None
        lb.pool.mark_up(first)
        self.clock.advance(1)
        self.assertNotIn("10.0.1.3:8003", self.live())

    def test_the_additional_section_spares_a_lookup(self) -> None:
        name = "_http._tcp.gpu.example"
        answers = self.resolver.zone[("SRV", name)]
        self.resolver.zone[("SRV", name)] = answers[:1]
        original = self.resolver.lookupService

        def with_additional(query: str, timeout: object = None) -> Deferred[Any]:
            self.resolver.asked.append(("SRV", query))
            return succeed((answers[:1], [], [a("a.gpu.example", "10.0.9.9")]))

        self.resolver.lookupService = with_additional  # type: ignore[method-assign]
        self.addCleanup(setattr, self.resolver, "lookupService", original)
        self.start()
        self.assertEqual(self.keys(), ["10.0.9.9:8001"])
        self.assertNotIn(("A", "a.gpu.example"), self.resolver.asked)

    def test_a_dead_target_record_is_skipped(self) -> None:
        name = "_http._tcp.gpu.example"
        self.resolver.zone[("SRV", name)] = [
            srv(name, "", 8001), srv(name, "a.gpu.example", 0),
            srv(name, "a.gpu.example", 8001)]
        self.start()
        self.assertEqual(self.keys(), ["10.0.1.1:8001"])
        self.assertEqual(self.status()["dns"][0]["skipped"], 2)


class SrvFailureTests(MembershipTestCase):
    """An SRV answer is whole only when every target was asked: one failing keeps the set."""

    backends = "srv:_http._tcp.gpu.example"

    def zone(self) -> None:
        name = "_http._tcp.gpu.example"
        self.resolver.zone[("SRV", name)] = [srv(name, "e1.example", 8000),
                                             srv(name, "e2.example", 8001)]
        self.resolver.serve("e1.example", "10.0.1.1")
        self.resolver.serve("e2.example", "10.0.1.2")

    def test_one_target_failing_to_resolve_keeps_the_last_set(self) -> None:
        self.start()
        every = self.live()
        self.assertEqual(every, ["10.0.1.1:8000", "10.0.1.2:8001"])
        for kind in ("A", "AAAA"):
            self.resolver.errors[(kind, "e2.example")] = DNSServerError("e2.example")
        self.resolver.serve("e1.example", "10.0.1.1", "10.0.1.9")
        self.clock.advance(30)
        self.assertEqual(self.live(), every)
        self.assertIn("part of the answer failed", self.status()["dns"][0]["error"])
        for kind in ("A", "AAAA"):
            del self.resolver.errors[(kind, "e2.example")]
        self.clock.advance(MAX_RETRY)
        self.assertEqual(self.live(), ["10.0.1.1:8000", "10.0.1.2:8001", "10.0.1.9:8000"])

    def test_a_target_with_no_such_name_has_no_addresses(self) -> None:
        self.start()
        del self.resolver.zone[("A", "e2.example")]
        del self.resolver.zone[("AAAA", "e2.example")]
        self.clock.advance(30)
        self.assertEqual(self.live(), ["10.0.1.1:8000"])


class WritersTests(MembershipTestCase):
    """Who wins: the file's addresses are the file's; an operator's drain and removal hold."""

    backends = "dns:vllm.example:8000,10.0.0.2:8000"

    def test_an_address_the_file_lists_stays_the_file_s(self) -> None:
        lb = self.start()
        self.assertEqual(self.keys(), ["10.0.0.1:8000", "10.0.0.2:8000"])
        self.resolver.serve("vllm.example", "10.0.0.1")
        self.clock.advance(30)
        self.assertEqual(self.live(), ["10.0.0.1:8000", "10.0.0.2:8000"])
        self.assertFalse(lb.dns.owns("10.0.0.2:8000"))
        self.assertTrue(lb.dns.owns("10.0.0.1:8000"))

    def test_an_operator_s_drain_holds_across_resolutions(self) -> None:
        lb = self.start()
        backend = lb.pool.get("10.0.0.1:8000")
        assert backend is not None
        lb.pool.drain(backend)
        self.clock.advance(300)
        self.assertTrue(backend.health.draining)

    def test_an_operator_s_removal_holds_until_the_address_leaves_dns(self) -> None:
        lb = self.start()
        backend = lb.pool.get("10.0.0.1:8000")
        assert backend is not None
        lb.pool.remove(backend)
        self.clock.advance(30)
        self.clock.advance(30)
        self.assertNotIn("10.0.0.1:8000", self.keys())
        self.resolver.serve("vllm.example", "10.0.0.3")
        self.clock.advance(30)
        self.resolver.serve("vllm.example", "10.0.0.1", "10.0.0.3")
        self.clock.advance(30)
        self.assertIn("10.0.0.1:8000", self.live())


class ReloadTests(SynchronousTestCase):
    """A reload leaves a name's addresses to it, and starts and stops names."""

    def setUp(self) -> None:
        self.path = Path(self.mktemp())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.clock = Clock()
        self.resolver = FakeResolver()
        self.resolver.serve("one.example", "10.0.0.1", "10.0.0.2")
        self.resolver.serve("two.example", "10.0.0.5")
        self.write('"dns:one.example:8000", "10.0.9.1:8000"')
        source = ConfigSource.snapshot({"config": str(self.path)}, {})
        self.lb = LoadBalancer(config=source.read(), source=source, reactor=self.clock,
                               agent=FakeUpstream(), probe_agent=FakeUpstream(),
                               resolver=self.resolver)
        service = self.lb.service()
        service.startService()
        self.addCleanup(service.stopService)

    def write(self, backends: str) -> None:
        self.path.write_text(f'log-file = "none"\nbackends = [{backends}]\n')

    def live(self) -> list[str]:
        return sorted(b.key for b in self.lb.pool if not b.health.removing)

    def test_a_reload_keeps_the_addresses_of_a_name_it_still_lists(self) -> None:
        self.write('"dns:one.example:8000"')
        self.successResultOf(self.lb.reload_from_source())
        self.assertEqual(self.live(), ["10.0.0.1:8000", "10.0.0.2:8000"])

    def test_a_reload_starts_a_new_name_and_stops_a_gone_one(self) -> None:
        self.write('"dns:two.example:8000", "10.0.9.1:8000"')
        self.successResultOf(self.lb.reload_from_source())
        self.assertEqual(self.live(), ["10.0.0.5:8000", "10.0.9.1:8000"])
        asked = len(self.resolver.asked)
        self.clock.advance(30)
        self.assertNotIn(("A", "one.example"), self.resolver.asked[asked:])
        self.assertIn(("A", "two.example"), self.resolver.asked[asked:])

    def test_a_reload_applies_a_table_s_settings_to_every_address(self) -> None:
        self.path.write_text('log-file = "none"\n[[backends]]\nurl = "dns:one.example:8000"'
                             '\nmax_conns = 7\n')
        self.successResultOf(self.lb.reload_from_source())
        self.assertEqual({b.spec.max_conns for b in self.lb.pool if not b.health.removing}, {7})

    def test_the_file_takes_over_an_address_it_lists(self) -> None:
        self.write('"dns:one.example:8000", "10.0.0.1:8000"')
        self.successResultOf(self.lb.reload_from_source())
        self.assertFalse(self.lb.dns.owns("10.0.0.1:8000"))
        self.resolver.serve("one.example", "10.0.0.2")
        self.clock.advance(30)
        self.assertEqual(self.live(), ["10.0.0.1:8000", "10.0.0.2:8000"])


class WorkerTests(SynchronousTestCase):
    """Under ``--workers`` only the supervisor resolves: a worker's config has no names."""

    def test_a_worker_runs_without_names_and_resolves_nothing(self) -> None:
        from txlb._workers.wire import config_blob
        from txlb._workers.worker import SupervisorLink

        config = build_config({"backends": "dns:vllm.example:8000", "workers": "2"}, NONE)
        own = SupervisorLink._own_config(config_blob(config))
        self.assertEqual((own.backends, own.dns_backends), ((), ()))
        resolver = FakeResolver()
        lb = LoadBalancer(config=config, reactor=Clock(), agent=FakeUpstream(),
                          probe_agent=FakeUpstream(), resolver=resolver)
        service = lb.service(health_checks=False)  # how a worker runs it
        service.startService()
        self.addCleanup(service.stopService)
        self.assertEqual(resolver.asked, [])


class NginxTests(SynchronousTestCase):
    """``python -m txlb.nginx`` writes names as nginx's ``resolve`` servers."""

    def test_names_become_resolve_servers_with_a_zone_and_a_resolver(self) -> None:
        from txlb.nginx import render

        text = render(build_config({
            "backends": "dns:vllm.example:8000,srv:_http._tcp.gpu.example,10.0.0.1:8002",
            "resolver": "127.0.0.1:5353"}, NONE))
        self.assertIn("    server vllm.example:8000 resolve max_fails=1", text)
        self.assertIn("    server gpu.example service=_http._tcp resolve max_fails=1", text)
        self.assertIn("    zone txlb_backends 1m;", text)
        self.assertIn("resolver 127.0.0.1:5353 valid=300s;", text)
        self.assertIn("    server 10.0.0.1:8002 max_fails=1", text)

    def test_no_names_no_zone_or_resolver(self) -> None:
        from txlb.nginx import render

        text = render(build_config({"backends": "10.0.0.1:8002"}, NONE))
        self.assertNotIn("resolve", text.replace("resolv.conf", ""))
        self.assertNotIn("zone txlb_backends", text)

    def test_the_system_s_nameservers_by_default(self) -> None:
        from txlb.nginx import _system_nameservers

        path = Path(self.mktemp())
        path.write_text("# comment\nnameserver 10.0.0.53\nnameserver fe80::1%eth0\n"
                        "search example\n")
        self.assertEqual(_system_nameservers(str(path)), ["10.0.0.53", "[fe80::1]"])
        self.assertEqual(_system_nameservers(str(path) + ".missing"), [])


class CheckTests(SynchronousTestCase):
    """``--check`` counts the names beside the addresses."""

    def test_the_verdict_counts_names(self) -> None:
        from txlb.check import verdict

        config = build_config({"backends": "dns:vllm.example:8000,10.0.0.1:8002"}, NONE)
        self.assertEqual(verdict(config, "lb.toml"),
                         "OK: lb.toml (1 backend and 1 DNS name, policy least-conn)")


class _FakeUDP:
    """The transport of a UDP port in memory: what was sent, and to whom."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, tuple[str, int]]] = []
        self.stopped = False

    def write(self, data: bytes, address: tuple[str, int]) -> None:
        self.sent.append((data, address))

    def stopListening(self) -> None:
        self.stopped = True


class _UDPReactor(Clock):
    """A Clock that also opens UDP ports in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.ports: list[tuple[Any, _FakeUDP]] = []

    def listenUDP(self, port: int, protocol: Any, interface: str = "",
                  maxPacketSize: int = 8192) -> _FakeUDP:
        transport = _FakeUDP()
        protocol.makeConnection(transport)
        self.ports.append((protocol, transport))
        return transport


class QuietResolverTests(SynchronousTestCase):
    """One kept socket; each try on the next server; only the server asked is believed."""

    def setUp(self) -> None:
        from txlb._discovery.resolver import QuietResolver

        self.reactor = _UDPReactor()
        self.resolver = QuietResolver(self.reactor, servers=[("10.0.0.53", 53),
                                                             ("10.0.0.54", 53)],
                                      timeout=(1, 3))

    def answer(self, query: bytes, source: tuple[str, int], address: str) -> None:
        asked = dns.Message()
        asked.fromStr(query)
        reply = dns.Message(id=asked.id, answer=True)
        reply.queries = asked.queries
        reply.answers = [a("vllm.example", address)]
        protocol, _ = self.reactor.ports[0]
        protocol.datagramReceived(reply.toStr(), source)

    def test_a_try_that_times_out_goes_to_the_next_server_on_the_same_socket(self) -> None:
        found = self.resolver.lookupAddress("vllm.example", timeout=(1, 3))
        protocol, transport = self.reactor.ports[0]
        self.assertEqual([to for _, to in transport.sent], [("10.0.0.53", 53)])
        self.reactor.advance(1)
        self.assertEqual([to for _, to in transport.sent],
                         [("10.0.0.53", 53), ("10.0.0.54", 53)])
        self.assertEqual(len(self.reactor.ports), 1)
        # an answer from anyone but the server asked is dropped
        self.answer(transport.sent[-1][0], ("10.6.6.6", 53), "10.6.6.6")
        self.assertNoResult(found)
        self.answer(transport.sent[-1][0], ("10.0.0.54", 53), "10.0.0.7")
        answers, _, _ = self.successResultOf(found)
        self.assertEqual([r.payload.dottedQuad() for r in answers], ["10.0.0.7"])
        # the next lookup reuses the socket
        self.resolver.lookupAddress("other.example", timeout=(1, 3))
        self.assertEqual(len(self.reactor.ports), 1)
        self.assertFalse(transport.stopped)
        self.resolver.close_sockets()
        self.assertTrue(transport.stopped)

    def test_a_fresh_socket_takes_over_after_a_number_of_queries(self) -> None:
        from txlb._discovery.resolver import QUERIES_PER_SOCKET

        first = [self.resolver.lookupAddress(f"n{i}.example", timeout=(1, 3))
                 for i in range(QUERIES_PER_SOCKET)]
        self.assertEqual(len(self.reactor.ports), 1)
        old_protocol, old = self.reactor.ports[0]
        later = self.resolver.lookupAddress("next.example", timeout=(1, 3))
        self.assertEqual(len(self.reactor.ports), 2)  # a new socket: a new source port
        new_protocol, new = self.reactor.ports[1]
        self.assertEqual(len(old.sent), QUERIES_PER_SOCKET)
        self.assertEqual(len(new.sent), 1)
        # the old socket stays open for the answers still owed to it ...
        for query, _ in old.sent[:-1]:
            self.reply(old_protocol, query)
        self.assertFalse(old.stopped)
        self.reply(old_protocol, old.sent[-1][0])
        self.assertTrue(old.stopped)  # ... and closes with the last one
        for found in first:
            self.successResultOf(found)
        self.reply(new_protocol, new.sent[0][0])
        self.successResultOf(later)
        self.assertFalse(new.stopped)
        self.resolver.close_sockets()
        self.assertTrue(new.stopped)

    def test_a_retired_socket_whose_queries_time_out_closes_too(self) -> None:
        from txlb._discovery.resolver import QUERIES_PER_SOCKET

        owed = [self.resolver.lookupAddress(f"n{i}.example", timeout=(1,))
                for i in range(QUERIES_PER_SOCKET)]
        _, old = self.reactor.ports[0]
        self.reactor.advance(0.5)
        self.resolver.lookupAddress("next.example", timeout=(1,))
        self.assertFalse(old.stopped)
        self.reactor.advance(0.5)  # the old socket's queries give up: nothing left owed
        for found in owed:
            self.failureResultOf(found)
        self.assertTrue(old.stopped)

    def reply(self, protocol: Any, query: bytes) -> None:
        asked = dns.Message()
        asked.fromStr(query)
        reply = dns.Message(id=asked.id, answer=True)
        reply.queries = asked.queries
        reply.answers = [a("n.example", "10.0.0.7")]
        protocol.datagramReceived(reply.toStr(), ("10.0.0.53", 53))

    def test_every_try_timing_out_is_a_timeout(self) -> None:
        from txlb._discovery.resolver import describe_failure

        found = self.resolver.lookupAddress("vllm.example", timeout=(1, 3))
        self.reactor.advance(1)
        self.reactor.advance(3)
        failure = self.failureResultOf(found)
        self.assertEqual(describe_failure(failure), "no answer (timed out)")


class LazyResolverTests(SynchronousTestCase):
    """A balancer started without names makes its resolver when a reload adds one."""

    def test_a_reload_that_adds_the_first_name_makes_the_resolver(self) -> None:
        from txlb._cluster.pool import Pool
        from txlb._discovery.membership import DnsMembership

        resolver = FakeResolver()
        resolver.serve("vllm.example", "10.0.0.1")
        made: list[FakeResolver] = []
        pool = Pool(clock=Clock())
        membership = DnsMembership(pool, build_config({"backends": "10.0.9.9:80"}, NONE),
                                   None, Clock(), on_added=lambda backend: None,
                                   make_resolver=lambda: made.append(resolver) or resolver)
        membership.startService()
        self.addCleanup(membership.stopService)
        self.assertEqual(made, [])
        membership.reconfigure(build_config({"backends": "dns:vllm.example:80"}, NONE))
        self.assertEqual(made, [resolver])
        self.assertEqual([b.key for b in pool], ["10.0.0.1:80"])


class _OperatorMarks:
    """:class:`SharedMarks` whose entries say who made them (``origin``), as a store may."""

    def __init__(self, replica: str) -> None:
        from txlb._shared.marks import SharedMarks

        self.marks = SharedMarks(replica)
        self.origins: dict[str, str] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.marks, name)

    def origin(self, key: str) -> str | None:
        return self.origins.get(key)


class SharedStoreTests(SynchronousTestCase):
    """
    DNS membership beside the shared store: a replica owns what its own names yield,
    even when another replica's DNS put it in the store first, and another replica's DNS
    letting an address go is not an operator's removal.
    """

    def setUp(self) -> None:
        from txlb._cluster.pool import Pool
        from txlb._discovery.membership import DnsMembership

        self.clock = Clock()
        self.resolver = FakeResolver()
        self.resolver.serve("vllm.example", "10.0.0.1", "10.0.0.2")
        self.shared = _OperatorMarks("B")
        self.marks = self.shared.marks
        self.marks.started = True
        store = type("Store", (), {"counts": None, "marks": self.shared})()
        self.pool = Pool(clock=self.clock, store=store)
        self.events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)
        self.dns = DnsMembership(self.pool,
                                 build_config({"backends": "dns:vllm.example:8000"}, NONE),
                                 self.resolver, self.clock, on_added=lambda backend: None)

    def start(self) -> None:
        self.dns.startService()
        self.addCleanup(self.dns.stopService)

    def from_a(self, key: str, **marks: bool) -> None:
        """Replica A wrote ``key``'s entry; B's next poll hands it to the pool."""
        host, port = key.split(":")
        from txlb._shared.marks import Entry

        values = {"draining": False, "removing": False, "healthy": True, **marks}
        text = Entry(BackendSpec(host, int(port)), by="A", **values).encode()
        self.marks.read([(key, text)])
        self.pool.refresh()

    def live(self) -> list[str]:
        return sorted(b.key for b in self.pool if not b.health.removing)

    def in_pool(self) -> list[str]:
        return self.dns.status()["dns"][0]["in_pool"]  # type: ignore[index]

    def test_members_learned_from_the_store_first_are_adopted_and_leave_with_dns(
            self) -> None:
        self.resolver.hold = True  # B's DNS server is slower than Redis
        self.start()
        self.from_a("10.0.0.1:8000")
        self.from_a("10.0.0.2:8000")
        self.assertEqual(self.live(), ["10.0.0.1:8000", "10.0.0.2:8000"])
        self.resolver.hold = False
        for waiting in self.resolver.held:
            waiting.cancel()
        self.clock.advance(1)  # the retry answers
        self.assertEqual(self.in_pool(), ["10.0.0.1:8000", "10.0.0.2:8000"])
        # A is gone; .2 leaves the name: B's own DNS removes it
        self.resolver.serve("vllm.example", "10.0.0.1")
        self.clock.advance(30)
        self.assertEqual(self.live(), ["10.0.0.1:8000"])
        self.assertTrue(self.marks.unsent["10.0.0.2:8000"].removing)

    def test_a_removal_by_another_replica_s_dns_does_not_take_ours_out(self) -> None:
        self.start()
        self.from_a("10.0.0.2:8000", removing=True,  # A's answer lacked .2 for a moment
                    draining=True)  # (a removal drains)
        self.assertEqual(self.live(), ["10.0.0.1:8000", "10.0.0.2:8000"])
        backend = self.pool.get("10.0.0.2:8000")
        assert backend is not None
        self.assertFalse(backend.health.draining)  # still in rotation
        self.assertFalse(self.marks.unsent["10.0.0.2:8000"].draining)
        self.assertFalse(self.marks.unsent["10.0.0.2:8000"].removing)  # and says so
        self.clock.advance(30)
        self.assertEqual(self.live(), ["10.0.0.1:8000", "10.0.0.2:8000"])
        self.assertEqual(self.in_pool(), ["10.0.0.1:8000", "10.0.0.2:8000"])
        lines = [formatEvent(e) for e in self.events]
        self.assertFalse([line for line in lines if "by an operator" in line], lines)
        # still ours: it leaves when our name stops yielding it
        self.resolver.serve("vllm.example", "10.0.0.1")
        self.clock.advance(30)
        self.assertEqual(self.live(), ["10.0.0.1:8000"])

    def test_a_removal_elsewhere_of_what_our_dns_does_not_yield_applies(self) -> None:
        self.start()
        self.from_a("10.0.0.7:8000")
        self.from_a("10.0.0.7:8000", removing=True)
        self.assertEqual(self.live(), ["10.0.0.1:8000", "10.0.0.2:8000"])

    def test_an_operator_s_removal_elsewhere_holds_while_dns_yields_it(self) -> None:
        self.start()
        self.shared.origins["10.0.0.2:8000"] = "admin"
        self.from_a("10.0.0.2:8000", removing=True)
        self.assertEqual(self.live(), ["10.0.0.1:8000"])
        self.clock.advance(30)
        self.clock.advance(30)
        self.assertEqual(self.live(), ["10.0.0.1:8000"])
        self.assertEqual(self.in_pool(), ["10.0.0.1:8000"])

    def test_a_backend_added_by_the_store_that_our_dns_does_not_yield_is_not_ours(
            self) -> None:
        self.start()
        self.from_a("10.0.0.7:8000")
        self.clock.advance(30)
        self.assertEqual(self.in_pool(), ["10.0.0.1:8000", "10.0.0.2:8000"])
        self.assertIn("10.0.0.7:8000", self.live())


class SearchListTests(SynchronousTestCase):
    """A short name is asked with resolv.conf's search domains, as the system asks it."""

    def test_fewer_dots_than_ndots_tries_the_search_domains_first(self) -> None:
        from txlb._discovery.resolver import search_names

        search = ["default.svc.cluster.local", "svc.cluster.local", "cluster.local"]
        self.assertEqual(search_names("vllm", search, 5), [
            "vllm.default.svc.cluster.local", "vllm.svc.cluster.local",
            "vllm.cluster.local", "vllm"])
        self.assertEqual(search_names("vllm.example", ["corp.example"], 1),
                         ["vllm.example", "vllm.example.corp.example"])
        self.assertEqual(search_names("vllm", [], 1), ["vllm"])
        self.assertEqual(search_names("vllm.example.", ["corp.example"], 5),
                         ["vllm.example"])
        self.assertEqual(search_names("v", ["x" * 252], 1), ["v"])  # too long: left out

    def test_resolv_conf_s_search_and_ndots_are_read(self) -> None:
        from txlb._discovery.resolver import QuietResolver

        path = Path(self.mktemp())
        path.write_text("nameserver 10.96.0.10\nsearch default.svc.cluster.local "
                        "svc.cluster.local\noptions ndots:5 timeout:1\n")
        clock = Clock()
        resolver = QuietResolver(clock, resolv=str(path), timeout=(1, 3))
        self.addCleanup(lambda: [call.cancel() for call in clock.getDelayedCalls()])
        self.assertEqual(resolver.names("vllm"), ["vllm.default.svc.cluster.local",
                                                  "vllm.svc.cluster.local", "vllm"])
        self.assertEqual(resolver.names("a.b.c.d.e"), ["a.b.c.d.e.default.svc.cluster.local",
                                                       "a.b.c.d.e.svc.cluster.local",
                                                       "a.b.c.d.e"])
        path.write_text("nameserver 10.96.0.10\ndomain corp.example\noptions ndots:x\n")
        resolver.parseConfig(path.open("rb"))
        self.assertEqual(resolver.names("vllm"), ["vllm.corp.example", "vllm"])
        self.assertEqual(resolver.names("vllm.example"),
                         ["vllm.example", "vllm.example.corp.example"])
        resolver.parseConfig([b"nameserver 10.96.0.10\n"])
        self.assertEqual(resolver.names("vllm"), ["vllm"])


class _SearchingResolver(FakeResolver):
    """A :class:`FakeResolver` with a Kubernetes pod's search list."""

    def names(self, name: str) -> list[str]:
        from txlb._discovery.resolver import search_names

        return search_names(name, ["default.svc.cluster.local", "svc.cluster.local"], 5)


class SearchingMembershipTests(MembershipTestCase):
    """``dns:vllm:8000`` in a pod resolves as the pod's resolver would resolve ``vllm``."""

    backends = "dns:vllm:8000"

    def setUp(self) -> None:
        super().setUp()
        self.resolver = _SearchingResolver()
        self.resolver.serve("vllm.svc.cluster.local", "10.0.0.1", "10.0.0.2")

    def test_a_short_name_resolves_through_the_search_list(self) -> None:
        self.start()
        self.assertEqual(self.live(), ["10.0.0.1:8000", "10.0.0.2:8000"])
        self.assertEqual(self.resolver.asked[:4], [
            ("A", "vllm.default.svc.cluster.local"), ("AAAA", "vllm.default.svc.cluster.local"),
            ("A", "vllm.svc.cluster.local"), ("AAAA", "vllm.svc.cluster.local")])
        self.assertNotIn(("A", "vllm"), self.resolver.asked)  # found before the bare name

    def test_a_server_failure_on_a_search_name_keeps_the_last_set(self) -> None:
        self.start()
        for kind in ("A", "AAAA"):  # the first candidate cannot be asked: not "not there"
            self.resolver.errors[(kind, "vllm.default.svc.cluster.local")] = \
                DNSServerError("vllm.default.svc.cluster.local")
        self.resolver.serve("vllm.svc.cluster.local", "10.0.0.1")
        self.clock.advance(30)
        self.assertEqual(self.live(), ["10.0.0.1:8000", "10.0.0.2:8000"])
        self.assertEqual(self.status()["dns"][0]["error"], "the DNS server failed (SERVFAIL)")

    def test_no_name_of_the_list_is_no_such_name(self) -> None:
        self.resolver.zone.clear()
        self.start()
        self.assertEqual(self.keys(), [])
        self.assertEqual(self.status()["dns"][0]["error"], "no such name (NXDOMAIN)")
        self.assertIn(("A", "vllm"), self.resolver.asked)
