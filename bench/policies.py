"""
Which scheduling policy should txlb use in front of heterogeneous LLM engines?

A deterministic discrete-event simulation that drives txlb's *real* scheduling code --
:class:`txlb._cluster.pool.Pool`, :class:`txlb._scheduling.router.Router` and the policies
made by :func:`txlb._scheduling.policies.registry.make_policy` -- on a
:class:`twisted.internet.task.Clock`.  There is no real time, no socket and no HTTP: only the
engines behind the balancer are modelled.

The engine model (one per backend)
----------------------------------
Each simulated engine behaves like a vLLM server, simplified:

* **A batch of at most ``max_num_seqs`` sequences** ("running"); a request that arrives
  when the batch is full waits in the engine's own FIFO queue ("waiting") and joins the
  batch as soon as a sequence finishes -- the ``vllm:num_requests_running`` /
  ``vllm:num_requests_waiting`` pair that the ``queue-depth`` policy scrapes.
* **Prefill.**  A sequence that joins the batch first spends ``prompt_tokens /
  prefill_rate`` seconds in prefill, then emits its first token.  Prefill of different
  sequences does not contend (each has its own timer) and does not slow decoding; a
  prefilling sequence does occupy a batch slot.
* **Decode.**  Every decoding sequence on an engine advances at the same per-sequence
  speed ``decode_rate * (1 - degradation * running / max_num_seqs)`` tokens/s, where
  ``running`` counts the whole batch (prefilling sequences included): with the default
  degradation of 0.3, a full batch decodes each sequence 30 % slower than a lone one, so
  an engine's total throughput still rises with batch size.  The speed is recomputed
  whenever the batch changes (processor sharing on a "virtual token clock").  A request
  finishes when it has produced ``output_tokens`` tokens (the first comes from prefill).
* **Prefix cache (off unless ``Params.kv_cache_blocks`` is set).**  The same model as the
  simulated vLLM's, :class:`txlb.testing.PrefixCache`: a request that carries its prompt's
  block chain (``Request.blocks``) looks it up when it joins the batch, pins its blocks
  while it runs, and prefills only the tokens not found (``Request.cached_tokens``); the
  blocks stay cached, least recently used first out, after it ends.  The experiments below
  carry no prompts, so the cache changes nothing in them.
* No KV-cache limit on admission, no preemption, no chunked prefill, no network time; the
  balancer's own overhead is zero.

TTFT is measured as the real balancer measures it: from the request's arrival at the
balancer to its first token, i.e. balancer queue wait + engine queue wait + prefill.
Completion time is arrival to last token.

The balancer side
-----------------
One :class:`~txlb._cluster.pool.Pool` + :class:`~txlb._scheduling.router.Router` + policy per
balancer replica, exactly as :mod:`txlb._balancer` wires them.  ``router.acquire()`` gives a lease;
the request goes to the lease's engine, and ``lease.release()`` is called once when its
last token is out.  As in the bookkeeper (``txlb._records.bookkeeper.policy_learns``), the
``latency`` policy is told the request's TTFT (``policy.observe``) when the request *ends*.
For ``queue-depth`` each replica scrapes every engine's running/waiting counts every
``scrape_interval`` seconds (like the health prober) into ``pool.set_engine_depth``; the
replicas' scrape phases are staggered evenly over the interval.  Health is perfect: no
backend ever goes down.

The workload
------------
Poisson arrivals; output lengths lognormal (median 200 tokens, p99 about 3000, capped at
8000, at least 1), prompt lengths lognormal (median 600 tokens, capped at 16000).  The
arrival rate is ``load`` times the fleet's capacity, where an engine's capacity is
``max_num_seqs / (mean prefill time + mean decode time at a full batch)`` requests/s,
computed from the generated workload itself -- the throughput the fleet reaches only if
every engine is kept exactly full; a real scheduler cannot quite do that, so the
effective utilisation is somewhat above ``load``.
The same request sequence (arrival times, lengths, replica choice) is replayed for every
policy; every random draw comes from ``random.Random`` seeded from ``--seed``.  All
requests are measured, including the cold start (no warm-up is discarded).

Experiments
-----------
A. one balancer, all weights 1 (what most users configure), ``max_conns`` 0 (no cap);
B. the same with weights proportional to decode speed (3 / 2 / 1);
C. one balancer, weights 1, ``max_conns = max_num_seqs``: the excess waits in the
   balancer's FIFO queue (``queue_timeout`` 30 s, the only source of 503s) rather than
   inside the engines;
D. three balancer replicas over the same engines, each arrival to a random replica,
   weights 1, no cap: each replica's pool sees only its own in-flight requests.

Each experiment runs every policy.  Besides the main tables (``--seed``, ``--load``) the
report repeats all four experiments over ``--seeds`` seeds (median and range, and each
policy's rank per seed), runs A, C and D at the ``--loads``, and has a diagnostics table
of where each policy puts the requests (time-averaged requests per engine, and how
unevenly it loads the four identical fast engines), including two what-if runs of the
``latency`` policy fed its sample at the first token rather than at the end.  A
"Recommendation" section is generated from those numbers.

Run from the repository root::

    python -m bench.policies              # 152 runs of 20000 requests: ~75 s on 2 cores
    python -m bench.policies --seeds 1 --loads ''   # main tables only: ~15 s
    python -m bench.policies --replicas 2,4,8 --publish-delay 0,0.01,0.1,1
        # instead: N replicas over one fleet, independent or sharing their in-flight
        # counts (bench.fleet_balance), to bench/results/scale-out.md: ~3 min on 2 cores
    python -m bench.policies --help

Tables go to standard output and ``bench/results/policies.md``, the plot to
``bench/results/policies.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench import fleet_balance, fleet_report
from bench.policies_report import markdown, plot
from bench.policies_run import EXPERIMENTS, Experiment, RunResult, run
from bench.provenance import RESULTS
from bench.sim_engines import Params, make_workload

Job = tuple[Experiment, str, Params, str]


def _run_job(job: Job) -> RunResult:
    return run(*job)


def jobs_for(params: Params, seeds: Sequence[int], loads: Sequence[float]) -> list[Job]:
    """Every run the report needs, each once."""
    wanted: dict[tuple[str, str, int, float, str], Job] = {}

    def add(experiment: Experiment, policy: str, seed: int, load: float,
            observe_at: str = "end") -> None:
        run_params = dataclasses.replace(params, seed=seed, load=load)
        wanted[(experiment.key, policy, seed, load, observe_at)] = (
            experiment, policy, run_params, observe_at)

    for experiment in EXPERIMENTS:
        for policy in experiment.policies:
            for seed in seeds:
                add(experiment, policy, seed, params.load)
            if experiment.key != "B":
                for load in loads:
                    add(experiment, policy, params.seed, load)
    for experiment in (EXPERIMENTS[0], EXPERIMENTS[3]):
        add(experiment, "latency", params.seed, params.load, "first-token")
    # the longest runs (overloaded round-robin/random, high loads) first, for the pool
    return sorted(wanted.values(), key=lambda job: -job[2].load)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.policies", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=Params.seed,
                        help="seed of the main tables (default %(default)s)")
    parser.add_argument("--seeds", type=int, default=4,
                        help="seeds in the seed table: --seed and the next ones "
                             "(default %(default)s; 1 leaves the table out)")
    parser.add_argument("--requests", type=int, default=Params.requests,
                        help="requests per run (default %(default)s)")
    parser.add_argument("--load", type=float, default=Params.load,
                        help="arrival rate as a fraction of full-batch capacity "
                             "(default %(default)s)")
    parser.add_argument("--loads", default=None,
                        help="comma-separated loads of the load table, '' to leave it out "
                             "(default 0.7,0.8,0.9,0.95; with --replicas: the loads of the "
                             "fleet tables, default 0.8,0.9)")
    parser.add_argument("--replicas", default="",
                        help="instead of the policy experiments, the fleet-balance runs "
                             "(bench.fleet_balance) at these comma-separated replica counts, "
                             "e.g. 2,4,8; to bench/results/scale-out.md")
    parser.add_argument("--publish-delay", default="0,0.01,0.1,1",
                        help="with --replicas: comma-separated seconds between two reads of "
                             "the other replicas' counts (default %(default)s)")
    parser.add_argument("--traffic", default="skewed,bursts",
                        help="with --replicas: traffic patterns (default %(default)s)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="worker processes; results do not depend on it")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="directory for policies.md and policies.png")
    args = parser.parse_args(argv)
    command = "python -m bench.policies" + "".join(
        f" {arg}" for arg in (argv if argv is not None else sys.argv[1:]))
    if args.replicas.strip():
        return fleet_main(args, parser, command)
    if args.loads is None:
        args.loads = "0.7,0.8,0.9,0.95"
    params = Params(seed=args.seed, requests=args.requests, load=args.load)
    seeds = [args.seed + k for k in range(max(1, args.seeds))]
    loads = sorted({float(x) for x in args.loads.split(",") if x.strip()} | {args.load}) \
        if args.loads.strip() else [args.load]

    started = time.perf_counter()
    jobs = jobs_for(params, seeds, loads)
    print(f"{len(jobs)} runs on {args.jobs} processes ...", file=sys.stderr, flush=True)
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as executor:
            results = list(executor.map(_run_job, jobs, chunksize=1))
    else:
        results = [_run_job(job) for job in jobs]
    wall = time.perf_counter() - started

    workload = make_workload(params, 1)
    report = markdown(results, params, seeds, loads, workload, wall, command)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "policies.md").write_text(report)
    plot(results, params, loads, args.out / "policies.png")
    print(report)
    print(f"\nwrote {args.out / 'policies.md'} and {args.out / 'policies.png'} "
          f"({wall:.0f} s; slowest run {max(r.wall_seconds for r in results):.1f} s)")
    return 0


def _numbers(parser: argparse.ArgumentParser, option: str, text: str,
             kind: type[float] | type[int]) -> list:  # type: ignore[type-arg]
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"{option}: {text!r} is not a comma-separated list of numbers")
    if not values or any(v < 0 or not math.isfinite(v) for v in values):
        parser.error(f"{option}: {text!r}: give one or more numbers, none negative")
    return values


def fleet_main(args: argparse.Namespace, parser: argparse.ArgumentParser,
               command: str) -> int:
    """``--replicas``: the fleet-balance runs of :mod:`bench.fleet_balance`."""
    replicas = _numbers(parser, "--replicas", args.replicas, int)
    if any(n < 2 or n > 64 for n in replicas):
        parser.error(f"--replicas: {args.replicas!r}: each count from 2 to 64")
    delays = _numbers(parser, "--publish-delay", args.publish_delay, float)
    loads = _numbers(parser, "--loads", args.loads if args.loads is not None else "0.8,0.9",
                     float)
    if any(not 0 < x <= 2 for x in loads):
        parser.error(f"--loads: {args.loads!r}: each load above 0 and at most 2")
    traffics = [t.strip() for t in args.traffic.split(",") if t.strip()]
    unknown = [t for t in traffics if t not in fleet_balance.TRAFFIC]
    if unknown or not traffics:
        parser.error(f"--traffic: {args.traffic!r}: choose from "
                     f"{', '.join(fleet_balance.TRAFFIC)}")
    params = fleet_balance.FleetParams(seed=args.seed, requests=args.requests)
    text = fleet_report.report(params, replicas, delays, loads, traffics, args.jobs,
                                args.out, command)
    print(text)
    print(f"\nwrote {args.out / 'scale-out.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
