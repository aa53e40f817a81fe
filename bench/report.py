"""
The every-figure table of ``python -m bench relay`` (:func:`full_table`: one row per figure,
one column per target, ratio columns) and the number formatting its report shares
(:mod:`bench.chat_report`).
"""

from __future__ import annotations

import math
from typing import Any

MiB = 1 << 20
CORES = "busy % of CPU 0 / CPU 1, whole machine"
Row = tuple[str, dict[str, Any]]  # (label, value per target)


def _num(value: Any) -> float:
    """``value`` as a float, NaN if it is not a number."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        return math.nan
    return out


def fmt(value: Any, digits: int = 1) -> str:
    """A number with ``digits`` decimals and thousands separators; text as is; NaN as a dash."""
    if isinstance(value, str):
        return value
    number = _num(value)
    if math.isnan(number):
        return "–"
    return f"{number:,.{digits}f}"


def ratio(a: Any, b: Any) -> float:
    """``a / b``; NaN unless both are numbers and ``b`` is positive (an "added" figure at or
    below zero has no meaningful ratio)."""
    a, b = _num(a), _num(b)
    if math.isnan(a) or math.isnan(b) or b <= 0:
        return math.nan
    return a / b


class Table:
    """Rows of one figure per target, with ratio columns (txlb/nginx unless told others)."""

    def __init__(self, targets: list[str],
                 ratios: list[tuple[str, str]] | None = None) -> None:
        self.targets = targets
        #: (subject, reference) of each ratio column: by default txlb, and txlb-pypy when it
        #: ran, to nginx
        self.ratios = ratios if ratios is not None else [
            (t, "nginx") for t in ([t for t in ("txlb", "txlb-pypy") if t in targets]
                                   or ["txlb"])]
        self.lines = [
            "| scenario | figure | " + " | ".join(targets) + " | "
            + " | ".join(f"{s}/{r}" for s, r in self.ratios) + " |",
            "|---|---|" + "---:|" * (len(targets) + len(self.ratios)),
        ]

    def add(self, section: str, label: str, values: dict[str, Any], digits: int = 1,
            with_ratio: bool = True) -> None:
        """One row: a figure per target and each ratio column's quotient."""
        cells = [fmt(values.get(t, math.nan), digits) for t in self.targets]
        for subject, reference in self.ratios:
            r = (ratio(values.get(subject), values.get(reference)) if with_ratio
                 else math.nan)
            cells.append(fmt(r, 2))
        self.lines.append(f"| {section} | {label} | " + " | ".join(cells) + " |")


def _per(data: dict[str, Any], key: str, scale: float = 1.0,
         proxy_only: bool = False) -> dict[str, Any]:
    """``row[key] * scale`` per target (direct left out with ``proxy_only``)."""
    return {t: _num(row.get(key)) * scale for t, row in data.items()
            if not (proxy_only and t == "direct")}


def _cores(data: dict[str, Any]) -> dict[str, str]:
    """Machine-wide busy % of each CPU during the run (ours and anybody else's work)."""
    return {t: " / ".join(fmt(x, 0) for x in row.get("core_busy_pct", []))
            for t, row in data.items()}


def _bound(data: dict[str, Any]) -> dict[str, str]:
    """What limited a throughput run: the proxy (its core busy) or the client side."""
    return {t: ("proxy" if t != "direct" and _num(row.get("proxy_cpu_pct")) >= 90
                else "client side") for t, row in data.items()}


def _added(data: dict[str, Any], key: str, scale: float = 1.0) -> dict[str, Any]:
    """``row[key]`` minus direct's, per proxy, times ``scale``."""
    direct = _num(data.get("direct", {}).get(key))
    return {t: (_num(row.get(key)) - direct) * scale for t, row in data.items()
            if t != "direct"}


def _phase_added(per: dict[str, Any], phase: str, key: str) -> dict[str, Any]:
    """A phase's latency figure (ms) minus direct's, per proxy (NaN where not measured)."""
    def value(row: dict[str, Any]) -> float:
        return _num(row.get("phases", {}).get(phase, {}).get(key)) / 1000

    direct = value(per.get("direct", {}))
    return {t: value(row) - direct for t, row in per.items() if t != "direct"}


def full_table(raw: dict[str, Any],
               ratios: list[tuple[str, str]] | None = None) -> list[str]:
    """Every figure for every target."""
    data, targets = raw["data"], raw["targets"]
    table = Table(targets, ratios)
    paced = [(f"paced SSE, {level} streams", per)
             for level, per in data.get("paced", {}).items()]
    paced += [(f"non-LLM GET paced SSE, {level} streams", per)
              for level, per in data.get("get-paced", {}).items()]
    for s, per in paced:
        table.add(s, "chunks received / expected",
                  {t: f"{r['events']:,}/{r['expected']:,}" for t, r in per.items()})
        table.add(s, "stream errors", _per(per, "errors"), 0)
        table.add(s, "proxy CPU µs per chunk", _per(per, "us_per_chunk", proxy_only=True), 2)
        table.add(s, "proxy CPU % of a core", _per(per, "proxy_cpu_pct", proxy_only=True))
        table.add(s, "chunk latency p50, ms", _per(per, "p50_us", 1e-3), 3)
        table.add(s, "chunk latency p99, ms", _per(per, "p99_us", 1e-3), 3)
        table.add(s, "added latency p50, ms", _added(per, "p50_us", 1e-3), 3)
        table.add(s, "added latency p99, ms", _added(per, "p99_us", 1e-3), 3)
        if any("phases" in row for row in per.values()):
            for phase in ("starting", "steady", "ending"):
                table.add(s, f"added latency p50 / p99, {phase}, ms", {
                    t: f"{fmt(_phase_added(per, phase, 'p50_us').get(t), 2)} /"
                       f" {fmt(_phase_added(per, phase, 'p99_us').get(t), 2)}"
                    for t in per if t != "direct"})
        table.add(s, "load generator CPU %", _per(per, "client_cpu_pct"), 0, False)
        table.add(s, "backend CPU %", _per(per, "backend_cpu_pct"), 0, False)
        table.add(s, CORES, _cores(per))
    if "bulk" in data:
        per, s = data["bulk"], "bulk SSE"
        table.add(s, "chunks/s", _per(per, "rate"), 0)
        table.add(s, "MB/s (wire)", {t: r["bytes"] / r["wall"] / 1e6 for t, r in per.items()})
        table.add(s, "proxy CPU µs per chunk", _per(per, "us_per_chunk", proxy_only=True), 3)
        table.add(s, "proxy CPU % of a core", _per(per, "proxy_cpu_pct", proxy_only=True))
        table.add(s, "load generator CPU %", _per(per, "client_cpu_pct"), 0, False)
        table.add(s, "backend CPU %", _per(per, "backend_cpu_pct"), 0, False)
        table.add(s, CORES, _cores(per))
        table.add(s, "stream errors", _per(per, "errors"), 0)
        table.add(s, "limited by (proxy: its CPU ≥ 90 %)", _bound(per))
    if "rps" in data:
        per = data["rps"]
        client = next(iter(per.values()))["client"]
        s = "small requests, " + ("wrk -t1 -c32" if client == "wrk"
                                  else "Python client, 32 conns")
        table.add(s, "requests/s", _per(per, "rate"), 0)
        table.add(s, "latency p50, µs", _per(per, "p50_us"), 0)
        table.add(s, "latency p99, µs", _per(per, "p99_us"), 0)
        table.add(s, "proxy CPU % of a core", _per(per, "proxy_cpu_pct", proxy_only=True))
        table.add(s, "requests per proxy CPU-second", _per(per, "per_cpu_second"), 0)
        table.add(s, "proxy CPU µs per request", _per(per, "us_per_request", proxy_only=True), 1)
        table.add(s, f"{client} CPU %", _per(per, "client_cpu_pct"), 0, False)
        table.add(s, "backend CPU %", _per(per, "backend_cpu_pct"), 0, False)
        table.add(s, CORES, _cores(per))
        table.add(s, "errors", _per(per, "errors"), 0)
        table.add(s, "limited by (proxy: its CPU ≥ 90 %)", _bound(per))
    if "ttfb" in data:
        for mode, label in (("fresh", "new connection each"), ("keepalive", "keep-alive")):
            per, s = data["ttfb"][mode], f"TTFB at idle, {label}"
            table.add(s, "p50, µs", _per(per, "p50_us"), 0)
            table.add(s, "p99, µs", _per(per, "p99_us"), 0)
            table.add(s, "added p50 vs direct, µs", _added(per, "p50_us"), 0)
            table.add(s, "proxy CPU µs per request (schedstat)",
                      _per(per, "us_per_request", proxy_only=True), 0)
            table.add(s, "errors", _per(per, "errors"), 0)
    for level, per in data.get("hold", {}).items():
        s, n = f"held streams, {int(level):,}", int(level)
        proxies = {t: r for t, r in per.items() if t != "direct"}
        table.add(s, "idle RSS, MiB (fresh proxy, warmed up)",
                  _per(proxies, "idle_kb", 1 / 1024), 1)
        table.add(s, "RSS while held, MiB", _per(proxies, "held_kb", 1 / 1024), 1)
        table.add(s, "RSS per held stream, KiB", _per(proxies, "per_stream_kb"), 1)
        table.add(s, "streams held (2+ events, open)",
                  {t: f"{r['held']:,}/{n:,}" for t, r in per.items()})
        table.add(s, "failed / refused",
                  {t: f"{r['failed']} / {r['refused']}" for t, r in per.items()})
        table.add(s, "ramp-up, s", _per(per, "ramp_s"), 1)
    if "slow" in data:
        per, s = data["slow"], "slow client, 1 stream"
        table.add(s, "transferred, MiB", _per(per, "bytes", 1 / MiB), 0)
        table.add(s, "complete", {t: "yes" if r["complete"] else f"no ({r['error']})"
                                  for t, r in per.items()})
        table.add(s, "read rate, MiB/s", {t: r["bytes"] / MiB / r["wall"] for t, r in per.items()})
        table.add(s, "RSS before, MiB", _per(per, "base_kb", 1 / 1024), 1)
        table.add(s, "peak RSS growth, MiB", _per(per, "growth_kb", 1 / 1024), 1)
    return table.lines
