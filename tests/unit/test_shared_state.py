"""
``--shared-state``'s parts without a Redis: the URL and its masking, the link's fallback on
a :class:`~twisted.internet.task.Clock`, the fleet's counts, the shared marks' rules and the
rate buckets' local copies.  The scripts themselves run against a real Redis in
``tests/integration/test_shared_state_process.py``.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, fail, succeed
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from txlb import LoadBalancer
from txlb._cluster.pool import Pool
from txlb._cluster.store import Marks
from txlb._config import BackendSpec, ConfigError, build_config
from txlb._config.shared import SharedStateSpec, parse_shared_state
from txlb._shared.counts import FleetCounts
from txlb._shared.link import COMMAND_TIMEOUT, RedisLink
from txlb._shared.marks import Entry, SharedMarks
from txlb._shared.rate import RedisRateTakes, SharedRateBuckets
from txlb._shared.replies import (
    MAX_BULK,
    MAX_DEPTH,
    MAX_ELEMENTS,
    MAX_LINE,
    SCAN_REPLY,
    ReplyRefused,
    bounded,
)
from txlb._shared.store import (
    CHANGES,
    CLAIM,
    FLUSH_DELAY,
    POLL,
    POLL_INTERVAL,
    SCAN_PAGE,
    WRITE,
    RedisStore,
)

SPEC = SharedStateSpec("127.0.0.1", 6379, password="hunter2-secret")

#: What Redis answers to the commands txlb sends, where a test does not say otherwise (the
#: link checks every reply's shape: a fake answering "OK" to all is a broken Redis).
REDIS_ANSWERS: dict[str, Any] = {
    "HSET": 1, "PEXPIRE": 1, "DEL": 1, "ZREM": 1, "PUBLISH": 0, "XADD": "1-0",
    "XREAD": None, "HSCAN": ["0", []], "HGETALL": [], "PING": "PONG"}
#: ... and the marks' scripts (the version written, the fields claimed).
SCRIPT_ANSWERS: dict[str, Any] = {WRITE.sha: 1, CLAIM.sha: 1}


def redis_answer(args: tuple[Any, ...]) -> Any:
    """Redis's usual answer to ``args`` (a command or a marks' script), else "OK"."""
    if args[0] == "EVALSHA" and args[1] in SCRIPT_ANSWERS:
        return SCRIPT_ANSWERS[args[1]]
    return REDIS_ANSWERS.get(args[0], "OK")


class FakeRedis:
    """Answers each command with what ``answer`` says; ``stalled``: never answers."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []
        self.stalled = False
        self.broken = False
        self.replies: dict[str, Any] = {}
        #: a script's reply by its SHA1 (before ``replies["EVALSHA"]``)
        self.scripts: dict[str, Any] = {}

    def execute_command(self, *args: Any, **kwargs: Any) -> Deferred[Any]:
        self.sent.append(args)
        if self.stalled:
            return Deferred()
        if self.broken:
            return fail(ConnectionError("Connection refused"))
        if args[0] == "EVALSHA" and args[1] in self.scripts:
            return succeed(self.scripts[args[1]])
        if args[0] == "EVALSHA" and args[1] in SCRIPT_ANSWERS:
            return succeed(SCRIPT_ANSWERS[args[1]])
        if args[0] in self.replies:
            return succeed(self.replies[args[0]])
        return succeed(redis_answer(args))

    def ran(self, script: Any) -> list[tuple[Any, ...]]:
        """The calls of ``script`` sent so far."""
        return [c for c in self.sent if c[:2] == ("EVALSHA", script.sha)]


class Captured:
    def __init__(self, test: SynchronousTestCase) -> None:
        self.events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(self.events.append)
        test.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def texts(self) -> list[str]:
        from twisted.logger import formatEvent

        return [formatEvent(event) for event in self.events]


class URLTests(SynchronousTestCase):
    def test_parts(self) -> None:
        spec = parse_shared_state("shared-state", "rediss://user:p%40ss@redis.example:6380/3")
        assert spec is not None
        self.assertEqual((spec.host, spec.port, spec.db, spec.tls, spec.username,
                          spec.password), ("redis.example", 6380, 3, True, "user", "p@ss"))
        self.assertEqual(spec.masked, "rediss://user:***@redis.example:6380/3")

    def test_defaults(self) -> None:
        spec = parse_shared_state("shared-state", "redis://10.0.0.5")
        assert spec is not None
        self.assertEqual((spec.port, spec.db, spec.password, spec.prefix), (6379, 0, None, "txlb"))
        self.assertIsNone(parse_shared_state("shared-state", "none"))

    def test_password_never_shown(self) -> None:
        spec = parse_shared_state("shared-state", "redis://:hunter2-secret@h:1/0")
        assert spec is not None
        for shown in (repr(spec), str(spec), spec.masked,
                      repr(build_config({"shared-state": "redis://:hunter2-secret@h:1/0",
                                         "backends": "127.0.0.1:9"}, environ={}))):
            self.assertNotIn("hunter2", shown)

    def test_refusals_name_the_option_and_hide_the_password(self) -> None:
        for bad in ("http://:hunter2-secret@h:1/0", "redis://:hunter2-secret@h:99999/0",
                    "redis://:hunter2-secret@h:1/99", "redis://:hunter2-secret@h:1/x",
                    "redis://:hunter2-secret@/0", "redis://:hunter2-secret@h:1/0?evil=1",
                    "redis://:hunter2-secret@h:1/0?prefix=a%20b",
                    "redis://:hunter2-secret@h:1/0?password_file=/etc/passwd"):
            with self.assertRaises(ConfigError) as caught:
                parse_shared_state("shared-state", bad)
            message = str(caught.exception)
            self.assertTrue(message.startswith("--shared-state: "), message)
            self.assertNotIn("hunter2", message)
            self.assertNotIn("\n", message)

    def test_a_password_with_unencoded_slash_or_at_is_never_shown(self) -> None:
        # a base64 password holds "/", a hand-typed one "@": neither ends the password
        for bad, secret in (("redis://:Zm9v/YmFy+pw@127.0.0.1:6379/0", "Zm9v"),
                            ("redis://:p@ssWORD@127.0.0.1:99999/0", "ssWORD"),
                            ("redis://user:a@b/c@h:1/x", "b/c")):
            with self.assertRaises(ConfigError) as caught:
                parse_shared_state("shared-state", bad)
            self.assertNotIn(secret, str(caught.exception))
            self.assertTrue(str(caught.exception).startswith("--shared-state: 'redis://***@"))
        with self.assertRaises(ConfigError) as caught:
            parse_shared_state("shared-state", "redis://:Zm9v/YmFy@127.0.0.1:6379/0")
        self.assertIn("%2F", str(caught.exception))

    def test_password_file(self) -> None:
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write("from-a-file\nignored\n")
        spec = parse_shared_state("shared-state", f"redis://h:1/0?password_file={path}")
        assert spec is not None
        self.assertEqual(spec.password, "from-a-file")
        with self.assertRaises(ConfigError) as caught:
            parse_shared_state("shared-state", "redis://h:1/0?password_file=/nonexistent")
        self.assertIn("cannot be read", str(caught.exception))
        empty = self.mktemp()
        open(empty, "w").close()
        with self.assertRaises(ConfigError):
            parse_shared_state("shared-state", f"redis://h:1/0?password_file={empty}")

    def test_a_private_ca_for_tls(self) -> None:
        from pathlib import Path

        from tests.processes import throwaway_certificate
        from txlb._shared.link import client_tls

        directory = Path(self.mktemp())
        directory.mkdir()
        _, cert = throwaway_certificate(directory)
        spec = parse_shared_state("shared-state", f"rediss://h:1/0?ca={cert}")
        assert spec is not None
        self.assertIn("BEGIN CERTIFICATE", spec.ca or "")
        self.assertNotIn("BEGIN", repr(spec))
        self.assertIsNotNone(client_tls(spec))
        garbage = directory / "garbage.pem"
        garbage.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
        big = directory / "big.pem"
        big.write_bytes(b"x" * (2 << 20))
        empty = directory / "empty.pem"
        empty.write_text("no certificate here\n")
        for url, why in (
            (f"redis://h:1/0?ca={cert}", "only a rediss://"),
            ("rediss://h:1/0?ca=/nonexistent", "cannot be read"),
            (f"rediss://h:1/0?ca={empty}", "no PEM certificate"),
            (f"rediss://h:1/0?ca={garbage}", "cannot be read"),
            (f"rediss://h:1/0?ca={big}", "over"),
        ):
            with self.assertRaises(ConfigError) as caught:
                parse_shared_state("shared-state", url)
            self.assertIn(why, str(caught.exception))

    def test_environment_and_workers(self) -> None:
        config = build_config({"backends": "127.0.0.1:9"},
                              environ={"LB_SHARED_STATE": "redis://h:1/2"})
        assert config.shared_state is not None
        self.assertEqual(config.shared_state.db, 2)
        # with --workers, the supervisor is the host's replica (txlb._shared.host)
        config = build_config({"backends": "127.0.0.1:9", "workers": "2",
                               "shared-state": "redis://h:1/0"}, environ={})
        self.assertEqual((config.workers, config.shared_state and config.shared_state.db),
                         (2, 0))


class LinkTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.redis = FakeRedis()
        self.link = RedisLink(SPEC, self.clock, self.redis)
        self.log = Captured(self)

    def test_down_within_a_second_of_a_stall_and_logged_once(self) -> None:
        self.link.call("PING", probe=True)
        self.assertTrue(self.link.connected)
        self.redis.stalled = True
        stalled: list[object] = []
        self.link.call("PING").addErrback(stalled.append)
        self.clock.advance(0.49)
        self.assertTrue(self.link.connected)
        self.clock.advance(0.02)
        self.assertFalse(self.link.connected)
        self.assertEqual(len(stalled), 1)
        for _ in range(5):
            self.link.call("PING", probe=True).addErrback(lambda f: None)
            self.clock.advance(1)
        warnings = [t for t in self.log.texts() if "local view" in t]
        self.assertEqual(len(warnings), 1)
        self.assertEqual(self.link.fallbacks, 1)
        self.assertNotIn("hunter2", " ".join(self.log.texts()))

    def test_an_answer_waiting_behind_a_busy_reactor_is_not_a_timeout(self) -> None:
        replies: list[Deferred[Any]] = []

        class Holding:
            def execute_command(self, *args: Any, **kwargs: Any) -> Deferred[Any]:
                replies.append(Deferred())
                return replies[-1]

        link = RedisLink(SPEC, self.clock, Holding())
        link.call("PING", probe=True)
        replies[0].callback("PONG")
        answered: list[object] = []
        link.call("HSCAN").addBoth(answered.append)
        # the reactor was busy past the timeout: its timer runs before the socket is read
        (timer,) = self.clock.getDelayedCalls()
        self.clock.rightNow = timer.getTime()
        timer.func(*timer.args, **timer.kw)
        self.assertEqual(answered, [])
        replies[1].callback(["0", []])  # ... and the answer was waiting there
        self.clock.advance(0)
        self.assertEqual(answered, [["0", []]])
        self.assertTrue(link.connected)
        self.assertEqual(link.fallbacks, 0)

    def test_while_down_only_probes_are_sent(self) -> None:
        self.redis.broken = True
        self.link.call("PING", probe=True).addErrback(lambda f: None)
        sent = len(self.redis.sent)
        failed: list[object] = []
        self.link.call("HSET", "k", "f", "v").addErrback(failed.append)
        self.assertEqual(len(self.redis.sent), sent)
        self.assertEqual(len(failed), 1)

    def test_back_up_tells_listeners_and_status(self) -> None:
        ups: list[int] = []
        self.link.on_up.append(lambda: ups.append(1))
        self.redis.broken = True
        self.link.call("PING", probe=True).addErrback(lambda f: None)
        status = self.link.status()
        self.assertEqual((status["connected"], status["url"]),
                         (False, "redis://:***@127.0.0.1:6379/0"))
        self.assertIn("Connection refused", str(status["last_error"]))
        self.redis.broken = False
        self.link.call("PING", probe=True)
        self.assertEqual(ups, [1])
        self.assertTrue(self.link.status()["connected"])

    def test_an_error_naming_the_password_is_masked(self) -> None:
        self.redis.broken = True
        self.redis.execute_command = lambda *a, **k: fail(  # type: ignore[method-assign]
            ValueError("bad auth hunter2-secret"))
        self.link.call("PING", probe=True).addErrback(lambda f: None)
        self.assertNotIn("hunter2", str(self.link.last_error))


    def test_a_refused_login_is_reported_as_such_not_as_a_timeout(self) -> None:
        self.link.refused("Redis error: could not auth: WRONGPASS invalid username-password "
                          "pair or user is disabled. hunter2-secret")
        self.link.call("PING", probe=True)
        self.redis.broken = True
        self.link.call("PING").addErrback(lambda f: None)
        error = self.link.status()["last_error"]
        assert isinstance(error, str)
        self.assertIn("WRONGPASS", error)
        self.assertIn("login refused", error)
        self.assertNotIn("hunter2", error)
        self.assertTrue(any("WRONGPASS" in line for line in self.log.texts()))

    def test_only_a_missing_script_is_an_answer(self) -> None:
        class ResponseError(Exception):
            pass

        link = RedisLink(SPEC, self.clock, self.redis, answer_errors=(ResponseError,))
        answers = iter([fail(ResponseError("NOSCRIPT No matching script")), succeed("1")])
        self.redis.execute_command = lambda *a, **k: next(answers)  # type: ignore[method-assign]
        replies: list[object] = []
        from txlb._shared.link import Script

        link.run(Script("return 1"), [], [], probe=True).addCallback(replies.append)
        self.assertEqual((replies, link.connected), (["1"], True))
        self.redis.execute_command = lambda *a, **k: fail(  # type: ignore[method-assign]
            ResponseError("NOAUTH Authentication required"))
        link.call("PING", probe=True).addErrback(lambda f: None)
        self.assertFalse(link.connected)


class NeverReachedTests(SynchronousTestCase):
    def test_a_replica_that_never_reached_redis_counts_one_fallback(self) -> None:
        clock, redis = Clock(), FakeRedis()
        link = RedisLink(SPEC, clock, redis)
        redis.broken = True
        for _ in range(3):
            link.call("PING", probe=True).addErrback(lambda f: None)
        # on its local view since it started: one fall-back, however many polls failed
        self.assertEqual((link.connected, link.fallbacks), (False, 1))
        redis.broken = False
        link.call("PING", probe=True)
        redis.broken = True
        link.call("PING").addErrback(lambda f: None)
        self.assertEqual((link.connected, link.fallbacks), (False, 2))


class Nonsense(FakeRedis):
    """A server that answers ``+OK`` to every command."""

    def execute_command(self, *args: Any, **kwargs: Any) -> Deferred[Any]:
        self.sent.append(args)
        return succeed("OK")


class ReplyShapeTests(SynchronousTestCase):
    """A reply that is not what its command answers: this Redis shares nothing."""

    def test_ok_to_everything_is_not_connected(self) -> None:
        clock = Clock()
        store = RedisStore(SPEC, clock, Nonsense(), replica="r1")
        store.start()
        clock.advance(1)
        status = store.status()
        self.assertEqual((status["connected"], status["fallbacks"]), (False, 1))
        self.assertEqual(status["last_error"], "the poll script answered 'OK', not an "
                                               "array of at least 2 texts, two by two")

    def test_nonsense_after_an_answer_falls_back(self) -> None:
        clock, redis = Clock(), FakeRedis()
        store = RedisStore(SPEC, clock, redis, replica="r1")
        store.counts.register("a:1")
        redis.scripts[POLL.sha] = ["2", "0", "a:1", "4"]
        store.start()
        self.assertEqual(store.counts.total("a:1"), 4)
        redis.scripts[POLL.sha] = ["2", "0", "a:1"]  # odd: not key, count pairs
        clock.advance(POLL_INTERVAL)
        self.assertFalse(store.link.connected)
        self.assertEqual(store.counts.total("a:1"), 0)  # the local view
        self.assertEqual(store.link.fallbacks, 1)
        self.assertIn("the poll script answered an array of 3", str(store.link.last_error))

    def test_every_script_and_command_says_what_it_answers(self) -> None:
        from txlb._shared.levels import MOVE
        from txlb._shared.prefixes import FLEET_KEY
        from txlb._shared.rate import TAKE
        from txlb._shared.slots import ACQUIRE

        for script, good, bad in ((POLL, ["1", "0"], "OK"), (CHANGES, ["3", "whole"], 3),
                                  (WRITE, 4, "OK"), (CLAIM, 0, ["0"]), (TAKE, "2.5", 2),
                                  (MOVE, ["1.0"], "1.0"), (ACQUIRE, [1, 0], ["1", "0"]),
                                  (FLEET_KEY, "ab" * 32, None)):
            self.assertTrue(script.expect.fits(good), script.name)
            self.assertFalse(script.expect.fits(bad), script.name)
        self.assertTrue(SCAN_REPLY.fits(["0", ["f", "v"]]))
        self.assertFalse(SCAN_REPLY.fits(["0", ["f"]]))
        self.assertFalse(SCAN_REPLY.fits("OK"))


def hostile_link(test: SynchronousTestCase) -> tuple[RedisLink, Any, StringTransport, Clock]:
    """
    A link over txredisapi's own client and factory, its connection txlb's bounded
    protocol over a StringTransport: what the server sends is what the test feeds.
    """
    import txredisapi  # type: ignore[import-untyped]

    clock = Clock()
    factory = txredisapi.RedisFactory(None, None, 1, isLazy=True, convertNumbers=False)
    factory.protocol = bounded(txredisapi.BaseRedisProtocol, clock)
    protocol = factory.protocol(charset="utf-8", convertNumbers=False)
    protocol.factory = factory
    transport = StringTransport()
    protocol.makeConnection(transport)
    factory.addConnection(protocol)
    link = RedisLink(SharedStateSpec("127.0.0.1", 6379), clock, factory.handler)
    link.lost_errors = (txredisapi.ConnectionError,)
    return link, protocol, transport, clock


class BoundedReplyTests(SynchronousTestCase):
    """What a hostile or broken server can send, fed to txlb's protocol."""

    def setUp(self) -> None:
        self.link, self.protocol, self.transport, self.clock = hostile_link(self)

    def test_a_huge_bulk_length_drops_the_connection_at_once(self) -> None:
        answer = self.link.call("EVALSHA", POLL.sha, 0, probe=True, expect=POLL.expect,
                                what=POLL.name)
        self.protocol.dataReceived(b"$99999999999\r\n" + b"x" * 65536)
        self.assertTrue(self.transport.disconnecting)
        self.assertEqual(self.protocol.buffered, 0)
        for _ in range(100):  # the server goes on: nothing more is read
            self.protocol.dataReceived(b"x" * 65536)
        self.assertEqual(self.protocol.buffered, 0)
        self.failureResultOf(answer, ReplyRefused)
        status = self.link.status()
        self.assertFalse(status["connected"])
        self.assertIn("a string of 99999999999 bytes", str(status["last_error"]))

    def test_deep_nesting_is_dropped_at_the_depth_limit(self) -> None:
        answer = self.link.call("XREAD", probe=True)
        self.protocol.dataReceived(b"*1\r\n" * 200_000)
        self.assertTrue(self.transport.disconnecting)
        self.assertEqual(self.protocol.refused, f"arrays nested over {MAX_DEPTH} deep")
        self.failureResultOf(answer, ReplyRefused)

    def test_too_many_elements_or_bytes_are_dropped_on_the_header(self) -> None:
        for hostile in (b"*%d\r\n" % (MAX_ELEMENTS + 1),
                        b"*2\r\n$%d\r\n" % MAX_BULK + b"x" * MAX_BULK + b"\r\n"
                        + b"*%d\r\n" % MAX_ELEMENTS,
                        b"+" + b"x" * (MAX_LINE + 1),
                        b"$3\r\nabcdef\r\n", b"?\r\n", b"$-7\r\n"):
            link, protocol, transport, _ = hostile_link(self)
            answer = link.call("GET", "k", probe=True)
            protocol.dataReceived(hostile)
            self.assertTrue(transport.disconnecting, hostile[:20])
            self.failureResultOf(answer, ReplyRefused)

    def test_a_reply_nobody_asked_for_drops_the_connection(self) -> None:
        self.protocol.dataReceived(b"+OK\r\n")
        self.assertEqual(self.protocol.refused, "a reply no command asked for")
        self.assertTrue(self.transport.disconnecting)

    def test_a_call_given_up_drops_its_connection(self) -> None:
        answer = self.link.call("PING", probe=True)
        later = self.link.call("PING", probe=True)
        self.clock.advance(COMMAND_TIMEOUT)
        self.clock.advance(0)
        self.failureResultOf(answer, CancelledError)
        self.assertTrue(self.transport.disconnecting)
        self.assertTrue(self.transport.disconnected)  # aborted, not waiting on writes
        self.protocol.connectionLost(Failure(ConnectionDone()))
        self.failureResultOf(later)
        # the cause stays in last_error, not the lost connection that followed it
        self.assertEqual(self.link.last_error, f"no answer within {COMMAND_TIMEOUT:g}s")

    def test_only_a_refusal_of_the_login_stops_the_reconnecting(self) -> None:
        import txredisapi

        for answer, refused in ((b"$99999999999\r\n", False), (b"*1\r\n" * 20, False),
                                (b"-ERR DB index is out of range\r\n", True)):
            factory = txredisapi.RedisFactory(None, 0, 1, isLazy=True, convertNumbers=False)
            told: list[str] = []
            factory.connectionError = told.append
            protocol = bounded(txredisapi.BaseRedisProtocol, self.clock)(
                charset="utf-8", dbid=0, convertNumbers=False)
            protocol.factory = factory
            transport = StringTransport()
            protocol.makeConnection(transport)
            self.assertIn(b"SELECT", transport.value())
            protocol.dataReceived(answer)
            self.assertTrue(transport.disconnecting)
            self.assertFalse(protocol._ready)
            # a broken answer is a lost connection (made again), not a wrong database
            self.assertEqual((factory.stopped, bool(told)), (refused, refused), answer[:10])

    def test_replies_read_as_txredisapi_reads_them(self) -> None:
        import txredisapi

        stream = (b"+OK\r\n:-42\r\n$-1\r\n*-1\r\n*0\r\n$0\r\n\r\n-ERR boom\r\n"
                  b"-NOSCRIPT No matching script\r\n$5\r\nh\xc3\xa9y\r\r\n$2\r\n\xff\xfe\r\n"
                  b"*2\r\n*2\r\n$6\r\nstream\r\n*1\r\n*2\r\n$3\r\n1-0\r\n"
                  b"*2\r\n$1\r\nr\r\n$2\r\nr2\r\n:7\r\n")
        replies = 11

        def read(protocol: Any, chunks: list[bytes]) -> list[object]:
            protocol.makeConnection(StringTransport())
            got: list[object] = []
            for _ in range(replies):
                protocol.replyQueue.get().addCallback(got.append)
            for chunk in chunks:
                protocol.dataReceived(chunk)
            return [repr(x) if isinstance(x, Exception) else x for x in got]

        bytewise = [stream[i:i + 1] for i in range(len(stream))]
        theirs = read(txredisapi.BaseRedisProtocol(convertNumbers=False), bytewise)
        ours = bounded(txredisapi.BaseRedisProtocol, self.clock)
        self.assertEqual(len(theirs), replies)
        self.assertEqual(read(ours(convertNumbers=False), bytewise), theirs)
        self.assertEqual(read(ours(convertNumbers=False), [stream]), theirs)


class CountsTests(SynchronousTestCase):
    def test_fleet_total_is_mine_plus_the_others(self) -> None:
        counts = FleetCounts()
        a, b = counts.register("a:1"), counts.register("b:1")
        counts.take("a:1")
        counts.read_others([("a:1", "2"), ("b:1", "3"), ("b:1", "1")])
        self.assertEqual(counts.totals()[a], 3)
        self.assertEqual(counts.totals()[b], 4)
        self.assertEqual(counts.mine("a:1"), 1)
        self.assertTrue(counts.read_others([("a:1", "2")]))  # b's fell: a slot freed
        self.assertTrue(counts.forget_others())
        self.assertEqual(counts.totals(), [1, 0])

    def test_hostile_rows_are_ignored(self) -> None:
        counts = FleetCounts()
        counts.register("a:1")
        counts.read_others([("a:1", "-5"), ("a:1", "1e9"), ("a:1", "99999999"),
                            ("zz:1", "4"), ("a:1", "x")])
        self.assertEqual(counts.total("a:1"), 0)

    def test_a_change_is_announced_once_per_batch(self) -> None:
        counts = FleetCounts()
        counts.register("a:1")
        told: list[int] = []
        counts.on_change = lambda: told.append(1)
        counts.take("a:1")
        counts.take("a:1")
        counts.give_back("a:1")
        self.assertEqual(told, [1])
        self.assertEqual(counts.changed_row(), {"a:1": 1})
        counts.give_back("a:1")
        self.assertEqual(counts.changed_row(), {"a:1": 0})


def entry(key: str, by: str, **marks: bool) -> tuple[str, str]:
    host, port = key.split(":")
    values = {"draining": False, "removing": False, "healthy": True, **marks}
    return key, Entry(BackendSpec(host, int(port)), by=by, **values).encode()


class MarksTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.marks = SharedMarks("me")
        self.pool = Pool((BackendSpec("h", 1), BackendSpec("h", 2)),
                         store=_Store(self.marks))
        self.marks.claims.clear()  # sent: Redis answered (the store's resync)

    def test_another_replicas_drain_reaches_the_pool(self) -> None:
        self.assertTrue(self.marks.read([entry("h:1", "other", draining=True)]))
        self.pool.refresh()
        backend = self.pool.get("h:1")
        assert backend is not None
        self.assertTrue(backend.health.draining)

    def test_our_own_echo_is_not_applied_again(self) -> None:
        backend = self.pool.get("h:1")
        assert backend is not None
        self.pool.drain(backend)
        self.pool.undrain(backend)
        self.assertFalse(self.marks.read([entry("h:1", "me", draining=True)]))

    def test_only_a_refusal_is_shared_as_health(self) -> None:
        backend = self.pool.get("h:1")
        assert backend is not None
        self.pool.mark_down(backend, "outlier: 5 consecutive 5xx")
        self.assertTrue(self.marks.unsent["h:1"].healthy)
        self.pool.mark_up(backend)
        self.pool.mark_down(backend, "proxy: connection refused (nothing listens)")
        self.assertFalse(self.marks.unsent["h:1"].healthy)
        self.pool.mark_up(backend)  # the next successful probe clears it for everyone
        self.assertTrue(self.marks.unsent["h:1"].healthy)

    def test_a_drain_elsewhere_does_not_bring_back_a_local_ejection(self) -> None:
        backend = self.pool.get("h:1")
        assert backend is not None
        self.pool.mark_down(backend, "outlier: 5 consecutive 5xx")
        self.marks.read([entry("h:1", "other", draining=True)])
        self.pool.refresh()
        self.assertFalse(backend.health.healthy)
        self.assertTrue(backend.health.draining)

    def test_a_refusal_elsewhere_takes_it_out_here(self) -> None:
        self.marks.read([entry("h:2", "other")], whole=True)
        self.pool.refresh()
        self.marks.read([entry("h:2", "other", healthy=False)])
        self.pool.refresh()
        backend = self.pool.get("h:2")
        assert backend is not None
        self.assertFalse(backend.health.healthy)

    def test_a_refusal_elsewhere_is_probed_here_before_it_takes_it_out(self) -> None:
        # replica A alone is refused (its own host's firewall); this replica reaches h:2
        probed: list[str] = []
        reachable = True
        backend = self.pool.get("h:2")
        assert backend is not None

        def probe(suspect: Any) -> None:
            probed.append(suspect.key)
            if reachable:
                self.pool.probe_succeeded(suspect, rise=1)
            else:
                self.pool.probe_failed(suspect, "probe: connection refused", True, fall=3)

        self.pool.on_suspect.append(probe)
        self.marks.read([entry("h:2", "A")], whole=True)
        self.pool.refresh()
        for healthy in (False, True, False, True, False):  # A's probes, then B's, in turn
            self.marks.read([entry("h:2", "A", healthy=healthy)])
            self.pool.refresh()
            self.assertTrue(backend.health.healthy)
        self.assertEqual(probed, ["h:2"] * 3)
        self.assertEqual(self.marks.unsent, {})  # nothing of ours to tell the others
        # refused here too: out here, and said so
        reachable = False
        self.marks.read([entry("h:2", "A", healthy=True)])
        self.pool.refresh()
        self.marks.read([entry("h:2", "A", healthy=False)])
        self.pool.refresh()
        self.assertFalse(backend.health.healthy)

    def test_added_and_removed_elsewhere(self) -> None:
        self.marks.read([entry("h:3", "other")])
        self.pool.refresh()
        self.assertIsNotNone(self.pool.get("h:3"))
        self.marks.read([entry("h:3", "other", removing=True)])
        self.pool.refresh()
        self.assertIsNone(self.pool.get("h:3"))

    def test_the_configured_backends_are_claims(self) -> None:
        marks = SharedMarks("me")
        Pool((BackendSpec("h", 1),), store=_Store(marks))
        self.assertEqual(list(marks.claims), ["h:1"])
        self.assertTrue(marks.claims["h:1"].claim)
        self.assertEqual(marks.claims["h:1"].origin, "config")
        self.assertEqual(marks.unsent, {})

    def test_a_drain_before_redis_answered_is_a_change_not_a_claim(self) -> None:
        # an admin drain made while Redis has been unreachable since the start must win
        # over the older entry Redis holds: it is sent as a write, not insert-if-absent
        marks = SharedMarks("me")
        pool = Pool((BackendSpec("h", 1),), store=_Store(marks))
        backend = pool.get("h:1")
        assert backend is not None
        pool.drain(backend)
        sent = marks.unsent["h:1"]
        assert sent is not None
        self.assertTrue(sent.draining)
        self.assertFalse(sent.claim)
        self.assertFalse(marks.claims["h:1"].draining)

    def test_a_health_verdict_before_redis_answered_stays_a_claim(self) -> None:
        # a probe marking a configured backend down before the first contact must not
        # overwrite a drain stored in Redis with this replica's draining=False
        marks = SharedMarks("me")
        pool = Pool((BackendSpec("h", 1),), store=_Store(marks))
        backend = pool.get("h:1")
        assert backend is not None
        pool.mark_down(backend, "probe: connection refused")
        self.assertEqual(marks.unsent, {})
        self.assertTrue(marks.claims["h:1"].claim)
        self.assertFalse(marks.claims["h:1"].healthy)

    def test_a_start_up_claim_never_undrains_a_known_backend(self) -> None:
        # Redis restarted empty; replica C starts and claims h:1 as it is configured
        self.marks.read([entry("h:1", "other", draining=True)])
        self.pool.refresh()
        claim = Entry(BackendSpec("h", 1), False, False, True, "C", "config", claim=True)
        self.assertFalse(self.marks.read([("h:1", claim.encode())]))
        self.pool.refresh()
        backend = self.pool.get("h:1")
        assert backend is not None
        self.assertTrue(backend.health.draining)
        # ... and what this replica knows goes back to Redis, over the claim
        written = self.marks.unsent["h:1"]
        assert written is not None
        self.assertTrue(written.draining)
        self.assertFalse(written.claim)

    def test_a_start_up_claim_adds_a_backend_nobody_knew(self) -> None:
        claim = Entry(BackendSpec("h", 7), False, False, True, "C", "config", claim=True)
        self.assertTrue(self.marks.read([("h:7", claim.encode())]))
        self.pool.refresh()
        self.assertIsNotNone(self.pool.get("h:7"))

    def test_a_dns_backend_leaves_the_hash_once_forgotten(self) -> None:
        self.pool.add(BackendSpec("10.0.0.3", 80), origin="dns:vllm.test")
        backend = self.pool.get("10.0.0.3:80")
        assert backend is not None
        self.pool.remove(backend)
        self.assertIsNone(self.pool.get("10.0.0.3:80"))
        self.assertEqual(self.marks.entries(self.marks.unsent), [("10.0.0.3:80", "")])
        self.assertNotIn("10.0.0.3:80", self.marks.known())

    def test_a_configured_backend_keeps_its_removal(self) -> None:
        backend = self.pool.get("h:1")
        assert backend is not None
        self.pool.remove(backend)
        sent = self.marks.unsent["h:1"]
        assert sent is not None
        self.assertTrue(sent.removing)  # kept: a restart with that config keeps it out

    def test_a_deleted_field_removes_a_backend_not_seen_removed(self) -> None:
        self.marks.read([entry("h:3", "other")])
        self.pool.refresh()
        self.assertTrue(self.marks.read([("h:3", "")]))
        self.pool.refresh()
        self.assertIsNone(self.pool.get("h:3"))

    def test_origin_is_carried_and_optional(self) -> None:
        spec = BackendSpec("10.0.0.3", 80)
        text = Entry(spec, False, False, True, "A", "dns:vllm.test").encode()
        decoded = Entry.decode("10.0.0.3:80", text)
        assert decoded is not None
        self.assertEqual(decoded.origin, "dns:vllm.test")
        self.assertNotIn("origin", Entry(spec, False, False, True, "A").encode())
        old = Entry.decode("10.0.0.3:80", Entry(spec, False, False, True, "A").encode())
        assert old is not None
        self.assertIsNone(old.origin)
        self.marks.read([("10.0.0.3:80", text)])
        self.pool.refresh()
        self.assertEqual(self.pool.origin("10.0.0.3:80"), "dns:vllm.test")
        self.assertEqual(self.pool.origin("h:1"), "config")

    def test_a_host_nobody_could_use_is_refused(self) -> None:
        def forged(host: str) -> tuple[str, str]:
            text = json.dumps({"spec": [host, 80, 1, 0, []], "draining": False,
                               "removing": False, "healthy": True, "by": "x"})
            return f"{host}:80", text

        for host in ("evil\nbackend 10.0.0.1:80 added", "0.0.0.0", "224.0.0.1",
                     "fe80::1", "a b", "", "x" * 300, "h\x00"):
            self.assertIsNone(Entry.decode(*forged(host)), repr(host))
        self.assertIsNotNone(Entry.decode(*forged("gpu-3.example")))
        self.assertFalse(self.marks.read([forged("evil\nfake log line")]))

    def test_poison_in_one_field_leaves_the_others_read(self) -> None:
        infinite = ('{"spec":["10.9.9.9",Infinity,1,0,[]],"draining":false,'
                    '"removing":false,"healthy":true,"by":"x"}')
        deep = "[" * 5000 + "]" * 5000
        self.assertIsNone(Entry.decode("10.9.9.9:80", infinite))
        self.assertIsNone(Entry.decode("10.9.9.8:80", deep))
        self.assertTrue(self.marks.read([("10.9.9.9:80", infinite), ("10.9.9.8:80", deep),
                                         entry("h:1", "other", draining=True)]))
        self.pool.refresh()
        backend = self.pool.get("h:1")
        assert backend is not None
        self.assertTrue(backend.health.draining)
        self.assertEqual(self.marks.status()["ignored"], 2)

    def test_removed_entries_never_crowd_out_a_live_one(self) -> None:
        from txlb._shared import marks as marks_module

        self.patch(marks_module, "MAX_MEMBERS", 2)
        tombstones = [entry(f"10.0.0.{i}:80", "old", removing=True) for i in range(10)]
        self.marks.read([*tombstones, entry("h:5", "other")], whole=True)
        self.pool.refresh()
        self.assertIsNotNone(self.pool.get("h:5"))  # 1 of 2: the ten removed do not count
        # beyond the bound, also one at a time (an incremental read)
        for port in (6, 7):
            self.marks.read([entry(f"h:{port}", "other")])
        self.pool.refresh()
        self.assertIsNotNone(self.pool.get("h:6"))
        self.assertIsNone(self.pool.get("h:7"))

    def test_garbage_in_the_hash_is_ignored(self) -> None:
        self.assertFalse(self.marks.read([
            ("h:1", "not json"), ("h:1", json.dumps({"spec": 5})),
            ("h:9", entry("h:1", "other", draining=True)[1]),  # key and spec disagree
            ("h:1", "x" * 20000)]))


class _Store:
    counts = None

    def __init__(self, marks: SharedMarks) -> None:
        self.marks = marks


class RateTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.redis = FakeRedis()
        self.link = RedisLink(SPEC, self.clock, self.redis)
        self.link.call("PING", probe=True)
        self.replicas = 3

    def buckets(self) -> SharedRateBuckets:
        return SharedRateBuckets(RedisRateTakes(self.link, "txlb"), 30.0, 30, self.clock,
                                 lambda: self.replicas)

    def test_admits_at_once_and_takes_from_the_shared_bucket(self) -> None:
        buckets = self.buckets()
        self.redis.replies["EVALSHA"] = "25.0"
        self.assertEqual(buckets.take("ip:1"), 0.0)
        sent = self.redis.sent[-1]
        self.assertEqual(sent[0], "EVALSHA")
        self.assertTrue(sent[3].startswith("txlb:rate:"))
        self.assertNotIn("ip:1", " ".join(map(str, sent)))  # the key is digested

    def test_the_shared_level_sets_the_copy(self) -> None:
        buckets = self.buckets()
        self.redis.replies["EVALSHA"] = "-30"  # the fleet spent everything
        self.assertEqual(buckets.take("ip:1"), 0.0)
        self.assertGreater(buckets.take("ip:1"), 0)

    def test_between_answers_a_copy_refills_at_its_share(self) -> None:
        buckets = self.buckets()
        self.redis.replies["EVALSHA"] = "0"
        buckets.take("ip:1")
        self.clock.advance(1 / 10 - 0.001)  # 30/s over 3 replicas: one token per 0.1 s
        self.assertGreater(buckets.take("ip:1"), 0)
        self.clock.advance(0.002)
        self.assertEqual(buckets.take("ip:1"), 0.0)

    def test_redis_gone_the_copy_decides_alone(self) -> None:
        buckets = self.buckets()
        self.redis.broken = True
        self.link.call("PING", probe=True).addErrback(lambda f: None)
        sent = len(self.redis.sent)
        allowed = sum(buckets.take("ip:1") == 0 for _ in range(50))
        self.assertEqual(allowed, 10)  # a new key's copy: its share of the burst
        self.assertEqual(len(self.redis.sent), sent)


class StoreTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.redis = FakeRedis()
        self.store = RedisStore(SPEC, self.clock, self.redis, replica="r1")

    def test_balancer_uses_the_store_and_reports_it(self) -> None:
        config = build_config({"backends": "127.0.0.1:9",
                               "shared-state": "redis://:hunter2-secret@h:1/0"}, environ={})
        lb = LoadBalancer(config=config, reactor=self.clock)
        self.assertIsInstance(lb.store, RedisStore)
        # another replica's refusal sends this one's prober at once
        self.assertIn(lb.health.probe_soon, lb.pool.on_suspect)
        from prometheus_client import generate_latest

        text = generate_latest(lb.metrics.registry).decode()
        self.assertIn("txlb_shared_state_up 0.0", text)
        self.assertIn("txlb_shared_state_fallbacks_total 0.0", text)

    def test_poll_reads_the_others_and_falls_back(self) -> None:
        self.store.counts.register("a:1")
        self.redis.replies["EVALSHA"] = ["3", "0", "a:1", "4"]
        self.redis.replies["HSCAN"] = ["0", []]
        self.store.start()
        self.assertTrue(self.store.link.connected)
        self.assertEqual((self.store.replicas, self.store.counts.total("a:1")), (3, 4))
        freed: list[int] = []
        self.store.on_freed = lambda: freed.append(1)
        self.redis.stalled = True
        self.clock.advance(0.25)
        self.clock.advance(0.5)
        self.assertFalse(self.store.link.connected)
        self.assertEqual(self.store.counts.total("a:1"), 0)  # the local view
        self.assertEqual(freed, [1])

    def test_count_changes_are_written_together_within_the_flush_delay(self) -> None:
        self.store.counts.register("a:1")
        self.store.counts.register("b:1")
        self.redis.replies["EVALSHA"] = ["1", "0"]
        self.store.start()
        self.store.counts.take("a:1")
        self.store.counts.take("b:1")
        self.store.counts.take("a:1")
        self.clock.advance(FLUSH_DELAY - 0.001)
        self.assertFalse([c for c in self.redis.sent if c[0] == "HSET"])
        self.clock.advance(0.001)
        self.assertEqual([c for c in self.redis.sent if c[0] == "HSET"],
                         [("HSET", "txlb:inflight:r1", "a:1", 2, "b:1", 1)])

    def test_marks_wait_for_redis_and_go_when_it_is_back(self) -> None:
        self.redis.broken = True
        self.store.start()
        self.store.marks.configured()
        self.store.marks.save(BackendSpec("h", 1), Marks(draining=True))
        self.clock.advance(FLUSH_DELAY)
        self.assertEqual(list(self.store.marks.unsent), ["h:1"])
        self.redis.broken = False
        self.redis.replies["EVALSHA"] = ["1", "0"]
        self.clock.advance(0.25)
        self.assertEqual(self.store.marks.unsent, {})
        self.assertTrue(any(c[:2] == ("EVALSHA", WRITE.sha) and c[3] == "txlb:marks"
                            for c in self.redis.sent))


class StoreMarksTests(SynchronousTestCase):
    """How the store reads and writes the marks: by their change log, and after a loss."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.redis = FakeRedis()
        self.store = RedisStore(SPEC, self.clock, self.redis, replica="r1")
        self.pool = Pool((BackendSpec("h", 1),), clock=self.clock, store=self.store)
        self.store.attach(self.pool.refresh, self.pool.slots.capacity_changed)
        self.redis.scripts[POLL.sha] = ["2", "5"]
        self.redis.replies["HSCAN"] = ["0", [*entry("h:1", "r2")]]
        self.store.start()
        self.redis.sent.clear()

    def drained_elsewhere(self) -> list[str]:
        return ["7", "some", *entry("h:1", "r2", draining=True)]

    def test_a_change_reads_only_the_changed_fields(self) -> None:
        self.redis.scripts[POLL.sha] = ["2", "7"]
        self.redis.scripts[CHANGES.sha] = self.drained_elsewhere()
        self.clock.advance(0.1)
        self.assertEqual([c[7] for c in self.redis.ran(CHANGES)], ["5"])  # since 5
        self.assertFalse([c for c in self.redis.sent if c[0] == "HSCAN"])
        backend = self.pool.get("h:1")
        assert backend is not None
        self.assertTrue(backend.health.draining)
        self.clock.advance(0.1)  # version 7 read: nothing more to ask
        self.assertEqual(len(self.redis.ran(CHANGES)), 1)

    def test_a_log_that_cannot_say_reads_the_whole_hash(self) -> None:
        self.redis.scripts[POLL.sha] = ["2", "9000"]
        self.redis.scripts[CHANGES.sha] = ["9000", "whole"]
        self.redis.replies["HSCAN"] = ["0", [*entry("h:1", "r2", draining=True)]]
        self.clock.advance(0.1)
        self.assertEqual(len([c for c in self.redis.sent if c[0] == "HSCAN"]), 1)
        backend = self.pool.get("h:1")
        assert backend is not None
        self.assertTrue(backend.health.draining)

    def test_a_version_gone_back_writes_back_what_this_replica_knows(self) -> None:
        backend = self.pool.get("h:1")
        assert backend is not None
        self.pool.drain(backend)
        self.clock.advance(FLUSH_DELAY)
        self.redis.sent.clear()
        # Redis restarted empty without the link noticing (a failover, a FLUSHALL)
        self.redis.scripts[POLL.sha] = ["2", "0"]
        self.redis.replies["HSCAN"] = ["0", []]
        self.clock.advance(0.1)
        claimed = self.redis.ran(CLAIM)
        self.assertEqual(len(claimed), 1)
        fields = dict(zip(claimed[0][7::2], claimed[0][8::2], strict=True))
        restored = Entry.decode("h:1", fields["h:1"])
        assert restored is not None
        self.assertTrue(restored.draining)
        self.assertTrue(backend.health.draining)

    def test_one_read_at_a_time_in_pages(self) -> None:
        # a slow whole read must not have every poll meanwhile queue another behind it
        self.redis.scripts[POLL.sha] = ["2", "0"]  # lost: a whole read
        pages = iter([["17", [*entry("h:1", "r2", draining=True)]], Deferred()])
        real = self.redis.execute_command

        def answer(*args: Any, **kwargs: Any) -> Deferred[Any]:
            if args[0] == "HSCAN":
                self.redis.sent.append(args)
                reply = next(pages)
                return reply if isinstance(reply, Deferred) else succeed(reply)
            return real(*args, **kwargs)

        self.redis.execute_command = answer  # type: ignore[method-assign]
        for _ in range(4):
            self.clock.advance(0.1)
        scans = [c for c in self.redis.sent if c[0] == "HSCAN"]
        self.assertEqual([c[2] for c in scans], ["0", "17"])  # the next page, no new read
        self.assertEqual(scans[0][3:], ("COUNT", SCAN_PAGE))

    def test_a_poisoned_count_does_not_stop_the_marks(self) -> None:
        self.store.counts.register("h:1")
        self.redis.scripts[POLL.sha] = ["2", "7", "h:1", "\u00b2"]
        self.redis.scripts[CHANGES.sha] = self.drained_elsewhere()
        self.clock.advance(0.1)
        backend = self.pool.get("h:1")
        assert backend is not None
        self.assertTrue(backend.health.draining)
        self.assertEqual(self.store.counts.total("h:1"), 0)
        self.assertTrue(self.store.link.connected)

    def test_a_forgotten_dns_backend_is_deleted_with_the_version_bumped(self) -> None:
        backend = self.pool.add(BackendSpec("10.0.0.3", 80), origin="dns:vllm.test")
        self.clock.advance(FLUSH_DELAY)
        self.redis.sent.clear()
        self.pool.remove(backend)
        self.clock.advance(FLUSH_DELAY)
        written = self.redis.ran(WRITE)
        self.assertEqual(len(written), 1)
        self.assertEqual(written[0][7:], ("10.0.0.3:80", ""))


class LevelsTests(SynchronousTestCase):
    BUCKET = ("budget:minute:ip:1", 600.0, 10.0)

    def setUp(self) -> None:
        self.clock = Clock()
        self.redis = FakeRedis()
        self.link = RedisLink(SPEC, self.clock, self.redis)
        self.link.call("PING", probe=True)
        from txlb._shared.levels import SharedTokenLevels

        self.levels = SharedTokenLevels(self.link, "txlb", self.clock, lambda: 2)

    def test_a_reservation_moves_the_shared_bucket_and_takes_its_level(self) -> None:
        self.redis.replies["EVALSHA"] = ["100.0"]  # the other replica spent the rest
        self.assertEqual(self.levels.reserve([self.BUCKET], 50), 0.0)
        sent = self.redis.sent[-1]
        self.assertEqual((sent[0], sent[2], sent[4]), ("EVALSHA", 1, "-50.0"))
        self.assertNotIn("ip:1", " ".join(map(str, sent)))
        self.assertEqual(self.levels.level(self.BUCKET), 100.0)
        self.assertGreater(self.levels.reserve([self.BUCKET], 150), 0)  # does not fit

    def test_reconciling_gives_back_to_the_shared_bucket(self) -> None:
        self.redis.replies["EVALSHA"] = ["580.0"]
        self.levels.adjust([self.BUCKET], 30)
        self.assertEqual(self.redis.sent[-1][4], "30.0")
        self.assertEqual(self.levels.level(self.BUCKET), 580.0)

    def test_redis_gone_the_copy_decides_alone(self) -> None:
        self.redis.broken = True
        self.link.call("PING", probe=True).addErrback(lambda f: None)
        sent = len(self.redis.sent)
        self.assertEqual(self.levels.reserve([self.BUCKET], 500), 0.0)
        self.assertEqual(len(self.redis.sent), sent)
        # refilled at its share: 10/s over 2 replicas
        self.clock.advance(10)
        self.assertEqual(self.levels.level(self.BUCKET), 150.0)


class SharedDebtTests(SynchronousTestCase):
    def test_a_shared_bucket_takes_the_same_debt_as_a_local_one(self) -> None:
        """
        A request that cost more than it reserved is paid in full across the fleet as in
        one process: the shared script's floor is the local buckets' (DEBT_WINDOWS).
        """
        from txlb._cluster.store import DEBT_WINDOWS
        from txlb._shared import levels

        self.assertEqual(levels.DEBT, DEBT_WINDOWS)
        self.assertIn(f"math.max(-cap * {DEBT_WINDOWS}, math.min(cap, level))",
                      levels.MOVE.source)
