"""
The cache-aware index shared through ``--shared-state`` (:mod:`txlb._shared.prefixes`),
between replicas on one :class:`~twisted.internet.task.Clock` sharing an in-memory Redis
that keeps strings and streams as Redis does (``SET NX``, ``XADD MAXLEN``, ``XREAD``).
The real server runs the same commands in tests/integration/test_shared_prefixes_process.py.
"""

from __future__ import annotations

import json
import random
from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from txlb import LoadBalancer
from txlb._config import build_config
from txlb._config.shared import SharedStateSpec
from txlb._scheduling.policies.cache_aware import CacheAware
from txlb._scheduling.request import RoutingRequest
from txlb._shared.prefixes import (
    ENTRY_BLOCKS,
    FLEET_KEY,
    READ_ENTRIES,
    WRITE_ENTRIES,
    SharedPrefixIndex,
    stream_length,
)
from txlb._shared.store import POLL, POLL_INTERVAL, RedisStore

from .test_shared_state import redis_answer

SPEC = SharedStateSpec("127.0.0.1", 6379)
BACKENDS = "127.0.0.1:8001,127.0.0.1:8002,127.0.0.1:8003,127.0.0.1:8004"
KEY_NAME = "txlb:prefix-key"
STREAM = "txlb:prefix"


class FleetRedis:
    """One Redis for every replica of a test: the commands they send, with Redis's meaning."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.strings: dict[str, str] = {}
        self.streams: dict[str, list[tuple[tuple[int, int], list[str]]]] = {}
        self.sent: list[tuple[Any, ...]] = []
        self.down = False

    def lose_everything(self) -> None:
        """A restart without persistence: the key and the stream are gone."""
        self.strings.clear()
        self.streams.clear()

    def execute_command(self, *args: Any, **kwargs: Any) -> Deferred[Any]:
        self.sent.append(args)
        if self.down:
            return fail(ConnectionError("Connection refused"))
        name = args[0]
        if name in ("EVALSHA", "EVAL"):
            keys = args[3:3 + int(args[2])]
            argv = args[3 + int(args[2]):]
            if args[1] in (FLEET_KEY.sha, FLEET_KEY.source):
                return succeed(self.strings.setdefault(keys[0], argv[0]))
            if args[1] in (POLL.sha, POLL.source):
                return succeed(["2", "0"])
            return succeed(0)
        if name == "XADD":
            return succeed(self._xadd(args[1:]))
        if name == "XREAD":
            return succeed(self._xread(args[1:]))
        return succeed(redis_answer(args))

    def _xadd(self, args: tuple[Any, ...]) -> str:
        key, maxlen, approx, length, star, *fields = args
        assert (maxlen, approx, star) == ("MAXLEN", "~", "*")
        entries = self.streams.setdefault(key, [])
        ms = int(self.clock.seconds() * 1000)
        seq = 0
        if entries and entries[-1][0][0] >= ms:
            ms, seq = entries[-1][0][0], entries[-1][0][1] + 1
        entries.append(((ms, seq), [str(field) for field in fields]))
        del entries[:-int(length)]
        return f"{ms}-{seq}"

    def _xread(self, args: tuple[Any, ...]) -> object:
        count_word, count, streams_word, key, last = args
        assert (count_word, streams_word) == ("COUNT", "STREAMS")
        ms, _, seq = str(last).partition("-")
        after = (int(ms), int(seq or 0))
        found = [[f"{i[0]}-{i[1]}", fields] for i, fields in self.streams.get(key, [])
                 if i > after][:int(count)]
        return [[key, found]] if found else None

    def added(self) -> list[tuple[Any, ...]]:
        return [args for args in self.sent if args[0] == "XADD"]


def replica(redis: FleetRedis, name: str, **options: str) -> LoadBalancer:
    config = build_config({"backends": BACKENDS, "policy": "cache-aware",
                           "shared-state": "redis://127.0.0.1:6379/0", **options},
                          environ={})
    store = RedisStore(SPEC, redis.clock, redis, replica=name)
    return LoadBalancer(config=config, reactor=redis.clock, store=store)


def started(lb: LoadBalancer) -> LoadBalancer:
    lb.store.start()  # type: ignore[attr-defined]
    return lb


def policy_of(lb: LoadBalancer) -> CacheAware:
    assert isinstance(lb.policy, CacheAware)
    return lb.policy


def shared_of(lb: LoadBalancer) -> SharedPrefixIndex:
    assert lb.shared_index is not None
    return lb.shared_index


def prompt(text: str, size: int = 2000) -> dict[str, object]:
    return {"model": "m", "prompt": (text * size)[:size]}


def pick(lb: LoadBalancer, body: dict[str, object]) -> str:
    return policy_of(lb).choose(list(lb.pool), RoutingRequest(json=body, model="m")).key


def chain(lb: LoadBalancer, body: dict[str, object]) -> list[int]:
    return policy_of(lb).hasher.key(body, "m")[0]


class Logged:
    def __init__(self, test: SynchronousTestCase) -> None:
        self.events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(self.events.append)
        test.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def text(self) -> str:
        return "\n".join(formatEvent(event) + repr(event) for event in self.events)


class FleetKeyTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.redis = FleetRedis(self.clock)

    def test_every_replica_hashes_with_the_one_stored_key(self) -> None:
        a, b = started(replica(self.redis, "a")), started(replica(self.redis, "b"))
        body = prompt("a long system prompt ")
        self.assertEqual(chain(a, body), chain(b, body))
        self.assertTrue(chain(a, body))
        self.assertEqual(list(self.redis.strings), [KEY_NAME])
        self.assertEqual(len(bytes.fromhex(self.redis.strings[KEY_NAME])), 32)
        # a replica started later takes the stored key, it does not make its own
        stored = self.redis.strings[KEY_NAME]
        c = started(replica(self.redis, "c"))
        self.assertEqual(self.redis.strings[KEY_NAME], stored)
        self.assertEqual(chain(c, body), chain(a, body))
        self.assertTrue(shared_of(c).sharing)

    def test_without_the_key_a_replica_hashes_alone_and_publishes_nothing(self) -> None:
        self.redis.down = True
        a = started(replica(self.redis, "a"))
        b = started(replica(self.redis, "b"))
        body = prompt("tenant one ")
        before = chain(a, body)
        self.assertNotEqual(before, chain(b, body))  # each its own key, drawn at start
        backend = pick(a, body)
        self.clock.advance(POLL_INTERVAL * 3)
        self.assertEqual(self.redis.added(), [])
        self.assertFalse(shared_of(a).sharing)
        index = policy_of(a).index.of(a.pool.get(backend))  # type: ignore[arg-type]
        index.capacity = 500  # learned from the engine: survives the switch
        self.assertGreater(len(index), 0)

        self.redis.down = False
        self.clock.advance(POLL_INTERVAL * 3)
        self.assertTrue(shared_of(a).sharing)
        self.assertEqual(chain(a, body), chain(b, body))
        self.assertNotEqual(chain(a, body), before)
        # its blocks were named with the old key: they go, what it learned stays
        self.assertEqual((len(index), index.capacity), (0, 500))
        self.assertEqual(policy_of(a).index.entries, 0)

    def test_a_malformed_key_in_redis_is_not_used(self) -> None:
        log = Logged(self)
        self.redis.strings[KEY_NAME] = "not hex at all"
        a = started(replica(self.redis, "a"))
        self.clock.advance(POLL_INTERVAL * 5)
        self.assertFalse(shared_of(a).sharing)
        pick(a, prompt("x "))
        self.clock.advance(POLL_INTERVAL * 2)
        self.assertEqual(self.redis.added(), [])
        warnings = [e for e in log.events if "is not a key" in formatEvent(e)]
        self.assertEqual(len(warnings), 1)  # once, not every poll
        self.assertNotIn("not hex at all", log.text())

    def test_the_key_is_never_logged_nor_shown(self) -> None:
        log = Logged(self)
        a, b = started(replica(self.redis, "a")), started(replica(self.redis, "b"))
        pick(a, prompt("some prompt "))
        self.clock.advance(POLL_INTERVAL * 2)
        self.redis.down = True
        self.clock.advance(1.0)
        self.redis.down = False
        self.clock.advance(1.0)
        key = self.redis.strings[KEY_NAME]
        secret = bytes.fromhex(key)
        shown = json.dumps([a.store.status(), shared_of(a).status(),  # type: ignore[attr-defined]
                            policy_of(b).describe(next(iter(b.pool)))])
        for text in (log.text(), shown, repr(self.redis.added())):
            self.assertNotIn(key, text)
            self.assertNotIn(repr(secret)[2:-1], text)
        self.assertTrue(shared_of(a).status()["shared"])
        self.assertIn("the cache-aware index is the fleet's", log.text())


class SharingTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.redis = FleetRedis(self.clock)
        self.a = started(replica(self.redis, "a"))
        self.b = started(replica(self.redis, "b"))

    def spread_a(self) -> str:
        """A sends three other prompts first, so the next lands where B would not put it."""
        for n in range(3):
            pick(self.a, prompt(f"other {n} "))
        return pick(self.a, prompt("the shared system prompt "))

    def test_a_send_on_one_replica_is_a_hit_on_the_other(self) -> None:
        where = self.spread_a()
        long_prompt = prompt("the shared system prompt ")
        follow_up = {"model": "m", "prompt": str(long_prompt["prompt"]) + " and a question"}
        # before B read A's entries, B picks by least-conn: not where A sent it
        fresh = replica(self.redis, "control")
        self.assertNotEqual(pick(fresh, follow_up), where)
        self.clock.advance(POLL_INTERVAL)  # A writes, B reads, at the next poll
        self.assertEqual(pick(self.b, follow_up), where)
        self.assertGreater(shared_of(self.b).applied, 0)
        self.assertEqual(shared_of(self.b).ignored, 0)

    def test_published_with_the_poll_never_on_the_pick(self) -> None:
        before = len(self.redis.sent)
        self.spread_a()
        self.assertEqual(len(self.redis.sent), before)  # no command on the request's path
        self.clock.advance(POLL_INTERVAL)
        added = self.redis.added()
        self.assertEqual(len(added), 1)  # four picks, one entry
        fields = dict(zip(added[0][6::2], added[0][7::2], strict=True))
        self.assertEqual(fields["r"], "a")
        self.assertEqual(len(json.loads(fields["c"])), 4)
        self.assertEqual(added[0][4], stream_length(200_000))

    def test_own_entries_are_not_applied_again(self) -> None:
        where = self.spread_a()
        index = policy_of(self.a).index.of(self.a.pool.get(where))  # type: ignore[arg-type]
        size = len(index)
        self.clock.advance(POLL_INTERVAL * 3)
        self.assertEqual((shared_of(self.a).applied, len(index)), (0, size))

    def test_a_removed_backend_is_ignored(self) -> None:
        where = self.spread_a()
        gone = self.b.pool.get(where)
        assert gone is not None
        lease = self.b.pool.slots.acquire(gone)  # a request still running: removed when it ends
        self.b.pool.remove(gone)
        self.assertIs(self.b.pool.get(where), gone)
        self.clock.advance(POLL_INTERVAL)
        self.assertIsNone(policy_of(self.b).index.get(gone))
        self.assertEqual(shared_of(self.b).ignored, 1)
        self.assertEqual(shared_of(self.b).applied, 3)
        follow_up = prompt("the shared system prompt ")
        self.assertNotEqual(pick(self.b, follow_up), where)
        lease.release()
        self.assertIsNone(self.b.pool.get(where))

    def test_hostile_entries_are_ignored(self) -> None:
        fingerprint = json.loads(json.dumps(self.redis.added()))  # none yet
        self.assertEqual(fingerprint, [])
        pick(self.a, prompt("real "))
        self.clock.advance(POLL_INTERVAL)
        good = dict(zip(self.redis.added()[0][6::2], self.redis.added()[0][7::2], strict=True))
        stream = self.redis.streams[STREAM]
        bad_entries = [
            ["r", "x", "f", "0" * 16, "c", good["c"]],         # another key's blocks
            ["r", "x", "f", good["f"], "c", "{not json"],
            ["r", "x", "f", good["f"], "c", json.dumps({"a": 1})],
            ["r", "x", "f", good["f"], "c", json.dumps([["127.0.0.1:9999", "00" * 8]])],
            ["r", "x", "f", good["f"], "c", json.dumps([["127.0.0.1:8001", "zz" * 8]])],
            ["r", "x", "f", good["f"], "c", json.dumps([["127.0.0.1:8001", "0" * 15]])],
            ["r", "x", "f", good["f"], "c", json.dumps([["127.0.0.1:8001", "00" * 8 * 300]])],
            ["r", "x", "f", good["f"], "c", json.dumps([["127.0.0.1:8001", "00 00 00 00 0000"]])],
            ["r", "x", "f", good["f"], "c", json.dumps([[1, 2], "x", None])],
            ["r", "x"],
        ]
        for n, fields in enumerate(bad_entries):
            stream.append(((10**13, n), fields))
        self.clock.advance(POLL_INTERVAL * 3)
        shared = shared_of(self.b)
        self.assertEqual(shared.applied, 1)  # A's real one only
        self.assertEqual(shared.ignored, 12)
        self.assertEqual(shared.last_id, f"{10**13}-{len(bad_entries) - 1}")

    def test_a_flood_stays_within_every_bound(self) -> None:
        """Endless distinct prompts at A: A's publishing, Redis and B's index stay bounded."""
        rng = random.Random(7)
        a, b = policy_of(self.a), policy_of(self.b)
        backends = list(self.a.pool)
        for _ in range(12):
            self.redis.sent.clear()
            for _ in range(200):  # 200 distinct 256-block prompts per poll interval
                flood = [rng.getrandbits(64) for _ in range(256)]
                backend = rng.choice(backends)
                a.index.sent(backend, flood)
                assert a.on_sent is not None
                a.on_sent(backend, flood)
            self.clock.advance(POLL_INTERVAL)
            added = self.redis.added()
            self.assertLessEqual(len(added), WRITE_ENTRIES)
            for args in added:
                batch = json.loads(dict(zip(args[6::2], args[7::2], strict=True))["c"])
                self.assertLessEqual(sum(len(text) // 16 for _, text in batch), ENTRY_BLOCKS)
            self.assertLessEqual(len(self.redis.streams[STREAM]), stream_length(200_000))
            reads = [args for args in self.redis.sent if args[0] == "XREAD"]
            self.assertTrue(all(args[2] == READ_ENTRIES for args in reads))
            for index in b.index.indexes():
                self.assertLessEqual(len(index), index.capacity)
            self.assertLessEqual(b.index.entries, b.index.max_entries)
        self.assertGreater(shared_of(self.a).unpublished, 0)
        self.assertGreater(shared_of(self.b).applied, 0)

    def test_while_redis_is_down_what_waits_is_a_poll_s_worth(self) -> None:
        self.redis.down = True
        self.clock.advance(1.0)
        rng = random.Random(3)
        a = policy_of(self.a)
        backend = next(iter(self.a.pool))
        for _ in range(2000):
            flood = [rng.getrandbits(64) for _ in range(256)]
            assert a.on_sent is not None
            a.on_sent(backend, flood)
        shared = shared_of(self.a)
        self.assertLessEqual(shared.pending_blocks, WRITE_ENTRIES * ENTRY_BLOCKS)
        self.assertGreater(shared.unpublished, 1900)
        self.redis.down = False
        self.clock.advance(POLL_INTERVAL * 2)
        self.assertEqual(shared.pending_blocks, 0)
        self.assertLessEqual(len(self.redis.added()), WRITE_ENTRIES)

    def test_a_small_index_keeps_a_short_stream(self) -> None:
        self.assertEqual(stream_length(200_000), 196)
        self.assertEqual(stream_length(1000), WRITE_ENTRIES)


class FallbackTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.redis = FleetRedis(self.clock)
        self.a = started(replica(self.redis, "a"))
        self.b = started(replica(self.redis, "b"))

    def test_redis_gone_each_keeps_its_index_then_resumes(self) -> None:
        log = Logged(self)
        first = pick(self.a, prompt("before "))
        self.clock.advance(POLL_INTERVAL)
        self.redis.down = True
        self.clock.advance(POLL_INTERVAL * 5)
        self.assertFalse(self.a.store.link.connected)  # type: ignore[attr-defined]
        # still picking, on its own index
        self.assertEqual(pick(self.a, prompt("before ")), first)
        during = pick(self.a, prompt("while down "))
        self.redis.down = False
        self.clock.advance(POLL_INTERVAL * 3)
        # the same key: nothing restarted, and what A sent meanwhile reached B
        self.assertEqual(pick(self.b, prompt("while down ")), during)
        self.assertEqual(pick(self.b, prompt("before ")), first)
        downs = [e for e in log.events if "unreachable" in formatEvent(e)]
        self.assertEqual(len(downs), 2)  # once per replica, by the link
        self.assertNotIn("starts again", log.text())

    def test_redis_lost_its_data_every_replica_takes_the_new_key(self) -> None:
        pick(self.a, prompt("old "))
        self.clock.advance(POLL_INTERVAL)
        old = self.redis.strings[KEY_NAME]
        self.redis.down = True
        self.clock.advance(1.0)
        self.redis.lose_everything()
        self.redis.down = False
        self.clock.advance(POLL_INTERVAL * 3)
        new = self.redis.strings[KEY_NAME]
        self.assertNotEqual(new, old)
        body = prompt("after ")
        self.assertEqual(chain(self.a, body), chain(self.b, body))
        self.assertEqual(policy_of(self.a).index.entries, 0)
        where = pick(self.a, body)
        self.clock.advance(POLL_INTERVAL)
        self.assertEqual(pick(self.b, body), where)

    def test_a_reader_behind_the_trimmed_stream_goes_on_from_its_oldest(self) -> None:
        for n in range(stream_length(200_000) + 40):
            pick(self.a, prompt(f"tenant {n} "))
            self.clock.advance(POLL_INTERVAL)
        stream = self.redis.streams[STREAM]
        self.assertEqual(len(stream), stream_length(200_000))  # trimmed
        late = replica(self.redis, "late")  # not polling on its own
        late.store.link.connected = True  # type: ignore[attr-defined]
        reader = shared_of(late)
        reader.poll()  # the key
        self.assertTrue(reader.sharing)
        reader.last_id = "1-0"  # its last entry was trimmed long ago
        reader.poll()
        self.assertEqual(reader.applied, READ_ENTRIES)  # a poll's worth, no more
        newest_read = stream[READ_ENTRIES - 1][0]
        self.assertEqual(reader.last_id, f"{newest_read[0]}-{newest_read[1]}")

    def test_a_reload_s_new_policy_hashes_with_the_fleet_key(self) -> None:
        body = prompt("reloaded ")
        shared = chain(self.b, body)
        config = build_config({"backends": BACKENDS, "policy": "cache-aware",
                               "cache-load": "1.5",
                               "shared-state": "redis://127.0.0.1:6379/0"}, environ={})
        old = self.a.policy
        self.a.reload(config)
        self.assertIsNot(self.a.policy, old)
        self.assertEqual(chain(self.a, body), shared)
        assert isinstance(old, CacheAware)
        self.assertIsNone(old.on_sent)


class PollHookTests(SynchronousTestCase):
    def test_a_failing_listener_stops_neither_the_poll_nor_the_others(self) -> None:
        clock = Clock()
        redis = FleetRedis(clock)
        store = RedisStore(SPEC, clock, redis, replica="a")
        heard: list[int] = []

        def broken() -> None:
            raise RuntimeError("a bug in a listener")

        store.on_poll += [broken, lambda: heard.append(1)]
        log = Logged(self)
        store.start()
        for _ in range(3):  # one advance each: a LoopingCall runs once per advance
            clock.advance(POLL_INTERVAL)
        self.assertEqual(len(heard), 4)  # every poll, the first one included
        polls = [args for args in redis.sent if args[0] == "EVALSHA" and args[1] == POLL.sha]
        self.assertEqual(len(polls), 4)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 4)
        self.assertIn("a shared-state poll listener failed", log.text())
