"""
The poll script (``txlb._shared.store.POLL``) run by a real ``redis-server``: the reply is
the other live replicas' counts summed per backend -- one pair a backend, whatever the
number of replicas -- with what no txlb writes left out, and this replica's own row and the
expired replicas' rows not counted.
"""

from __future__ import annotations

import socket

from twisted.trial.unittest import SynchronousTestCase

from txlb._shared.store import POLL

from ..redis import RedisServer


def command(sock: socket.socket, *args: str) -> object:
    """One RESP command and its reply (integers, bulk strings and arrays)."""
    out = f"*{len(args)}\r\n" + "".join(f"${len(a.encode())}\r\n{a}\r\n" for a in args)
    sock.sendall(out.encode())
    reader = sock.makefile("rb")

    def read() -> object:
        line = reader.readline().rstrip(b"\r\n")
        kind, rest = line[:1], line[1:]
        if kind == b"*":
            return [read() for _ in range(int(rest))]
        if kind == b"$":
            size = int(rest)
            if size < 0:
                return None
            data = reader.read(size + 2)[:-2]
            return data.decode()
        if kind == b":":
            return int(rest)
        if kind == b"-":
            raise AssertionError(rest.decode())
        return rest.decode()

    return read()


class PollScriptTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.redis = RedisServer()
        self.addCleanup(self.redis.kill)
        self.sock = socket.create_connection(("127.0.0.1", self.redis.port), timeout=5)
        self.addCleanup(self.sock.close)

    def poll(self, me: str, *row: str) -> list[object]:
        reply = command(self.sock, "EVAL", POLL.source, "0", "t", me, "3000", *row)
        assert isinstance(reply, list)
        return reply

    def test_the_others_counts_come_summed_per_backend(self) -> None:
        self.poll("a", "h:1", "2", "h:2", "1")
        self.poll("b", "h:1", "3")
        command(self.sock, "HSET", "t:inflight:c", "h:1", "4", "h:2", "\u00b2",
                "h:3", "1e3", "h:4", "12345678", "h:5", "5")
        command(self.sock, "ZADD", "t:replicas", "99999999999999", "c")
        # an expired replica's row is not counted, and is dropped from the replicas
        command(self.sock, "HSET", "t:inflight:gone", "h:1", "100")
        command(self.sock, "ZADD", "t:replicas", "1", "gone")
        reply = self.poll("me", "h:1", "50")
        self.assertEqual(reply[0], "4")  # a, b, c and me
        pairs = dict(zip(reply[2::2], reply[3::2], strict=True))
        self.assertEqual(pairs, {"h:1": "9", "h:2": "1", "h:5": "5"})

    def test_a_sum_stops_at_seven_digits(self) -> None:
        for name in ("a", "b"):
            self.poll(name, "h:1", "9999999")
        reply = self.poll("me")
        self.assertEqual(reply[2:], ["h:1", "9999999"])
