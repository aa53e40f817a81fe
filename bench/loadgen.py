"""
The benchmark's load generator (``python -m bench.loadgen MODE ...``), one process per run.

Raw asyncio protocols (or blocking sockets where one request at a time is the point) with
hand-written HTTP/1.1 parsing, so the client spends as little CPU per chunk as it can.  Each
run prints one JSON line with what it saw, including its own CPU time, for the harness.

Every mode sends ``POST /v1/chat/completions`` (``--api chat``, the default: the request of
:mod:`bench.chat`, its instruction in the message content) or the non-LLM ``GET`` with the
instruction in the query string (``--api get``: ``/sse``, ``/bulk``, ``/json``, ``/big``).

Modes:

``paced``
    ``--streams`` SSE streams at once, starts staggered over one interval, stream ``i``
    ``--spread × count × i / streams`` events shorter so that streams end one by one over the
    last part of the run; de-chunks every response and records, per token event, receive
    time minus the send time the backend embedded (both ``CLOCK_MONOTONIC``).  The first
    event of each stream (which includes connection setup) is counted but left out of the
    latency percentiles.  Latencies are also given by phase (streams starting, steady,
    streams ending: :func:`bench.chat.phase_split`) and over time (``--bucket`` ms).
``bulk``
    ``--streams`` streams from ``/bulk`` for ``--seconds``; events are counted as the blank
    lines that end them (``\\n\\n``, carrying one byte across reads), which chunk framing can
    neither add nor remove, so no de-chunking is needed at a million events per second.
``ttfb``
    ``--count`` sequential requests, each on a fresh connection (``--fresh``) or all on one
    keep-alive connection; time from ``connect`` (fresh) or from sending the request
    (keep-alive) to the response's first byte.
``rps``
    The Python stand-in for wrk: ``--connections`` keep-alive connections sending small
    requests back to back for ``--seconds``.
``hold``
    ``--streams`` long-lived SSE streams (one event every ``--interval`` ms), opened with at
    most ``--connect-parallel`` setups in flight; once every stream has its first event and
    one more interval has passed, prints a ``HELD`` line (the harness then samples the
    proxy's memory), holds for ``--linger`` seconds more, then closes everything.
``slow``
    One stream from ``/big`` read at ``--rate`` bytes/s at most, on a blocking socket.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
from dataclasses import asdict
from typing import Any

from bench.loadgen_requests import run_rps, run_ttfb
from bench.loadgen_streams import run_bulk, run_hold, run_paced, run_slow


def _raise_nofile() -> None:
    """Soft RLIMIT_NOFILE up to the hard limit (10,000 sockets)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: list[str] | None = None) -> None:
    """Run one mode and print its result as ``RESULT {json}``."""
    parser = argparse.ArgumentParser(prog="python -m bench.loadgen",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    paced = sub.add_parser("paced")
    paced.add_argument("--streams", type=int, required=True)
    paced.add_argument("--count", type=int, required=True, help="events per stream")
    paced.add_argument("--interval", type=float, required=True, help="ms between events")
    paced.add_argument("--size", type=int, default=250)
    paced.add_argument("--timeout", type=float, required=True)
    paced.add_argument("--spread", type=float, default=0.0,
                       help="stream i is spread*count*i/streams events shorter")
    paced.add_argument("--bucket", type=float, default=500.0, help="timeline bucket, ms")
    bulk = sub.add_parser("bulk")
    bulk.add_argument("--streams", type=int, default=4)
    bulk.add_argument("--seconds", type=float, required=True)
    bulk.add_argument("--size", type=int, default=250)
    ttfb = sub.add_parser("ttfb")
    ttfb.add_argument("--count", type=int, required=True)
    ttfb.add_argument("--fresh", action="store_true")
    ttfb.add_argument("--gap", type=float, default=0.002)
    rps = sub.add_parser("rps")
    rps.add_argument("--connections", type=int, default=32)
    rps.add_argument("--seconds", type=float, required=True)
    hold = sub.add_parser("hold")
    hold.add_argument("--streams", type=int, required=True)
    hold.add_argument("--interval", type=float, default=3000.0)
    hold.add_argument("--connect-parallel", type=int, default=32)
    hold.add_argument("--linger", type=float, default=3.0)
    hold.add_argument("--ramp-timeout", type=float, default=90.0)
    slow = sub.add_parser("slow")
    slow.add_argument("--bytes", type=int, required=True)
    slow.add_argument("--rate", type=float, required=True, help="bytes per second")
    slow.add_argument("--chunk", type=int, default=65536)
    slow.add_argument("--timeout", type=float, default=120.0)
    for p in (paced, bulk, ttfb, rps, hold, slow):
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--api", choices=("chat", "get"), default="chat",
                       help="POST /v1/chat/completions (default) or the non-LLM GET path")
    args = parser.parse_args(argv)
    _raise_nofile()
    result: Any
    if args.mode == "paced":
        result = asyncio.run(run_paced(args.port, args.streams, args.count, args.interval,
                                       args.size, args.timeout, args.api, args.spread,
                                       args.bucket))
    elif args.mode == "bulk":
        result = asyncio.run(run_bulk(args.port, args.streams, args.seconds, args.size,
                                      args.api))
    elif args.mode == "ttfb":
        result = run_ttfb(args.port, args.count, args.fresh, args.gap, args.api)
    elif args.mode == "rps":
        result = asyncio.run(run_rps(args.port, args.connections, args.seconds, args.api))
    elif args.mode == "hold":
        result = asyncio.run(run_hold(args.port, args.streams, args.interval,
                                      args.connect_parallel, args.linger, args.ramp_timeout,
                                      args.api))
    else:
        result = run_slow(args.port, args.bytes, args.rate, args.chunk, args.timeout,
                          args.api)
    print("RESULT " + json.dumps(asdict(result)), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
