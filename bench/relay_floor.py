"""
The floor under any Python proxy's cost per streamed chunk: ``python -m bench.relay_floor``.

What it measures: the CPU one process spends to relay one ~250-byte message from one TCP
connection to another -- no HTTP, no parsing, no bookkeeping -- with the messages paced as
an LLM's tokens are (N connections, 40 messages a second each, staggered), on loopback, the
relay pinned to core 0 and the load generator to core 1 (as ``python -m bench relay`` pins them).

Three relays, in alternating rounds:

``raw``
    A loop of ``select.epoll.poll``, ``recv`` and ``send`` in plain Python: the least any
    Python event loop can do per message (three system calls and the wake-up).
``twisted``
    Twisted's stock epoll reactor and ``Protocol.dataReceived`` -> ``transport.write``.
``txlb-epoll``
    The same protocol on txlb's reactor (direct dispatch, eager writes).

Why: txlb's CPU per relayed chunk is measured against the Rust routers' and nginx's, and at
64 paced streams most of any proxy's cost is the kernel's -- the wake-up from ``epoll_wait``
and the two socket calls -- which no Python code can remove.  This tells how much of txlb's
figure is that floor and how much is txlb.

    python -m bench.relay_floor [--rounds 3] [--streams 64 --streams 256] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import select
import socket
import statistics
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

RELAYS = ("raw", "twisted", "txlb-epoll")
MESSAGE = b"data: " + b"x" * 242 + b"\n\n"
RATE = 40.0  # messages per second per connection, like a decode at 40 tokens/s
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _ready(up: int, down: int) -> None:
    print(json.dumps({"up": up, "down": down}), flush=True)


def relay_raw() -> None:
    """The plain-Python relay: one epoll loop; stdin lines ask for the CPU so far."""
    ups, downs = socket.socket(), socket.socket()
    for listener in (ups, downs):
        listener.bind(("127.0.0.1", 0))
        listener.listen(1024)
        listener.setblocking(False)
    poller = select.epoll()
    poller.register(ups.fileno(), select.EPOLLIN)
    poller.register(downs.fileno(), select.EPOLLIN)
    poller.register(0, select.EPOLLIN)
    _ready(ups.getsockname()[1], downs.getsockname()[1])
    sources: dict[int, socket.socket] = {}
    sinks: list[socket.socket] = []
    paired: dict[int, socket.socket] = {}
    while True:
        for fd, _ in poller.poll(-1, 1024):
            if fd == ups.fileno():
                conn, _ = ups.accept()
                conn.setblocking(False)
                sources[conn.fileno()] = conn
                poller.register(conn.fileno(), select.EPOLLIN)
            elif fd == downs.fileno():
                conn, _ = downs.accept()
                conn.setblocking(False)
                sinks.append(conn)
            elif fd == 0:
                line = os.read(0, 100)
                print(json.dumps({"cpu": _cpu()}), flush=True)
                if not line or b"q" in line:
                    return
            else:
                data = sources[fd].recv(65536)
                if not data:
                    poller.unregister(fd)
                    continue
                sink = paired.get(fd)
                if sink is None:
                    sink = paired[fd] = sinks[len(paired) % len(sinks)]
                sink.send(data)


def relay_twisted(txlb_reactor: bool) -> None:
    """``dataReceived`` -> ``transport.write`` on Twisted's epoll reactor or txlb's."""
    if txlb_reactor:
        from txlb._server.reactor import install

        install()
    else:
        from twisted.internet import epollreactor

        epollreactor.install()
    from twisted.internet import reactor as installed
    from twisted.internet import stdio
    from twisted.internet.protocol import Protocol, ServerFactory

    reactor: Any = installed

    sinks: list[Protocol] = []
    paired: dict[Protocol, Protocol] = {}

    class Sink(Protocol):
        def connectionMade(self) -> None:
            sinks.append(self)

    class Source(Protocol):
        def dataReceived(self, data: bytes) -> None:
            sink = paired.get(self)
            if sink is None:
                sink = paired[self] = sinks[len(paired) % len(sinks)]
            assert sink.transport is not None
            sink.transport.write(data)

    class Control(Protocol):
        def dataReceived(self, data: bytes) -> None:
            print(json.dumps({"cpu": _cpu()}), flush=True)
            if b"q" in data:
                reactor.stop()

    up = reactor.listenTCP(0, ServerFactory.forProtocol(Source), interface="127.0.0.1")
    down = reactor.listenTCP(0, ServerFactory.forProtocol(Sink), interface="127.0.0.1")
    stdio.StandardIO(Control())
    _ready(up.getHost().port, down.getHost().port)
    reactor.run()


async def generate(up: int, down: int, streams: int, seconds: float) -> dict[str, int]:
    """
    Open ``streams`` sinks and sources, wait for a line on stdin, then send ``RATE``
    messages a second on each source (staggered, on an absolute schedule) for ``seconds``.
    """
    sinks = [await asyncio.open_connection("127.0.0.1", down) for _ in range(streams)]
    received = 0

    async def drain(reader: asyncio.StreamReader) -> None:
        nonlocal received
        while data := await reader.read(65536):
            received += len(data)

    readers = [asyncio.create_task(drain(reader)) for reader, _ in sinks]
    sources = [await asyncio.open_connection("127.0.0.1", up) for _ in range(streams)]
    await asyncio.sleep(0.3)  # every connection accepted before the measured part
    print("GO", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    loop = asyncio.get_running_loop()
    start, interval, sent = loop.time(), 1.0 / RATE, 0

    async def pace(index: int, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        due = start + index * interval / streams
        while due < start + seconds:
            await asyncio.sleep(max(0.0, due - loop.time()))
            writer.write(MESSAGE)
            sent += 1
            due += interval

    await asyncio.gather(*(pace(i, writer) for i, (_, writer) in enumerate(sources)))
    deadline = loop.time() + 5.0
    while received < sent * len(MESSAGE) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    for task in readers:
        task.cancel()
    return {"sent": sent, "received": received // len(MESSAGE)}


def measure(relay: str, streams: int, seconds: float) -> dict[str, Any]:
    """One relay process and one load generator: µs of relay CPU per message."""
    relay_argv = [sys.executable, "-m", "bench.relay_floor", "--serve", relay]
    child = subprocess.Popen(["taskset", "-c", "0", *relay_argv], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert child.stdin is not None and child.stdout is not None
    ports = json.loads(child.stdout.readline())
    gen = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-m", "bench.relay_floor",
                            "--generate", str(ports["up"]), str(ports["down"]), str(streams),
                            str(seconds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert gen.stdin is not None and gen.stdout is not None
    try:
        if gen.stdout.readline().strip() != "GO":
            raise RuntimeError("the load generator did not start")

        def cpu_now() -> float:
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write("cpu\n")
            child.stdin.flush()
            return float(json.loads(child.stdout.readline())["cpu"])

        before = cpu_now()
        gen.stdin.write("\n")
        gen.stdin.flush()
        counts = json.loads(gen.stdout.readline())
        spent = cpu_now() - before
    finally:
        if child.poll() is None:
            child.stdin.write("q\n")
            child.stdin.flush()
        for process in (gen, child):
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
    lost = counts["sent"] - counts["received"]
    return {"relay": relay, "streams": streams, "messages": counts["received"],
            "lost": lost, "us_per_message": spent / max(counts["received"], 1) * 1e6}


def table(results: Sequence[dict[str, Any]]) -> str:
    """Markdown: per relay and stream count, every round's µs per message and the median."""
    rows = ["| relay | streams | µs CPU per message, each round | median |",
            "|---|---:|---|---:|"]
    for relay in RELAYS:
        for streams in sorted({r["streams"] for r in results}):
            values = [r["us_per_message"] for r in results
                      if r["relay"] == relay and r["streams"] == streams]
            if values:
                rounds = " · ".join(f"{v:.1f}" for v in values)
                rows.append(f"| {relay} | {streams} | {rounds} | "
                            f"{statistics.median(values):.1f} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.relay_floor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, action="append")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--serve", choices=RELAYS, help=argparse.SUPPRESS)
    parser.add_argument("--generate", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve == "raw":
        relay_raw()
        return
    if args.serve:
        relay_twisted(args.serve == "txlb-epoll")
        return
    if args.generate:
        up, down, streams, seconds = args.generate
        counts = asyncio.run(generate(int(up), int(down), int(streams), float(seconds)))
        print(json.dumps(counts), flush=True)
        return
    results = []
    for round_number in range(args.rounds):
        # rotate the order each round, so drift on a shared machine hits every relay alike
        order = RELAYS[round_number % 3:] + RELAYS[:round_number % 3]
        for relay in order:
            for streams in args.streams or [64, 256]:
                result = measure(relay, streams, args.seconds)
                result["round"] = round_number + 1
                results.append(result)
                print(f"round {round_number + 1} {relay:10} {streams:4} streams: "
                      f"{result['us_per_message']:6.1f} µs/message"
                      + (f" ({result['lost']} lost)" if result["lost"] else ""), flush=True)
    print()
    print(table(results))


if __name__ == "__main__":
    main()
