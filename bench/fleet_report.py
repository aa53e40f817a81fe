"""
The fleet-balance section of ``bench/results/scale-out.md``: every variant of
:mod:`bench.fleet_balance` run at each load and traffic, the tables, the overshoot bound
checked against the figures, and the verdict generated from them.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench.fleet_balance import (
    GPU,
    FleetParams,
    FleetResult,
    Variant,
    expected_unread,
    run_fleet,
    variants,
)
from bench.provenance import git_revision, machine
from bench.sections import SCALE_OUT_TITLE, replace_section

Job = tuple[FleetParams, Variant]


def _run_job(job: Job) -> FleetResult:
    return run_fleet(*job)

def balance_table(results: Sequence[FleetResult]) -> list[str]:
    lines = ["| replicas | what each replica sees of the others | imbalance max/mean (mean) | "
             "imbalance (p99) | peak in flight on one engine | p99 TTFT s | mean TTFT s | "
             "requests that found the batch full |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(
            f"| {r.replicas} | {r.label} | {r.imbalance:.3f} | {r.imbalance_p99:.2f} | "
            f"{r.peak_in_flight} | {r.p99_ttft:.2f} | {r.mean_ttft:.3f} | {r.over_batch} |")
    return lines


def overshoot_table(params: FleetParams, results: Sequence[FleetResult]) -> list[str]:
    lines = ["| replicas | view | unread picks U: predicted mean | measured mean | p99 | "
             "overshoot: mean | p99 | max | N - 1 | choices with overshoot > U |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r.replicas == 1 or not r.shared:
            continue
        variant = Variant(r.replicas, r.shared, r.delay)
        predicted = expected_unread(params, variant, r.rate)
        shown = f"{predicted:.2f}" if params.traffic == "skewed" else "–"
        lines.append(
            f"| {r.replicas} | {r.label} | {shown} | {r.unread_mean:.2f} | {r.unread_p99} | "
            f"{r.overshoot_mean:.2f} | {r.overshoot_p99} | {r.overshoot_max} | "
            f"{r.replicas - 1} | {r.beyond_bound} |")
    independent = [r for r in results if r.replicas > 1 and not r.shared]
    for r in independent:
        lines.append(f"| {r.replicas} | independent | – | – | – | {r.overshoot_mean:.2f} | "
                     f"{r.overshoot_p99} | {r.overshoot_max} | {r.replicas - 1} | – |")
    return lines


BOUND_TEXT = """\
### The overshoot bound

A replica's choice sees its own in-flight requests exactly and the other replicas' as of
its last read of the store, at most `d` ago (`d` = the read interval plus the store's
one-way latency; every replica publishes its own changes at once).  The engine it picks
can hold more requests than it believed only by those the other replicas sent there since
that read -- their completions meanwhile only lower the count.  So at every choice

    overshoot  <=  U  =  the picks the other replicas made since the chooser's last read.

For Poisson arrivals at fleet rate `λ`, replica `i` taking a share `s_i` of them, a view
is on average `d/2` old, so over the choices

    E[U] = Σ_i s_i (1 - s_i) λ d / 2,      and at worst (a view `d` old)  U ≈ (1 - s_i) λ d

plus the Poisson tail.  Least-connections spreads each replica's own picks over the
engines its view ranks lowest (its own picks are exact in its view), so with `m` engines
tied at the bottom no engine gets more than `⌈k_j / m⌉` of replica `j`'s `k_j` unread
picks:

    overshoot  <=  Σ_{j≠i} ⌈k_j / m⌉,

which is `N - 1` (one request per other replica) as long as no replica sends more than
`m` requests per interval, and only reaches `U` when a single engine is far below the
others (`m = 1`).  In requests per engine: the extra in flight on one engine is at most
one per other replica, and at most the fleet's arrivals in one read interval.  Without
shared counts there is no bound but the others' whole load on that engine.

Measured: `U` at every choice, and the overshoot (true in flight on the chosen engine
minus what its replica believed, when positive); the last column counts the choices that
broke `overshoot <= U` (none may).
"""


def markdown(params: FleetParams, loads: Sequence[float], traffics: Sequence[str],
             results: Sequence[FleetResult], command: str, wall: float) -> str:
    engine = params.engine
    info = machine()
    rates = {(r.traffic, r.load, round(r.rate, 1)) for r in results}
    lines = [
        "## Fleet-wide balance: independent replicas, shared counts, one balancer",
        "",
        f"- command: `{command}` ({len(results)} runs, {wall:.0f} s wall); "
        f"txlb `{git_revision()}`; nproc {info['nproc']}; python {info['python']}",
        f"- {params.engines} identical engines (decode {GPU.decode_rate:g} tok/s per "
        f"sequence alone, prefill {GPU.prefill_rate:g} tok/s, max_num_seqs "
        f"{engine.max_num_seqs}, decode slowed by {engine.degradation:g} x running / "
        "max_num_seqs), no max_conns (engines queue the excess themselves); output tokens "
        f"lognormal median {engine.output_median:g}, p99 {engine.output_p99:g}; prompt "
        f"tokens lognormal median {engine.prompt_median:g}",
        f"- {params.requests} requests per run, seed {params.seed}, policy "
        f"`{params.policy}`; loads {', '.join(f'{x:g}' for x in loads)} x full-batch "
        "capacity (fleet rates: " + ", ".join(f"{t} at {x:g}: {rate:.1f} req/s"
                                               for t, x, rate in sorted(rates)) + ")",
        f"- traffic: *skewed* = Poisson, {100 * params.skew:g} % to replica 0, the rest "
        f"spread over the others; *bursts* = bursts of {params.burst_size} requests, each "
        f"burst to one replica within {params.burst_window * 1000:g} ms, bursts Poisson",
        "- views: *independent* = each replica counts only its own requests (no "
        "`--shared-state`); *shared, delay d* = its own counts exact plus the others' as "
        "read every d (d = 0: read at each choice, the exact count); *single balancer* = "
        "one replica takes everything (the ideal)",
        "- columns: imbalance = max over the engines of requests in flight (running + "
        "waiting) / their mean, sampled at each arrival (mean and p99 over the arrivals); "
        "requests that found the batch full = arrivals at an engine already running "
        "max_num_seqs sequences (they wait inside it)",
        "",
    ]
    for traffic in traffics:
        for load in loads:
            selected = [r for r in results if r.traffic == traffic and r.load == load]
            lines += [f"### {traffic}, load {load:g}", "", *balance_table(selected), ""]
    lines += [BOUND_TEXT, ""]
    for traffic in traffics:
        load = max(loads)
        selected = [r for r in results if r.traffic == traffic and r.load == load]
        lines += [f"#### {traffic}, load {load:g}", "",
                  *overshoot_table(dataclasses.replace(params, traffic=traffic), selected),
                  ""]
    lines += summary(results, traffics, loads)
    return "\n".join(lines)


def summary(results: Sequence[FleetResult], traffics: Sequence[str],
            loads: Sequence[float]) -> list[str]:
    """The verdict the figures give, generated from them."""
    out = ["### What the figures say", "",
           f"At load {max(loads):g}: imbalance (mean max/mean) / requests that found the batch "
           "full / p99 TTFT, for independent replicas, shared counts at each delay, and one "
           "balancer.", ""]
    for traffic in traffics:
        runs = [r for r in results if r.traffic == traffic and r.load == max(loads)]
        single = next(r for r in runs if r.replicas == 1)
        for n in sorted({r.replicas for r in runs if r.replicas > 1}):
            alone = next(r for r in runs if r.replicas == n and not r.shared)
            shared = sorted((r for r in runs if r.replicas == n and r.shared),
                            key=lambda r: r.delay)

            def cell(r: FleetResult) -> str:
                return f"{r.imbalance:.3f} / {r.over_batch} / {r.p99_ttft:.2f} s"

            better = [r for r in shared if r.imbalance <= alone.imbalance]
            worse = [r for r in shared if r.imbalance > alone.imbalance]
            out.append(
                f"- {traffic}, {n} replicas: independent {cell(alone)}; "
                + "; ".join(f"shared {r.delay * 1000:g} ms {cell(r)}" for r in shared)
                + f"; one balancer {cell(single)}.  Shared counts balance better than "
                "independent replicas at "
                + (", ".join(f"{r.delay * 1000:g}" for r in better) or "no")
                + " ms" + ("" if not worse else ", worse at " + ", ".join(
                    f"{r.delay * 1000:g}" for r in worse)
                    + " ms (each replica piles onto the engines that were emptiest at "
                      "its last read)") + ".")
    return out + [""]


def report(params: FleetParams, replica_counts: Sequence[int], delays: Sequence[float],
           loads: Sequence[float], traffics: Sequence[str], jobs: int, out: Path,
           command: str) -> str:
    """Run every variant at every load and traffic; write the section of scale-out.md."""
    work: list[Job] = [(dataclasses.replace(params, traffic=t, load=load), v)
                       for t in traffics for load in loads
                       for v in variants(replica_counts, delays)]
    started = time.perf_counter()
    print(f"{len(work)} fleet runs on {jobs} processes ...", file=sys.stderr, flush=True)
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as executor:
            results = list(executor.map(_run_job, work, chunksize=1))
    else:
        results = [_run_job(job) for job in work]
    text = markdown(params, loads, traffics, results, command, time.perf_counter() - started)
    replace_section(out / "scale-out.md", "balance", text, SCALE_OUT_TITLE)
    return text
