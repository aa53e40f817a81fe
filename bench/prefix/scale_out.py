"""
``python -m bench.prefix --scale-out``: one cache-aware index per replica, or one for the
fleet, at 2, 4 and 8 replicas -- and what sharing it through a store would cost.

An index shared live through a store costs a round trip per lookup, which txlb's shared
state does not allow on a request's path; the cheap form is one index every replica writes
to at once and looks up in its own copy, refreshed every ``R``
(:mod:`bench.prefix.synced_index`).  Variants,
each with ``cache-aware`` over the virtual fleet of :mod:`bench.prefix.virtual`:

* *independent*: own in-flight counts, own index (separate processes, nothing shared);
* *shared counts, own index*: fleet-wide in-flight counts, each replica its own index;
* *shared counts, index every R*: the same, with the fleet's one index looked up in a copy
  each replica refreshes every ``R`` seconds;
* *shared counts, one index*: one index, exact (the upper bound; live through a store it
  would cost the round trip per lookup);
* ``least-conn`` with shared counts: no index at all, the floor.

The section ``prefix`` of ``bench/results/scale-out.md`` is written from the runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.prefix import virtual
from bench.prefix.engine_model import EngineConfig
from bench.prefix.workloads import Options


def scenarios(workloads: Sequence[str], engines: int, requests: int, load: float,
              seed: int, replicas: Sequence[int],
              refreshes: Sequence[float]) -> list[tuple[virtual.Scenario, str]]:
    """Every (scenario, policy) run of the section."""
    config = EngineConfig()
    jobs: list[tuple[virtual.Scenario, str]] = []
    for workload in workloads:
        options = Options(seed=seed, requests=requests, burst=8 * engines,
                          tenants=min(150, 6 * engines), active=8 * engines)

        def scenario(n: int, workload: str = workload, options: Options = options,
                     **how: object) -> virtual.Scenario:
            return virtual.Scenario(workload, engines=engines, requests=requests,
                                    replicas=n, load=load, seed=seed, config=config,
                                    options=options, **how)  # type: ignore[arg-type]

        jobs.append((scenario(1), "cache-aware"))
        for n in replicas:
            jobs.append((scenario(n), "cache-aware"))
            jobs.append((scenario(n, shared_counts=True), "cache-aware"))
            jobs += [(scenario(n, shared_counts=True, index_refresh=r), "cache-aware")
                     for r in refreshes]
            jobs.append((scenario(n, shared_counts=True, shared_index=True), "cache-aware"))
            jobs.append((scenario(n, shared_counts=True), "least-conn"))
    return jobs


def label(r: virtual.VirtualResult) -> str:
    if r.replicas == 1:
        return "one balancer"
    if r.policy == "least-conn":
        return "least-conn, shared counts (no index)"
    if not r.shared_counts:
        return "independent"
    if r.shared_index:
        return "shared counts, one index"
    if r.index_refresh:
        return f"shared counts, index every {r.index_refresh * 1000:g} ms"
    return "shared counts, own index"


def markdown(results: Sequence[virtual.VirtualResult], command: str, wall: float,
             requests: int, engines: int, load: float, seed: int) -> str:
    lines = [
        "## Cache-aware index: one per replica or one for the fleet",
        "",
        f"- command: `{command}` ({len(results)} runs, {wall:.0f} s wall)",
        f"- the virtual fleet of `bench/results/cache-aware.md` (bench.prefix.virtual): "
        f"{engines} engines with prefix caches, {requests} requests per run, load {load:g}, "
        f"seed {seed}; each arrival to a random replica; policy `cache-aware` unless "
        "named",
        "- *index every R*: one index for the fleet, every replica's sends written to it "
        "at once, each replica looking it up in its own copy refreshed every R (phases "
        "staggered); *one index*: every lookup on the fleet's index itself (what a store "
        "lookup per request would give, at a round trip per request)",
        "- hit rate = cached prompt tokens / prompt tokens, as the engines counted them; "
        "TTFT in ms",
        "",
        "| workload | replicas | index | hit rate | TTFT p50 | TTFT p99 | max in flight |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(f"| {r.workload} | {r.replicas} | {label(r)} | {r.hit_rate:.3f} | "
                     f"{1000 * r.ttft_p50:.0f} | {1000 * r.ttft_p99:.0f} | "
                     f"{r.max_in_flight} |")
    lines += ["", *verdict(results), ""]
    return "\n".join(lines)


def verdict(results: Sequence[virtual.VirtualResult]) -> list[str]:
    """Which variant wins, and by how much, per workload and replica count."""
    out = ["### What the figures say", ""]
    for workload in dict.fromkeys(r.workload for r in results):
        runs = [r for r in results if r.workload == workload]
        single = next(r for r in runs if r.replicas == 1)
        for n in sorted({r.replicas for r in runs if r.replicas > 1}):
            at = {label(r): r for r in runs if r.replicas == n}
            own = at["shared counts, own index"]
            one = at["shared counts, one index"]
            stale = sorted((r for r in at.values() if r.index_refresh),
                           key=lambda r: r.index_refresh)
            parts = ", ".join(f"every {r.index_refresh * 1000:g} ms {r.hit_rate:.3f}"
                              for r in stale)
            out.append(
                f"- {workload}, {n} replicas: hit rate {at['independent'].hit_rate:.3f} "
                f"independent, {own.hit_rate:.3f} own index, {parts}, {one.hit_rate:.3f} one "
                f"index ({single.hit_rate:.3f} for one balancer); p99 TTFT "
                f"{1000 * own.ttft_p99:.0f} ms own index, "
                + ", ".join(f"{1000 * r.ttft_p99:.0f} ms every {r.index_refresh * 1000:g} ms"
                            for r in stale)
                + f", {1000 * one.ttft_p99:.0f} ms one index.")
    return out


def main(args: argparse.Namespace, command: str, out: Path) -> str:
    from bench.sections import SCALE_OUT_TITLE, replace_section

    jobs = scenarios(args.workloads, args.engines[0], args.requests, args.load, args.seed,
                     args.replicas, args.index_refresh)
    started = time.perf_counter()
    print(f"scale-out: {len(jobs)} runs on {args.jobs} processes", file=sys.stderr)

    def progress(r: virtual.VirtualResult) -> None:
        print(f"  {r.workload:9s} x{r.replicas} {label(r):40s} hit {r.hit_rate:.3f} "
              f"({r.wall_seconds:.1f}s)", file=sys.stderr)

    results = virtual.run_all(jobs, args.jobs, progress)
    text = markdown(results, command, time.perf_counter() - started, args.requests,
                    args.engines[0], args.load, args.seed)

    replace_section(out / "scale-out.md", "prefix", text, SCALE_OUT_TITLE)
    return text
