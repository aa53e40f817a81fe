"""
``python -m bench.prefix.replicas_process``: the shared cache-aware index with real processes.

For each replica count and each of "own index" (no ``--shared-state``) and "shared index"
(``--shared-state`` over one ``redis-server``): fresh simulated engines (``twistd -n
vllm-sim`` with a prefix cache, cold), that many ``twistd -n llmlb --policy cache-aware``
replicas in front of them, and one client sending ``--requests`` completions, one at a time
every ``--gap`` seconds, each to the next replica in turn: ``--tenants`` tenants, each with
its own ~1,000-token system prompt and a question of its own.  The figure is the engines'
own: prefix-cache hits over queries (``vllm:prefix_cache_*_total``, in tokens), summed.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import HOST, ROOT, TWISTD, Children, free_port
from bench.prefix.fleet import HITS, QUERIES, EngineShape, Fleet, scrape, simulator_options
from bench.sections import SCALE_OUT_TITLE, replace_section
from bench.shared_state import start_redis

RESULTS = ROOT / "bench" / "results"


def start_replica(children: Children, urls: list[str], redis: int | None) -> int:
    port = free_port()
    state = ["--shared-state", f"redis://{HOST}:{redis}/0"] if redis else []
    child = children.spawn("txlb", [
        TWISTD, "-n", "--pidfile=", "llmlb", "--listen", f"tcp:{port}:interface={HOST}",
        "--backends", ",".join(urls), "--policy", "cache-aware", "--admin", "none",
        "--log-file", "none", "--health-interval", "1", *state])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = child.text()
        if ("shared state: the cache-aware index is the fleet's" in text or not redis) \
                and "starting on" in text:
            return port
        time.sleep(0.1)
    raise RuntimeError(f"replica not ready:\n{child.text()[-2000:]}")


def post(port: int, body: dict[str, object]) -> None:
    connection = http.client.HTTPConnection(HOST, port, timeout=30)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body),
                           {"Content-Type": "application/json", "X-Sim-Tokens": "1"})
        response = connection.getresponse()
        response.read()
        if response.status != 200:
            raise RuntimeError(f"status {response.status}")
    finally:
        connection.close()


def run(replicas: int, shared: bool, args: argparse.Namespace) -> float:
    with tempfile.TemporaryDirectory(prefix="txlb-replicas-") as work:
        children = Children(Path(work))
        try:
            fleet = Fleet(children, EngineShape(count=args.engines)).start(simulator_options())
            redis = start_redis(children) if shared else None
            ports = [start_replica(children, fleet.urls(), redis) for _ in range(replicas)]
            rng = random.Random(args.seed)
            systems = [f"Tenant {t}'s assistant, with its own rules and tools. " * 80
                       for t in range(args.tenants)]
            before = [scrape(port) for port in fleet.ports]
            for n in range(args.requests):
                tenant = rng.randrange(args.tenants)
                post(ports[n % replicas], {"model": "sim-model", "max_tokens": 1,
                                           "prompt": systems[tenant] + f" question {n}?"})
                time.sleep(args.gap)
            after = [scrape(port) for port in fleet.ports]
        finally:
            children.stop_all()
    hits = sum(a.get(HITS, 0.0) - b.get(HITS, 0.0) for a, b in zip(after, before, strict=True))
    queries = sum(a.get(QUERIES, 0.0) - b.get(QUERIES, 0.0)
                  for a, b in zip(after, before, strict=True))
    return hits / queries if queries else 0.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--replicas", default="2,4,8")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--tenants", type=int, default=32)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--gap", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--save", action="store_true",
                        help="write the table to bench/results/scale-out.md")
    args = parser.parse_args(argv)
    lines = [f"{args.engines} engines, {args.tenants} tenants, {args.requests} requests "
             f"{args.gap * 1000:g} ms apart, to each replica in turn; the engines' hit rate "
             "(prefix-cache hits / queries, in tokens):", "",
             "| replicas | own index | shared index |", "|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    for count in (int(n) for n in args.replicas.split(",")):
        own, shared = run(count, False, args), run(count, True, args)
        lines.append(f"| {count} | {own:.3f} | {shared:.3f} |")
        print(lines[-1], flush=True)
    if args.save:
        command = "python -m bench.prefix.replicas_process " + " ".join(argv or sys.argv[1:])
        text = "\n".join([
            "## Cache-aware index with real processes: own index or shared through Redis", "",
            f"`{command.strip()}` ({datetime.date.today().isoformat()}, "
            f"{platform.machine()}, {os.cpu_count()} cores, shared with other work): fresh "
            "simulated engines with a prefix cache, `twistd -n llmlb --policy cache-aware` "
            "replicas without and with `--shared-state` (one `redis-server`).", "", *lines])
        replace_section(RESULTS / "scale-out.md", "prefix-processes", text, SCALE_OUT_TITLE)
        print(f"wrote {RESULTS / 'scale-out.md'}")


if __name__ == "__main__":
    main()
