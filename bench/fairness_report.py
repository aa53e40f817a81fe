"""
``python -m bench.fairness_report``: :mod:`bench.fairness`' runs, written to
bench/results/fairness.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import fairness
from bench.fairness import (
    BURST,
    HEAVY,
    Comparison,
    Run,
    Tenant,
    bound,
    burst_arrivals,
    capacity_of,
    compare,
    fleet_tokens,
    tenants_of,
)
from bench.provenance import RESULTS, git_revision
from bench.sim_engines import Params
from txlb._scheduling.fairness import INPUT_PRICE, OUTPUT_PRICE


def _lights(r: Run) -> list[str]:
    return [name for name in r.tenants if name != HEAVY]


def _worst_light(r: Run) -> float:
    return max(r.tenants[name].p99_ttft for name in _lights(r))


def _refused(r: Run, names: Sequence[str]) -> int:
    return sum(r.tenants[n].sent - r.tenants[n].completed for n in names)


def gap_rows(comparisons: Sequence[Comparison]) -> list[str]:
    lines = [
        "| scenario | order | requests | largest counter gap | largest interval gap | "
        "bound, M = fleet estimate | bound, M = peak in flight | completed req/s | "
        "tokens/s | heavy p99 TTFT (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        for r in (c.vtc, c.fifo):
            sent = sum(t.sent for t in r.tenants.values())
            lines.append(
                f"| {c.name} | {r.order} | {sent} | {r.gaps.counters:,.0f} | "
                f"{r.gaps.interval:,.0f} | {bound(r.longest_prompt, fleet_tokens(r)):,.0f} | "
                f"{bound(r.longest_prompt, r.peak_in_flight_tokens):,.0f} | "
                f"{r.requests_per_s:.2f} | {r.tokens_per_s:,.0f} | "
                f"{r.tenants[HEAVY].p99_ttft:.1f} |")
    return lines


def light_rows(comparisons: Sequence[Comparison]) -> list[str]:
    lines = [
        "| scenario | light tenant | requests | p99 TTFT, vtc (s) | p99 TTFT, fifo (s) | "
        "fifo / vtc | p99 TTFT, lights alone (s) | p50 TTFT, vtc / fifo (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        for name in _lights(c.vtc):
            v, f = c.vtc.tenants[name], c.fifo.tenants[name]
            alone = c.alone.tenants[name].p99_ttft if c.alone is not None else float("nan")
            lines.append(
                f"| {c.name} | {name} | {v.sent} | {v.p99_ttft:.2f} | {f.p99_ttft:.2f} | "
                f"{f.p99_ttft / v.p99_ttft:.0f}x | {alone:.2f} | "
                f"{v.p50_ttft:.2f} / {f.p50_ttft:.2f} |")
    return lines


def weighted_rows(c: Comparison) -> list[str]:
    lines = [
        "| order | gold (weight 2) service | plain (weight 1) service | gold / plain | "
        "gold p99 TTFT (s) | plain p99 TTFT (s) | largest interval gap | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in (c.vtc, c.fifo):
        gold, plain = r.tenants["gold"], r.tenants["plain"]
        lines.append(
            f"| {r.order} | {gold.saturated_service:,.0f} | {plain.saturated_service:,.0f} | "
            f"{gold.saturated_service / plain.saturated_service:.2f} | {gold.p99_ttft:.1f} | "
            f"{plain.p99_ttft:.1f} | {r.gaps.interval:,.0f} | {r.tokens_per_s:,.0f} |")
    return lines


def variant_rows(variants: Sequence[tuple[str, Comparison]]) -> list[str]:
    lines = [
        "| variant | order | worst light p99 TTFT (s) | lights refused | heavy refused | "
        "largest counter gap | bound, M = peak in flight | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, c in variants:
        for r in (c.vtc, c.fifo):
            lines.append(
                f"| {label} | {r.order} | {_worst_light(r):.2f} | "
                f"{_refused(r, _lights(r))}/{sum(r.tenants[n].sent for n in _lights(r))} | "
                f"{_refused(r, [HEAVY])}/{r.tenants[HEAVY].sent} | {r.gaps.counters:,.0f} | "
                f"{bound(r.longest_prompt, r.peak_in_flight_tokens):,.0f} | "
                f"{r.tokens_per_s:,.0f} |")
    return lines


def burst_rows(bursts: Sequence[Comparison]) -> list[str]:
    lines = [
        "| case | order | steady p50 / p99 TTFT (s) | bursty p50 / p99 TTFT (s) | "
        "largest counter gap | largest interval gap | bound, M = peak in flight |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in bursts:
        for r in (c.vtc, c.fifo):
            steady, bursty = r.tenants["steady"], r.tenants["bursty"]
            lines.append(
                f"| {c.name} | {r.order} | {steady.p50_ttft:.1f} / {steady.p99_ttft:.1f} | "
                f"{bursty.p50_ttft:.1f} / {bursty.p99_ttft:.1f} | {r.gaps.counters:,.0f} | "
                f"{r.gaps.interval:,.0f} | "
                f"{bound(r.longest_prompt, r.peak_in_flight_tokens):,.0f} |")
    return lines


def reading(comparisons: Sequence[Comparison], weighted: Comparison,
            variants: Sequence[tuple[str, Comparison]], bursts: Sequence[Comparison],
            load: float) -> list[str]:
    lines = ["Reading (this run):", ""]
    for c in comparisons:
        v, f = c.vtc, c.fifo
        tight = bound(v.longest_prompt, v.peak_in_flight_tokens)
        lines.append(
            f"- {c.name}: the worst light tenant's p99 TTFT is {_worst_light(v):.2f} s with "
            f"vtc against {_worst_light(f):.1f} s with fifo "
            f"(alone: {_worst_light(c.alone) if c.alone else float('nan'):.2f} s); the "
            f"heavy tenant pays: {v.tenants[HEAVY].p99_ttft:.1f} s against "
            f"{f.tenants[HEAVY].p99_ttft:.1f} s. The vtc counter gap "
            f"({v.gaps.counters:,.0f}) is {v.gaps.counters / tight:.1%} of the bound with the "
            f"peak in flight as M; fifo's ({f.gaps.counters:,.0f}) grows with the duration. "
            f"Throughput: {v.tokens_per_s:,.0f} against {f.tokens_per_s:,.0f} tokens/s "
            f"({v.tokens_per_s / f.tokens_per_s - 1:+.1%}).")
    ratios = [r.tenants["gold"].saturated_service / r.tenants["plain"].saturated_service
              for r in (weighted.vtc, weighted.fifo)]
    lines.append(
        f"- weighted: gold (weight 2) got {ratios[0]:.2f} times plain's service with vtc, "
        f"{ratios[1]:.2f} with fifo; the largest counter gap was "
        f"{weighted.vtc.gaps.counters:,.0f} (interval gap {weighted.vtc.gaps.interval:,.0f}).")
    (_, no_max), (_, unstreamed), (_, guarded), (_, unguarded) = variants
    lights = _lights(guarded.vtc)
    offered = load * sum(guarded.vtc.tenants[n].sent for n in lights) / sum(
        t.sent for t in guarded.vtc.tenants.values())
    lines.append(
        f"- not streamed: the grant charges each answer's whole (exact) completion at once; "
        f"the light tenant's p99 TTFT is {_worst_light(unstreamed.vtc):.2f} s with vtc "
        f"(against {_worst_light(comparisons[0].vtc):.2f} s streamed), its counter gap "
        f"{unstreamed.vtc.gaps.counters:,.0f}. No max_tokens, not streamed: the grant "
        f"charges 256 completion tokens and the settle the rest; the light tenant's p99 "
        f"TTFT is {_worst_light(no_max.vtc):.2f} s, its counter gap "
        f"{no_max.vtc.gaps.counters:,.0f}.")
    lines.append(
        f"- queue timeout 30 s (txlb's default): worst light p99 TTFT "
        f"{_worst_light(guarded.vtc):.2f} s with vtc (fifo {_worst_light(guarded.fifo):.1f} "
        f"s), {_refused(guarded.vtc, _lights(guarded.vtc))} light requests refused; without "
        f"the starvation guard {_worst_light(unguarded.vtc):.2f} s and "
        f"{_refused(unguarded.vtc, _lights(unguarded.vtc))} refused. The lights offer "
        f"{offered:.0%} of the fleet. The guard serves a starving waiter ahead of a higher "
        "class only, so within one class it leaves the fair order alone.")
    (kept,) = bursts
    lines.append(
        f"- burst: steady's p99 TTFT is {kept.vtc.tenants['steady'].p99_ttft:.1f} s with vtc "
        f"against {kept.fifo.tenants['steady'].p99_ttft:.1f} s with fifo; the interval gap "
        f"{kept.vtc.gaps.interval:,.0f} against the bound with the peak in flight as M, "
        f"{bound(kept.vtc.longest_prompt, kept.vtc.peak_in_flight_tokens):,.0f}.")
    return lines


def markdown(comparisons: Sequence[Comparison], weighted: Comparison,
             variants: Sequence[tuple[str, Comparison]], bursts: Sequence[Comparison],
             params: Params, capacity: float, duration: float, heavy_ratio: float,
             command: str) -> str:
    first = comparisons[0].vtc
    lines = [
        "# Fair shares between tenants: VTC against FIFO (simulated)",
        "",
        f"Command: `{command}` (txlb `{git_revision()}`). Seed {params.seed}; eight engines "
        "(bench.policies' 4 fast, 2 medium, 2 slow), `max_conns = max_num_seqs` = "
        f"{params.max_num_seqs} (a fleet of {first.fleet_max_conns} slots), least-conn, "
        "the real Pool, Router and FairShares. Every tenant sends Poisson arrivals with "
        "lognormal prompt and output lengths (bench.policies' workload) for "
        f"{duration:g} simulated seconds, then the queue drains; together they offer "
        f"{params.load:g} x the fleet's full-batch capacity ({capacity:.1f} requests/s). "
        f"`heavy` sends {heavy_ratio:g} x the rate of each light tenant. Each request's body "
        "says `\"stream\": true` and `max_tokens` = its output unless said otherwise: a grant "
        "charges the prompt, and each answer's output is charged as its engine decodes it, "
        "16 tokens at a time (txlb's StreamMeter, fed the tokens the engine has produced "
        "whenever a request ends, the moment a freed slot's choice reads the counters). The "
        "queue timeout is 10^9 s (nothing is refused) unless said otherwise. vtc and fifo "
        "replay the same request sequence; \"lights alone\" is the same sequence without "
        "`heavy`. TTFT: arrival at the balancer to first token.",
        "",
        "The simulation runs on a virtual clock (`twisted.internet.task.Clock`) from seeded "
        "streams: its figures depend on the parameters and the seed only, never on the "
        "machine or its load, so one run per configuration is the measurement.",
        "",
        "- **counter gap**: the largest difference of FairShares' counters (weighted "
        "tokens, 1 per prompt token + 2 per completion token, over the weight) between two "
        "tenants that both had requests waiting, sampled at every grant.",
        "- **interval gap**: the paper's quantity, the largest |W_f(t1,t2) - W_g(t1,t2)| "
        "over an interval both tenants stayed backlogged, W the weighted tokens granted, "
        "counted from the requests' real lengths (independent of FairShares).",
        f"- **bound**: 2 max(w_p L_input, w_q M) of Sheng et al. (OSDI 2024), w_p = "
        f"{INPUT_PRICE:g} and w_q = {OUTPUT_PRICE:g} the prices, L_input the longest prompt "
        f"of the workload ({first.longest_prompt:,} tokens in the 2-tenant run). M, the "
        "tokens the fleet holds in flight at most, two ways: *fleet estimate* = "
        f"{first.fleet_max_conns} slots x (longest prompt + longest output of the workload) "
        f"= {first.fleet_max_conns} x ({first.longest_prompt:,} + {first.longest_output:,}) "
        f"= {fleet_tokens(first):,} (an upper estimate), and *peak in flight* = the most "
        "prompt + output tokens of the requests holding slots at one time in that run "
        f"({first.peak_in_flight_tokens:,} in the 2-tenant vtc run), the tighter one.",
        "- **throughput**: completions per simulated second and prompt + completion "
        f"tokens processed per second between {duration / 4:g} s and {duration:g} s, when "
        "the fleet is full (decode counted as even over a request's decode time).",
        "",
        "## Service gap and throughput",
        "",
        *gap_rows(comparisons),
        "",
        "## Light tenants' TTFT",
        "",
        *light_rows(comparisons),
        "",
        "## Weights: gold (weight 2) and plain (weight 1), both backlogged",
        "",
        "The same rate each, together the same load; service = price-weighted tokens "
        f"granted between {duration / 4:g} s and {duration:g} s.",
        "",
        *weighted_rows(weighted),
        "",
        "## Variants",
        "",
        "*Not streamed*: the bodies do not say `stream`, so a grant charges the prompt and "
        "the completion's estimate (exact here) at once. *No max_tokens*: not streamed, and "
        "the bodies carry no `max_tokens`, so a grant charges the default completion "
        "estimate (256) and the settle corrects it at the end. *Queue timeout "
        "30 s*: txlb's default `--queue-timeout`, so waits past 30 s are refused and the "
        "built-in `default` class's starvation guard (at half the timeout, 15 s) is on: it "
        "serves a waiter older than that ahead of a higher class's waiters (here no higher "
        "class waits). *No starvation guard*: the same with the guard removed. (An earlier "
        "version let the guard serve the oldest waiters of their own class first, in "
        "arrival order, which under overload handed half the fleet to the heavy tenant.)",
        "",
        *variant_rows(variants),
        "",
        "## A credit carried into contention",
        "",
        "`steady` sends at 0.5 x the capacity for 240 s; `bursty` at 0.05 x for 180 s, then "
        "at 3 x for 30 s. While nothing waits (the first 180 s) every request gets its slot "
        "at once; each is still an arrival (`Router.acquire` calls `FairShares.arrived`), "
        "lifted to the lowest waiting counter or, with nothing waiting, to the last served "
        "one's, so neither tenant carries a credit into the burst. (An earlier version "
        "lifted only a request that queued: bursty then kept its quiet minutes as a credit "
        "and steady's p99 TTFT was worse than fifo's.)",
        "",
        *burst_rows(bursts),
        "",
        *reading(comparisons, weighted, variants, bursts, params.load),
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fairness_report",
                                     description=fairness.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration", type=float, default=120.0,
                        help="simulated seconds of arrivals before the drain "
                             "(default %(default)s)")
    parser.add_argument("--load", type=float, default=1.5,
                        help="offered load, times the fleet's full-batch capacity "
                             "(default %(default)s)")
    parser.add_argument("--heavy-ratio", type=float, default=10.0,
                        help="the heavy tenant's rate over each light one's "
                             "(default %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS / "fairness.md")
    args = parser.parse_args(argv)
    params = Params(seed=args.seed, load=args.load, queue_timeout=1e9)
    capacity = capacity_of(params)
    duration, ratio = args.duration, args.heavy_ratio

    def both(name: str, tenants: Sequence[Tenant], alone: bool = False,
             **options: Any) -> Comparison:
        return compare(name, options.pop("params", params), tenants,
                       options.pop("duration", duration), capacity, alone=alone,
                       verbose=True, **options)

    main_runs = [both(f"{count} tenants", tenants_of(count, ratio), alone=True)
                 for count in (2, 10)]
    weighted = both("weighted", (Tenant("gold", 1.0, 2.0), Tenant("plain", 1.0)))
    timeout = replace(params, queue_timeout=30.0)
    variants = [
        ("2 tenants, no max_tokens",
         both("no max_tokens", tenants_of(2, ratio), estimate="default", streamed=False)),
        ("2 tenants, not streamed",
         both("not streamed", tenants_of(2, ratio), streamed=False)),
        ("10 tenants, queue timeout 30 s",
         both("timeout 30 s", tenants_of(10, ratio), params=timeout)),
        ("10 tenants, queue timeout 30 s, no starvation guard",
         both("timeout 30 s, no guard", tenants_of(10, ratio), params=timeout, guard=False)),
    ]
    pair = (Tenant("steady", 1.0), Tenant("bursty", 1.0))
    burst = burst_arrivals(params, capacity)
    ends = max(end for phases in BURST.values() for _, end, _ in phases)
    bursts = [both("burst", pair, duration=ends, arrivals=burst)]
    command = "python -m bench.fairness_report" + "".join(
        f" {arg}" for arg in (argv if argv is not None else sys.argv[1:]))
    report = markdown(main_runs, weighted, variants, bursts, params, capacity, duration,
                      ratio, command)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
