"""
What priority classes buy the interactive class when a batch flood shares the fleet.

A deterministic discrete-event simulation on a :class:`twisted.internet.task.Clock`, with
txlb's *real* :class:`~txlb._cluster.pool.Pool`, :class:`~txlb._scheduling.router.Router`
(its per-class queues, the starvation guard, the per-class timeouts) and
:class:`~txlb._scheduling.classes.PriorityClasses`, in front of :mod:`bench.policies`'
virtual-clock engines (eight heterogeneous vLLM-like engines, ``max_conns =
max_num_seqs``: the excess waits in the balancer's queue, experiment C there).

The workload is bench.policies' (Poisson arrivals, lognormal prompt and output lengths) at
``load`` times the fleet's full-batch capacity; each request is ``interactive`` with
probability ``--interactive`` (0.2), else ``batch``.  Each run is made twice on the same
request sequence: **with classes** (the built-in classes: interactive first, batch guarded
against starvation at half the 30 s queue timeout) and **without** (every request in one
FIFO queue, which is what a class-less balancer does).  TTFT is arrival at the balancer to
first token (balancer queue + engine queue + prefill); a request still waiting after the
queue timeout is refused (503) and counted apart.

``python -m bench.classes`` writes bench/results/priority-classes.md.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from bench.policies_run import EXPERIMENTS, specs_for
from bench.provenance import RESULTS
from bench.sim_engines import (
    Engine,
    Params,
    Request,
    make_workload,
    percentile,
    run_to_the_end,
)
from txlb._cluster.pool import Pool
from txlb._cluster.slots import Lease
from txlb._config import Config
from txlb._scheduling.classes import PriorityClasses
from txlb._scheduling.policies.registry import make_policy
from txlb._scheduling.request import RoutingRequest
from txlb._scheduling.router import Router, RoutingError

#: experiment C of bench.policies: one balancer, weights 1, max_conns = max_num_seqs
CAPPED = next(e for e in EXPERIMENTS if e.capped)
INTERACTIVE, BATCH = "interactive", "batch"


@dataclass(frozen=True)
class ClassFigures:
    """What one class got in one run."""

    sent: int
    completed: int
    refused: int
    p50_ttft: float
    p99_ttft: float
    p99_completion: float


@dataclass(frozen=True)
class ClassRun:
    load: float
    classes: bool
    interactive: ClassFigures
    batch: ClassFigures
    wall_seconds: float


def figures(requests: Sequence[Request]) -> ClassFigures:
    ok = [r for r in requests if not r.refused]
    ttft = [r.first_token - r.arrival for r in ok]  # type: ignore[operator]
    completion = [r.done - r.arrival for r in ok]  # type: ignore[operator]
    return ClassFigures(
        sent=len(requests), completed=len(ok), refused=len(requests) - len(ok),
        p50_ttft=percentile(ttft, 50) if ttft else 0.0,
        p99_ttft=percentile(ttft, 99) if ttft else 0.0,
        p99_completion=percentile(completion, 99) if completion else 0.0)


def run(params: Params, classes: bool, interactive_share: float = 0.2) -> ClassRun:
    """Replay the workload through one balancer, with the built-in classes or without."""
    started = time.perf_counter()
    clock = Clock()
    workload = make_workload(params, 1)
    specs = specs_for(CAPPED, params)
    pool = Pool(tuple(spec for spec, _ in specs), clock=clock)
    policy = make_policy("least-conn", clock, random.Random(f"policy-{params.seed}"))
    router = Router(pool, policy, clock, queue_timeout=params.queue_timeout, retry_after=1,
                    classes=PriorityClasses(Config(backends=(),
                                                   queue_timeout=params.queue_timeout)))
    chooser = random.Random(f"classes-{params.seed}")
    kinds = [INTERACTIVE if chooser.random() < interactive_share else BATCH
             for _ in workload.arrivals]
    requests: list[Request] = []
    outstanding = [len(workload.arrivals)]

    def done(request: Request) -> None:
        assert request.lease is not None
        outstanding[0] -= 1
        request.lease.release()

    engines = {spec.key: Engine(clock, spec.key, cls, params, lambda r: None, done)
               for spec, cls in specs}

    def leased(lease: Lease, request: Request) -> None:
        request.lease = lease
        engines[lease.backend.key].submit(request)

    def refused(failure: Failure, request: Request) -> None:
        failure.trap(RoutingError)
        request.refused = True
        outstanding[0] -= 1

    def arrive(index: int) -> None:
        when, prompt, output, replica = workload.arrivals[index]
        request = Request(index, when, prompt, output, replica)
        requests.append(request)
        if index + 1 < len(workload.arrivals):
            clock.callLater(workload.arrivals[index + 1][0] - clock.seconds(),
                            arrive, index + 1)
        priority = kinds[index] if classes else "default"
        d: Deferred[Lease] = router.acquire(RoutingRequest(priority=priority))
        d.addCallbacks(leased, refused, callbackArgs=(request,), errbackArgs=(request,))

    clock.callLater(workload.arrivals[0][0], arrive, 0)
    run_to_the_end(clock, outstanding)
    if any(b.counts.active for b in pool) or router.queue_length:
        raise RuntimeError("slots or waiters left over")
    by_kind = {kind: [r for r, k in zip(requests, kinds, strict=True) if k == kind]
               for kind in (INTERACTIVE, BATCH)}
    return ClassRun(params.load, classes, figures(by_kind[INTERACTIVE]),
                    figures(by_kind[BATCH]), time.perf_counter() - started)


def markdown(runs: Sequence[ClassRun], params: Params, share: float, command: str) -> str:
    lines = [
        "# Priority classes under a batch flood (simulated)",
        "",
        f"Command: `{command}`. {params.requests} requests per run (seed {params.seed}), "
        f"{share:.0%} interactive, the rest batch; eight engines (bench.policies' 4 fast, "
        "2 medium, 2 slow), `max_conns = max_num_seqs` = "
        f"{params.max_num_seqs}, least-conn, queue timeout {params.queue_timeout:g} s. "
        "With classes: the built-in ones (interactive first; batch served next once it has "
        f"waited {params.queue_timeout / 2:g} s). Without: one FIFO queue. TTFT and "
        "completion in seconds from the arrival at the balancer; refused = 503 after the "
        "queue timeout. Virtual time: the figures do not depend on the machine.",
        "",
        "| load | classes | interactive p50 TTFT | interactive p99 TTFT | interactive refused "
        "| batch p50 TTFT | batch p99 TTFT | batch p99 completion | batch completed | "
        "batch refused |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        i, b = r.interactive, r.batch
        lines.append(
            f"| {r.load:.0%} | {'yes' if r.classes else 'no'} | {i.p50_ttft:.2f} | "
            f"{i.p99_ttft:.2f} | {i.refused}/{i.sent} | {b.p50_ttft:.2f} | {b.p99_ttft:.2f} "
            f"| {b.p99_completion:.1f} | {b.completed}/{b.sent} | {b.refused}/{b.sent} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.classes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--requests", type=int, default=20_000,
                        help="requests per run (default %(default)s)")
    parser.add_argument("--loads", default="0.9,1.0,1.1",
                        help="comma-separated loads (default %(default)s)")
    parser.add_argument("--interactive", type=float, default=0.2,
                        help="share of interactive requests (default %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS / "priority-classes.md")
    args = parser.parse_args(argv)
    base = Params(seed=args.seed, requests=args.requests)
    runs = []
    for load in (float(x) for x in args.loads.split(",") if x.strip()):
        for classes in (False, True):
            result = run(replace(base, load=load), classes, args.interactive)
            print(f"load {load:.0%} classes={classes}: interactive p99 TTFT "
                  f"{result.interactive.p99_ttft:.2f}s ({result.wall_seconds:.0f}s)",
                  file=sys.stderr, flush=True)
            runs.append(result)
    command = "python -m bench.classes" + "".join(
        f" {arg}" for arg in (argv if argv is not None else sys.argv[1:]))
    report = markdown(runs, base, args.interactive, command)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
