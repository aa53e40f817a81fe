"""
txlb against the balancers users would pick instead, on the path LLM clients use
(``python -m bench relay``).

Targets (``--targets`` picks some, e.g. ``--targets nginx,txlb,vllm-router``; direct always
runs, as every *added* figure subtracts it): **direct** (client -> backend), **nginx** (the
configuration ``python -m txlb.nginx --standalone`` generates, one worker, access log off),
**txlb** (``twistd -n llmlb`` from this source tree with its default command line: default
reactor, result log on; ``--txlb-args`` adds options), **vllm-router** and
**sglang-router** (the Rust routers from PyPI, installed on first use into
``bench/.venv-routers`` by :mod:`bench.routers`; ``round_robin``; ``RUST_LOG=warn``; worker
health probes every 300 s), and with ``--txlb-root PATH`` **txlb-b**, txlb run from another
checkout (an A/B of two revisions in one run).  The backend is :mod:`bench.backend`, a small
raw asyncio HTTP/1.1 server much cheaper per chunk than any proxy; the clients are
:mod:`bench.loadgen` (raw asyncio) and ``wrk``.  With two or more CPUs the proxy gets CPU 0
and the backend + clients CPU 1 (``taskset``), so proxy CPU time is the proxy's alone.

Every scenario sends ``POST /v1/chat/completions`` with a small JSON body; the backend takes
its instruction from the message content (:mod:`bench.chat`), as the routers pass nothing
else on.  Scenarios (``--only NAME`` runs one; repeat it for several):

``paced``      SSE streams of ~250-byte ``chat.completion.chunk`` events (one HTTP chunk
               each, then a usage event and ``data: [DONE]``) at 40 events/s per stream, at
               64 and 256 streams, the streams ending one by one over the last quarter of
               the run: proxy CPU µs per relayed chunk and added per-chunk latency, overall,
               by phase (starting, steady, ending) and over time.
``get-paced``  The same at 256 streams on the old non-LLM ``GET /sse`` path (continuity with
               ``bench/results/proxy.md``; not the routers, which route only OpenAI paths).
``bulk``       A few SSE streams written as fast as the path takes them: chunks/s.
``rps``        Small chat requests (``"stream": false``) with ``wrk -t1 -c32`` (a Lua script
               posts the body; the Python client if wrk is missing): requests per proxy
               CPU-second.
``ttfb``       Sequential single requests at idle: time to first byte, fresh connection and
               keep-alive; added = target - direct.
``hold``       RSS idle and per held stream (an event every 3 s) at 1,000 and 9,900
               streams, each level on a freshly started proxy (last round only).
``slow``       A 1 GiB stream read at 64 MiB/s through each proxy: peak RSS growth (last
               round only).

``--rounds N`` (default 2) runs every scenario on every target once per round, the targets
in a rotated order each round, after waiting (at most ``--quiet-wait`` s) for the load
average to fall under 0.7.  The Markdown report goes to stdout and ``bench/results/chat.md``
(raw figures in ``chat.json``, plots in ``chat.png`` when matplotlib is installed): the
headline figures of every round, their range, and txlb's ratios to vllm-router and to
nginx.  ``--quick`` is a ~2-minute smoke run (one round, shorter windows, smaller levels);
it writes nothing unless ``--save``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.chat_report import render, save
from bench.harness import HOST, NGINX, Children, log, nofile_limit, start_backend, stop_on_signals
from bench.provenance import (
    RESULTS,
    command_output,
    cpu_model,
    cpu_steal,
    loadavg,
    revision,
    twisted_version,
)
from bench.relay import targets as relay_targets
from bench.relay.scenarios import (
    FULL,
    LAST_ROUND_ONLY,
    QUICK,
    RUNNERS,
    SCENARIOS,
    Bench,
    Config,
    warm_up,
    warm_up_long,
)
from bench.relay.targets import (
    DEFAULT_TARGETS,
    NGINX_PATCHES,
    ROUTERS,
    TARGETS,
    chosen_targets,
    pypy_status,
    start_all,
)
from bench.rounds import QUIET_LOAD, rotated, wait_quiet
from bench.routers import router_version

#: ``--warm-up``: seconds of paced SSE and of small requests each proxy gets before the
#: scenarios (a JIT's warm-up; 0: only the short warm-up every proxy always gets).
WARM_SECONDS = 0.0


def system_info(args: argparse.Namespace, multi: bool, nofile: int,
                names: Sequence[str]) -> dict[str, Any]:
    """The report's header: the machine, its load, and every version measured."""
    info: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "uname -a": command_output(["uname", "-a"]),
        "nproc": command_output(["nproc"]),
        "cpu": cpu_model(),
        "python": f"{platform.python_version()} ({sys.executable}), Twisted {twisted_version()}",
        "nginx": command_output([NGINX, "-v"]).replace("nginx version: ", ""),
        "wrk": (command_output(["wrk", "--version"]).splitlines() or ["?"])[0]
        if shutil.which("wrk") else "not installed",
        "txlb": revision(),
        "txlb command": "twistd -n llmlb --listen tcp:0 --backends B1,B2 --admin none"
        " --log-file FILE --read-timeout 600 --health-interval 30"
        + (f" --reactor {relay_targets.TXLB_REACTOR}" if relay_targets.TXLB_REACTOR else "")
        + (f" {shlex.join(relay_targets.TXLB_ARGS)}" if relay_targets.TXLB_ARGS else ""),
    }
    if "txlb-b" in names and relay_targets.TXLB_ROOT is not None:
        info["txlb-b"] = f"{revision(relay_targets.TXLB_ROOT)} ({relay_targets.TXLB_ROOT})"
    for router in ROUTERS:
        if router in names:
            info[router] = (f"{router_version(router)} (PyPI), --policy"
                            f" {relay_targets.ROUTER_POLICY}, health probes every"
                            f" {relay_targets.ROUTER_HEALTH_INTERVAL:g} s, RUST_LOG=warn")
    if "txlb-pypy" in names:
        info["PyPy"] = pypy_status()
    info.update({
        "command": shlex.join(["python", "-m", "bench", "relay", *args.argv]),
        "pinning": ("proxy on CPU 0; backend, load generator and wrk on CPU 1 (taskset)"
                    if multi else "none (one CPU or no taskset)"),
        "RLIMIT_NOFILE": nofile,
        "load average at start": loadavg(),
    })
    return info


def run_round(bench: Bench, index: int, rounds: int, only: Sequence[str],
              quiet_wait: float) -> dict[str, Any]:
    """One round: wait for a quiet machine, then every scenario, targets in rotated order."""
    quiet = wait_quiet(quiet_wait)
    order = rotated(bench.proxies(), index)
    direct = [t for t in bench.targets if t.child is None]
    bench.targets = [*direct, *order]
    log(f"== round {index + 1}/{rounds}: {quiet.describe(QUIET_LOAD)};"
        f" order {' -> '.join(t.name for t in bench.targets)}")
    data: dict[str, Any] = {}
    for name in only:
        if name in LAST_ROUND_ONLY and index != rounds - 1:
            continue
        log(f"-- {name}")
        try:
            data[name] = RUNNERS[name](bench)
        except (RuntimeError, OSError, ValueError, KeyError) as exc:
            # one broken scenario should not cost the others; the report says so
            log(f"scenario {name} FAILED: {exc}")
            bench.notes.append(f"round {index + 1}: scenario `{name}` FAILED:"
                               f" {str(exc)[:300]}")
    return {"order": [t.name for t in bench.targets], "quiet": quiet.describe(QUIET_LOAD),
            "load": quiet.load, "waited_s": quiet.waited_s, "data": data}


def orchestrate(config: Config, only: Sequence[str], args: argparse.Namespace) -> dict[str, Any]:
    """Start backend and proxies, run the rounds, stop everything; the raw results."""
    multi = (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None
    proxy_core, client_core = (0, 1) if multi else (None, None)
    nofile = nofile_limit()
    names = chosen_targets(args.targets, args.pypy is not None, relay_targets.TXLB_ROOT is not None)
    info = system_info(args, multi, nofile, names)
    notes: list[str] = []
    rounds: list[dict[str, Any]] = []
    steal0 = cpu_steal()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="txlb-bench.") as tmp:
        children = Children(Path(tmp))
        try:
            backend, ports = start_backend(children, client_core, 2)
            backends = ",".join(f"{HOST}:{port}" for port in ports)
            targets = start_all(children, proxy_core, backends, Path(tmp), names, ports[0],
                                notes)
            bench = Bench(children, Path(tmp), backend, backends, targets, proxy_core,
                          client_core, config, nofile, notes=notes)
            log(f"backend ports {ports}; " + ", ".join(
                f"{t.name} :{t.port} pids {t.pids()}" for t in targets if t.child))
            for target in targets:
                if target.name.startswith("txlb") and target.child is not None:
                    logged = re.search(r"reactor class: ([\w.]+)", target.child.text())
                    info[f"{target.name} reactor"] = (logged.group(1).rstrip(".") if logged
                                                      else "? (not in its start-up log)")
            for target in targets:
                warm_up(bench, target)
            if WARM_SECONDS > 0:
                for target in bench.proxies():
                    log(f"warm-up {target.name}: {WARM_SECONDS:g} s paced + {WARM_SECONDS:g} s"
                        " small requests")
                    warm_up_long(bench, target, WARM_SECONDS)
            for index in range(config.rounds):
                rounds.append(run_round(bench, index, config.rounds, only, args.quiet_wait))
        finally:
            children.stop_all()
    steal1 = cpu_steal()
    total = steal1[1] - steal0[1]
    info["load average at end"] = loadavg()
    info["CPU steal during run"] = (f"{(steal1[0] - steal0[0]) / total * 100:.1f} %"
                                    if total else "?")
    info["wall"] = f"{time.monotonic() - started:.0f} s"
    ran = {t.name for t in targets}
    return {"info": info, "config": config.__dict__, "rounds": rounds, "notes": notes,
            "targets": [n for n in names if n in ran]}


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the options, run, print the report, save it (full runs, or ``--save``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench relay",
                                     description=(__doc__ or "").split("\n\n")[0].strip())
    parser.add_argument("--quick", action="store_true", help="~2-minute smoke run, one round")
    parser.add_argument("--only", action="append", choices=SCENARIOS, metavar="NAME",
                        help=f"run only this scenario (repeatable): {', '.join(SCENARIOS)}")
    parser.add_argument("--targets", metavar="A,B,...",
                        help=f"the targets to measure (direct always runs): {', '.join(TARGETS)}"
                             f" (default: {','.join(DEFAULT_TARGETS)})")
    parser.add_argument("--rounds", type=int, metavar="N",
                        help="rounds, targets in rotated order each (default 2; --quick 1)")
    parser.add_argument("--quiet-wait", type=float, metavar="SECONDS",
                        help=f"before each round, wait at most this long for the load average"
                             f" to fall under {QUIET_LOAD:g} (default 60; --quick 10)")
    parser.add_argument("--save", action="store_true",
                        help="write bench/results/ even with --quick or --only")
    parser.add_argument("--no-save", action="store_true", help="never write bench/results/")
    parser.add_argument("--txlb-args", default="", metavar="'ARGS'",
                        help="extra options for every txlb target, e.g. '--reactor txlb-epoll'"
                             " or '--log-file none'")
    parser.add_argument("--txlb-reactor", metavar="NAME",
                        help="run txlb under this reactor (e.g. txlb-epoll)")
    parser.add_argument("--txlb-root", type=Path, metavar="PATH",
                        help="add target txlb-b: txlb run from this other checkout (its"
                             " .venv's twistd if it has one), for an A/B in one run")
    parser.add_argument("--router-policy", default="round_robin", metavar="NAME",
                        help="the Rust routers' --policy (default round_robin)")
    parser.add_argument("--pypy", metavar="PATH",
                        help="add target txlb-pypy, run by this PyPy interpreter (with "
                             "Twisted & co.), e.g. a venv's bin/pypy3")
    parser.add_argument("--warm-up", type=float, default=0.0, metavar="SECONDS",
                        help="drive every proxy with paced SSE and small requests for this "
                             "long each before measuring (lets PyPy's JIT compile; default 0)")
    parser.add_argument("--note", action="append", default=[], metavar="TEXT",
                        help="a note for the report (repeatable)")
    parser.add_argument("--save-as", metavar="STEM",
                        help="save as bench/results/STEM.* (default chat)")
    args = parser.parse_args(argv)
    global WARM_SECONDS
    relay_targets.TXLB_REACTOR = args.txlb_reactor
    relay_targets.TXLB_ARGS = shlex.split(args.txlb_args)
    relay_targets.TXLB_ROOT = args.txlb_root.resolve() if args.txlb_root else None
    relay_targets.ROUTER_POLICY = args.router_policy
    relay_targets.PYPY = args.pypy
    WARM_SECONDS = args.warm_up
    args.argv = argv
    try:
        chosen_targets(args.targets, False, True)
    except ValueError as exc:
        parser.error(str(exc))
    only = [name for name in SCENARIOS if name in (args.only or SCENARIOS)]
    config = QUICK if args.quick else FULL
    if args.quiet_wait is None:
        args.quiet_wait = 10.0 if args.quick else 60.0
    if args.rounds is not None:
        if args.rounds < 1:
            parser.error("--rounds must be at least 1")
        config = replace(config, rounds=args.rounds)
    stop_on_signals()
    raw = orchestrate(config, only, args)
    raw["notes"] = [*args.note, *raw["notes"]]
    if WARM_SECONDS > 0:
        raw["info"]["warm-up"] = (f"{WARM_SECONDS:g} s of paced SSE (64 streams) and"
                                  f" {WARM_SECONDS:g} s of small requests per proxy")
    raw["nginx_patches"] = [why for _, _, why in NGINX_PATCHES]
    report = render(raw)
    print()
    print(report)
    full = not args.quick and not args.only
    if (full or args.save) and not args.no_save:
        written = save(raw, report, RESULTS, args.save_as or "chat")
        for path in written:
            print(f"written: {path}")
        if not any(path.suffix == ".png" for path in written):
            print("no plot: matplotlib is not installed in this environment")


if __name__ == "__main__":
    main()
