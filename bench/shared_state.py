"""
What ``--shared-state`` adds to a request's time to first byte (``python -m bench.shared_state``).

Four balancers run at once from this source tree in front of the same :mod:`bench.backend`
(4 ports) and one ``redis-server`` on a free loopback port (nothing saved), and are measured
in alternation, round after round, so slow drifts of a shared machine hit all alike:

``local``      no ``--shared-state``;
``shared``     ``--shared-state``: every request's slot taken and given back is written to
               Redis (pipelined, off the request's path);
``shared+rl``  the same with ``--rate-limit`` set far above the load, so every request also
               runs the rate script;
``shared+max_conns``  ``--shared-state`` with every backend given a ``max_conns`` far above
               the load, so every pick waits for the slot script's answer (one round trip
               to Redis) before the request goes out.

Each round sends ``--requests`` sequential ``GET /json`` on one keep-alive connection per
balancer and times each from the request's last byte written to the answer's first byte
read.  Writes ``bench/results/shared-state.md`` with ``--save``.

``--confirm N`` measures instead the slot script alone, in this process: N confirmations of
a ``max_conns`` slot (:meth:`txlb._shared.slots.SharedSlots.confirm`) against its own
``redis-server``, one after the other -- the round trip a ``max_conns`` pick waits for,
without the other processes' scheduling that the TTFB runs share.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

from bench.harness import (
    HOST,
    ROOT,
    TWISTD,
    Child,
    Children,
    free_port,
    start_backend,
    wait_for,
    wait_ready,
)

RESULTS = ROOT / "bench" / "results"
VARIANTS = ("local", "shared", "shared+rl", "shared+max_conns")
#: ``max_conns`` of every backend in the ``shared+max_conns`` variant: never reached, so the
#: variant measures the confirmation alone
UNREACHED_MAX_CONNS = 100_000


def start_redis(children: Children) -> int:
    program = shutil.which("redis-server") or "/usr/bin/redis-server"
    port = free_port()
    child = children.spawn("redis", [program, "--port", str(port), "--bind", HOST,
                                     "--save", "", "--appendonly", "no",
                                     "--dir", str(children.workdir)])
    wait_for(child, r"Ready to accept connections")
    return port


def start_balancer(children: Children, name: str, backends: str, redis: int) -> int:
    extra: list[str] = []
    if name != "local":
        extra += ["--shared-state", f"redis://{HOST}:{redis}/0"]
    if name == "shared+rl":
        extra += ["--rate-limit", "1000000/s"]
    members = ["--backends", backends]
    if name == "shared+max_conns":
        config = children.workdir / "max-conns.toml"
        config.write_text("backends = [" + ", ".join(
            f'{{url = "http://{key}", max_conns = {UNREACHED_MAX_CONNS}}}'
            for key in backends.split(",")) + "]\n")
        members = ["--config", str(config)]
    child: Child = children.spawn(name, [
        TWISTD, "-n", "--pidfile=", "llmlb", "--listen", f"tcp:0:interface={HOST}",
        *members, "--admin", "none", "--log-file", "none",
        "--health-interval", "30", *extra])
    port = int(wait_for(child, r"ProxySite starting on (\d+)").group(1))
    wait_ready(port, alive=lambda: child.process.poll() is None)
    if name != "local":
        wait_for(child, r"shared state: connected")
    return port


def ttfbs(port: int, requests: int) -> list[float]:
    """Seconds from each request written to its answer's first byte, on one connection."""
    request = f"GET /json HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()
    times = []
    with socket.create_connection((HOST, port), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = sock.makefile("rb")
        for _ in range(requests):
            sock.sendall(request)
            began = time.perf_counter()
            first = reader.read(1)
            times.append(time.perf_counter() - began)
            line = first + reader.readline()
            if not line.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"unexpected answer {line!r}")
            length = 0
            while (header := reader.readline()) not in (b"\r\n", b""):
                name, _, value = header.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            reader.read(length)
    return times


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def confirm_times(redis: int, count: int) -> list[float]:
    """Seconds each of ``count`` slot confirmations took, against Redis on ``redis``."""
    from twisted.internet import reactor, task
    from twisted.internet.defer import ensureDeferred

    from txlb._cluster.pool import Pool
    from txlb._config import BackendSpec
    from txlb._config.shared import SharedStateSpec
    from txlb._shared.slots import SharedSlots
    from txlb._shared.store import RedisStore

    times: list[float] = []

    async def run() -> None:
        store = RedisStore(SharedStateSpec(HOST, redis), reactor, replica="bench")
        pool = Pool((BackendSpec("gpu", 1, max_conns=UNREACHED_MAX_CONNS),), clock=reactor,
                    store=store)
        slots = SharedSlots(store, lambda: None)
        pool.slots.confirm_with(slots)
        store.start()
        for _ in range(200):
            if store.link.connected:
                break
            await task.deferLater(reactor, 0.05, lambda: None)
        backend = pool.get("gpu:1")
        assert backend is not None and store.link.connected
        for _ in range(count):
            lease = pool.slots.acquire(backend)
            began = time.perf_counter()
            admitted = await slots.confirm(backend)
            times.append(time.perf_counter() - began)
            assert admitted
            lease.release()
            await task.deferLater(reactor, 0.0005, lambda: None)  # the flush runs too
        await store.stop()

    def done(_: object) -> None:
        reactor.stop()  # type: ignore[attr-defined]

    reactor.callWhenRunning(lambda: ensureDeferred(run()).addBoth(done))  # type: ignore[attr-defined]
    reactor.run()  # type: ignore[attr-defined]
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--confirm", type=int, default=0, metavar="N",
                        help="time N slot confirmations in this process instead")
    args = parser.parse_args(argv)
    if args.confirm:
        with tempfile.TemporaryDirectory(prefix="txlb-bench-shared-") as workdir:
            children = Children(Path(workdir))
            try:
                times = confirm_times(start_redis(children), args.confirm)
            finally:
                children.stop_all()
        print(f"slot script, {len(times)} confirmations: p50 "
              f"{statistics.median(times) * 1e3:.3f} ms, p90 "
              f"{percentile(times, 0.9) * 1e3:.3f} ms, p99 "
              f"{percentile(times, 0.99) * 1e3:.3f} ms")
        return
    with tempfile.TemporaryDirectory(prefix="txlb-bench-shared-") as workdir:
        children = Children(Path(workdir))
        try:
            _, ports = start_backend(children, None, 4)
            backends = ",".join(f"{HOST}:{port}" for port in ports)
            redis = start_redis(children)
            balancers = {name: start_balancer(children, name, backends, redis)
                         for name in VARIANTS}
            samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
            for port in balancers.values():
                ttfbs(port, 100)  # warm up
            for round_ in range(args.rounds):
                order = VARIANTS if round_ % 2 == 0 else tuple(reversed(VARIANTS))
                for name in order:
                    samples[name] += ttfbs(balancers[name], args.requests)
                print(f"round {round_ + 1}/{args.rounds} done", flush=True)
        finally:
            children.stop_all()
    report = table(samples, args)
    print(report)
    if args.save:
        (RESULTS / "shared-state.md").write_text(report)


def table(samples: dict[str, list[float]], args: argparse.Namespace) -> str:
    local50 = statistics.median(samples["local"])
    local99 = percentile(samples["local"], 0.99)
    lines = [
        "# What `--shared-state` adds to time to first byte",
        "",
        f"`python -m bench.shared_state --rounds {args.rounds} --requests {args.requests}` "
        f"on {datetime.date.today().isoformat()}, {platform.machine()}, Python "
        f"{platform.python_version()}, one machine (2 shared cores) running the backend, "
        "Redis, the four balancers and the client: sequential `GET /json` on one "
        "keep-alive connection per balancer, the variants alternated round by round.",
        "",
        "| variant | requests | TTFB p50 (ms) | TTFB p99 (ms) | added p50 (ms) | "
        "added p99 (ms) | over `shared` p50 / p99 (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    shared50 = statistics.median(samples["shared"])
    shared99 = percentile(samples["shared"], 0.99)
    for name in VARIANTS:
        values = samples[name]
        p50, p99 = statistics.median(values), percentile(values, 0.99)
        over = ("" if name in ("local", "shared") else
                f"{(p50 - shared50) * 1e3:+.3f} / {(p99 - shared99) * 1e3:+.3f}")
        lines.append(f"| {name} | {len(values)} | {p50 * 1e3:.3f} | {p99 * 1e3:.3f} | "
                     f"{(p50 - local50) * 1e3:+.3f} | {(p99 - local99) * 1e3:+.3f} | "
                     f"{over} |")
    lines += [
        "",
        "`shared`: the slot's take and give-back are each written to Redis within 5 ms "
        "with the other changes meanwhile (pipelined `HSET` + `PEXPIRE`), off the "
        "request's path; the poll "
        "(every 0.1 s) is not per request.  `shared+rl`: one `EVALSHA` per admitted "
        "request as well, also not awaited (admission reads the local copy of the "
        "bucket).  What the added time is: the extra writes' CPU in the same process, "
        "not a round trip.  `shared+max_conns`: every pick is confirmed by one `EVALSHA` "
        "of the slot script (`txlb._shared.slots.ACQUIRE`) before the request is sent: "
        "the one shared-state cost that is a round trip to Redis, paid only by backends "
        "with `max_conns`.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
