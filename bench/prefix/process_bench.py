"""
The process bench: every target in front of the same fresh fleet of simulated engines, on
the same seeded workload.

For each (workload, target) pair: start ``shape.count`` engines (cold caches), start the
target in front of them, read every engine's ``/metrics``, drive the workload
(:func:`bench.prefix.client.drive`), read ``/metrics`` again, stop everything.  The figures:

* **hit rate** -- prefix-cache hits / queries over the run, summed over the engines
  (``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` deltas, in
  tokens, as vLLM counts them); empty when the engines do not export them;
* **TTFT p50/p99** -- at the client, to the first content event;
* **throughput** -- requests/s and output tokens/s over the run's wall time;
* **max in flight** -- the most requests one engine ran at once (the engine's
  ``txlb_sim_peak_requests_running`` gauge when it has one, else the largest
  ``vllm:num_requests_running`` seen by a sampler that reads every engine every 0.1 s);
* **proxy CPU per request** -- the target's processes' on-CPU time over the run
  (``/proc/PID/task/*/schedstat``) divided by the requests.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from bench.harness import Children, cpu_ns
from bench.prefix.client import Answer, drive
from bench.prefix.fleet import (
    HITS,
    PEAK,
    QUERIES,
    RUNNING,
    EngineShape,
    Fleet,
    TargetSpec,
    scrape,
    start_target,
)
from bench.prefix.workloads import PrefixRequest


@dataclass(frozen=True)
class ProcessResult:
    target: str
    workload: str
    requests: int
    errors: int
    hit_rate: float | None  # from the engines' /metrics
    answer_hit_rate: float | None  # cached / prompt tokens the answers reported
    ttft_p50: float | None
    ttft_p99: float | None
    rps: float
    output_tps: float
    max_in_flight: int | None
    proxy_cpu_us: float  # per request
    wall: float
    first_error: str = ""


def quantile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile (``q`` in 0..1); ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


class _RunningSampler(threading.Thread):
    """Reads every engine's running count every ``interval`` seconds; keeps the maximum."""

    def __init__(self, ports: Sequence[int], interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.ports = list(ports)
        self.interval = interval
        self.peak = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            for port in self.ports:
                running = scrape(port).get(RUNNING)
                if running is not None:
                    self.peak = max(self.peak, int(running))

    def stop(self) -> int:
        self.stopped.set()
        self.join(5)
        return self.peak


def _hit_rate(before: list[dict[str, float]], after: list[dict[str, float]]) -> float | None:
    if not all(QUERIES in m and HITS in m for m in after):
        return None
    queries = sum(a[QUERIES] - b.get(QUERIES, 0.0) for a, b in zip(after, before, strict=True))
    hits = sum(a[HITS] - b.get(HITS, 0.0) for a, b in zip(after, before, strict=True))
    return hits / queries if queries > 0 else None


def _answer_hit_rate(answers: Sequence[Answer]) -> float | None:
    known = [a for a in answers if a.prompt_tokens and a.cached_tokens is not None]
    if not known:
        return None
    prompt = sum(a.prompt_tokens or 0 for a in known)
    return sum(a.cached_tokens or 0 for a in known) / prompt if prompt else None


def run_one(children: Children, spec: TargetSpec, workload: str,
            requests: Sequence[PrefixRequest], shape: EngineShape,
            supported: frozenset[str], concurrency: int) -> ProcessResult:
    """One target on one workload, on a fresh fleet (see the module docstring)."""
    fleet = Fleet(children, shape).start(supported)
    try:
        target = start_target(children, spec, fleet.urls())
        try:
            before = [scrape(port) for port in fleet.ports]
            sampler = _RunningSampler(fleet.ports)
            sampler.start()
            cpu_before = cpu_ns(target.pids())
            run = asyncio.run(drive(target.port, requests, concurrency))
            cpu = cpu_ns(target.pids()) - cpu_before
            sampled_peak = sampler.stop()
            time.sleep(0.2)  # let the engines count the last requests
            after = [scrape(port) for port in fleet.ports]
        finally:
            if target.child is not None:
                children.stop(target.child)
    finally:
        fleet.stop()
    ok = [a for a in run.answers if not a.error]
    ttfts = [a.ttft for a in ok if a.ttft is not None]
    peaks = [m[PEAK] for m in after if PEAK in m]
    errors = [a for a in run.answers if a.error]
    return ProcessResult(
        target=spec.name, workload=workload, requests=len(run.answers), errors=len(errors),
        hit_rate=_hit_rate(before, after), answer_hit_rate=_answer_hit_rate(ok),
        ttft_p50=quantile(ttfts, 0.5), ttft_p99=quantile(ttfts, 0.99),
        rps=len(ok) / run.wall if run.wall else 0.0,
        output_tps=sum(a.output_tokens for a in ok) / run.wall if run.wall else 0.0,
        max_in_flight=int(max(peaks)) if peaks else (sampled_peak or None),
        proxy_cpu_us=cpu / 1000 / max(1, len(run.answers)), wall=run.wall,
        first_error=errors[0].error if errors else "",
    )
