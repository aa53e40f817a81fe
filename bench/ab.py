"""
txlb at another git revision (A) against this tree (B), side by side in one run.

Why: comparing two revisions with two separate ``python -m bench relay`` runs mixes the change with
whatever the machine was doing in between (another job, CPU steal, thermal state), which on
a shared machine is often as large as the change.  Here both are measured in the same run,
in alternating rounds (A, B, then B, A, ...), with the same backend, clients and pinning, so
drift hits both alike, and the answer is the median of the per-round B/A ratios.

How: ``git archive`` exports ``--base REV``'s ``txlb/`` and ``twisted/`` to a temp directory
(removed afterwards), and this tree's ``txlb/`` and ``twisted/plugins/`` are copied beside it
at the start, so edits or commits made in the tree during the run cannot reach B's later
rounds.  The backend (:mod:`bench.backend`) is started once, pinned like the main
harness's.  Each round starts ``twistd -n llmlb`` from each tree in turn
(``PYTHONPATH`` = that tree alone, so its own ``llmlb`` and reactor plugins are found; the
harness's options; ``--txlb-reactor NAME`` for both), pinned to the proxy core, warms it up,
runs the harness's ``paced`` (64 and 256 SSE streams: proxy CPU µs per chunk from /proc,
chunk latency p50/p99) and ``rps`` (small JSON requests, wrk if present: requests per proxy
CPU-second) scenarios against it, and stops it.  The reactor class each process logs is
checked against the reactor module its tree provides.

    python -m bench.ab --base 5fd6dc7 --txlb-reactor txlb-epoll --save --name NAME

prints a Markdown table; ``--save`` writes it to ``bench/results/ab-NAME.md``.
"""

from __future__ import annotations

import argparse
import datetime
import io
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bench.harness import (
    HOST,
    ROOT,
    Children,
    log,
    nofile_limit,
    start_backend,
    start_txlb,
    stop_on_signals,
    wait_for,
)
from bench.provenance import RESULTS, cpu_model, cpu_steal, loadavg, revision
from bench.relay.scenarios import FULL, Bench, scenario_paced, scenario_rps, warm_up

#: (label, format) of each figure, in table order; "↓"/"↑": lower/higher is better.
METRICS = (
    ("64 streams: proxy CPU µs/chunk ↓", "{:.1f}"),
    ("64 streams: chunk p50 ms ↓", "{:.2f}"),
    ("64 streams: chunk p99 ms ↓", "{:.2f}"),
    ("256 streams: proxy CPU µs/chunk ↓", "{:.1f}"),
    ("256 streams: chunk p50 ms ↓", "{:.2f}"),
    ("256 streams: chunk p99 ms ↓", "{:.2f}"),
    ("small requests: req/s ↑", "{:,.0f}"),
    ("small requests: req per proxy CPU-second ↑", "{:,.0f}"),
)
Figures = dict[str, float]


def git(*args: str) -> str:
    """``git -C ROOT ARGS``' stdout, stripped."""
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def export(rev: str, dest: Path) -> str:
    """``rev``'s ``txlb/`` and ``twisted/`` into ``dest``; its short commit and subject."""
    commit = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "txlb", "twisted"],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return git("log", "-1", "--format=%h (%s)", commit)


def snapshot(dest: Path) -> str:
    """This tree's ``txlb/`` and ``twisted/plugins/`` copied to ``dest``; its revision."""
    skip = shutil.ignore_patterns("__pycache__", "dropin.cache")
    for part in ("txlb", "twisted/plugins"):
        shutil.copytree(ROOT / part, dest / part, ignore=skip)
    return revision()


def module_file(tree: Path, module: str) -> str:
    """Where ``module`` is imported from with ``PYTHONPATH=tree`` (as txlb runs)."""
    return subprocess.run(
        [sys.executable, "-c", "import importlib, sys;"
         " print(importlib.import_module(sys.argv[1]).__file__)", module],
        capture_output=True, text=True, check=True, cwd=tempfile.gettempdir(),
        env=dict(os.environ, PYTHONPATH=str(tree))).stdout.strip()


def measure(bench: Bench, label: str, tree: Path, reactor: str | None) -> tuple[Figures, str]:
    """One txlb from ``tree``, freshly started: (its figures, the reactor class it logged)."""
    target = start_txlb(bench.children, bench.proxy_core, bench.backends, name=label,
                        reactor=reactor, source=tree)
    assert target.child is not None
    try:
        reactor_class = wait_for(target.child, r"reactor class: ([\w.]+)").group(1).rstrip(".")
        where = module_file(tree, reactor_class.rpartition(".")[0])
        if not Path(where).resolve().is_relative_to(tree.resolve()) and reactor:
            raise RuntimeError(f"{label}: {reactor_class} comes from {where}, not {tree}")
        bench.targets = [target]
        warm_up(bench, target)
        paced, rps = scenario_paced(bench), scenario_rps(bench)[label]
    finally:
        bench.children.stop(target.child)
    values = []
    errors = rps["errors"]
    for level in ("64", "256"):
        row = paced[level][label]
        values += [row["us_per_chunk"], row["p50_us"] / 1000, row["p99_us"] / 1000]
        errors += row["errors"]
    values += [rps["rate"], rps["per_cpu_second"]]
    if errors:
        bench.notes.append(f"{label}: {errors} client errors in one round")
    figures = dict(zip((name for name, _ in METRICS), values, strict=True))
    return figures, f"{reactor_class} ({where.replace(str(tree), label + ' tree')})"


def ratio(b: float, a: float) -> float:
    """B/A, NaN when A is 0 or missing."""
    return b / a if a and not math.isnan(a) else math.nan


def render(runs: dict[str, list[Figures]], info: dict[str, str], notes: Sequence[str]) -> str:
    """The Markdown report: run information, then one row per figure."""
    lines = ["# A/B: txlb at another revision (A) against this tree (B)", ""]
    lines += [f"- **{key}**: {value}" for key, value in info.items()]
    lines += ["", "Figures per round (r1 · r2 · ...); ratio B/A per round, then its median.", "",
              "| figure | A | B | B/A per round | median B/A |", "|---|---|---|---|---|"]
    for name, fmt in METRICS:
        a, b = ([run[name] for run in runs[key]] for key in ("A", "B"))
        ratios = [ratio(y, x) for x, y in zip(a, b, strict=True)]
        lines.append(
            f"| {name} | {' · '.join(fmt.format(x) for x in a)}"
            f" | {' · '.join(fmt.format(y) for y in b)}"
            f" | {' · '.join(f'{r:.2f}' for r in ratios)} | **{statistics.median(ratios):.2f}** |")
    if notes:
        lines += ["", *[f"- {note}" for note in notes]]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the options, export the base, run the rounds, print (and save) the table."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench.ab",
                                     description=(__doc__ or "").split("\n\n")[0].strip())
    parser.add_argument("--base", required=True, metavar="REV", help="revision A (git rev)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--seconds", type=float, default=FULL.paced_seconds,
                        help="seconds per paced level and of small requests (default 10)")
    parser.add_argument("--txlb-reactor", metavar="NAME", help="reactor for both (txlb-epoll)")
    parser.add_argument("--save", action="store_true", help="write bench/results/ab-NAME.md")
    parser.add_argument("--name", help="NAME for --save (default: the base revision)")
    args = parser.parse_args(argv)
    stop_on_signals()
    multi = (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None
    proxy_core, client_core = (0, 1) if multi else (None, None)
    config = replace(FULL, paced_seconds=args.seconds, rps_seconds=args.seconds)
    info = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench.ab", *argv]),
        "A": "",  # filled in once exported
        "B": "",
        "txlb reactor": args.txlb_reactor or "Twisted's default",
        "cpu": f"{cpu_model()}, {os.cpu_count()} CPUs",
        "pinning": ("txlb on CPU 0; backend, load generator and wrk on CPU 1 (taskset)"
                    if multi else "none (one CPU or no taskset)"),
        "rounds": f"{args.rounds}, order A,B then B,A alternately; each txlb freshly started"
                  f" and warmed up; {args.seconds:g} s per paced level (40 events/s per stream,"
                  f" 250-byte events) and {args.seconds:g} s of small requests"
                  f" ({'wrk' if shutil.which('wrk') else 'Python client'},"
                  f" {config.rps_connections} connections)",
        "load average at start": loadavg(),
    }
    runs: dict[str, list[Figures]] = {"A": [], "B": []}
    reactors: dict[str, set[str]] = {"A": set(), "B": set()}
    steal0, started = cpu_steal(), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="txlb-ab.") as tmp:
        trees = {"A": Path(tmp) / "A", "B": Path(tmp) / "B"}
        info["A"] = f"{export(args.base, trees['A'])}, exported with git archive"
        info["B"] = f"this tree, {snapshot(trees['B'])}, copied at the start"
        children = Children(Path(tmp))
        try:
            backend, ports = start_backend(children, client_core, 2)
            bench = Bench(children, Path(tmp), backend, ",".join(f"{HOST}:{p}" for p in ports),
                          [], proxy_core, client_core, config, nofile_limit())
            for round_ in range(args.rounds):
                for label in ("A", "B") if round_ % 2 == 0 else ("B", "A"):
                    log(f"-- round {round_ + 1}: {label}")
                    figures, reactor_class = measure(bench, label, trees[label],
                                                     args.txlb_reactor)
                    runs[label].append(figures)
                    reactors[label].add(reactor_class)
                    log(f"   reactor class {reactor_class}")
        finally:
            children.stop_all()
    steal1 = cpu_steal()
    total = steal1[1] - steal0[1]
    info["reactor class logged"] = "; ".join(
        f"{label}: {', '.join(sorted(seen))}" for label, seen in reactors.items())
    info["load average at end"] = loadavg()
    info["CPU steal during run"] = (f"{(steal1[0] - steal0[0]) / total * 100:.1f} %"
                                    if total else "?")
    info["wall"] = f"{time.monotonic() - started:.0f} s"
    report = render(runs, info, bench.notes)
    print()
    print(report)
    if args.save:
        name = args.name or re.sub(r"[^\w.-]", "_", args.base)
        path = RESULTS / f"ab-{name}.md"
        path.write_text(report)
        print(f"written: {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
