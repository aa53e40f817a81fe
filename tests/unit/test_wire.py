"""
The typed messages between a ``--workers`` supervisor and its workers (txlb._workers.wire):
every message survives the trip, and a line that is no message is refused -- never a crash
of the supervisor that reads it.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
from twisted.trial.unittest import SynchronousTestCase

from txlb._records.summary import Summary
from txlb._workers import wire
from txlb._workers.wire import (
    MAX_SPENT_BUCKETS,
    Answer,
    BudgetRefused,
    Down,
    Finished,
    Hello,
    Kick,
    Levels,
    Log,
    Ready,
    Reload,
    Retry,
    Revoked,
    Served,
    Shared,
    Spent,
    State,
    Stop,
    Suspect,
    Take,
    Taken,
    Wait,
    WireError,
    decode,
    encode,
)

SUMMARY = Summary(time=1.5, orid="ORD-1", backend="h:1", method="POST",
                  path="/v1/chat/completions", status=200, kind="completion", outcome="ok",
                  dur=2.0, ttft=0.1, finish="stop", preview="é\nx", req_keys=["a"], tries=2)
STATE = [{"spec": {"host": "127.0.0.1", "port": 9}, "slot": 0, "healthy": True}]

#: One of every message, both directions.
EVERY_MESSAGE: list[Any] = [
    Hello(workers=2, slots=64, family=2, config="Y29uZmln", state=STATE),
    State(STATE),
    Reload(config="Y29uZmln"),
    Kick(),
    Stop(),
    Ready(4242),
    Finished(SUMMARY, True),
    Finished(attrs.evolve(SUMMARY, backend=None, status=404), False),
    Answer("h:1", 503, "ip:10.0.0.1"),
    Answer("h:1", 500, None),
    Suspect("h:1"),
    Retry(),
    Wait(0.25),
    Wait(3),
    Down("h:1", "hung: no byte from any of 2 requests"),
    Log("warn", "txlb._workers.main", "line one\nline two \ud800"),
    Spent([["per-ip", 60, "ip:10.0.0.1"], ["per-ip", 86400.0, "ip:10.0.0.1"]], 150, 0),
    Spent([["acme", 60.0, "token:0f2c"]], -42.5, 107),
    Served("search", 412.5),
    Served("batch.jobs", -37.0),
    Revoked(["9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"]),
    BudgetRefused("per-ip"),
    Shared(True, 3),
    Taken(7, True, 4.5),
    Taken(8, True, None),
    Taken(9, False, None),
    Levels([["per-ip\x1f60\x1fip:10.0.0.1", 600.0, 10.0, -25.5]]),
    Take(7, "0f2c" * 8, 10.0, 10),
]


def line(value: object) -> bytes:
    return json.dumps(value).encode("ascii")


class RoundTripTests(SynchronousTestCase):
    def test_every_message_survives_the_trip(self) -> None:
        for message in EVERY_MESSAGE:
            encoded = encode(message)
            self.assertTrue(encoded.endswith(b"\n"))
            self.assertNotIn(b"\n", encoded[:-1], message)  # one line each
            self.assertEqual(decode(encoded[:-1]), message)

    def test_every_message_type_is_covered(self) -> None:
        types = {type(message) for message in EVERY_MESSAGE}
        for name in ("ToWorker", "FromWorker"):
            self.assertEqual(set(getattr(wire, name).__args__) - types, set())

    def test_objects_name_their_type_and_fields(self) -> None:
        self.assertEqual(json.loads(encode(Answer("h:1", 503, None))),
                         {"t": "answer", "backend": "h:1", "status": 503, "client": None})

    def test_each_line_is_the_type_then_every_field_in_declared_order(self) -> None:
        """What encode and decode read once per type is each type's attrs fields, whole."""
        for message in EVERY_MESSAGE:
            if isinstance(message, Finished):
                continue
            value = json.loads(encode(message))
            self.assertEqual(list(value), ["t", *(f.name for f in attrs.fields(type(message)))])
            self.assertEqual(value, {"t": message.kind, **attrs.asdict(message, recurse=False)})
            for field in attrs.fields(type(message)):  # and each field's own check is applied
                broken = {**value, field.name: float("nan")}
                self.assertRaises(WireError, decode, json.dumps(broken).encode("ascii"))

    def test_a_finished_request_travels_as_summary_message_writes_it(self) -> None:
        self.assertEqual(encode(Finished(SUMMARY, True)), wire.summary_message(SUMMARY, True))


class RefusalTests(SynchronousTestCase):
    def refused(self, data: bytes) -> str:
        with self.assertRaises(WireError) as caught:
            decode(data)
        return str(caught.exception)

    def test_not_json(self) -> None:
        self.refused(b"{not json")
        self.refused(b"\xff\xfe")
        self.refused(b"[" * 100_000)  # too deeply nested for the parser

    def test_json_that_is_no_message(self) -> None:
        for value in (1, "kick", None, True, {}, {"t": 3}, ["answer", "h:1", 500]):
            self.refused(line(value))

    def test_an_unknown_type(self) -> None:
        self.assertIn("unknown message type", self.refused(line({"t": "reboot"})))

    def test_missing_and_extra_fields(self) -> None:
        self.refused(line({"t": "answer", "backend": "h:1", "status": 500}))
        self.refused(line({"t": "kick", "now": True}))
        self.refused(line({"t": "suspect", "backend": "h:1", "also": "h:2"}))

    def test_fields_of_the_wrong_type(self) -> None:
        for value in (
            {"t": "answer", "backend": "h:1", "status": "500", "client": None},
            {"t": "answer", "backend": "h:1", "status": True, "client": None},
            {"t": "answer", "backend": "h:1", "status": 500.0, "client": None},
            {"t": "answer", "backend": ["h:1"], "status": 500, "client": None},
            {"t": "answer", "backend": "h:1", "status": 500, "client": 7},
            {"t": "suspect", "backend": None},
            {"t": "wait", "seconds": "1"},
            {"t": "wait", "seconds": False},
            {"t": "ready", "pid": 1.5},
            {"t": "down", "backend": "h:1", "reason": {"text": "x"}},
            {"t": "state", "state": {"a": 1}},
            {"t": "state", "state": [1, 2]},
            {"t": "log", "level": "info", "namespace": "-", "text": None},
            {"t": "hello", "workers": 2, "slots": 64, "family": 2, "config": 1, "state": []},
            {"t": "spent", "buckets": {"a": 1}, "amount": 1, "charged": 0},
            {"t": "spent", "buckets": [["a", 60]], "amount": 1, "charged": 0},
            {"t": "spent", "buckets": [["a", "60", "ip:x"]], "amount": 1, "charged": 0},
            {"t": "spent", "buckets": [[1, 60, "ip:x"]], "amount": 1, "charged": 0},
            {"t": "spent", "buckets": [["a", 60, None]], "amount": 1, "charged": 0},
            {"t": "spent", "buckets": [], "amount": "1", "charged": 0},
            {"t": "spent", "buckets": [], "amount": 1, "charged": -1},
            {"t": "spent", "buckets": [], "amount": 1, "charged": 1.5},
            {"t": "spent", "buckets": [["a", 60, "k"]] * (MAX_SPENT_BUCKETS + 1),
             "amount": 1, "charged": 0},
            {"t": "refused", "budget": None},
            {"t": "reload", "config": None},
            {"t": "reload", "config": ["a"]},
        ):
            self.refused(line(value))

    def test_seconds_must_be_finite(self) -> None:
        for text in (b'{"t":"wait","seconds":NaN}', b'{"t":"wait","seconds":Infinity}',
                     b'{"t":"spent","buckets":[],"amount":Infinity,"charged":0}',
                     b'{"t":"spent","buckets":[["a",NaN,"k"]],"amount":1,"charged":0}'):
            self.refused(text)

    def test_a_finished_request_that_is_none(self) -> None:
        fields = json.loads(wire.summary_message(SUMMARY, True))[2]
        self.assertEqual(decode(line(["end", True, fields])), Finished(SUMMARY, True))
        self.refused(line(["end", 1, fields]))  # answered is a boolean
        self.refused(line(["end", True, {"time": 1}]))  # too few fields for a Summary
        self.refused(line(["end", True, list(fields.values())]))  # the old positional form
        self.refused(line(["end", True, {**fields, "extra": 1}]))
        self.refused(line(["end", True, {**fields, "status": "200"}]))
        self.refused(line(["begin", True, fields]))

    def test_oversize(self) -> None:
        self.patch(wire, "MAX_LINE", 64)
        message = encode(Log("info", "-", "x" * 100))[:-1]
        self.assertIn("over the limit", self.refused(message))
