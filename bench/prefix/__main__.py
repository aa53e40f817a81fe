"""
``python -m bench.prefix``: cache-aware routing against least-conn, an oracle, and the
routers users would pick instead (vllm-router, sglang-router), on five seeded workloads.

Parts (any combination; each saves ``bench/results/cache-aware-PART.json``, and the page
``bench/results/cache-aware.md`` is rendered from every part saved there):

``--virtual``
    The virtual-clock model (:mod:`bench.prefix.virtual`): txlb's Router/Pool/policies
    over simulated engines with prefix caches, at ``--engines`` fleet sizes (8, 16, 64),
    ``--requests`` requests per run, plus 2 and 4 replicas with per-replica or shared
    indexes.  Deterministic: same arguments, same figures.  About 10 minutes on 2 cores.
``--process``
    Real processes (:mod:`bench.prefix.process_bench`): 4 ``twistd vllm-sim`` engines,
    each target in front (txlb per policy, vllm-router's four policies, sglang-router's
    cache_aware; the routers install into ``bench/.venv-routers`` on first use), a
    streaming client; plus the policies' own CPU per request.  About 15 minutes.
``--real``
    llama.cpp's ``llama-server`` (:mod:`bench.prefix.real_engine`) behind txlb's policies;
    skipped when the engine is not there.  About 2 minutes.
``--quick``
    A seconds-long smoke of the virtual model (4 engines, 300 requests, no replicas), to
    ``--out``.

``--scale-out``
    One index per replica against one for the fleet (:mod:`bench.prefix.scale_out`): at
    ``--replicas`` (2,4,8), each replica's own index, a copy refreshed from the others every
    ``--index-refresh`` seconds, and one exact index; to the ``prefix`` section of
    ``bench/results/scale-out.md``.

``--report`` alone re-renders the page from the saved parts.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.prefix import report
from bench.prefix.workloads import WORKLOADS, Options, generate

ROOT = Path(__file__).resolve().parent.parent.parent
RESULTS = ROOT / "bench" / "results"


def _info(command: str, **extra: Any) -> dict[str, Any]:
    try:
        revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                  capture_output=True, text=True).stdout.strip()
    except OSError:
        revision = ""
    return {"command": command, "date": datetime.datetime.now(datetime.UTC).isoformat(
        timespec="seconds"), "revision": revision,
        "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()), **extra}


def _txlb_policies(wanted: Sequence[str]) -> list[str]:
    from txlb._scheduling.policies.registry import policy_names

    known = set(policy_names())
    return [p for p in wanted if p in known]


def run_virtual(args: argparse.Namespace, command: str) -> None:
    from bench.prefix import virtual
    from bench.prefix.engine_model import EngineConfig

    policies = [p for p in virtual.POLICIES if (p in ("oracle", "prefix-hash")
                or p in _txlb_policies([p])) and (args.policies is None or p in args.policies)]
    config = EngineConfig()
    jobs: list[tuple[virtual.Scenario, str]] = []
    for engines in args.engines:
        for workload in args.workloads:
            options = Options(seed=args.seed, requests=args.requests, burst=8 * engines,
                              tenants=min(150, 6 * engines), active=8 * engines)
            scenario = virtual.Scenario(workload, engines=engines, requests=args.requests,
                                        load=args.load, seed=args.seed, config=config,
                                        options=options)
            jobs += [(scenario, policy) for policy in policies]
    if not args.quick:
        engines = args.engines[0]
        for workload in args.workloads:
            options = Options(seed=args.seed, requests=args.requests, burst=8 * engines,
                              tenants=min(150, 6 * engines), active=8 * engines)
            for replicas in (2, 4):
                for policy in [p for p in policies if p in ("least-conn", "cache-aware")]:
                    # independent replicas (own pools), then --workers (one pool's counts)
                    # with an index per worker and, for cache-aware, one shared index
                    variants = [(False, False), (True, False)]
                    if policy == "cache-aware":
                        variants.append((True, True))
                    for counts, shared in variants:
                        jobs.append((virtual.Scenario(
                            workload, engines=engines, requests=args.requests,
                            replicas=replicas, shared_index=shared, shared_counts=counts,
                            load=args.load, seed=args.seed, config=config,
                            options=options), policy))
    started = time.perf_counter()
    print(f"virtual: {len(jobs)} runs on {args.jobs} processes", file=sys.stderr)

    def progress(r: virtual.VirtualResult) -> None:
        print(f"  {r.workload:9s} {r.engines:3d}x{r.replicas}{'s' if r.shared_index else ' '}"
              f" {r.policy:12s} hit {r.hit_rate:.3f} p99 {r.ttft_p99:.3f}s "
              f"({r.wall_seconds:.1f}s)", file=sys.stderr)

    results = [dataclasses.asdict(r) for r in virtual.run_all(jobs, args.jobs, progress)]
    info = _info(command, requests=args.requests, seed=args.seed, load=args.load,
                 wall=time.perf_counter() - started,
                 engine=", ".join(f"{f.name} {getattr(config, f.name)}"
                                  for f in dataclasses.fields(config)))
    report.save_part(args.out, "virtual", info, _merged(
        args.out, "virtual", info, results, ("requests", "seed", "load"),
        ("workload", "policy", "engines", "replicas", "shared_index", "shared_counts")))


def _merged(out: Path, part: str, info: dict[str, Any], results: list[dict[str, Any]],
            same: Sequence[str], key: Sequence[str]) -> list[dict[str, Any]]:
    """
    ``results`` plus the saved runs of ``part`` they do not replace (by ``key``), when those
    were made with the same ``same`` settings (so one policy or target can be rerun alone);
    else ``results`` alone.
    """
    saved = report.load(out).get(part)
    if not saved or any(saved["info"].get(k) != info[k] for k in same):
        return results
    fresh = {tuple(r[k] for k in key) for r in results}
    kept = [r for r in saved["results"] if tuple(r.get(k) for k in key) not in fresh]
    return kept + results


def run_policy_cpu(args: argparse.Namespace, command: str) -> None:
    from bench.prefix.policy_cpu import measure

    rows = []
    for workload in args.workloads:
        requests = list(generate(workload, Options(seed=args.seed, requests=2000)))
        for policy in _txlb_policies(["least-conn", "cache-aware"]):
            rows.append({"workload": workload, **dataclasses.asdict(measure(policy, requests))})
    report.save_part(args.out, "policy_cpu", _info(command), rows)


def run_process(args: argparse.Namespace, command: str) -> None:
    from bench.harness import Children
    from bench.prefix.fleet import EngineShape, available_targets, simulator_options
    from bench.prefix.process_bench import run_one

    shape = EngineShape()
    supported = simulator_options()
    specs = available_targets(args.targets)
    results = []
    info = _info(command, requests=args.process_requests, concurrency=args.concurrency,
                 engines=(f"{shape.count} simulated engines, max_num_seqs "
                          f"{shape.max_num_seqs}, {shape.tokens_per_second:g} tokens/s, "
                          f"kv_cache_blocks {shape.kv_cache_blocks}, prefill "
                          f"{shape.prefill_rate:g} tokens/s"),
                 note=args.note)
    with tempfile.TemporaryDirectory(prefix="prefixbench-") as workdir:
        children = Children(Path(workdir))
        try:
            for workload in args.workloads:
                requests = list(generate(workload, Options(
                    seed=args.seed, requests=args.process_requests)))
                for spec in specs:
                    result = run_one(children, spec, workload, requests, shape, supported,
                                     args.concurrency)
                    print(f"  {workload:9s} {spec.name:28s} hit {result.hit_rate} p99 "
                          f"{result.ttft_p99} errors {result.errors}", file=sys.stderr)
                    results.append(dataclasses.asdict(result))
        finally:
            children.stop_all()
    report.save_part(args.out, "process", info, _merged(
        args.out, "process", info, results, ("requests", "concurrency", "engines"),
        ("workload", "target")))
    run_policy_cpu(args, command)


def run_real(args: argparse.Namespace, command: str) -> None:
    from bench.harness import Children
    from bench.prefix.real_engine import RealShape, run_all

    shape = RealShape()
    with tempfile.TemporaryDirectory(prefix="prefixbench-real-") as workdir:
        children = Children(Path(workdir))
        try:
            results = run_all(children, Path(workdir),
                              _txlb_policies(["least-conn", "cache-aware"]), shape)
        finally:
            children.stop_all()
    if results:
        report.save_part(args.out, "real", _info(command, engines=(
            f"{shape.engines} llama-servers, --parallel {shape.parallel}, -c "
            f"{shape.context}, --cache-ram 0, 1 thread each")),
            [dataclasses.asdict(r) for r in results])


def _numbers(kind: type, text: str) -> list[Any]:
    return [kind(x) for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.prefix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--virtual", action="store_true", help="run the virtual-clock model")
    p.add_argument("--process", action="store_true", help="run the process bench")
    p.add_argument("--real", action="store_true", help="run the llama-server bench")
    p.add_argument("--quick", action="store_true",
                   help="a seconds-long smoke of the virtual model")
    p.add_argument("--report", action="store_true", help="only re-render the page")
    p.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOADS),
                   help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all)")
    p.add_argument("--engines", type=lambda s: _numbers(int, s), default=[8, 16, 64],
                   help="virtual fleet sizes (default 8,16,64)")
    p.add_argument("--requests", type=int, default=20_000,
                   help="virtual requests per run (default %(default)s)")
    p.add_argument("--load", type=float, default=0.8,
                   help="virtual arrival rate, as a fraction of the fleet's prefill capacity "
                        "without cache hits (default %(default)s)")
    p.add_argument("--policies", type=lambda s: s.split(","), default=None,
                   help="virtual policies to run (default: all); runs saved earlier with "
                        "the same --requests, --seed and --load are kept for the others")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--jobs", type=int, default=2, help="virtual runs at once")
    p.add_argument("--targets", type=lambda s: s.split(","), default=None,
                   help="process targets by name or kind (default: all); runs saved "
                        "earlier with the same settings are kept for the others")
    p.add_argument("--process-requests", type=int, default=400,
                   help="process-bench requests per workload (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=32,
                   help="process-bench requests in flight (default %(default)s)")
    p.add_argument("--note", default="", help="a note on the machine, for the page")
    p.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    p.add_argument("--scale-out", action="store_true",
                   help="one index per replica against one for the fleet")
    p.add_argument("--replicas", type=_counts, default=[2, 4, 8],
                   help="--scale-out replica counts (default 2,4,8)")
    p.add_argument("--index-refresh", type=_delays, default=[0.01, 0.1, 1.0],
                   help="--scale-out: seconds between two refreshes of a replica's copy of "
                        "the others' sends (default 0.01,0.1,1)")
    return p


def _counts(text: str) -> list[int]:
    values = _numbers(int, text)
    if not values or any(not 2 <= n <= 64 for n in values):
        raise argparse.ArgumentTypeError(f"{text!r}: replica counts from 2 to 64")
    return values


def _delays(text: str) -> list[float]:
    values = _numbers(float, text)
    if not values or any(not 0 < x <= 3600 for x in values):
        raise argparse.ArgumentTypeError(f"{text!r}: seconds above 0, at most 3600")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    given = list(argv if argv is not None else sys.argv[1:])
    if "--note" in given[:-1]:  # the note is shown on its own
        at = given.index("--note")
        del given[at:at + 2]
    command = "python -m bench.prefix " + " ".join(given)
    if args.quick:
        args.engines, args.requests, args.virtual = [4], 300, True
    if args.scale_out:
        from bench.prefix import scale_out

        print(scale_out.main(args, command, args.out))
        if not (args.virtual or args.process or args.real or args.report):
            return 0
    if not (args.virtual or args.process or args.real or args.report):
        parser().print_help()
        return 2
    if args.virtual:
        run_virtual(args, command)
    if args.process:
        run_process(args, command)
    if args.real:
        run_real(args, command)
    page = report.write(args.out)
    print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
