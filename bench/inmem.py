"""
The CPU of one request through the in-memory proxy, with no sockets: the bookkeeping path
in isolation (``python -m bench.inmem MODE [NUMBER [REPEATS]]``, µs, the best of the
repeats).  ``PYTHONPATH=TREE`` measures another checkout's txlb (an export of an older
revision), so that two trees can be timed in alternating runs on the same machine.

``json``  a POST answered with a 30-byte JSON body: routing, the exchange, the summary, the
          metrics and a text result log line (written to a temporary file)
``sse``   the same with a 20-event stream (248-byte events)
``long``  one 1,000-event stream per request: µs per relayed event
``wire``  a ``--workers`` worker's ``end`` message for one such request: µs to encode it
          (the worker) and to decode it into a summary (the supervisor)

The client is :class:`tests.helpers.ClientConnection` on ``LoadBalancer.site()``, the
backend :class:`tests.helpers.FakeUpstream`, the clock a ``task.Clock``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import timeit
from typing import Any

from twisted.internet.task import Clock

import txlb
from tests.helpers import ClientConnection, FakeResponse, FakeUpstream
from txlb import LoadBalancer

JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream")]
BODY = b'{"model":"m","prompt":"hello","max_tokens":8}'
EVENT = b"data: " + b"x" * 240 + b"\n\n"


def main(argv: list[str]) -> None:
    mode = argv[0]
    number = int(argv[1]) if len(argv) > 1 else 1000
    repeats = int(argv[2]) if len(argv) > 2 else 7
    events = 1000 if mode == "long" else 20
    upstream = FakeUpstream()
    path = tempfile.mktemp(prefix="txlb-inmem.")
    lb = LoadBalancer(["127.0.0.1:8002", "127.0.0.1:8003"], reactor=Clock(), agent=upstream,
                      probe_agent=FakeUpstream(), log_file=path)
    client = ClientConnection(lb.site())

    def one() -> None:
        client.request(b"POST", b"/v1/completions", headers=JSON, body=BODY)
        call = upstream.calls.pop()
        if mode in ("json", "wire"):
            response = call.respond(FakeResponse(200, JSON, length=30))
            response.send(b'{"id":"x","choices":[],"ok":1}')
        else:
            response = call.respond(FakeResponse(200, SSE))
            for _ in range(events):
                response.send(EVENT)
        response.end()
        assert client.transport.value().startswith(b"HTTP/1.1 200")
        client.transport.clear()

    try:
        if mode == "wire":
            print(wire(lb, one, number * 10, repeats))
            return
        for _ in range(200):
            one()
        best = min(timeit.repeat(one, number=number, repeat=repeats)) / number * 1e6
        print(f"{mode} {best / events if mode == 'long' else best:.2f}")
    finally:
        os.unlink(path)


def wire(lb: Any, one: Any, number: int, repeats: int) -> str:
    """Encode and decode one request's ``end`` message, this tree's way or the old one."""
    summaries: list[Any] = []
    assert lb.result_log is not None
    lb.result_log.write = summaries.append
    one()
    summary = summaries[0]
    if os.path.exists(os.path.join(txlb.__path__[0], "_wire.py")):  # before 6f97a5f..
        from txlb import _wire as old  # type: ignore[attr-defined]

        line = old.summary_message(summary, True)

        def decode() -> object:
            return old.summary_from(old.decode(line)[2])
        encode = lambda: old.summary_message(summary, True)  # noqa: E731
    else:
        from txlb._workers import wire as new

        line = new.summary_message(summary, True)

        def decode() -> object:
            return new.decode(line[:-1])
        encode = lambda: new.summary_message(summary, True)  # noqa: E731
    e = min(timeit.repeat(encode, number=number, repeat=repeats)) / number * 1e6
    d = min(timeit.repeat(decode, number=number, repeat=repeats)) / number * 1e6
    return f"wire encode {e:.2f} decode {d:.2f} ({len(line)}-byte line)"


if __name__ == "__main__":
    main(sys.argv[1:])
