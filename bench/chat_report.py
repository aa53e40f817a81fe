"""
The report of ``python -m bench relay``: the chat path through every target, every round.

The figures users compare balancers by, each per round and as a range over the rounds, with
txlb's ratio to vllm-router and to nginx measured in the same round; the paced streams'
added chunk latency by phase (streams starting, steady, streams ending); then every figure of
every round (:func:`bench.report.full_table`).  Raw results go to ``chat.json``, this text to
``chat.md``, plots (when matplotlib is installed) to ``chat.png``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.chat import PHASES
from bench.report import fmt, full_table, ratio

#: The targets whose ratios the tables give, and what they are divided by.
SUBJECTS = ("txlb", "txlb-b", "txlb-pypy")
REFERENCES = ("vllm-router", "nginx")


@dataclass(frozen=True)
class Figure:
    """One headline figure of one round: a value per target."""

    label: str
    values: dict[str, float]
    digits: int = 1
    with_ratio: bool = True


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _added(per: dict[str, Any], value: Any) -> dict[str, float]:
    """``value(row)`` minus direct's, for every proxy in ``per``."""
    direct = _num(value(per["direct"])) if "direct" in per else math.nan
    return {t: _num(value(row)) - direct for t, row in per.items() if t != "direct"}


def _phase(row: dict[str, Any], phase: str, key: str) -> float:
    return _num(row.get("phases", {}).get(phase, {}).get(key))


def key_figures(data: dict[str, Any]) -> list[Figure]:
    """The headline figures of one round's results (only those of scenarios that ran)."""
    out: list[Figure] = []
    for level, per in data.get("paced", {}).items():
        out.append(Figure(f"proxy CPU µs per SSE chunk, {level} streams ↓",
                          {t: _num(r.get("us_per_chunk")) for t, r in per.items()
                           if t != "direct"}, 1))
    for level, per in data.get("paced", {}).items():
        out.append(Figure(f"added chunk latency p50, {level} streams, ms ↓",
                          {t: v / 1000 for t, v in _added(per, lambda r: r.get("p50_us"))
                           .items()}, 2))
        out.append(Figure(f"added chunk latency p99, {level} streams, ms ↓",
                          {t: v / 1000 for t, v in _added(per, lambda r: r.get("p99_us"))
                           .items()}, 2))
        out.append(Figure(f"added chunk latency p99 while streams end, {level} streams, ms ↓",
                          {t: v / 1000 for t, v in _added(
                              per, lambda r: _phase(r, "ending", "p99_us")).items()}, 2))
    if "rps" in data:
        out.append(Figure("small chat requests per proxy CPU-second ↑",
                          {t: _num(r.get("per_cpu_second")) for t, r in data["rps"].items()
                           if t != "direct"}, 0))
    for mode, label in (("keepalive", "keep-alive"), ("fresh", "new connection")):
        per = data.get("ttfb", {}).get(mode)
        if per:
            out.append(Figure(f"added TTFB p50 at idle, {label}, µs ↓",
                              _added(per, lambda r: r.get("p50_us")), 0))
    for level, per in data.get("hold", {}).items():
        out.append(Figure(f"RSS per held stream, {int(level):,} streams, KiB ↓",
                          {t: _num(r.get("per_stream_kb")) for t, r in per.items()
                           if t != "direct"}, 1))
        out.append(Figure(f"streams held without errors, of {int(level):,} ↑",
                          {t: (_num(r.get("held")) if r.get("failed", 0) + r.get("refused", 0)
                               == 0 else math.nan) for t, r in per.items() if t != "direct"},
                          0, with_ratio=False))
    for level, per in data.get("get-paced", {}).items():
        out.append(Figure(f"non-LLM GET path: proxy CPU µs per SSE chunk, {level} streams ↓",
                          {t: _num(r.get("us_per_chunk")) for t, r in per.items()
                           if t != "direct"}, 1))
    return out


def ratio_columns(targets: list[str]) -> list[tuple[str, str]]:
    """(subject, reference) of every ratio column: each txlb build to each reference run,
    and for an A/B run (``--txlb-root``) the other revision to this one."""
    pairs = [(s, r) for s in SUBJECTS if s in targets for r in REFERENCES if r in targets]
    if "txlb" in targets and "txlb-b" in targets:
        pairs.append(("txlb-b", "txlb"))
    return pairs


def _span(values: list[float], digits: int) -> str:
    """``low–high`` of the numbers among ``values`` (one number if they agree; – if none)."""
    numbers = [v for v in values if not math.isnan(v)]
    if not numbers:
        return "–"
    low, high = fmt(min(numbers), digits), fmt(max(numbers), digits)
    return low if low == high else f"{low}–{high}"


def ratio_table(rounds: list[list[Figure]], targets: list[str]) -> list[str]:
    """
    The headline table: for each figure, a row per round and a row with the range over the
    rounds; a column per target (direct left out: "added" figures already subtract it) and
    one per ratio (:func:`ratio_columns`), computed within each round.
    """
    shown = [t for t in targets if t != "direct"]
    pairs = ratio_columns(targets)
    lines = ["| figure | round | " + " | ".join(shown) + "".join(
        f" | {s}/{r}" for s, r in pairs) + " |",
        "|---|---|" + "---:|" * (len(shown) + len(pairs))]
    labels: list[str] = []
    for figures in rounds:
        labels += [f.label for f in figures if f.label not in labels]
    for label in labels:
        per_round = [next((f for f in figures if f.label == label), None) for figures in rounds]
        present = [(i, f) for i, f in enumerate(per_round) if f is not None]
        digits = present[0][1].digits
        collected: dict[str, list[float]] = {t: [] for t in shown}
        ratios: dict[tuple[str, str], list[float]] = {p: [] for p in pairs}
        for index, figure in present:
            cells = []
            for t in shown:
                value = figure.values.get(t, math.nan)
                collected[t].append(value)
                cells.append(fmt(value, digits))
            for s, r in pairs:
                value = (ratio(figure.values.get(s), figure.values.get(r))
                         if figure.with_ratio else math.nan)
                ratios[(s, r)].append(value)
                cells.append(fmt(value, 2))
            lines.append(f"| {label} | {index + 1} | " + " | ".join(cells) + " |")
        if len(present) > 1:
            cells = [_span(collected[t], digits) for t in shown]
            cells += [_span(ratios[p], 2) for p in pairs]
            lines.append(f"| {label} | **range** | " + " | ".join(cells) + " |")
    return lines


def phase_table(rounds: list[dict[str, Any]], targets: list[str]) -> list[str]:
    """Added chunk latency p50 / p99 (ms) by phase, for each paced level and round."""
    shown = [t for t in targets if t != "direct"]
    lines = ["| streams | phase | round | events (direct) | " + " | ".join(
        f"{t} p50 / p99" for t in shown) + " |", "|---|---|---|---:|" + "---:|" * len(shown)]
    for index, entry in enumerate(rounds):
        for level, per in entry["data"].get("paced", {}).items():
            for phase in PHASES:
                direct = per.get("direct", {})
                base50, base99 = _phase(direct, phase, "p50_us"), _phase(direct, phase, "p99_us")
                count = _phase(direct, phase, "count")
                cells = []
                for t in shown:
                    row = per.get(t, {})
                    p50 = (_phase(row, phase, "p50_us") - base50) / 1000
                    p99 = (_phase(row, phase, "p99_us") - base99) / 1000
                    cells.append(f"{fmt(p50, 2)} / {fmt(p99, 2)}")
                lines.append(f"| {level} | {phase} | {index + 1} | {fmt(count, 0)} | "
                             + " | ".join(cells) + " |")
    return lines


def render(raw: dict[str, Any]) -> str:
    """The whole Markdown report."""
    info, cfg, targets = raw["info"], raw["config"], raw["targets"]
    rounds = raw["rounds"]
    out = ["# The chat path: txlb against vllm-router, sglang-router and nginx", ""]
    out += [f"- {key}: `{value}`" for key, value in info.items()]
    out += [
        "- path: every scenario sends `POST /v1/chat/completions` (a small JSON body: model,"
        " system + user message, `stream`, `max_tokens`); the backend takes its instruction"
        " from the user message, the one thing every router passes on",
        f"- workload: paced {cfg['paced_rate']:g} token events/s per stream for up to"
        f" {cfg['paced_seconds']:g} s, 250-byte `chat.completion.chunk` events then a usage"
        f" event and `data: [DONE]`; streams end one by one over the last"
        f" {cfg['paced_spread'] * 100:g} % of the run; bulk {cfg['bulk_streams']} streams ×"
        f" {cfg['bulk_seconds']:g} s; small chat requests (`\"stream\": false`)"
        f" {cfg['rps_connections']} connections × {cfg['rps_seconds']:g} s; TTFB"
        f" {cfg['ttfb_count']} sequential requests; held streams one event per"
        f" {cfg['hold_interval_ms'] / 1000:g} s (last round only); slow client"
        f" {cfg['slow_bytes'] / (1 << 20):,.0f} MiB (last round only)",
        "- the non-LLM line is the old `GET /sse` path (query-string instructions), for"
        " continuity with bench/results/proxy.md; the routers do not route it",
        "",
        "Rounds (the order the targets were measured in, and the machine before each):",
        "",
        *[f"{i + 1}. {' → '.join(r['order'])}; {r['quiet']}" for i, r in enumerate(rounds)],
        "",
    ]
    if raw.get("notes"):
        out += ["Notes:", "", *[f"- {note}" for note in raw["notes"]], ""]
    figures = [key_figures(r["data"]) for r in rounds]
    out += ["## Headline figures, every round", "",
            "Ratios are within a round; ↓ lower is better, ↑ higher is better. *Added*"
            " figures subtract direct access (client → backend) measured in the same round.",
            "", *ratio_table(figures, targets), ""]
    if any("paced" in r["data"] for r in rounds):
        out += ["## Added chunk latency by phase (ms, p50 / p99)", "",
                "*starting*: until every stream has had its first event, and two intervals"
                " more; *ending*: from the first stream's end on, while the others finish one"
                " by one; *steady*: between.", "", *phase_table(rounds, targets), ""]
    for index, entry in enumerate(rounds):
        out += [f"## Every figure, round {index + 1}", "",
                *full_table({"data": entry["data"], "targets": targets},
                            ratios=ratio_columns(targets)), ""]
    out += [
        "Definitions: *proxy CPU* is utime+stime from `/proc/PID/stat` of the proxy's"
        " processes (nginx: master + worker; the routers: their one process, all threads),"
        " a delta over the client's run, divided by the chunks (every SSE event, usage and"
        " `[DONE]` included) or requests the client received. *Chunk latency* is receive"
        " time in the client minus the send time the backend wrote into the event (same"
        " clock); *added* subtracts direct's figure. *TTFB* is from `connect` (new"
        " connection) or from sending the request (keep-alive) to the first response byte."
        " *RSS per held stream* is (RSS with N streams held − idle RSS) / N, on a proxy"
        " started fresh for each level.",
        "",
    ]
    return "\n".join(out)


def plot(raw: dict[str, Any], path: Path) -> Path | None:
    """``chat.png``: headline figures (mean over rounds) and 256-stream latency over time;
    None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = [t for t in raw["targets"] if t != "direct"]
    figures = [key_figures(r["data"]) for r in raw["rounds"]]
    labels = [f.label for f in figures[-1]] if figures else []
    fig, axes = plt.subplots(2, 1, figsize=(12, 9))
    width = 0.8 / max(1, len(targets))
    for i, target in enumerate(targets):
        means = []
        for label in labels:
            values = [f.values.get(target, math.nan) for fs in figures for f in fs
                      if f.label == label]
            numbers = [v for v in values if not math.isnan(v)]
            reference = [f.values.get("vllm-router", math.nan) for fs in figures for f in fs
                         if f.label == label]
            ref = [v for v in reference if not math.isnan(v) and v > 0]
            mean = sum(numbers) / len(numbers) if numbers else math.nan
            means.append(mean / (sum(ref) / len(ref)) if ref and numbers else math.nan)
        xs = [x + (i - (len(targets) - 1) / 2) * width for x in range(len(labels))]
        # a ratio of an "added" figure at or below zero means nothing: left out, not drawn
        axes[0].bar(xs, [m if m > 0 else math.nan for m in means], width, label=target)
    axes[0].axhline(1.0, color="black", linewidth=0.8)
    axes[0].set_yscale("log")
    axes[0].set_xticks(range(len(labels)), [lb.rstrip(" ↑↓") for lb in labels],
                       rotation=30, ha="right", fontsize=7)
    axes[0].set_ylabel("÷ vllm-router (same round)")
    axes[0].set_title("Headline figures ÷ vllm-router's (mean over rounds; ↑-figures: higher"
                      " is better)", fontsize=10)
    axes[0].legend(fontsize=8)
    last = raw["rounds"][-1]["data"].get("paced", {}) if raw["rounds"] else {}
    level = max(last, key=int) if last else None
    if level is not None:
        for target, row in last[level].items():
            line = row.get("timeline", [])
            axes[1].plot([p["t_s"] for p in line], [p["p99_us"] / 1000 for p in line],
                         label=target)
        axes[1].set_yscale("log")
        axes[1].set_xlabel("s since the streams started")
        axes[1].set_ylabel("chunk latency p99, ms")
        axes[1].set_title(f"{level} paced streams, last round: chunk latency over time",
                          fontsize=10)
        axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def save(raw: dict[str, Any], report: str, directory: Path, stem: str = "chat") -> list[Path]:
    """Write ``STEM.md``, ``STEM.json`` and (with matplotlib) ``STEM.png`` into ``directory``."""
    md, js = directory / f"{stem}.md", directory / f"{stem}.json"
    md.parent.mkdir(parents=True, exist_ok=True)  # a --save-as stem may name a directory
    md.write_text(report)
    js.write_text(json.dumps(raw, indent=1, default=str))
    png = plot(raw, directory / f"{stem}.png")
    return [md, js, *([png] if png else [])]
