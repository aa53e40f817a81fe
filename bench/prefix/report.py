"""
The prefix bench's results page (``bench/results/cache-aware.md``), its plot, and the
targets of cache-aware routing checked against the figures.

Each part of the bench (``virtual``, ``process``, ``real``, ``policy_cpu``) saves its raw
results as ``cache-aware-PART.json`` in the results directory; the page is rendered from
whichever parts are there, so one part can be rerun without the others.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.prefix.workloads import SHARED_PREFIX, WORKLOADS

PARTS = ("virtual", "process", "real", "policy_cpu")
CACHE_AWARE = "cache-aware"
ROUTER_CACHE_AWARE = "vllm-router cache_aware"


def load(directory: Path) -> dict[str, dict[str, Any]]:
    """Every part saved in ``directory``: part -> {"info": ..., "results": [...]}."""
    parts = {}
    for part in PARTS:
        path = directory / f"cache-aware-{part}.json"
        if path.exists():
            parts[part] = json.loads(path.read_text())
    return parts


def save_part(directory: Path, part: str, info: dict[str, Any],
              results: Sequence[dict[str, Any]]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"cache-aware-{part}.json"
    path.write_text(json.dumps({"info": info, "results": list(results)}, indent=1))
    return path


def _f(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _ms(value: Any) -> str:
    return "–" if value is None else f"{value * 1000:,.0f}"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def _single(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in results if r["replicas"] == 1]


def _pick(results: Sequence[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for r in results:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def virtual_section(part: dict[str, Any]) -> list[str]:
    info, results = part["info"], part["results"]
    out = ["## The virtual-clock model (fleet scale)", "",
           f"`{info.get('command', '')}` -- {info.get('requests', '?')} requests per run, "
           f"seed {info.get('seed', '?')}, load {info.get('load', '?')}; engines: "
           f"{info.get('engine', '')}. Wall time {info.get('wall', 0):.0f} s.", "",
           "Hit rate: cached / prompt tokens as the engines counted them; `of oracle`: "
           "the hit rate as a share of the oracle's; TTFT in ms from arrival; max "
           "in-flight: most requests one engine held.", ""]
    single = _single(results)
    for engines in sorted({r["engines"] for r in single}):
        out += [f"### {engines} engines", ""]
        rows = []
        for workload in WORKLOADS:
            oracle = _pick(single, workload=workload, engines=engines, policy="oracle")
            for r in single:
                if r["workload"] != workload or r["engines"] != engines:
                    continue
                share = (r["hit_rate"] / oracle["hit_rate"]
                         if oracle and oracle["hit_rate"] > 0 else None)
                rows.append([workload, r["policy"], _f(r["hit_rate"]), _f(share, 2),
                             _ms(r["ttft_p50"]), _ms(r["ttft_p99"]), _f(r["rps"], 1),
                             _f(r["output_tps"], 0), str(r["max_in_flight"]),
                             str(r["refused"])])
        out += _table(["workload", "policy", "hit rate", "of oracle", "TTFT p50", "TTFT p99",
                       "req/s", "out tok/s", "max in-flight", "refused"], rows) + [""]
    replicated = [r for r in results if r["replicas"] > 1]
    if replicated:
        out += ["### Replicas and `--workers`: one index each or one shared index", "",
                "Each arrival goes to a random replica. *independent*: each replica has its "
                "own pool (its own in-flight counts) and its own policy -- separate txlb "
                "processes with no shared state. *workers, own index*: one pool's counts "
                "(exact fleet-wide in-flight, as `--workers` shares them), each worker's own "
                "policy object -- what `--workers N` does. *workers, shared index*: the same "
                "with one policy object behind every worker's router (one index).", ""]
        rows = []
        for r in sorted(replicated, key=lambda r: (r["workload"], r["replicas"], r["policy"],
                                                     r["shared_counts"], r["shared_index"])):
            kind = ("independent" if not r["shared_counts"] else
                    "workers, shared index" if r["shared_index"] else "workers, own index")
            rows.append([r["workload"], str(r["engines"]), str(r["replicas"]), r["policy"],
                         kind, _f(r["hit_rate"]), _ms(r["ttft_p50"]), _ms(r["ttft_p99"]),
                         str(r["max_in_flight"])])
        out += _table(["workload", "engines", "replicas", "policy", "index", "hit rate",
                       "TTFT p50", "TTFT p99", "max in-flight"], rows) + [""]
    return out


def process_section(part: dict[str, Any], cpu: dict[str, Any] | None) -> list[str]:
    info, results = part["info"], part["results"]
    per_policy: dict[tuple[str, str], float] = {}
    if cpu:
        per_policy = {(c["workload"], c["policy"]): c["choose_us"] + c["observe_us"]
                      for c in cpu["results"]}
    out = ["## Real processes: txlb against vllm-router and sglang-router", "",
           f"`{info.get('command', '')}` -- {info.get('engines', '')}; "
           f"{info.get('requests', '?')} requests per workload, concurrency "
           f"{info.get('concurrency', '?')} (hot-burst: whole bursts at once); load "
           f"average at the start: {info.get('loadavg', '?')}. {info.get('note', '')}", "",
           "Hit rate from the engines' `/metrics` (prefix-cache hits / queries, in tokens, "
           "over the run); TTFT in ms at the client (first content event); max in-flight: "
           "most requests one engine ran at once; proxy CPU: the target's processes' "
           "on-CPU time per request; policy CPU: txlb's `choose()` + `observe()` alone "
           "(microbench on the same requests).", ""]
    rows = []
    for workload in WORKLOADS:
        for r in results:
            if r["workload"] != workload:
                continue
            policy = r["target"].split(" ", 1)[1] if r["target"].startswith("txlb ") else ""
            cost = per_policy.get((workload, policy))
            rows.append([workload, r["target"], _f(r["hit_rate"]), _ms(r["ttft_p50"]),
                         _ms(r["ttft_p99"]), _f(r["rps"], 1), _f(r["output_tps"], 0),
                         _f(r["max_in_flight"]), _f(r["proxy_cpu_us"], 0),
                         _f(cost, 1) if cost is not None else "–", str(r["errors"])])
    out += _table(["workload", "target", "hit rate", "TTFT p50", "TTFT p99", "req/s",
                   "out tok/s", "max in-flight", "proxy CPU µs/req", "policy CPU µs/req",
                   "errors"], rows) + [""]
    errors = [r for r in results if r["errors"]]
    for r in errors:
        out.append(f"- {r['target']} on {r['workload']}: {r['errors']} errors, first: "
                   f"`{r['first_error'][:160]}`")
    return out + ([""] if errors else [])


def real_section(part: dict[str, Any]) -> list[str]:
    info, results = part["info"], part["results"]
    out = ["## A real engine: llama.cpp's llama-server", "",
           f"`{info.get('command', '')}` -- {info.get('engines', '')}. Hit rate from the "
           "answers (`timings.cache_n` / (`cache_n` + `prompt_n`)); TTFT in ms at the "
           f"client. {info.get('note', '')}", ""]
    rows = [[r["workload"], r["policy"], _f(r["hit_rate"]), _ms(r["ttft_p50"]),
             _ms(r["ttft_p99"]), _f(r["rps"], 1), str(r["errors"])] for r in results]
    return out + _table(["workload", "policy", "hit rate", "TTFT p50", "TTFT p99", "req/s",
                         "errors"], rows) + [""]


# -- the targets ------------------------------------------------------------------------------


def _verdict(ok: bool | None) -> str:
    return "–" if ok is None else ("met" if ok else "**not met**")


def targets(parts: dict[str, dict[str, Any]]) -> list[list[str]]:
    """One row per target and workload: [target, where, figures, verdict]."""
    rows: list[list[str]] = []
    process = parts.get("process", {}).get("results", [])
    for workload in WORKLOADS:
        ours = _pick(process, workload=workload, target=f"txlb {CACHE_AWARE}")
        theirs = _pick(process, workload=workload, target=ROUTER_CACHE_AWARE)
        if ours and theirs and ours["hit_rate"] is not None and theirs["hit_rate"] is not None:
            ok = ours["hit_rate"] >= theirs["hit_rate"] - 1e-9
            rows.append([f"hit rate ≥ vllm-router cache_aware: {workload}", "processes",
                         f"{ours['hit_rate']:.3f} vs {theirs['hit_rate']:.3f}", _verdict(ok)])
    virtual = _single(parts.get("virtual", {}).get("results", []))
    for engines in sorted({r["engines"] for r in virtual}):
        for workload in SHARED_PREFIX:
            ours = _pick(virtual, workload=workload, engines=engines, policy=CACHE_AWARE)
            oracle = _pick(virtual, workload=workload, engines=engines, policy="oracle")
            if ours and oracle and oracle["hit_rate"] > 0:
                share = ours["hit_rate"] / oracle["hit_rate"]
                rows.append([f"hit rate ≥ 90 % of the oracle: {workload}",
                             f"virtual, {engines} engines",
                             f"{ours['hit_rate']:.3f} / {oracle['hit_rate']:.3f} = "
                             f"{share:.0%}", _verdict(share >= 0.9)])
        ours = _pick(virtual, workload="hot-burst", engines=engines, policy=CACHE_AWARE)
        base = _pick(virtual, workload="hot-burst", engines=engines, policy="least-conn")
        if ours and base:
            rows.append(["hot-burst p99 TTFT ≤ least-conn", f"virtual, {engines} engines",
                         f"{ours['ttft_p99'] * 1000:,.0f} vs {base['ttft_p99'] * 1000:,.0f} ms",
                         _verdict(ours["ttft_p99"] <= base["ttft_p99"] + 1e-9)
                         + _burst_why(ours, base)])
        ours = _pick(virtual, workload="unique", engines=engines, policy=CACHE_AWARE)
        base = _pick(virtual, workload="unique", engines=engines, policy="least-conn")
        if ours and base:
            worst, figures = _within(ours, base)
            rows.append(["unique: within 2 % of least-conn on every figure",
                         f"virtual, {engines} engines", figures, _verdict(worst <= 0.02)])
    ours = _pick(process, workload="hot-burst", target=f"txlb {CACHE_AWARE}")
    base = _pick(process, workload="hot-burst", target="txlb least-conn")
    if ours and base and ours["ttft_p99"] is not None and base["ttft_p99"] is not None:
        rows.append(["hot-burst p99 TTFT ≤ least-conn", "processes",
                     f"{ours['ttft_p99'] * 1000:,.0f} vs {base['ttft_p99'] * 1000:,.0f} ms",
                     _verdict(ours["ttft_p99"] <= base["ttft_p99"] * 1.0 + 1e-9)
                     + _burst_why(ours, base, shared_machine=True)])
    return rows


def _burst_why(ours: dict[str, Any], base: dict[str, Any], shared_machine: bool = False
               ) -> str:
    """Why a hot-burst p99 came out worse than least-conn's, in figures."""
    if ours["ttft_p99"] <= base["ttft_p99"] + 1e-9:
        return ""
    why = (f": {ours['ttft_p99'] / base['ttft_p99'] - 1:.1%} above, with the same hit rate "
           f"({ours['hit_rate']:.3f} vs {base['hit_rate']:.3f})")
    if shared_machine:
        return why + (f"; p50 {ours['ttft_p50'] * 1000:,.0f} vs "
                      f"{base['ttft_p50'] * 1000:,.0f} ms, one run each on a machine other "
                      "work shared; three alternating rounds put p99 either way (see "
                      "cache-aware-hotburst-rounds.md), the median a few ms above: the "
                      "policy hashes a burst's prompts one after another")
    return why + ("; every engine holds the one prefix, so the two differ only in which "
                  "engine takes each request of bursts that overlap (ties)")


FIGURES = ("hit_rate", "ttft_p50", "ttft_p99", "rps", "output_tps", "max_in_flight")


def _within(ours: dict[str, Any], base: dict[str, Any]) -> tuple[float, str]:
    """The largest relative difference over :data:`FIGURES`, and the figures in words."""
    worst, words = 0.0, []
    for name in FIGURES:
        a, b = float(ours[name]), float(base[name])
        diff = abs(a - b) / abs(b) if b else abs(a - b)
        worst = max(worst, diff)
        words.append(f"{name} {diff:.1%}")
    return worst, ", ".join(words)


def summary(parts: dict[str, dict[str, Any]], engines: int = 8) -> list[str]:
    """The short table docs/scheduling.md quotes: hit rate and p99 TTFT per workload."""
    virtual = _single(parts.get("virtual", {}).get("results", []))
    process = parts.get("process", {}).get("results", [])
    rows = []
    for workload in WORKLOADS:
        def hit(policy: str, workload: str = workload) -> str:
            r = _pick(virtual, workload=workload, engines=engines, policy=policy)
            return _f(r["hit_rate"], 2) if r else "–"

        def p99(policy: str, workload: str = workload) -> str:
            r = _pick(virtual, workload=workload, engines=engines, policy=policy)
            return _ms(r["ttft_p99"]) if r else "–"

        def proc(target: str, workload: str = workload) -> str:
            r = _pick(process, workload=workload, target=target)
            return _f(r["hit_rate"], 2) if r else "–"

        rows.append([workload, hit("least-conn"), hit(CACHE_AWARE), hit("oracle"),
                     p99("least-conn"), p99(CACHE_AWARE), proc("txlb least-conn"),
                     proc(f"txlb {CACHE_AWARE}"), proc(ROUTER_CACHE_AWARE),
                     proc("sglang-router cache_aware")])
    return _table([f"workload ({engines} engines / processes)", "hit least-conn",
                   "hit cache-aware", "hit oracle", "p99 TTFT least-conn ms",
                   "p99 TTFT cache-aware ms", "processes: least-conn", "cache-aware",
                   "vllm-router cache_aware", "sglang-router cache_aware"], rows)


def render(parts: dict[str, dict[str, Any]], directory: Path) -> str:
    from bench.prefix import workloads

    out = ["# Cache-aware routing: txlb against the routers users would pick instead", "",
           "Generated by `python -m bench.prefix` (see `python -m bench.prefix --help`); "
           "every workload is seeded, so the virtual-clock figures are exactly "
           "reproducible, and the process figures up to the machine's noise.", "",
           "## Summary", "", *summary(parts), "", "## Targets", ""]
    rows = targets(parts)
    out += (_table(["target", "where", "figures", "verdict"], rows) if rows
            else ["(no figures yet)"]) + [""]
    out += ["## The workloads", "", "```", (workloads.__doc__ or "").strip(), "```", ""]
    from bench.prefix import engine_model, process_bench, real_engine, virtual

    out += ["## How the figures are made", ""]
    for title, module in (("The virtual-clock model", virtual),
                          ("Its engines", engine_model),
                          ("The process bench", process_bench),
                          ("The real engine", real_engine)):
        out += [f"<details><summary>{title} (<code>{module.__name__}</code>)</summary>", "",
                "```", (module.__doc__ or "").strip(), "```", "", "</details>", ""]
    if "virtual" in parts:
        out += virtual_section(parts["virtual"])
    if "process" in parts:
        out += process_section(parts["process"], parts.get("policy_cpu"))
    if "real" in parts:
        out += real_section(parts["real"])
    if (directory / "cache-aware.png").exists():
        out += ["![hit rate and TTFT per policy](cache-aware.png)", ""]
    return "\n".join(out)


def plot(parts: dict[str, dict[str, Any]], path: Path) -> bool:
    """Hit rate and p99 TTFT per workload and policy; ``False`` without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[str, Callable[[], tuple[list[str], dict[str, list[float]]]], bool]] = []
    virtual = _single(parts.get("virtual", {}).get("results", []))
    if virtual:
        engines = min(r["engines"] for r in virtual)

        def series(field: str, rows: list[dict[str, Any]], key: str
                   ) -> tuple[list[str], dict[str, list[float]]]:
            names = list(dict.fromkeys(r[key] for r in rows))
            return list(WORKLOADS), {
                n: [float((_pick(rows, workload=w, **{key: n}) or {}).get(field) or 0.0)
                    for w in WORKLOADS] for n in names}

        rows = [r for r in virtual if r["engines"] == engines]
        panels.append((f"virtual, {engines} engines: hit rate",
                       lambda: series("hit_rate", rows, "policy"), False))
        panels.append((f"virtual, {engines} engines: TTFT p99 (s, log)",
                       lambda: series("ttft_p99", rows, "policy"), True))
    process = parts.get("process", {}).get("results", [])
    if process and any(r["hit_rate"] is not None for r in process):
        def process_series(field: str) -> tuple[list[str], dict[str, list[float]]]:
            names = list(dict.fromkeys(r["target"] for r in process))
            return list(WORKLOADS), {
                n: [float((_pick(process, workload=w, target=n) or {}).get(field) or 0.0)
                    for w in WORKLOADS] for n in names}

        panels.append(("processes: hit rate", lambda: process_series("hit_rate"), False))
        panels.append(("processes: TTFT p99 (s, log)", lambda: process_series("ttft_p99"),
                       True))
    if not panels:
        return False
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.6 * len(panels)), squeeze=False)
    for ax, (title, make, log) in zip((a[0] for a in axes), panels, strict=True):
        groups, values = make()
        width = 0.8 / max(1, len(values))
        for i, (name, ys) in enumerate(values.items()):
            xs = [g + (i - (len(values) - 1) / 2) * width for g in range(len(groups))]
            ax.bar(xs, [max(y, 1e-4) if log else y for y in ys], width, label=name)
        ax.set_xticks(range(len(groups)), groups)
        if log:
            ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7, ncol=4)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def write(directory: Path) -> Path:
    """Render ``cache-aware.md`` (and the plot) from the parts saved in ``directory``."""
    parts = load(directory)
    plot(parts, directory / "cache-aware.png")
    page = directory / "cache-aware.md"
    page.write_text(render(parts, directory))
    return page
