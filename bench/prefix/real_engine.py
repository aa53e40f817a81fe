"""
The real-engine bench: txlb's policies in front of a fleet of llama.cpp ``llama-server``s.

llama-server keeps each slot's last prompt in its KV cache and reuses the longest common
prefix (``timings.cache_n`` of each answer; ``timings.prompt_n`` is what it evaluated), so
with ``--parallel 2`` and ``--cache-ram 0`` (no host-memory prompt cache) each engine holds
two prompts' prefixes.  The workloads have as many tenants (or live conversations) as the
fleet has slots, six: they all fit only if each engine is sent its own two, so prefixes
compete, as they do for a GPU's KV cache, and a router that spreads every prefix everywhere
thrashes the slots.  The model is the engine kit's "fast" random-weight GGUF
(``bench/make_model.py``: 1.8 MB, byte-level tokenizer, about one token per character),
one CPU thread per engine.

The engine is ``../shared/realengine/llama-server`` beside the project, or where
``TXLB_REALENGINE`` points (``bench/build_llama_server.sh`` builds one).  Figures per
policy and workload: the hit rate the answers report (sum of ``cache_n`` / sum of
``cache_n + prompt_n``), TTFT p50/p99 at the client, requests/s, errors.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.harness import ROOT, Child, Children, free_port, http_get
from bench.prefix.client import drive
from bench.prefix.fleet import TargetSpec, start_target
from bench.prefix.process_bench import quantile
from bench.prefix.workloads import Options, PrefixRequest, generate

MODEL_ARGS = ("--n-embd", "128", "--n-layer", "2", "--n-head", "4", "--n-head-kv", "2",
              "--n-ff", "352")


def engine_dir() -> Path:
    configured = os.environ.get("TXLB_REALENGINE")
    return Path(configured) if configured else ROOT.parent / "shared" / "realengine"


def engine_binary() -> Path | None:
    """The llama-server to use, or ``None`` when there is none."""
    path = engine_dir() / "llama-server"
    return path if os.access(path, os.X_OK) else None


@dataclass(frozen=True)
class RealShape:
    engines: int = 3
    parallel: int = 2
    context: int = 4096  # tokens, shared by the slots


@dataclass(frozen=True)
class RealWorkload:
    """A small workload for a CPU engine."""

    name: str
    options: Options
    concurrency: int


REAL_WORKLOADS = (
    RealWorkload("tenants", Options(requests=240, tenants=6, scale=0.08, model="fast"), 3),
    RealWorkload("multiturn", Options(requests=240, active=6, scale=0.08, model="fast"), 3),
)


@dataclass(frozen=True)
class RealResult:
    policy: str
    workload: str
    requests: int
    errors: int
    hit_rate: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    rps: float
    first_error: str = ""


def make_model(directory: Path) -> Path:
    path = directory / "fast.gguf"
    if not path.exists():
        subprocess.run([sys.executable, str(ROOT / "bench" / "make_model.py"), str(path),
                        *MODEL_ARGS], check=True, capture_output=True, timeout=120)
    return path


def start_engines(children: Children, binary: Path, model: Path,
                  shape: RealShape) -> tuple[list[Child], list[int]]:
    engines, ports = [], []
    for _ in range(shape.engines):
        port = free_port()
        ports.append(port)
        engines.append(children.spawn("llama-server", [
            str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--alias", "fast", "--parallel", str(shape.parallel), "-c", str(shape.context),
            "-t", "1", "-tb", "1", "--metrics", "--no-webui", "--cache-ram", "0"]))
    deadline = time.monotonic() + 60
    for engine, port in zip(engines, ports, strict=True):
        while True:
            if engine.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server on {port} did not start:\n"
                                   f"{engine.text()[-2000:]}")
            try:
                if http_get(port, "/health", timeout=1.0)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
    return engines, ports


def run_one(children: Children, binary: Path, model: Path, policy: str,
            workload: RealWorkload, requests: Sequence[PrefixRequest],
            shape: RealShape) -> RealResult:
    engines, ports = start_engines(children, binary, model, shape)
    try:
        target = start_target(children, TargetSpec(f"txlb {policy}", "txlb", policy),
                              [f"http://127.0.0.1:{p}" for p in ports])
        try:
            run = asyncio.run(drive(target.port, requests, workload.concurrency))
        finally:
            if target.child is not None:
                children.stop(target.child)
    finally:
        for engine in engines:
            children.stop(engine)
    ok = [a for a in run.answers if not a.error]
    known = [a for a in ok if a.prompt_tokens and a.cached_tokens is not None]
    prompt = sum(a.prompt_tokens or 0 for a in known)
    ttfts = [a.ttft for a in ok if a.ttft is not None]
    errors = [a for a in run.answers if a.error]
    return RealResult(
        policy=policy, workload=workload.name, requests=len(run.answers),
        errors=len(errors),
        hit_rate=sum(a.cached_tokens or 0 for a in known) / prompt if prompt else None,
        ttft_p50=quantile(ttfts, 0.5), ttft_p99=quantile(ttfts, 0.99),
        rps=len(ok) / run.wall if run.wall else 0.0,
        first_error=errors[0].error if errors else "")


def run_all(children: Children, workdir: Path, policies: Sequence[str],
            shape: RealShape = RealShape(),
            workloads: Sequence[RealWorkload] = REAL_WORKLOADS) -> list[RealResult]:
    """Every policy on every workload; empty (and says why) without the engine."""
    binary = engine_binary()
    if binary is None:
        print(f"real engine: no llama-server in {engine_dir()}; skipped", file=sys.stderr)
        return []
    model = make_model(workdir)
    results = []
    for workload in workloads:
        requests = list(generate(workload.name, workload.options))
        for policy in policies:
            result = run_one(children, binary, model, policy, workload, requests, shape)
            print(f"real {workload.name} {policy}: hit {result.hit_rate} "
                  f"p50 {result.ttft_p50} errors {result.errors}", file=sys.stderr)
            results.append(result)
    return results
