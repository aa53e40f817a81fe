"""
The fleet's fair-share counters and revoked keys (:mod:`txlb._shared.fair`), against a
scripted link: what is sent, how an answer is taken, and what a hostile one cannot do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.trial.unittest import SynchronousTestCase

from txlb._config import build_config
from txlb._scheduling.fairness import FairShares
from txlb._shared.fair import SYNC_EVERY, SharedTenants

DIGEST = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"


class _Link:
    def __init__(self) -> None:
        self.connected = True
        self.sent: list[tuple[list[str], list[str]]] = []
        self.reply: Any = ["0"]

    def run(self, script: Any, keys: list[str], args: list[str]) -> Deferred[Any]:
        self.sent.append((keys, args))
        if isinstance(self.reply, Exception):
            return fail(self.reply)
        return succeed(self.reply)


class _Store:
    prefix = "txlb"

    def __init__(self) -> None:
        self.link = _Link()
        self.on_poll: list[Callable[[], object]] = []


class SyncTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.store = _Store()
        self.fair = FairShares(enabled=True)
        self.shared = SharedTenants(self.store, self.fair)  # type: ignore[arg-type]
        self.shared.reconfigure(build_config({"backends": "10.0.0.1:1"}, {}))
        self.shared.enabled = True

    def sync(self) -> None:
        for _ in range(SYNC_EVERY):
            self.store.on_poll[0]()

    def test_changes_are_sent_and_the_fleets_counters_taken(self) -> None:
        self.fair._add("alpha", 100.0)
        self.store.link.reply = ["2", "alpha", "350", "beta", "20.5", DIGEST]
        revoked: list[frozenset[str]] = []
        self.shared.on_revoked.append(revoked.append)
        self.sync()
        self.assertEqual(self.store.link.sent, [(["txlb:vtc", "txlb:revoked"],
                                                ["alpha", "100.0"])])
        self.assertEqual(self.fair.counters, {"alpha": 350.0, "beta": 20.5})
        self.assertEqual(revoked, [frozenset({DIGEST})])

    def test_a_change_made_during_the_sync_is_kept(self) -> None:
        link = self.store.link
        answer: Deferred[Any] = Deferred()
        link.run = lambda *args: answer  # type: ignore[method-assign]
        self.sync()
        self.fair._add("alpha", 7.0)  # after the sync left
        answer.callback(["1", "alpha", "100"])
        self.assertEqual(self.fair.counters["alpha"], 107.0)

    def test_a_hostile_answer_changes_nothing_it_should_not(self) -> None:
        for reply in (["x"], ["99999999"], ["2", "alpha", "1"], ["-1"]):
            self.store.link.reply = reply
            self.sync()
        self.assertEqual(self.fair.counters, {})
        self.store.link.reply = ["3", "bad name", "5", "alpha", "inf", "beta", "nan", "not hex"]
        self.sync()
        self.assertEqual(self.fair.counters, {})
        self.assertEqual(self.shared.revoked, frozenset())

    def test_nothing_is_sent_without_keys_or_while_redis_is_gone(self) -> None:
        self.shared.enabled = False
        self.sync()
        self.assertEqual(self.store.link.sent, [])
        self.shared.enabled = True
        self.store.link.connected = False
        self.fair._add("alpha", 5.0)
        self.sync()
        self.assertEqual(self.store.link.sent, [])
        self.assertEqual(self.shared.unshared, 1)
        self.assertEqual(self.fair.counters, {"alpha": 5.0})  # the local count goes on

    def test_a_failed_sync_is_never_counted_twice(self) -> None:
        self.fair._add("alpha", 5.0)
        self.store.link.reply = ConnectionError("gone")
        self.sync()
        self.store.link.reply = ["0"]
        self.sync()
        self.assertEqual(self.store.link.sent[-1][1], [])
        self.assertEqual(self.shared.unshared, 1)
