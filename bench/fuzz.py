"""
A raw-socket fuzz of the real ``twistd -n llmlb`` (``python -m bench.fuzz``).

For ``--duration`` seconds, a bounded number of hostile connections (``--hostile``) hammer
the main port -- the framing cases of ``tests/framing.py``, request-smuggling attempts,
slowloris heads, random bytes, oversized heads, abrupt closes mid-request and mid-stream,
half-closes, stalled readers, pipelined garbage -- while well-behaved clients
(``--streams``) stream chat completions through it the whole time.  Afterwards:

* every well-behaved stream was a clean 200 ending in ``data: [DONE]``: 0 errors;
* the balancer is alive and logged no traceback;
* every backend's in-flight count in ``/__lb_status`` is back to 0 and every simulated
  engine's slots are free (client aborts reached the backends);
* no smuggled request (path ``/smuggled``) reached a backend.

Randomness is seeded (``--seed``, else a fresh one, printed first), so a failing run can be
replayed.  The test suite runs the same code for ~20 s (``tests/integration/test_fuzz.py``); this
is the multi-minute run, by hand::

    python -m bench.fuzz --duration 300
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet import defer, task
from twisted.internet.error import TimeoutError as DeferredTimeout
from twisted.internet.protocol import ClientFactory, Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool, ResponseDone
from twisted.web.http_headers import Headers

from tests.framing import CASES
from txlb._upstream.agent import BytesProducer

HOST = "127.0.0.1"
#: The marker of a request hidden behind a framing trick: no backend may ever receive it.
SMUGGLED_PATH = b"/smuggled"
CHAT = json.dumps({"model": "sim-model", "stream": True,
                   "messages": [{"role": "user", "content": "hello"}]}).encode()
#: A hostile connection is aborted after at most this long (a random share of it, so that
#: connections kept alive after a good answer do not idle out the run), whatever it was doing.
HOSTILE_LIFETIME = 4.0
STREAM_TIMEOUT = 30.0


@attrs.define
class FuzzReport:
    """What a run did and what went wrong for the well-behaved clients."""

    seed: int
    streams_ok: int = 0
    stream_errors: list[str] = attrs.Factory(list)
    hostile: Counter[str] = attrs.Factory(Counter)
    answers: Counter[bytes] = attrs.Factory(Counter)

    def summary(self) -> str:
        kinds = ", ".join(f"{k}={n}" for k, n in sorted(self.hostile.items()))
        answers = ", ".join(f"{k.decode()}={n}" for k, n in sorted(self.answers.items()))
        return (f"seed={self.seed} streams_ok={self.streams_ok} "
                f"stream_errors={len(self.stream_errors)} hostile[{kinds}] "
                f"answers[{answers}]")


# -- hostile connections ----------------------------------------------------------------------

#: A script step: bytes to send, a pause (seconds), or one of "abort", "half-close",
#: "stop-reading".
Step = bytes | float | str


class _Hostile(Protocol):
    """Plays a script on one connection, records the status lines it gets, then goes."""

    def __init__(self, script: list[Step], clock: Any, lifetime: float,
                 done: defer.Deferred[bytes]) -> None:
        self.script = list(script)
        self.clock = clock
        self.lifetime = lifetime
        self.done = done
        self.received = b""
        self.pending: Any = None  # the abort at the end of its lifetime
        self.step: Any = None  # the next step after a pause

    def connectionMade(self) -> None:
        self.pending = self.clock.callLater(self.lifetime, self._abort)
        self._next()

    def _next(self) -> None:
        while self.script and self.transport is not None:
            step = self.script.pop(0)
            if isinstance(step, float):
                self.step = self.clock.callLater(step, self._next)
                return
            if step == "abort":
                self._abort()
                return
            if step == "half-close":
                self.transport.loseWriteConnection()  # type: ignore[attr-defined]
            elif step == "stop-reading":
                self.transport.pauseProducing()  # type: ignore[attr-defined]
            else:
                assert isinstance(step, bytes)
                self.transport.write(step)

    def _abort(self) -> None:
        if self.transport is not None:
            self.transport.abortConnection()  # type: ignore[attr-defined]

    def dataReceived(self, data: bytes) -> None:
        self.received += data[:65536]  # the status lines are all we look at

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        for call in (self.pending, self.step):
            if call is not None and call.active():
                call.cancel()
        self.script = []
        self.transport = None
        if not self.done.called:
            self.done.callback(self.received)


class _HostileFactory(ClientFactory):
    def __init__(self, script: list[Step], clock: Any, lifetime: float) -> None:
        self.script = script
        self.clock = clock
        self.lifetime = lifetime
        self.done: defer.Deferred[bytes] = defer.Deferred()

    def buildProtocol(self, addr: Any) -> Protocol:
        return _Hostile(self.script, self.clock, self.lifetime, self.done)

    def clientConnectionFailed(self, connector: Any, reason: Failure) -> None:
        self.done.callback(b"")


def _chat_request(path: bytes = b"/v1/chat/completions", tokens: int = 64) -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: lb\r\nContent-Type: application/json\r\n"
            b"X-Sim-Tokens: %d\r\nContent-Length: %d\r\n\r\n%s"
            % (path, tokens, len(CHAT), CHAT))


def _smuggle(rng: random.Random) -> list[Step]:
    return [_smuggling_bytes(rng)]


def _smuggling_bytes(rng: random.Random) -> bytes:
    """A request whose framing, read leniently, would hide a second one behind it."""
    hidden = _chat_request(SMUGGLED_PATH)
    front = rng.choice([
        b"Transfer-Encoding: identity\r\n",
        b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n",
        b"Transfer-Encoding: identity\r\nTransfer-Encoding: chunked\r\n",
        b"Transfer-Encoding: chunked, identity\r\n",
        b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n" % (len(hidden) + 5),
        b"Transfer-Encoding: chunked\r\nContent-Length: 0\r\n",
        b"Content-Length: 0\r\nContent-Length: %d\r\n" % len(hidden),
        b"Transfer-Encoding : chunked\r\n",
        b"Transfer-Encoding: \x0bchunked\r\n",
        b"Transfer-Encoding:\r\n chunked, identity\r\n",
        b"Host: second.example\r\n",
    ])
    head = b"POST /v1/completions HTTP/1.1\r\nHost: lb\r\n" + front + b"\r\n"
    body = rng.choice([b"", b"0\r\n\r\n"])
    return head + body + hidden


def _slowloris(rng: random.Random) -> list[Step]:
    head = _chat_request()[: rng.randint(1, 60)]
    steps: list[Step] = []
    for byte in head:
        steps += [bytes([byte]), rng.uniform(0.02, 0.3)]
    return steps + [float(HOSTILE_LIFETIME)]  # then hold until cut off (408) or aborted


def _random_bytes(rng: random.Random) -> list[Step]:
    noise = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 4096)))
    if rng.random() < 0.5:
        noise = rng.choice([b"POST /v1/chat/completions HTTP/1.1\r\n",
                            b"GET / HTTP/1.1\r\nHost: lb\r\n"]) + noise
    return [noise]


def _huge(rng: random.Random) -> list[Step]:
    return [rng.choice([
        b"GET / HTTP/1.1\r\nHost: lb\r\nX-Big: " + b"a" * rng.randint(16_400, 70_000)
        + b"\r\n\r\n",
        b"GET /" + b"a" * rng.randint(16_400, 70_000) + b" HTTP/1.1\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: lb\r\n" + b"X: y\r\n" * rng.randint(501, 3000) + b"\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: lb\r\nContent-Length: 99999999999\r\n"
        b"\r\n" + b"x" * rng.randint(0, 100_000),
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: lb\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"ffffff\r\n" + b"x" * rng.randint(0, 200_000),
    ])]


def _abort_mid_stream(rng: random.Random) -> list[Step]:
    return [_chat_request(tokens=rng.randint(8, 200)), rng.uniform(0.0, 1.0), "abort"]


def _abort_mid_body(rng: random.Random) -> list[Step]:
    whole = _chat_request()
    cut = rng.randint(len(whole) - len(CHAT), len(whole) - 1)
    return [whole[:cut], rng.uniform(0.0, 0.3), "abort"]


def _half_close(rng: random.Random) -> list[Step]:
    return [_chat_request(), rng.uniform(0.0, 0.2), "half-close", float(HOSTILE_LIFETIME)]


def _stalled_reader(rng: random.Random) -> list[Step]:
    return ["stop-reading", _chat_request(tokens=rng.randint(100, 2000)),
            float(rng.uniform(0.5, HOSTILE_LIFETIME))]


def _pipelined_garbage(rng: random.Random) -> list[Step]:
    good = b"GET /fuzz/pipelined HTTP/1.1\r\nHost: lb\r\n\r\n" * rng.randint(1, 5)
    return [good + rng.choice([b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
                               b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\n\r\n",
                               _smuggling_bytes(rng)]), float(HOSTILE_LIFETIME)]


def _framing_case(rng: random.Random) -> list[Step]:
    raw = rng.choice(CASES).raw
    if rng.random() < 0.5:
        return [raw]
    cut = rng.randint(0, len(raw))
    return [raw[:cut], rng.uniform(0.0, 0.1), raw[cut:]]


KINDS: dict[str, Callable[[random.Random], list[Step]]] = {
    "framing": _framing_case,
    "smuggle": _smuggle,
    "slowloris": _slowloris,
    "random": _random_bytes,
    "huge": _huge,
    "abort-stream": _abort_mid_stream,
    "abort-body": _abort_mid_body,
    "half-close": _half_close,
    "stalled": _stalled_reader,
    "pipelined": _pipelined_garbage,
}


async def _hostile_loop(reactor: Any, port: int, rng: random.Random, deadline: float,
                        report: FuzzReport) -> None:
    while time.monotonic() < deadline:
        kind = rng.choice(sorted(KINDS))
        # a slowloris lives long enough to meet the header timeout (2 s in the runs here)
        lifetime = HOSTILE_LIFETIME if kind == "slowloris" else rng.uniform(0.3,
                                                                            HOSTILE_LIFETIME)
        factory = _HostileFactory(KINDS[kind](rng), reactor, lifetime)
        reactor.connectTCP(HOST, port, factory, timeout=5)
        received = await factory.done
        report.hostile[kind] += 1
        for line in received.split(b"\r\n"):
            if line.startswith(b"HTTP/1.1 "):
                report.answers[line[9:12]] += 1


# -- the well-behaved client -------------------------------------------------------------------

class _Body(Protocol):
    def __init__(self) -> None:
        self.data = b""
        self.done: defer.Deferred[bool] = defer.Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.data += data

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.done.callback(reason.check(ResponseDone) is not None)


async def _one_stream(reactor: Any, agent: Agent, url: bytes, tokens: int) -> str | None:
    """One streamed chat completion; ``None`` if it was perfect, else what was wrong."""
    headers = Headers({b"content-type": [b"application/json"],
                       b"x-sim-tokens": [b"%d" % tokens]})
    response = await agent.request(b"POST", url, headers, BytesProducer(CHAT))
    body = _Body()
    response.deliverBody(body)
    clean = await body.done
    if response.code != 200:
        return f"status {response.code}: {body.data[:200]!r}"
    if not clean:
        return f"truncated after {len(body.data)} bytes"
    events = [e for e in body.data.split(b"\n\n") if e]
    if not events or events[-1] != b"data: [DONE]":
        return f"no [DONE]: {body.data[-200:]!r}"
    text = ""
    for event in events[:-1]:
        if not event.startswith(b"data: "):
            return f"not an SSE data event: {event[:100]!r}"
        for choice in json.loads(event[6:]).get("choices", []):
            text += choice.get("delta", {}).get("content") or ""
    if not text:
        return "no content streamed"
    return None


async def _stream_loop(reactor: Any, port: int, rng: random.Random, deadline: float,
                       report: FuzzReport) -> None:
    pool = HTTPConnectionPool(reactor, persistent=True)  # keep-alive, as real clients do
    agent = Agent(reactor, pool=pool)
    url = f"http://{HOST}:{port}/v1/chat/completions".encode()
    try:
        while time.monotonic() < deadline:
            attempt = defer.ensureDeferred(_one_stream(reactor, agent, url,
                                                       rng.randint(8, 64)))
            attempt.addTimeout(STREAM_TIMEOUT, reactor)
            try:
                problem = await attempt
            except DeferredTimeout:
                problem = f"no complete answer within {STREAM_TIMEOUT:g}s"
            except Exception as error:  # a failed request is exactly what we count
                problem = repr(error)[:300]
            if problem is None:
                report.streams_ok += 1
            else:
                report.stream_errors.append(problem)
    finally:
        await pool.closeCachedConnections()


# -- the run -----------------------------------------------------------------------------------

async def fuzz(reactor: Any, port: int, duration: float, seed: int, hostile: int = 16,
               streams: int = 3) -> FuzzReport:
    """
    Run ``hostile`` hostile connection loops and ``streams`` well-behaved streaming clients
    against the balancer on ``port`` for ``duration`` seconds; every hostile connection
    lives at most :data:`HOSTILE_LIFETIME`, so the run ends soon after.
    """
    report = FuzzReport(seed)
    rng = random.Random(seed)
    deadline = time.monotonic() + duration
    loops = [defer.ensureDeferred(_hostile_loop(reactor, port, random.Random(rng.random()),
                                                deadline, report)) for _ in range(hostile)]
    loops += [defer.ensureDeferred(_stream_loop(reactor, port, random.Random(rng.random()),
                                                deadline, report)) for _ in range(streams)]
    await defer.gatherResults(loops, consumeErrors=True)
    return report


async def settled_status(reactor: Any, port: int, timeout: float = 20.0) -> dict[str, Any]:
    """``/__lb_status`` once every backend's in-flight count is 0 (or the last one seen)."""
    pool = HTTPConnectionPool(reactor, persistent=False)
    agent = Agent(reactor, pool=pool)
    deadline = time.monotonic() + timeout
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        response = await agent.request(b"GET", f"http://{HOST}:{port}/__lb_status".encode())
        body = _Body()
        response.deliverBody(body)
        await body.done
        status = json.loads(body.data)
        if all(b["active"] == 0 for b in status["backends"]):
            break
        await task.deferLater(reactor, 0.1)
    return status


def problems(report: FuzzReport, status: dict[str, Any], alive: bool, output: str,
             sims: list[Any]) -> list[str]:
    """Everything the run's guarantees say must not happen; empty when all held."""
    found = [f"well-behaved stream failed: {e}" for e in report.stream_errors[:20]]
    if report.streams_ok == 0:
        found.append("no well-behaved stream completed")
    if not alive:
        found.append("the balancer died")
    if "Traceback" in output:
        found.append("the balancer logged a traceback")
    busy = {b["backend"]: b["active"] for b in status.get("backends", []) if b["active"]}
    if busy or not status:
        found.append(f"in-flight counts not back to 0: {busy or status}")
    for sim in sims:
        if sim.running:
            found.append(f"a backend still runs {sim.running} generations")
        if any(r.path.startswith(SMUGGLED_PATH) for r in sim.requests):
            found.append("a smuggled request reached a backend")
    return found


async def _main(reactor: Any, args: argparse.Namespace) -> None:
    from tests.processes import TwistdProcess
    from txlb.testing import SimulatedVLLM, listen_simulated

    print(f"fuzz seed {args.seed} (replay with --seed {args.seed})", flush=True)
    sims = [SimulatedVLLM(reactor, tokens_per_second=200.0) for _ in range(args.backends)]
    ports = [listen_simulated(reactor, sim) for sim in sims]
    keys = ",".join(f"{HOST}:{p.getHost().port}" for p in ports)  # type: ignore[attr-defined]
    lb = TwistdProcess("--backends", keys, "--header-timeout", "2", "--max-body", "1MiB")
    try:
        await lb.started()
        started = time.monotonic()
        report = await fuzz(reactor, lb.port, args.duration, args.seed, args.hostile,
                            args.streams)
        status = await settled_status(reactor, lb.port)
        found = problems(report, status, lb.process.poll() is None, lb.output(), sims)
        print(f"{time.monotonic() - started:.0f}s {report.summary()}")
    finally:
        await lb.stop()
        for port in ports:
            await defer.maybeDeferred(port.stopListening)
    for problem in found:
        print("PROBLEM:", problem)
    if found:
        raise SystemExit(1)
    print("OK: 0 errors for the well-behaved clients, balancer alive, in-flight back to 0")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=300.0, help="seconds (300)")
    parser.add_argument("--seed", type=int, default=random.SystemRandom().randrange(2**32))
    parser.add_argument("--hostile", type=int, default=24, help="hostile connections (24)")
    parser.add_argument("--streams", type=int, default=4, help="well-behaved clients (4)")
    parser.add_argument("--backends", type=int, default=2, help="simulated backends (2)")
    args = parser.parse_args(argv)
    task.react(lambda reactor: defer.ensureDeferred(_main(reactor, args)))


if __name__ == "__main__":
    main()
