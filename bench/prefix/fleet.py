"""
The processes of the prefix bench: simulated engines and the targets in front of them.

Engines are ``twistd -n vllm-sim`` processes (one per port, as separate as real GPU
servers); targets are txlb (``twistd -n llmlb --policy P``), ``vllm-router`` and
``sglang-router`` (from :mod:`bench.routers`' own venv).  Everything is started with
:class:`bench.harness.Children` (own process group, stopped group by group) on loopback
ports, and what the bench reads of an engine comes from its ``/metrics``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.harness import (
    HOST,
    TWISTD,
    Child,
    Children,
    Target,
    free_port,
    http_get,
    wait_for,
)
from bench.routers import ROUTER_ENV, router_argv

#: Names on an engine's /metrics the bench reads (vLLM's, which the simulator speaks).
QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
RUNNING = "vllm:num_requests_running"
PEAK = "txlb_sim_peak_requests_running"


@dataclass(frozen=True)
class EngineShape:
    """How every simulated engine of the fleet is configured."""

    count: int = 4
    max_num_seqs: int = 16
    tokens_per_second: float = 50.0
    ttft: float = 0.02
    kv_cache_blocks: int = 2048  # x 16 tokens = 32,768 tokens of prefix cache
    prefill_rate: float = 20000.0  # prompt tokens/s
    batch_slowdown: float = 0.3
    max_model_len: int = 65536

    def argv(self, port: int, supported: frozenset[str]) -> list[str]:
        argv = [TWISTD, "-n", "--pidfile=", "vllm-sim", "--port", str(port),
                "--max-num-seqs", str(self.max_num_seqs),
                "--tokens-per-second", str(self.tokens_per_second),
                "--ttft", str(self.ttft), "--max-model-len", str(self.max_model_len)]
        if "kv-cache-blocks" in supported:
            argv += ["--kv-cache-blocks", str(self.kv_cache_blocks)]
        if "prefill-rate" in supported:
            argv += ["--prefill-rate", str(self.prefill_rate)]
        if "batch-slowdown" in supported:
            argv += ["--batch-slowdown", str(self.batch_slowdown)]
        return argv


def simulator_options() -> frozenset[str]:
    """The long options this checkout's ``twistd vllm-sim`` takes (the cache ones are new)."""
    from bench.harness import ROOT

    out = subprocess.run([TWISTD, "vllm-sim", "--help"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT).stdout
    return frozenset(word[2:].split("=")[0] for word in out.split() if word.startswith("--"))


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: each metric name's value summed over its label sets."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            number = float(value)
        except ValueError:
            continue
        totals[name] = totals.get(name, 0.0) + number
    return totals


def scrape(port: int) -> dict[str, float]:
    """One engine's /metrics, parsed; empty when it does not answer."""
    try:
        status, raw = http_get(port, "/metrics", timeout=2.0)
    except OSError:
        return {}
    if status != 200:
        return {}
    return parse_metrics(raw.partition(b"\r\n\r\n")[2].decode("utf-8", "replace"))


@dataclass
class Fleet:
    """``shape.count`` simulated engines, started fresh (cold caches)."""

    children: Children
    shape: EngineShape
    ports: list[int] = field(default_factory=list)
    engines: list[Child] = field(default_factory=list)

    def start(self, supported: frozenset[str]) -> Fleet:
        for _ in range(self.shape.count):
            port = free_port()
            self.ports.append(port)
            self.engines.append(self.children.spawn("engine", self.shape.argv(port, supported)))
        for engine in self.engines:
            wait_for(engine, r"starting on (\d+)")
        return self

    def stop(self) -> None:
        for engine in self.engines:
            self.children.stop(engine)

    def urls(self) -> list[str]:
        return [f"http://{HOST}:{port}" for port in self.ports]

    def pids(self) -> list[int]:
        return [engine.process.pid for engine in self.engines]


def _wait_answering(child: Child, port: int, path: str, timeout: float = 60.0) -> None:
    """Until ``GET path`` on ``port`` answers 200 (the target reaches an engine)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if child.process.poll() is not None:
            break
        try:
            status, _ = http_get(port, path, timeout=2.0)
            if status == 200:
                return
            last = status
        except OSError as error:
            last = error
        time.sleep(0.2)
    raise RuntimeError(f"{child.name} not ready on {port} ({last}):\n{child.text()[-2000:]}")


@dataclass(frozen=True)
class TargetSpec:
    """One thing clients send the workload to: a router and its policy."""

    name: str  # as the tables show it, e.g. "txlb cache-aware"
    kind: str  # "txlb", "vllm-router", "sglang-router"
    policy: str

    @property
    def is_txlb(self) -> bool:
        return self.kind == "txlb"


TXLB_POLICIES = ("least-conn", "cache-aware")
TARGETS: tuple[TargetSpec, ...] = (
    *(TargetSpec(f"txlb {p}", "txlb", p) for p in TXLB_POLICIES),
    *(TargetSpec(f"vllm-router {p}", "vllm-router", p)
      for p in ("cache_aware", "power_of_two", "consistent_hash", "round_robin")),
    TargetSpec("sglang-router cache_aware", "sglang-router", "cache_aware"),
)


def start_target(children: Children, spec: TargetSpec, urls: Sequence[str]) -> Target:
    """Start ``spec`` in front of the engines at ``urls``; wait until it answers ``/v1/models``."""
    port = free_port()
    if spec.kind == "txlb":
        child = children.spawn(spec.name.replace(" ", "-"), [
            TWISTD, "-n", "--pidfile=", "llmlb", "--listen", f"tcp:{port}:interface={HOST}",
            "--backends", ",".join(urls), "--policy", spec.policy, "--admin", "none",
            "--log-file", "none", "--read-timeout", "600", "--health-interval", "2"])
    elif spec.kind in ("vllm-router", "sglang-router"):
        child = children.spawn(spec.name.replace(" ", "-"), router_argv(
            spec.kind, port, urls, spec.policy, free_port(), host=HOST), env=ROUTER_ENV)
    else:
        raise ValueError(f"unknown target kind {spec.kind!r}")
    _wait_answering(child, port, "/v1/models")
    return Target(spec.name, port, child)


def available_targets(names: Sequence[str] | None) -> list[TargetSpec]:
    """The targets named (all by default); txlb policies this checkout lacks are left out."""
    from txlb._scheduling.policies.registry import policy_names

    known = set(policy_names())
    chosen = [t for t in TARGETS if names is None or t.name in names or t.kind in names]
    missing = [t.name for t in chosen if t.is_txlb and t.policy not in known]
    if missing:
        print(f"leaving out {', '.join(missing)}: not in this checkout's --policy choices",
              file=sys.stderr)
    return [t for t in chosen if not (t.is_txlb and t.policy not in known)]
