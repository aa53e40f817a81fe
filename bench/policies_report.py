"""
The results page of :mod:`bench.policies` (``bench/results/policies.md``): the tables, the
recommendation generated from them, and the plot.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence
from pathlib import Path

from bench.policies_run import EXPERIMENTS, RunResult
from bench.provenance import git_revision, machine
from bench.sim_engines import ENGINE_CLASSES, Params, Workload, engine_capacity

Selection = dict[str, RunResult]  # policy -> result


def pick(results: Sequence[RunResult], experiment: str, seed: int, load: float,
         observe_at: str = "end") -> Selection:
    """The results of one experiment at one seed and load, by policy (in policy order)."""
    return {r.policy: r for r in results
            if r.experiment == experiment and r.seed == seed and r.load == load
            and r.observe_at == observe_at}


def table(results: Sequence[RunResult], show_wait: bool) -> str:
    names = [cls.name for cls in ENGINE_CLASSES]
    head = ["policy", "mean completion s", "p99 completion s", "mean TTFT s", "p99 TTFT s"]
    if show_wait:
        head.append("mean balancer wait s")
    head += ["peak engine waiting (max)", "peak waiting " + " / ".join(names),
             "share of requests " + " / ".join(names), "503s"]
    lines = ["| " + " | ".join(head) + " |",
             "|---|" + "---:|" * (len(head) - 1)]
    for r in results:
        row = [f"`{r.policy}`", f"{r.mean_completion:.1f}", f"{r.p99_completion:.1f}",
               f"{r.mean_ttft:.2f}", f"{r.p99_ttft:.2f}"]
        if show_wait:
            row.append(f"{r.mean_balancer_wait:.2f}")
        row += [str(r.peak_waiting_max),
                " / ".join(str(r.peak_waiting[n]) for n in names),
                " / ".join(f"{100 * r.share[n]:.0f} %" for n in names),
                str(r.refused)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def spread(values: Sequence[float], digits: int) -> str:
    """``median (min-max)``."""
    return f"{median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def per_seed(results: Sequence[RunResult], experiment: str, seeds: Sequence[int],
             load: float) -> list[Selection]:
    return [pick(results, experiment, seed, load) for seed in seeds]


def seed_table(selections: Sequence[Selection]) -> str:
    """Each policy over the seeds: median (min-max), and its rank by mean completion."""
    lines = ["| policy | mean completion s | p99 completion s | p99 TTFT s | peak engine "
             "waiting | rank by mean completion, per seed |",
             "|---|---:|---:|---:|---:|---|"]
    ranks: dict[str, list[int]] = {}
    for selection in selections:
        ordered = sorted(selection.values(), key=lambda r: r.mean_completion)
        for rank, r in enumerate(ordered, 1):
            ranks.setdefault(r.policy, []).append(rank)
    for policy in selections[0]:
        runs = [s[policy] for s in selections]
        lines.append(
            f"| `{policy}` | {spread([r.mean_completion for r in runs], 1)} | "
            f"{spread([r.p99_completion for r in runs], 0)} | "
            f"{spread([r.p99_ttft for r in runs], 2)} | "
            f"{spread([r.peak_waiting_max for r in runs], 0)} | "
            + ", ".join(str(k) for k in ranks[policy]) + " |")
    return "\n".join(lines)


def load_table(results: Sequence[RunResult], experiment: str, seed: int,
               loads: Sequence[float]) -> str:
    """Each policy at each load: mean completion / p99 TTFT / peak engine waiting / 503s."""
    columns = [pick(results, experiment, seed, load) for load in loads]
    lines = ["| policy | " + " | ".join(f"load {load:g}" for load in loads) + " |",
             "|---|" + "---:|" * len(loads)]
    for policy in columns[0]:
        cells = []
        for column in columns:
            r = column[policy]
            cell = f"{r.mean_completion:.1f} / {r.p99_ttft:.2f} / {r.peak_waiting_max}"
            if r.refused:
                cell += f" / **{r.refused} x 503**"
            elif r.mean_balancer_wait >= 0.005:
                cell += f" (wait {r.mean_balancer_wait:.2f})"
            cells.append(cell)
        lines.append(f"| `{policy}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def diagnostic_table(results: Sequence[RunResult], seed: int, load: float) -> str:
    """Where each policy puts the requests, and the ``latency`` what-if rows."""
    names = " / ".join(c.name for c in ENGINE_CLASSES)
    lines = [f"| experiment | policy | mean in flight per engine {names} | spread among the "
             "fast engines | peak engine waiting | p99 TTFT s | mean completion s |",
             "|---|---|---:|---:|---:|---:|---:|"]
    rows: list[tuple[str, str, RunResult]] = []
    for policy, r in pick(results, "A", seed, load).items():
        rows.append(("A", f"`{policy}`", r))
    for experiment in ("A", "D"):
        for observe_at in ("end", "first-token"):
            found = pick(results, experiment, seed, load, observe_at).get("latency")
            if found is not None and (experiment, observe_at) != ("A", "end"):
                what = "TTFT at request end (txlb)" if observe_at == "end" else \
                    "TTFT at first token (what-if)"
                rows.append((experiment, f"`latency`, {what}", found))
    for experiment, label, r in rows:
        lines.append(
            f"| {experiment} | {label} | "
            + " / ".join(f"{r.in_flight[c.name]:.1f}" for c in ENGINE_CLASSES)
            + f" | {r.fast_spread:.1f} | {r.peak_waiting_max} | {r.p99_ttft:.2f} | "
            f"{r.mean_completion:.1f} |")
    return "\n".join(lines)


def recommendation(results: Sequence[RunResult], params: Params, seeds: Sequence[int],
                   loads: Sequence[float], workload: Workload) -> str:
    """Turn the measured numbers into advice, quoting the numbers it rests on."""
    seed, load = params.seed, params.load
    a, b, c, d = (pick(results, k, seed, load) for k in "ABCD")
    over = {k: per_seed(results, k, seeds, load) for k in "ABCD"}
    n = len(seeds)
    many = f"*median of {n} seeds*" if n > 1 else f"*seed {seed}*"

    def med(experiment: str, policy: str, attr: str = "mean_completion") -> float:
        return median([getattr(s[policy], attr) for s in over[experiment]])

    def order(experiment: str) -> list[str]:
        return sorted(over[experiment][0], key=lambda p: med(experiment, p))

    def wins(experiment: str, policy: str) -> int:
        return sum(1 for s in over[experiment]
                   if min(s.values(), key=lambda r: r.mean_completion).policy == policy)

    def ranks(experiment: str, policy: str) -> list[int]:
        return [sorted(s, key=lambda p: s[p].mean_completion).index(policy) + 1
                for s in over[experiment]]

    def stable(experiment: str) -> bool:
        orders = {tuple(sorted(s, key=lambda p: s[p].mean_completion)) for s in over[experiment]}
        return len(orders) == 1

    out = ["## Recommendation", "",
           f"Numbers are seed {seed} at load {load:g} unless marked {many}.", ""]

    # A: one balancer, weights 1.
    order_a = order("A")
    best = order_a[0]
    close = [p for p in order_a if med("A", p) <= 1.05 * med("A", best)]
    lc, lat = a["least-conn"], a["latency"]
    slots = workload.rate * lc.mean_completion
    total_slots = params.max_num_seqs * sum(cls.count for cls in ENGINE_CLASSES)
    out.append(
        f"* **One balancer over heterogeneous GPUs: a load-aware policy "
        f"({', '.join(f'`{p}`' for p in close)})**, within 5 % of each other by mean "
        f"completion ({many}: "
        + ", ".join(f"`{p}` {med('A', p):.1f} s" for p in order_a)
        + f"; `{best}` lowest in {wins('A', best)} of {n} seeds).  They need no weights to "
        f"find the fast GPUs: with equal in-flight counts the fast ones finish sooner and "
        f"get {100 * lc.share['fast']:.0f} % of the requests (their share of capacity: "
        f"{100 * _capacity_share(params, workload)['fast']:.0f} %).  "
        + ("`least-conn`, the default and the simplest, is the best of them here"
           if best == "least-conn" else
           f"`least-conn`, the default, is "
           f"{100 * (med('A', 'least-conn') / med('A', best) - 1):.0f} % behind `{best}`")
        + f"; `p2c` and `queue-depth` spread identical engines less evenly (mean in-flight "
        f"spread among the 4 fast engines {a['p2c'].fast_spread:.1f} and "
        f"{a['queue-depth'].fast_spread:.1f} requests vs {lc.fast_spread:.1f} for "
        "`least-conn`, see *Diagnostics*): `p2c` by its random draw, `queue-depth` by "
        "counting completions only at each scrape."
    )
    best_b = order("B")[0]
    out.append(
        f"* **Better still: the same policy with weights proportional to speed (B).**  "
        f"`{best_b}` with weights 3/2/1: {med('B', best_b):.1f} s mean completion vs "
        f"{med('A', 'least-conn'):.1f} s for `least-conn` unweighted ({many}), p99 "
        f"completion {b[best_b].p99_completion:.0f} s vs {lc.p99_completion:.0f} s.  Equal "
        "in-flight counts keep as many requests on a slow GPU as on a fast one, each taking "
        f"up to 3x as long there; weights cut the slow GPUs' share from "
        f"{100 * lc.share['slow']:.0f} % to {100 * b[best_b].share['slow']:.0f} %.  So if "
        "you know the GPUs' relative decode throughput, put it in `weight`"
        + (" and keep `least-conn`." if med("B", "least-conn") <= 1.02 * med("B", best_b)
           else f" and use `{best_b}`.")
    )
    gap = lat.mean_completion / lc.mean_completion - 1
    out.append(
        f"* **`latency` is not recommended on its own**: mean completion "
        f"{100 * gap:+.0f} % vs `least-conn` but p99 TTFT {lat.p99_ttft:.1f} s vs "
        f"{lc.p99_ttft:.2f} s, with up to {lat.peak_waiting_max} requests queued inside "
        f"one engine while `least-conn` "
        + ("never queued any" if lc.peak_waiting_max == 0
           else f"peaked at {lc.peak_waiting_max}")
        + f"; ranked {', '.join(map(str, ranks('A', 'latency')))} of "
        f"{len(over['A'][0])} across the seeds.  The *Diagnostics* show why: the four "
        f"identical fast engines differ by {lat.fast_spread:.1f} requests in flight on "
        f"average (`least-conn`: {lc.fast_spread:.1f}), so some queue while their twins "
        "have room.  With `max_conns` = `max_num_seqs` (C) it "
        f"cannot overfill an engine and its preference for fast engines pays: "
        f"{med('C', 'latency'):.1f} s mean ({many}), best in C, p99 TTFT "
        f"{c['latency'].p99_ttft:.2f} s -- still behind weighted `{best_b}` "
        f"({med('B', best_b):.1f} s)."
    )
    out.append(
        f"* **`round-robin` / `random` with equal weights are not usable on a mixed "
        f"fleet**: {med('A', 'round-robin') / med('A', best):.0f}x / "
        f"{med('A', 'random') / med('A', best):.0f}x the best mean completion ({many}), "
        f"because they give the two slow GPUs {100 * a['round-robin'].share['slow']:.0f} % "
        f"of the requests when they have "
        f"{100 * _capacity_share(params, workload)['slow']:.0f} % of the capacity; their "
        f"queues grow for the whole run (peak "
        f"{max(a['round-robin'].peak_waiting_max, a['random'].peak_waiting_max)} waiting).  "
        f"A slow GPU offered 1/{sum(c.count for c in ENGINE_CLASSES)} of the traffic "
        f"overloads at any load above {_static_limit(params, workload):.2f} x capacity"
        + (", so this holds at every load in the load table."
           if min(loads) > _static_limit(params, workload) else ".")
    )
    static_b = max(med("B", "round-robin"), med("B", "random")) / med("B", best_b)
    static_c = max(med("C", "round-robin"), med("C", "random")) / med("C", order("C")[0])
    rr_b, rnd_b, lc_b = b["round-robin"], b["random"], b["least-conn"]
    out.append(
        f"* **When round-robin / random are fine**: with weights proportional to speed (B) "
        f"they come within {100 * (static_b - 1):.0f} % of the best mean ({many}), with "
        f"worse tails (p99 TTFT {rr_b.p99_ttft:.2f} / {rnd_b.p99_ttft:.2f} s vs "
        f"`least-conn` {lc_b.p99_ttft:.2f} s; peak engine queue {rr_b.peak_waiting_max} / "
        f"{rnd_b.peak_waiting_max} vs {lc_b.peak_waiting_max}), since they cannot see that "
        f"a backend drew several long answers; with `max_conns` (C) within "
        f"{100 * (static_c - 1):.0f} %.  Identical GPUs (not simulated) are the "
        "equal-weight case of B.  "
        + ("They beat `least-conn` in no run here." if not _static_wins(results) else
           "They beat `least-conn` in: " + ", ".join(_static_wins(results)) + ".")
    )
    out.append(
        f"* **`max_conns` = the engine's `max_num_seqs` (C) is a cheap safety net**: it "
        f"rescues `round-robin` ({a['round-robin'].mean_completion:.1f} s -> "
        f"{c['round-robin'].mean_completion:.1f} s mean) and `latency` (above), and "
        "changes nothing for the policies that never reach it.  The balancer queue it "
        "creates stayed short: mean wait at most "
        f"{max(r.mean_balancer_wait for r in results if r.experiment == 'C'):.2f} s, and "
        "no request was refused with 503 at any load simulated ("
        + _refusals(results, "C", seed, loads) + ")."
    )
    lc_d, qd_d, p2c_d = d["least-conn"], d["queue-depth"], d["p2c"]
    replicas = next(e.replicas for e in EXPERIMENTS if e.key == "D")
    ratio = med("D", "queue-depth") / med("D", "least-conn")
    high = max(loads)
    hi = pick(results, "D", seed, high)
    out.append(
        "* **Several replicas (D): "
        + ("local `least-conn` is enough here, `queue-depth` matches it.**  "
           if abs(ratio - 1) <= 0.03 else
           "`queue-depth` beats local `least-conn`.**  " if ratio < 1 else
           "local `least-conn` beats `queue-depth`.**  ")
        + f"{replicas} replicas sprayed at random: `least-conn` "
        f"{lc_d.mean_completion:.1f} s mean / {lc_d.p99_ttft:.2f} s p99 TTFT (one "
        f"balancer: {lc.mean_completion:.1f} s / {lc.p99_ttft:.2f} s); `queue-depth` "
        f"{qd_d.mean_completion:.1f} s / {qd_d.p99_ttft:.2f} s; mean-completion ratio "
        f"queue-depth / least-conn {ratio:.3f} ({many})"
        + (f"; at load {high:g}: {hi['least-conn'].p99_ttft:.2f} s vs "
           f"{hi['queue-depth'].p99_ttft:.2f} s p99 TTFT, `p2c` {hi['p2c'].p99_ttft:.2f} s"
           if hi else "")
        + f".  Random spraying makes each replica's in-flight counts a fair sample of "
        "the fleet's, so equalising them locally very nearly equalises them globally; "
        f"and with about {workload.rate / replicas * params.scrape_interval:.0f} requests per "
        "replica per scrape interval spread over 8 engines, replicas do not visibly herd "
        "onto the same engine.  `p2c` "
        f"({p2c_d.mean_completion:.1f} s, p99 TTFT {p2c_d.p99_ttft:.2f} s) "
        + ("gains nothing from its anti-herding randomness"
           if med("D", "p2c") >= med("D", "least-conn") else "does slightly better")
        + ".  "
        + (f"Near saturation `queue-depth` has the longer TTFT tail, with one balancer as "
           f"with three (load {high:g}, p99 TTFT: one balancer "
           f"{pick(results, 'A', seed, high)['queue-depth'].p99_ttft:.2f} s vs "
           f"{pick(results, 'A', seed, high)['least-conn'].p99_ttft:.2f} s for `least-conn`; "
           f"three replicas {hi['queue-depth'].p99_ttft:.2f} s vs "
           f"{hi['least-conn'].p99_ttft:.2f} s), presumably because between scrapes it "
           "counts the requests it sent but not the ones that finished.  "
           if hi and pick(results, "A", seed, high)
           and hi["queue-depth"].p99_ttft > 1.1 * hi["least-conn"].p99_ttft
           and pick(results, "A", seed, high)["queue-depth"].p99_ttft
           > 1.1 * pick(results, "A", seed, high)["least-conn"].p99_ttft else "")
        + "`queue-depth` should matter when the engines "
        "carry load a replica cannot count -- skewed or sticky client-to-replica "
        "traffic, direct clients, other balancers -- none of which is modelled."
    )
    consistent = [k for k in "ABCD" if stable(k)]
    out.append(
        "* **Caveats.**  One fleet shape, one request-length distribution, a simplified "
        "engine (module docstring: no KV-cache limit, no preemption, prefill does not "
        "contend with decode), perfect health, streaming requests only (txlb takes TTFT "
        "at the first body byte, which for a non-streaming request is about its whole "
        "duration).  Every policy replays the same requests, which makes small "
        "differences between policies more repeatable than their size suggests: "
        + (f"the ranking by mean completion was the same in all {n} seeds in "
           f"{len(consistent)} of the 4 experiments ({', '.join(consistent) or '-'})"
           if n > 1 else "only one seed was run")
        + "; still, a different fleet or workload could reorder policies that are within "
        f"a few per cent of each other.  Load {load:g} means {workload.rate:.2f} req/s against "
        f"{workload.capacity:.2f} req/s at full batches; by Little's law `least-conn` keeps "
        f"{slots:.0f} of the {total_slots} batch slots busy on average."
    )
    return "\n".join(out)


def _static_limit(params: Params, workload: Workload) -> float:
    """The load above which an equal share of the traffic overloads the slowest engine."""
    engines = sum(cls.count for cls in ENGINE_CLASSES)
    slowest = min(engine_capacity(cls, params, workload.mean_prompt, workload.mean_output)
                  for cls in ENGINE_CLASSES)
    return engines * slowest / workload.capacity


def _static_wins(results: Sequence[RunResult]) -> list[str]:
    """Runs in which round-robin or random had a lower mean completion than least-conn."""
    least = {(r.experiment, r.seed, r.load, r.observe_at): r.mean_completion
             for r in results if r.policy == "least-conn"}
    return [f"{r.experiment} seed {r.seed} load {r.load:g} (`{r.policy}`)" for r in results
            if r.policy in ("round-robin", "random")
            and r.mean_completion < least.get((r.experiment, r.seed, r.load, r.observe_at),
                                              math.inf)]


def _capacity_share(params: Params, workload: Workload) -> dict[str, float]:
    caps = {cls.name: cls.count * engine_capacity(cls, params, workload.mean_prompt,
                                                  workload.mean_output)
            for cls in ENGINE_CLASSES}
    total = sum(caps.values())
    return {name: cap / total for name, cap in caps.items()}


def _refusals(results: Sequence[RunResult], experiment: str, seed: int,
              loads: Sequence[float]) -> str:
    parts = []
    for load in loads:
        selection = pick(results, experiment, seed, load)
        refused = {p: r.refused for p, r in selection.items() if r.refused}
        parts.append(f"load {load:g}: " + (", ".join(f"`{p}` {k}" for p, k in refused.items())
                                           if refused else "none"))
    return "; ".join(parts)


def markdown(results: Sequence[RunResult], params: Params, seeds: Sequence[int],
             loads: Sequence[float], workload: Workload, wall: float,
             command: str) -> str:
    seed, load = params.seed, params.load
    info = machine()
    shares = _capacity_share(params, workload)
    lines = [
        "# Scheduling policies over heterogeneous engines (simulation)",
        "",
        f"- date: `{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}`",
        *(f"- {k}: `{v}`" for k, v in info.items()),
        f"- txlb: `{git_revision()}`",
        f"- command: `{command}` ({len(results)} runs, {wall:.0f} s wall)",
        f"- seed: {seed} (seed table: seeds {', '.join(map(str, seeds))}); "
        f"{params.requests} requests per run; Poisson arrivals at {workload.rate:.2f} "
        f"req/s = load {load:g} x full-batch capacity {workload.capacity:.2f} req/s "
        "(load table: other loads, same seed)",
        "- engines: " + "; ".join(
            f"{c.count} {c.name} (decode {c.decode_rate:g} tok/s per sequence, prefill "
            f"{c.prefill_rate:g} tok/s, {100 * shares[c.name]:.0f} % of capacity, weight "
            f"{c.weight} in B)" for c in ENGINE_CLASSES)
        + f"; max_num_seqs {params.max_num_seqs}; per-sequence decode speed x "
        f"(1 - {params.degradation:g} x running / max_num_seqs)",
        f"- requests: output tokens lognormal, median {params.output_median:g}, p99 "
        f"{params.output_p99:g}, cap {params.output_cap} (mean {workload.mean_output:.0f}); "
        f"prompt tokens lognormal, median {params.prompt_median:g}, sigma "
        f"{params.prompt_sigma:g}, cap {params.prompt_cap} (mean {workload.mean_prompt:.0f})",
        f"- balancer: txlb's own Pool + Router + make_policy on a twisted Clock; "
        f"queue_timeout {params.queue_timeout:g} s; `queue-depth` scrapes every engine's "
        f"running + waiting every {params.scrape_interval:g} s; `latency` is told each "
        "request's TTFT (arrival to first token) when the request ends, as txlb does",
        "- columns: completion = arrival at the balancer to last token; TTFT = arrival to "
        "first token (balancer queue + engine queue + prefill); peak engine waiting = the "
        "most requests ever waiting inside one engine (vLLM's num_requests_waiting), max "
        "over all 8 and per class; share = fraction of the requests each class served; "
        "503s = requests refused by the router",
        "",
    ]
    for experiment in EXPERIMENTS:
        lines += [f"## {experiment.key}. {experiment.title}", "",
                  table(list(pick(results, experiment.key, seed, load).values()),
                        show_wait=experiment.capped), ""]
    if len(seeds) > 1:
        lines += [f"## Across seeds {', '.join(map(str, seeds))} (load {load:g})", "",
                  "Median (min-max) over the seeds; the last column is the policy's rank "
                  "by mean completion in each seed (1 = lowest).", ""]
        for experiment in EXPERIMENTS:
            lines += [f"### {experiment.key}. {experiment.title}", "",
                      seed_table(per_seed(results, experiment.key, seeds, load)), ""]
    if len(loads) > 1:
        lines += [f"## Across loads (seed {seed})", "",
                  "Each cell: mean completion s / p99 TTFT s / peak engine waiting (and the "
                  "mean balancer queue wait, or the 503 count, where there is any).", ""]
        for experiment in EXPERIMENTS:
            if all(pick(results, experiment.key, seed, x) for x in loads):
                lines += [f"### {experiment.key}. {experiment.title}", "",
                          load_table(results, experiment.key, seed, loads), ""]
    lines += [
        f"## Diagnostics: where the requests sit (A, seed {seed}, load {load:g})", "",
        "Mean in flight = requests on one engine (running + waiting), time-averaged while "
        "arrivals last; spread = max - min of that count over the 4 identical fast "
        "engines, averaged over arrivals.  txlb tells `PeakEwmaLatency` a request's TTFT "
        "when the request *ends* (the bookkeeper's `policy_learns`); the what-if rows feed the "
        "same sample the moment the first token arrives instead (not what txlb does).", "",
        diagnostic_table(results, seed, load), "",
        "How `latency` gets there: below an engine's batch cap its TTFT is just prefill "
        "time, which does not depend on the load, so the peak-EWMA of two identical "
        "engines differs only by noise (prompt lengths, the last queueing spike); the cost "
        "`peak_ewma x (active + 1)` turns that noise into a proportional difference in "
        "requests, pushing the engine with the lowest average towards and past "
        "`max_num_seqs`.  Load shows up in TTFT only once requests queue inside that "
        "engine, and txlb learns it only when those requests end; then the peak-sensitive "
        "average jumps and the traffic swings to the others.  Feeding the sample at the "
        "first token shortens the lag (see the what-if rows) but does not remove the "
        "cause.", "",
        recommendation(results, params, seeds, loads, workload), "",
        "![policies](policies.png)", "",
    ]
    return "\n".join(lines)


def plot(results: Sequence[RunResult], params: Params, loads: Sequence[float],
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows_n = len(EXPERIMENTS) + (1 if len(loads) > 1 else 0)
    fig, axes = plt.subplots(rows_n, 3, figsize=(16, 3.8 * rows_n), squeeze=False)
    for row, experiment in enumerate(EXPERIMENTS):
        runs = list(pick(results, experiment.key, params.seed, params.load).values())
        names = [r.policy for r in runs]
        x = list(range(len(runs)))
        width = 0.38
        panels = (
            ("completion s", [r.mean_completion for r in runs],
             [r.p99_completion for r in runs]),
            ("TTFT s", [r.mean_ttft for r in runs], [r.p99_ttft for r in runs]),
        )
        for col, (label, means, p99s) in enumerate(panels):
            ax = axes[row][col]
            ax.bar([i - width / 2 for i in x], means, width, label="mean")
            ax.bar([i + width / 2 for i in x], p99s, width, label="p99")
            ax.set_yscale("log")
            ax.set_xticks(x, names, rotation=15, fontsize=8)
            ax.set_ylabel(label + " (log)")
            ax.set_title(f"{experiment.key}: {label}", fontsize=10)
            ax.legend(fontsize=8)
            ax.grid(axis="y", alpha=0.3)
        ax = axes[row][2]
        classes = [cls.name for cls in ENGINE_CLASSES]
        w = 0.8 / len(classes)
        if all(r.peak_waiting_max == 0 for r in runs):
            ax.text(0.5, 0.5, "no request ever waited inside an engine", ha="center",
                    va="center", transform=ax.transAxes, fontsize=9)
        else:
            for k, name in enumerate(classes):
                ax.bar([i - 0.4 + w * (k + 0.5) for i in x],
                       [max(r.peak_waiting[name], 0.5) for r in runs], w, label=name)
            ax.set_yscale("log")
            ax.legend(fontsize=8)
        ax.set_xticks(x, names, rotation=15, fontsize=8)
        ax.set_ylabel("peak waiting in one engine (log)")
        ax.set_title(f"{experiment.key}: peak engine queue by class (0 drawn as 0.5)",
                     fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    if len(loads) > 1:
        for col, key in enumerate(("A", "C", "D")):
            ax = axes[-1][col]
            by_load = [pick(results, key, params.seed, load) for load in loads]
            if not all(by_load):
                ax.set_visible(False)
                continue
            values = [s[policy].mean_completion for s in by_load for policy in s]
            for policy in by_load[0]:
                ax.plot(loads, [s[policy].mean_completion for s in by_load], marker="o",
                        label=policy)
            log = max(values) > 3 * min(values)
            if log:
                ax.set_yscale("log")
            ax.set_xlabel("load (x full-batch capacity)")
            ax.set_ylabel("mean completion s" + (" (log)" if log else ""))
            ax.set_title(f"{key}: mean completion vs load", fontsize=10)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
    fig.suptitle(
        "txlb policies, simulated 4 fast + 2 medium + 2 slow engines, seed "
        f"{params.seed}, load {params.load:g}\n"
        + "; ".join(f"{e.key} = {e.title}" for e in EXPERIMENTS[:2]) + "\n"
        + "; ".join(f"{e.key} = {e.title}" for e in EXPERIMENTS[2:]), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=80)
    plt.close(fig)
