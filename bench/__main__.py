"""
``python -m bench <scenario> [options]``: every benchmark of the project behind one door.

``python -m bench`` alone lists the scenarios, one line each; ``python -m bench NAME
--help`` gives one's options.  Each scenario is a module of this package run as its own
``python -m bench.NAME`` would run it (the same options, output and exit code), so the two
spellings are one command and a results page's recorded command works either way.  The
table below is the one list of what there is to run; ``tests/unit/test_bench_entry.py``
checks that every module it names can be run.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Scenario:
    """One benchmark: its name on the command line, what it answers, and its module."""

    name: str
    summary: str
    module: str


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("relay", "txlb against nginx and the Rust routers on the chat path: CPU per "
             "chunk, latency, requests/s, memory", "bench.relay"),
    Scenario("ab", "txlb at another git revision against this tree, side by side in one run",
             "bench.ab"),
    Scenario("workers", "--workers: txlb with 1 and with 2 worker processes, side by side",
             "bench.workers"),
    Scenario("relay_floor", "the floor under any Python proxy's CPU per streamed chunk",
             "bench.relay_floor"),
    Scenario("relay_log", "what the per-request result log costs the relay path",
             "bench.relay_log"),
    Scenario("lean_server", "the main port's lean server against twisted.web's, in memory",
             "bench.lean_server"),
    Scenario("summary_cost", "what the result-log summary costs the reactor thread",
             "bench.summary_cost"),
    Scenario("formats", "the result log's two formats: time per line", "bench.formats"),
    Scenario("body_memory", "what a request body costs txlb in memory and in others' time",
             "bench.body_memory"),
    Scenario("hostile_json", "what hostile JSON bodies cost txlb and everyone else's latency",
             "bench.hostile_json"),
    Scenario("hostile_redis", "a hostile Redis behind --shared-state against a real txlb",
             "bench.hostile_redis"),
    Scenario("fuzz", "raw-socket fuzz of a real twistd -n llmlb", "bench.fuzz"),
    Scenario("shared_state", "what --shared-state adds to a request's time to first byte",
             "bench.shared_state"),
    Scenario("policies", "the scheduling policies over heterogeneous engines (simulation); "
             "--replicas: fleet balance of several replicas", "bench.policies"),
    Scenario("classes", "what priority classes buy the interactive class under a batch flood",
             "bench.classes"),
    Scenario("fairness", "what --fairness vtc buys light tenants against a heavy one's flood "
             "(simulation)", "bench.fairness_report"),
    Scenario("auth_timing", "whether --auth keys' check takes longer for a closer guess",
             "bench.auth_timing"),
    Scenario("prefix", "cache-aware routing against least-conn, an oracle and the routers",
             "bench.prefix"),
    Scenario("prefix.replicas_process", "the shared cache-aware index with real replica "
             "processes", "bench.prefix.replicas_process"),
    Scenario("prefix.sharing_cost", "the CPU the shared cache-aware index adds per request",
             "bench.prefix.sharing_cost"),
    Scenario("prefix_memory", "what cache-aware's prefix index costs in memory and time",
             "bench.prefix_memory"),
    Scenario("prefix_workers", "cache-aware under --workers: one index per worker or one "
             "shared", "bench.prefix_workers"),
    Scenario("mutation", "mutation testing of txlb's core modules (cosmic-ray)",
             "bench.mutation"),
    Scenario("routers", "install the Rust routers the relay and prefix benches compare with",
             "bench.routers"),
)


def listing() -> str:
    """What ``python -m bench`` alone prints: usage, then one line per scenario."""
    width = max(len(s.name) for s in SCENARIOS)
    lines = ["usage: python -m bench <scenario> [options]   (python -m bench <scenario> "
             "--help for its options)", "", "scenarios:"]
    lines += [f"  {s.name:<{width}}  {s.summary}" for s in SCENARIOS]
    return "\n".join(lines)


def find(name: str) -> Scenario | None:
    """The scenario called ``name``, if there is one."""
    return next((s for s in SCENARIOS if s.name == name), None)


def main(argv: Sequence[str] | None = None) -> int:
    """List the scenarios, or run the one named first with the options after it."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "list"):
        print(listing())
        return 0
    scenario = find(args[0])
    if scenario is None:
        sys.stderr.write(f"python -m bench: no scenario {args[0]!r}\n\n{listing()}\n")
        return 2
    sys.argv = [scenario.module, *args[1:]]  # runpy puts the module's path first
    runpy.run_module(scenario.module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
