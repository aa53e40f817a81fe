"""
What a hostile JSON request body costs txlb, and what one client sending such bodies does
to everyone else's latency (``python -m bench.hostile_json``).

Three bodies, each a valid ``POST /v1/chat/completions`` a client may send under the default
``--max-body``:

``parts``     one user message of 50,000 small text content parts (~2.8 MB)
``messages``  100,000 short messages (~4 MB)
``tools``     5,000 function tools with a JSON schema each, one short message (~2.6 MB)

Two measurements, each under ``--policy least-conn`` and ``cache-aware``:

* **in process** -- CPU ms per request (``time.process_time``, the median of ``--repeat``)
  through the whole proxy in memory: ``lb.main_factory()`` on a ``StringTransport``, a fake
  upstream answering a 30-byte JSON, the result log on (a temporary file), a ``task.Clock``.
  The same for a small chat request as the reference.
* **over sockets** -- a real ``twistd -n llmlb`` (the result log on, its default) in front
  of a tiny backend that answers every POST with a fixed JSON without reading it: first the
  proxy's CPU ms per hostile request (its ``schedstat`` over ``--count`` sequential ones);
  then one client sends small chat requests one after another for ``--seconds`` s, alone
  and while another client sends ``parts`` bodies at ``--rate`` per second (open loop, at
  most 4 in flight): the small client's median and p99 latency.

``--txlb-root PATH`` measures another checkout as well (e.g. ``/work/main``), each part run
against both trees in turn.  Every process listens on 127.0.0.1; every loop is bounded in
count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
HOST = "127.0.0.1"
MODEL = "bench"
POLICIES = ("least-conn", "cache-aware")
SHAPES = ("parts", "messages", "tools")
#: every loop over sockets gives up after this long, whatever happens
DEADLINE = 60.0


def body_of(shape: str) -> bytes:
    """One hostile request body of ``shape`` (:data:`SHAPES`), or ``small``."""
    payload: dict[str, object]
    if shape == "parts":
        parts = [{"type": "text", "text": f"word {i:05d} abcdefghijklmno"} for i in range(50_000)]
        payload = {"model": MODEL, "stream": False,
                   "messages": [{"role": "user", "content": parts}]}
    elif shape == "messages":
        payload = {"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}
                                                for i in range(100_000)]}
    elif shape == "tools":
        tools = [{"type": "function", "function": {
            "name": f"f{i}", "description": "d" * 200,
            "parameters": {"type": "object", "required": ["a"], "properties": {
                "a": {"type": "string", "description": "x" * 100},
                "b": {"type": "integer"}}}}} for i in range(5_000)]
        payload = {"model": MODEL, "tools": tools,
                   "messages": [{"role": "user", "content": "hi"}]}
    else:
        payload = {"model": MODEL, "max_tokens": 8,
                   "messages": [{"role": "user", "content": "hello"}]}
    return json.dumps(payload).encode()


def request_of(body: bytes) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: lb\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


# -- in process (run as a child with the measured tree first on PYTHONPATH) ------------------


def in_process(policy: str, repeat: int) -> dict[str, float]:
    """CPU ms per request of each shape (and ``small``) through the in-memory proxy."""
    from twisted.internet.task import Clock

    from tests.helpers import ClientConnection, FakeResponse, FakeUpstream
    from txlb import LoadBalancer

    upstream = FakeUpstream()
    handle, log_file = tempfile.mkstemp(prefix="txlb-hostile.")
    os.close(handle)
    lb = LoadBalancer(["127.0.0.1:8002", "127.0.0.1:8003"], reactor=Clock(), agent=upstream,
                      probe_agent=FakeUpstream(), log_file=log_file, policy=policy)
    client = ClientConnection(lb.main_factory())
    headers = [(b"content-type", b"application/json")]
    out: dict[str, float] = {}
    try:
        for shape in ("small", *SHAPES):
            body = body_of(shape)

            def one(body: bytes = body) -> None:
                client.request(b"POST", b"/v1/chat/completions", headers=headers, body=body)
                response = upstream.calls.pop().respond(FakeResponse(200, headers, length=30))
                response.send(b'{"id":"x","choices":[],"ok":1}')
                response.end()
                assert client.transport.value().startswith(b"HTTP/1.1 200")
                client.transport.clear()

            times = []
            for index in range(repeat + 2):
                started = time.process_time()
                one()
                if index >= 2:  # the first two warm up
                    times.append(time.process_time() - started)
            out[shape] = statistics.median(times) * 1e3
    finally:
        os.unlink(log_file)
    return out


def run_in_process(root: Path, policy: str, repeat: int) -> dict[str, float]:
    """:func:`in_process` in a child whose ``txlb`` and ``tests`` are ``root``'s."""
    found = subprocess.run(
        [sys.executable, str(HERE), "--child", policy, "--repeat", str(repeat)],
        env=dict(os.environ, PYTHONPATH=str(root)), cwd=root, capture_output=True,
        text=True, timeout=DEADLINE * 5, check=True)
    result: dict[str, float] = json.loads(found.stdout.splitlines()[-1])
    return result


# -- over sockets ----------------------------------------------------------------------------


def backend_main() -> None:
    """A backend answering every POST with a small chat completion, without reading it."""
    answer = json.dumps({"id": "c", "object": "chat.completion", "model": MODEL,
                         "choices": [{"index": 0, "finish_reason": "stop", "message": {
                             "role": "assistant", "content": "ok"}}],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 1}}).encode()
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()

    def response(body: bytes) -> bytes:
        return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d"
                b"\r\n\r\n%s" % (len(body), body))

    class Backend(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport
            self.buffer = bytearray()
            self.skip = 0

        def data_received(self, data: bytes) -> None:
            self.buffer += data
            while True:
                if self.skip:
                    take = min(self.skip, len(self.buffer))
                    del self.buffer[:take]
                    self.skip -= take
                    if self.skip:
                        return
                end = self.buffer.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(self.buffer[:end]).lower()
                del self.buffer[:end + 4]
                length = 0
                for line in head.split(b"\r\n"):
                    if line.startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                self.skip = length
                self.transport.write(  # type: ignore[attr-defined]
                    response(models if b" /v1/models " in head else answer))

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(Backend, HOST, 0)
        print(json.dumps({"port": server.sockets[0].getsockname()[1]}), flush=True)
        await server.serve_forever()

    asyncio.run(serve())


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    raw: bytes) -> int:
    """Send one request, read its whole (sized) answer; its status."""
    writer.write(raw)
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    await reader.readexactly(length)
    return int(head.split(b" ", 2)[1])


async def _small_client(port: int, seconds: float, gap: float) -> list[float]:
    """Small requests one after another for ``seconds``: each one's latency, in ms."""
    reader, writer = await asyncio.open_connection(HOST, port)
    raw = request_of(body_of("small"))
    latencies: list[float] = []
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end and len(latencies) < 100_000:
            started = time.perf_counter()
            status = await asyncio.wait_for(_exchange(reader, writer, raw), DEADLINE)
            latencies.append((time.perf_counter() - started) * 1e3)
            if status != 200:
                raise RuntimeError(f"a small request was answered {status}")
            await asyncio.sleep(gap)
    finally:
        writer.close()
    return latencies


async def _hostile_client(port: int, raw: bytes, rate: float, seconds: float,
                          stop: asyncio.Event) -> tuple[int, int]:
    """``raw`` at ``rate`` per second (open loop, at most 4 in flight): (sent, skipped)."""
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = [
        await asyncio.open_connection(HOST, port) for _ in range(4)]
    every = [connection[1] for connection in idle]
    tasks: set[asyncio.Task[None]] = set()
    sent = skipped = 0

    async def one(connection: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        await asyncio.wait_for(_exchange(*connection, raw), DEADLINE)
        idle.append(connection)

    start = time.monotonic()
    for tick in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, start + tick / rate - time.monotonic()))
        if stop.is_set():
            break
        if not idle:
            skipped += 1
            continue
        sent += 1
        task = asyncio.create_task(one(idle.pop()))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks, timeout=DEADLINE)
    for writer in every:
        writer.close()
    return sent, skipped


async def _contended(port: int, rate: float, seconds: float, gap: float,
                     shape: str) -> tuple[list[float], int, int]:
    stop = asyncio.Event()
    hostile = asyncio.create_task(
        _hostile_client(port, request_of(body_of(shape)), rate, seconds, stop))
    await asyncio.sleep(0.2)  # the hostile load under way first
    try:
        latencies = await _small_client(port, seconds - 0.2, gap)
    finally:
        stop.set()
    sent, skipped = await hostile
    return latencies, sent, skipped


async def _sequential(port: int, raw: bytes, count: int) -> None:
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        for _ in range(count):
            status = await asyncio.wait_for(_exchange(reader, writer, raw), DEADLINE)
            if status != 200:
                raise RuntimeError(f"a hostile request was answered {status}")
    finally:
        writer.close()


def _quantiles(latencies: list[float]) -> tuple[float, float]:
    ordered = sorted(latencies)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def over_sockets(root: Path, policy: str, backend: int, options: argparse.Namespace,
                 workdir: Path) -> dict[str, object]:
    """One ``twistd -n llmlb`` from ``root``: CPU per hostile request, others' latency."""
    from bench.harness import Children, cpu_ns, start_txlb

    children = Children(workdir)
    try:
        target = start_txlb(children, None, f"{HOST}:{backend}", source=root,
                            log_file=None, extra=["--policy", policy])
        pids = target.pids()
        out: dict[str, object] = {}
        asyncio.run(_sequential(target.port, request_of(body_of("small")), 50))  # warm up
        for shape in SHAPES:
            raw = request_of(body_of(shape))
            asyncio.run(_sequential(target.port, raw, 2))
            before = cpu_ns(pids)
            asyncio.run(_sequential(target.port, raw, options.count))
            out[f"cpu_ms_{shape}"] = (cpu_ns(pids) - before) / options.count / 1e6
        alone = asyncio.run(_small_client(target.port, options.seconds, options.gap))
        out["alone"] = _quantiles(alone)
        latencies, sent, skipped = asyncio.run(_contended(
            target.port, options.rate, options.seconds, options.gap, options.shape))
        out["contended"] = _quantiles(latencies)
        out["hostile_sent"], out["hostile_skipped"] = sent, skipped
        return out
    finally:
        children.stop_all()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--txlb-root", type=Path, action="append", default=[],
                        help="another checkout to measure too (repeatable)")
    parser.add_argument("--repeat", type=int, default=15,
                        help="in-process requests per shape (the median)")
    parser.add_argument("--count", type=int, default=10,
                        help="sequential hostile requests per shape over sockets")
    parser.add_argument("--rate", type=float, default=7.0,
                        help="hostile requests per second beside the small client")
    parser.add_argument("--shape", choices=SHAPES, default="parts",
                        help="the hostile body sent beside the small client")
    parser.add_argument("--seconds", type=float, default=5.0,
                        help="how long the small client runs, alone and contended")
    parser.add_argument("--gap", type=float, default=0.01,
                        help="seconds between the small client's requests")
    parser.add_argument("--in-process-only", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--backend", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.backend:
        backend_main()
        return 0
    if options.child:
        print(json.dumps(in_process(options.child, options.repeat)))
        return 0
    options.seconds = min(options.seconds, DEADLINE / 2)
    roots = [ROOT, *(root.resolve() for root in options.txlb_root)]
    sizes = {shape: len(body_of(shape)) for shape in SHAPES}
    print("bodies: " + ", ".join(f"{shape} {size / 1e6:.1f} MB" for shape, size in sizes.items()))
    print("\n## in process: CPU ms per request (median)\n")
    print("| tree | policy | small | " + " | ".join(SHAPES) + " |")
    print("|---|---|---:|" + "---:|" * len(SHAPES))
    for policy in POLICIES:
        for root in roots:
            ms = run_in_process(root, policy, options.repeat)
            print(f"| {root} | {policy} | {ms['small']:.2f} | "
                  + " | ".join(f"{ms[shape]:.1f}" for shape in SHAPES) + " |", flush=True)
    if options.in_process_only:
        return 0
    print(f"\n## over sockets: twistd -n llmlb's CPU ms per hostile request ({options.count} "
          f"each); a small client's latency alone and beside {options.rate:g} {options.shape} "
          f"requests/s\n")
    print("| tree | policy | " + " | ".join(f"CPU ms {s}" for s in SHAPES)
          + " | alone p50 / p99 ms | contended p50 / p99 ms | hostile sent (skipped) |")
    print("|---|---|" + "---:|" * len(SHAPES) + "---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="txlb-hostile-") as work:
        workdir = Path(work)
        backend = subprocess.Popen([sys.executable, str(HERE), "--backend"],
                                   stdout=subprocess.PIPE, text=True, cwd=workdir)
        try:
            assert backend.stdout is not None
            port = json.loads(backend.stdout.readline())["port"]
            for policy in POLICIES:
                for root in roots:
                    row = over_sockets(root, policy, port, options, workdir)
                    print(f"| {root} | {policy} | "
                          + " | ".join(f"{row[f'cpu_ms_{s}']:.1f}" for s in SHAPES)
                          + f" | {_pair(row['alone'])} | {_pair(row['contended'])} | "
                          f"{row['hostile_sent']} ({row['hostile_skipped']}) |", flush=True)
        finally:
            backend.terminate()
            backend.wait(10)
    return 0


def _pair(value: object) -> str:
    low, high = value  # type: ignore[misc]
    return f"{low:.1f} / {high:.1f}"


if __name__ == "__main__":
    sys.exit(main())
