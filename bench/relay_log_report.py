"""
The results page of :mod:`bench.relay_log` (``bench/results/relay_log.md``): one row per
run, the pooled ratio log on / log off, the in-process cross-check and the log-line check.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.provenance import command_output
from bench.relay_log_children import LoadStats


@dataclass
class Measurement:
    balancer: str
    round: int
    proxy_cpu: float
    sim_cpu: float
    load: LoadStats
    log_lines: int | None  # lines the log grew by, log-on only

    @property
    def us_per_event(self) -> float:
        return self.proxy_cpu / self.load.events * 1e6 if self.load.events else float("nan")

    @property
    def requests(self) -> int:
        return self.load.started


@dataclass
class LogCost:
    """In-process cost of the two per-request steps of the log, as a cross-check."""

    summarize_us: float  # parse the captured response into a Summary
    write_us: float  # format the line and write it to the file
    events: int  # SSE events in the response


def system_info() -> dict[str, str]:
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "uname -a": command_output(["uname", "-a"]),
        "nproc": command_output(["nproc"]),
        "python": f"{platform.python_version()} ({sys.executable})",
    }


def revision(source: Path) -> str:
    """`` at <commit>`` (``+ changes`` if the tree is dirty), or nothing outside git."""
    head = command_output(["git", "-C", str(source), "rev-parse", "--short", "HEAD"])
    if not re.fullmatch(r"[0-9a-f]+", head):
        return ""
    dirty = command_output(["git", "-C", str(source), "status", "--porcelain", "--", "txlb"])
    return f" at {head}" + (" + uncommitted changes to txlb/" if dirty else "")


def render(results: list[Measurement], cost: LogCost, sample: str, args: argparse.Namespace,
           info: dict[str, str], pinning: str) -> str:
    """The Markdown report: settings, one row per run, summary and log-line check."""
    out = [
        "# Result log cost on the relay path",
        "",
        *[f"- {key}: `{value}`" for key, value in info.items()],
        f"- command: `{' '.join(['python -m bench.relay_log', *args.argv])}`",
        f"- load: C={args.concurrency} streaming chat completions, X-Sim-Tokens: {args.tokens},"
        f" {args.duration:g} s per run + drain, {args.rounds} rounds each, alternating",
        f"- simulators: 4 backends in one process, {args.tokens_per_second:g} tokens/s per"
        f" stream, max-num-seqs {args.max_num_seqs}",
        f"- pinning: {pinning}",
        f"- balancer source: `{args.source}`{revision(args.source)}",
        "",
        "| run | log | proxy CPU s | events | CPU µs/event | requests | events/s"
        " | proxy CPU % | client-side CPU % | log lines |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in results:
        load = m.load
        client_cpu = (m.sim_cpu + load.cpu) / load.wall * 100
        out.append(
            f"| {m.round} | {m.balancer} | {m.proxy_cpu:.2f} | {load.events} |"
            f" {m.us_per_event:.1f} | {m.requests} ({load.completed} ok, {load.errors} err,"
            f" {load.aborted} aborted) | {load.events / load.wall:.0f} |"
            f" {m.proxy_cpu / load.wall * 100:.0f} | {client_cpu:.0f} |"
            f" {'-' if m.log_lines is None else m.log_lines} |"
        )
    by = {label: [m for m in results if m.balancer == label] for label in ("on", "off")}
    per_event = {label: [m.us_per_event for m in ms] for label, ms in by.items()}
    pooled = {
        label: sum(m.proxy_cpu for m in ms) / sum(m.load.events for m in ms) * 1e6
        for label, ms in by.items()
    }
    ratio = pooled["on"] / pooled["off"]
    spread = {
        label: (max(v) - min(v)) / statistics.mean(v) * 100 for label, v in per_event.items()
    }
    pair_ratios = [on / off for on, off in zip(per_event["on"], per_event["off"], strict=False)]
    requests_on = sum(m.requests for m in by["on"])

    def expect(us_per_request: float) -> float:
        return 1 + us_per_request / cost.events / pooled["off"]

    lines_on = sum(m.log_lines or 0 for m in by["on"])
    out += [
        "",
        "| log | CPU µs/event (pooled) | per-run values | spread (max-min)/mean |",
        "|---|---:|---|---:|",
        *[
            f"| {label} | {pooled[label]:.1f} | {', '.join(f'{v:.1f}' for v in per_event[label])}"
            f" | {spread[label]:.1f} % |"
            for label in ("on", "off")
        ],
        "",
        f"**Ratio log on / log off, CPU µs per relayed event: {ratio:.3f}**"
        f" ({(ratio - 1) * 100:+.1f} %); per round: "
        + ", ".join(f"{r:.3f}" for r in pair_ratios)
        + f" (median {statistics.median(pair_ratios):.3f}).",
        "",
        f"Cross-check, in process, pinned like the balancers, on one such response"
        f" ({cost.events} events): `summarize` {cost.summarize_us:.0f} µs"
        f" ({cost.summarize_us / cost.events:.2f} µs/event), `ResultLog.write` (format + write"
        f" one line) {cost.write_us:.1f} µs ({cost.write_us / cost.events:.3f} µs/event)."
        f" Expected ratio if only format + write is log-only: {expect(cost.write_us):.3f};"
        f" if summarising is log-only too: {expect(cost.summarize_us + cost.write_us):.3f}.",
        "",
        f"Sample log line: `{sample[:200]}`",
        "",
        f"Log check (log-on balancer, measured runs): {requests_on} requests sent,"
        f" {lines_on} lines written"
        + (" -- one line per request." if requests_on == lines_on else " -- MISMATCH."),
        "",
    ]
    return "\n".join(out)
