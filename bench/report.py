"""The Markdown report and the plots of ``python -m bench relay`` (from its raw results)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
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


def _goal(rows: list[str], name: str, txlb: Any, nginx: Any, r: float, target: str,
          met: bool | None, digits: int = 1) -> None:
    """One row of the goals table."""
    verdict = "–" if met is None else ("**yes**" if met else "**no**")
    rows.append(f"| {name} | {fmt(txlb, digits)} | {fmt(nginx, digits)} | {fmt(r, 2)} |"
                f" {target} | {verdict} |")


def goals(raw: dict[str, Any]) -> list[str]:
    """The issue's targets: txlb against nginx, each with its verdict."""
    data = raw["data"]
    rows = ["| goal | txlb | nginx | txlb/nginx | target | met |",
            "|---|---:|---:|---:|---|---|"]
    for level, per in data.get("paced", {}).items():
        t, n = per["txlb"]["us_per_chunk"], per["nginx"]["us_per_chunk"]
        r = ratio(t, n)
        _goal(rows, f"CPU µs per relayed chunk, {level} paced streams", t, n, r,
              "≤ 1.5× nginx", None if math.isnan(r) else r <= 1.5, 2)
    if "ttfb" in data:
        for mode, label in (("fresh", "fresh connection"), ("keepalive", "keep-alive")):
            added = _added(data["ttfb"][mode], "p50_us")
            t, n = added.get("txlb", math.nan), added.get("nginx", math.nan)
            r = ratio(t, n) if n > 0 else math.nan
            met = None if math.isnan(t) or math.isnan(n) else t <= 2 * max(n, 0.0)
            _goal(rows, f"added TTFB p50 at idle, µs ({label})", t, n, r, "≤ 2× nginx's",
                  met)
    if "rps" in data:
        per = data["rps"]
        t, n = per["txlb"]["per_cpu_second"], per["nginx"]["per_cpu_second"]
        r = ratio(t, n)
        _goal(rows, "small requests per proxy CPU-second (= req/s per core)", t, n, r,
              "≥ 0.35× nginx", None if math.isnan(r) else r >= 0.35, 0)
        t, n = per["txlb"]["rate"], per["nginx"]["rate"]
        r = ratio(t, n)
        _goal(rows, "small requests/s (wall clock, one core each)", t, n, r,
              "(≥ 0.35× nginx; nginx may be client-bound)",
              None if math.isnan(r) else r >= 0.35, 0)
    if "hold" in data:
        for level, per in data["hold"].items():
            t, n = per["txlb"]["per_stream_kb"], per["nginx"]["per_stream_kb"]
            r = ratio(t, n)
            _goal(rows, f"RSS KiB per held stream at {int(level):,}", t, n, r, "≤ nginx's",
                  None if math.isnan(r) else r <= 1.0)
        level = max(data["hold"], key=int)
        streams = int(level)
        row_t, row_n = data["hold"][level]["txlb"], data["hold"][level]["nginx"]

        def held(row: dict[str, Any]) -> str:
            bad = row["failed"] + row["refused"] + row["starved"]
            return f"{row['held']:,}/{streams:,}, {bad} errors"

        ok = row_t["held"] == streams and row_t["failed"] + row_t["refused"] == 0
        _goal(rows, f"{streams:,} concurrent streams held without errors", held(row_t),
              held(row_n), math.nan, "all held, no errors", ok)
    return rows


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


def render(raw: dict[str, Any]) -> str:
    """The whole Markdown report."""
    info, cfg = raw["info"], raw["config"]
    out = ["# Proxy overhead: direct vs nginx vs txlb", ""]
    out += [f"- {key}: `{value}`" for key, value in info.items()]
    out += [
        "- nginx: `python -m txlb.nginx --standalone` output, 1 worker; edited: "
        + "; ".join(raw.get("nginx_patches", [])),
        "- txlb: `twistd -n llmlb --admin none --log-file none --read-timeout 600"
        " --health-interval 30`, from the source tree",
        f"- workload: paced {cfg['paced_rate']:g} events/s per stream for"
        f" {cfg['paced_seconds']:g} s, 250-byte events, one chunk each; bulk"
        f" {cfg['bulk_streams']} streams × {cfg['bulk_seconds']:g} s; small JSON"
        f" {cfg['rps_connections']} connections × {cfg['rps_seconds']:g} s; TTFB"
        f" {cfg['ttfb_count']} sequential requests; held streams one event per"
        f" {cfg['hold_interval_ms'] / 1000:g} s; slow client {cfg['slow_bytes'] / MiB:,.0f} MiB"
        f" at {cfg['slow_rate'] / MiB:g} MiB/s",
        "- the machine is shared and noisy (CI and other benchmarks may run at the same time);"
        " single runs, no repetition: treat differences under ~10–20 % as noise",
        "",
    ]
    if raw.get("notes"):
        out += ["Notes:", "", *[f"- {note}" for note in raw["notes"]], ""]
    out += ["## The issue's targets", "", *goals(raw), "", "## Every figure", "",
            *full_table(raw), ""]
    out += [
        "Definitions: *proxy CPU* is utime+stime from `/proc/PID/stat` of the proxy's"
        " processes (nginx: master + worker), a delta over the client's run, divided by the"
        " chunks the client received. *Chunk latency* is receive time in the client minus"
        " the send time the backend wrote into the event (same clock); *added* subtracts"
        " direct's figure. *TTFB* is from `connect` (new connection) or from sending the"
        " request (keep-alive) to the first response byte, requests 2 ms apart; its proxy CPU"
        " per request comes from `/proc/PID/task/*/schedstat` (ns), as a few hundred idle"
        " requests are too few 10 ms ticks for `/proc/PID/stat` (on this VM a proxy woken"
        " from idle spends several times the CPU per request it spends under load)."
        " *RSS per held stream* is (RSS with N streams held − idle RSS) / N, VmRSS summed"
        " over the proxy's processes, on a proxy started fresh for each level. *Bulk* chunks"
        " are counted at the client. *Busy % of CPU n* is from `/proc/stat`: everything that"
        " ran there, ours or not (CPU 0 should be the proxy alone).",
        "",
    ]
    return "\n".join(out)


def plot(raw: dict[str, Any], directory: Path, stem: str = "proxy") -> list[Path]:
    """``proxy.png`` (the main figures) and ``proxy_slow.png`` (RSS under a slow client)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data, targets = raw["data"], raw["targets"]
    proxies = [t for t in targets if t != "direct"]
    colors = {"direct": "#888888", "nginx": "#2a9d8f", "txlb": "#e76f51",
              "txlb-pypy": "#f4a261"}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    axes = axes.ravel()

    def bars(ax: Any, title: str, groups: list[str], series: list[str],
             value: Callable[[str, str], float], ylabel: str) -> None:
        width = 0.8 / max(1, len(series))
        for i, name in enumerate(series):
            xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
            ys = [value(group, name) for group in groups]
            ax.bar(xs, [0 if math.isnan(y) else y for y in ys], width, label=name,
                   color=colors.get(name))
            for x, y in zip(xs, ys, strict=True):
                if not math.isnan(y):
                    label = f"{y:,.0f}" if abs(y) >= 100 else f"{y:.3g}"
                    ax.annotate(label, (x, y), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(groups)), groups)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)

    def empty(ax: Any, title: str) -> None:
        ax.set_title(title + " (not run)", fontsize=10)
        ax.axis("off")

    paced = data.get("paced", {})
    if paced:
        levels = list(paced)
        bars(axes[0], "Paced SSE: proxy CPU per relayed chunk",
             [f"{lv} streams" for lv in levels], proxies,
             lambda g, t: _num(paced[g.split()[0]][t]["us_per_chunk"]), "µs CPU / chunk")
        groups = [f"{lv} {q}" for lv in levels for q in ("p50", "p99")]

        def added(group: str, target: str) -> float:
            level, q = group.split()
            per = paced[level]
            return (_num(per[target][f"{q}_us"]) - _num(per["direct"][f"{q}_us"])) / 1000

        bars(axes[1], "Paced SSE: added chunk latency vs direct", groups, proxies, added,
             "ms")
    else:
        empty(axes[0], "Paced SSE CPU")
        empty(axes[1], "Paced SSE latency")
    if "bulk" in data:
        bars(axes[2], "Bulk SSE throughput", ["chunks/s"], targets,
             lambda g, t: _num(data["bulk"][t]["rate"]), "chunks/s")
    else:
        empty(axes[2], "Bulk SSE")
    if "rps" in data:
        bars(axes[3], "Small JSON requests (wrk)", ["req/s", "req per CPU-s"], targets,
             lambda g, t: _num(data["rps"][t]["rate" if g == "req/s" else "per_cpu_second"]),
             "requests")
    else:
        empty(axes[3], "Small requests")
    if "ttfb" in data:
        bars(axes[4], "TTFB p50 at idle", ["new connection", "keep-alive"], targets,
             lambda g, t: _num(data["ttfb"]["fresh" if g == "new connection" else "keepalive"]
                               [t]["p50_us"]), "µs")
    else:
        empty(axes[4], "TTFB")
    if "hold" in data:
        levels = list(data["hold"])
        bars(axes[5], "RSS per held stream", [f"{int(lv):,}" for lv in levels], proxies,
             lambda g, t: _num(data["hold"][g.replace(",", "")][t]["per_stream_kb"]), "KiB")
    else:
        empty(axes[5], "Held streams")
    fig.suptitle(f"txlb vs nginx vs direct — {raw['info']['date']}, {raw['info']['cpu']},"
                 f" nproc {raw['info']['nproc']}", fontsize=11)
    fig.tight_layout()
    paths = [directory / f"{stem}.png"]
    fig.savefig(paths[0], dpi=80)
    plt.close(fig)
    if "slow" in data:
        fig, ax = plt.subplots(figsize=(8, 4))
        for name, row in data["slow"].items():
            line = row["timeline"]
            ax.plot([t for t, _ in line], [(kb - row["base_kb"]) / 1024 for _, kb in line],
                    label=name, color=colors.get(name))
        ax.set_xlabel("s")
        ax.set_ylabel("RSS growth, MiB")
        ax.set_title(f"Slow client reading {raw['config']['slow_bytes'] / MiB:,.0f} MiB at"
                     f" {raw['config']['slow_rate'] / MiB:g} MiB/s: proxy RSS", fontsize=10)
        ax.legend()
        fig.tight_layout()
        paths.append(directory / f"{stem}_slow.png")
        fig.savefig(paths[-1], dpi=80)
        plt.close(fig)
    return paths


def save(raw: dict[str, Any], report: str, directory: Path,
         stem: str = "proxy") -> list[Path]:
    """Write ``STEM.md``, ``STEM.json`` and the plots into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    md, js = directory / f"{stem}.md", directory / f"{stem}.json"
    md.write_text(report)
    js.write_text(json.dumps(raw, indent=1, default=str))
    return [md, js, *plot(raw, directory, stem)]
