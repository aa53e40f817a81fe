"""
What a request body costs txlb in memory and in time for everyone else
(``python -m bench.body_memory``).

A real ``twistd -n llmlb`` (its default command line: ``--max-body 64MiB``) in front of a
sink backend that reads each body and answers a small chat completion.  Three attacks, each
while a probe client sends one small chat request at a time and times its answers:

* **tiny chunks** -- one connection sends a chunked body of 2-byte chunks (``2\\r\\nab\\r\\n``)
  and holds it before its last chunk: up to ``--tiny-mib`` MiB of payload;
* **small chunks** -- the same with 32-byte chunks, which txlb accepts: the memory a chunked
  body holds while it arrives, against its payload;
* **large bodies** -- ``--large`` concurrent ``Content-Length`` chat bodies of
  ``--large-mib`` MiB each, sent whole.

For each: txlb's RSS before, while held (or at the end), its peak (``VmHWM``, reset before
each attack) and after; what the attacker got back; the probe's median and worst latency.
``--source DIR`` runs txlb from another checkout (e.g. a worktree of an older commit) for a
side-by-side run.  Every loop is bounded in count and time; 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.harness import HOST, ROOT, Children, start_txlb, wait_for

CHAT_ANSWER = json.dumps({
    "id": "x", "object": "chat.completion", "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}).encode()


class Sink(asyncio.Protocol):
    """Reads requests with ``Content-Length`` bodies (what txlb sends) and answers each."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.need = -1  # body bytes still to read; -1 while reading a head
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.need > 0 and not self.buffer:  # body bytes: counted, never buffered
            taken = min(self.need, len(data))
            self.need -= taken
            data = data[taken:]
            if self.need:
                return
        self.buffer += data
        while True:
            if self.need < 0:
                end = self.buffer.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(self.buffer[:end]).lower()
                del self.buffer[:end + 4]
                self.need = 0
                for line in head.split(b"\r\n"):
                    if line.startswith(b"content-length:"):
                        self.need = int(line.split(b":", 1)[1])
            taken = min(self.need, len(self.buffer))
            del self.buffer[:taken]
            self.need -= taken
            if self.need:
                return
            self.need = -1
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(CHAT_ANSWER),
                                                                    CHAT_ANSWER))


def run_sink() -> None:
    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Sink, HOST, 0)
        print(json.dumps({"port": server.sockets[0].getsockname()[1]}), flush=True)
        await server.serve_forever()

    asyncio.run(main())


def status_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak(pid: int) -> None:
    """Reset ``VmHWM`` to the current RSS (``/proc/PID/clear_refs``, value 5)."""
    with open(f"/proc/{pid}/clear_refs", "w") as refs:
        refs.write("5")


class Probe(threading.Thread):
    """One small chat request at a time, each timed, until stopped (at most ``limit``)."""

    def __init__(self, port: int, limit: int = 100_000) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.limit = limit
        self.latencies: list[float] = []
        self.failures = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
        request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: lb\r\nContent-Type: "
                   b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        while not self.stopping.is_set() and len(self.latencies) < self.limit:
            started = time.monotonic()
            try:
                with socket.create_connection((HOST, self.port), timeout=10) as sock:
                    sock.sendall(request)
                    answer = b""
                    while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
                        more = sock.recv(65536)
                        if not more:
                            break
                        answer += more
                ok = answer.startswith(b"HTTP/1.1 200")
            except OSError:
                ok = False
            if ok:
                self.latencies.append(time.monotonic() - started)
            else:
                self.failures += 1
            time.sleep(0.01)

    def figures(self) -> dict[str, Any]:
        values = sorted(self.latencies) or [0.0]
        return {"probe_requests": len(self.latencies), "probe_failures": self.failures,
                "probe_median_ms": round(statistics.median(values) * 1000, 2),
                "probe_max_ms": round(values[-1] * 1000, 1)}


def answer_of(sock: socket.socket, timeout: float) -> bytes:
    """The status line of what txlb answered on ``sock`` (b"" if it closed silently)."""
    sock.settimeout(timeout)
    with contextlib.suppress(OSError):
        data = sock.recv(65536)
        return data.split(b"\r\n", 1)[0]
    return b""


def chunked_attack(port: int, chunk: int, payload_mib: float, deadline: float) -> tuple[
        socket.socket, str, int]:
    """Send a chunked body of ``chunk``-byte chunks up to its last chunk; what happened."""
    sock = socket.create_connection((HOST, port), timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: lb\r\nContent-Type: "
                 b"application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    framed = b"%x\r\n%s\r\n" % (chunk, b"a" * chunk)
    block = framed * max(1, (1 << 20) // len(framed))
    per_block = chunk * (len(block) // len(framed))
    target = int(payload_mib * (1 << 20))
    sent = 0
    try:
        while sent < target and time.monotonic() < deadline:
            sock.sendall(block)
            sent += per_block
    except OSError as error:
        return sock, f"cut after {sent >> 10} KiB of payload ({error.strerror}): " \
                     f"{answer_of(sock, 1).decode(errors='replace')!r}", sent
    return sock, "held", sent


def measure(pid: int, port: int, name: str, attack: Any) -> dict[str, Any]:
    """Run ``attack()`` beside a probe; txlb's memory around it."""
    time.sleep(0.5)
    reset_peak(pid)
    before = status_kb(pid, "VmRSS")
    probe = Probe(port)
    probe.start()
    try:
        outcome, held = attack()
    finally:
        probe.stopping.set()
        probe.join(30)
    peak = status_kb(pid, "VmHWM")
    time.sleep(1.0)
    after = status_kb(pid, "VmRSS")
    result = {"attack": name, "outcome": outcome, "rss_before_mib": round(before / 1024, 1),
              "rss_held_mib": round(held / 1024, 1), "rss_peak_mib": round(peak / 1024, 1),
              "rss_after_mib": round(after / 1024, 1), **probe.figures()}
    print(json.dumps(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=ROOT, help="the txlb checkout to run")
    parser.add_argument("--tiny-mib", type=float, default=32.0)
    parser.add_argument("--small-mib", type=float, default=32.0)
    parser.add_argument("--large", type=int, default=8)
    parser.add_argument("--large-mib", type=float, default=60.0)
    parser.add_argument("--seconds", type=float, default=120.0, help="each attack's bound")
    parser.add_argument("--sink", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sink:
        run_sink()
        return
    workdir = Path(tempfile.mkdtemp(prefix="txlb-body-"))
    children = Children(workdir)
    try:
        sink = children.spawn("sink", [sys.executable, "-m", "bench.body_memory", "--sink"])
        sink_port = json.loads(wait_for(sink, r"(\{.*\})").group(1))["port"]
        txlb = start_txlb(children, None, f"{HOST}:{sink_port}", source=args.source)
        pid, port = txlb.child.process.pid, txlb.port
        results = []

        def chunked(chunk: int, mib: float) -> Any:
            def attack() -> tuple[str, int]:
                sock, outcome, _ = chunked_attack(port, chunk, mib,
                                                  time.monotonic() + args.seconds)
                held = status_kb(pid, "VmRSS")
                with contextlib.suppress(OSError):
                    sock.sendall(b"0\r\n\r\n")
                if outcome == "held":
                    outcome = "completed: " + answer_of(sock, 30).decode(errors="replace")
                sock.close()
                return outcome, held
            return attack

        results.append(measure(pid, port, f"{args.tiny_mib:g} MiB in 2-byte chunks",
                               chunked(2, args.tiny_mib)))
        results.append(measure(pid, port, f"{args.small_mib:g} MiB in 32-byte chunks",
                               chunked(32, args.small_mib)))

        def large() -> tuple[str, int]:
            size = int(args.large_mib * (1 << 20))
            prefix = b'{"model":"m","messages":[{"role":"user","content":"'
            suffix = b'"}]}'
            body = prefix + b"a" * (size - len(prefix) - len(suffix)) + suffix
            head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: lb\r\nContent-Type: "
                    b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
            answers: list[bytes] = []
            held = [0]

            def one() -> None:
                with socket.create_connection((HOST, port), timeout=args.seconds) as sock:
                    sock.sendall(head + body)
                    held[0] = max(held[0], status_kb(pid, "VmRSS"))
                    answers.append(answer_of(sock, args.seconds))

            threads = [threading.Thread(target=one) for _ in range(args.large)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(args.seconds)
            statuses = sorted({a.decode(errors="replace") for a in answers})
            return f"{len(answers)} answered: {statuses}", held[0]

        results.append(measure(pid, port, f"{args.large} x {args.large_mib:g} MiB bodies",
                               large))
        print(json.dumps({"source": str(args.source), "results": results}), flush=True)
    finally:
        children.stop_all()


if __name__ == "__main__":
    main()
