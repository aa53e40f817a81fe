"""
Process plumbing for the proxy benchmark: children, pinning, limits, /proc readings, targets.

Every child runs in its own session (process group), with ``RLIMIT_NOFILE`` raised to the
hard limit, optionally pinned with ``taskset`` (which execs the command, so the pid is the
target's own).  :class:`Children` stops them all, group by group, SIGTERM then SIGKILL.
txlb is treated as a black box: it is started as ``twistd -n llmlb`` from the source tree,
and only its process is observed.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
TWISTD = str(Path(sys.executable).with_name("twistd"))
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024
STARTUP_TIMEOUT = 20.0


def nofile_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; return the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    for wanted in (max(target, 1 << 17), target):  # more only if privileged enough
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, wanted))
            return wanted
        except (ValueError, OSError):
            continue
    return soft


def log(message: str) -> None:
    """Progress line on stdout, flushed."""
    print(message, flush=True)


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM/SIGHUP: unwind through the ``finally`` that stops the children."""
    raise SystemExit(128 + signum)


def stop_on_signals() -> None:
    """Make SIGTERM and SIGHUP unwind the bench, so its ``finally`` stops every child."""
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)


def _child_setup() -> None:
    """``preexec_fn``: the highest ``RLIMIT_NOFILE`` allowed (inherited by nginx's worker)."""
    nofile_limit()


def pinned(core: int | None, argv: Sequence[str]) -> list[str]:
    """``argv`` under ``taskset -c core`` when a core is given."""
    return list(argv) if core is None else ["taskset", "-c", str(core), *argv]


@dataclass
class Child:
    """A started process and the file its output goes to."""

    name: str
    process: subprocess.Popen[bytes]
    output: Path

    def text(self) -> str:
        """Everything the child wrote so far."""
        return self.output.read_text(errors="replace")


@dataclass
class Children:
    """Every process the benchmark starts, each in its own process group."""

    workdir: Path
    started: list[Child] = field(default_factory=list)
    spawned: int = 0

    def spawn(self, name: str, argv: Sequence[str], source: Path = ROOT,
              **kwargs: Any) -> Child:
        """
        Start ``argv`` with ``source`` (a txlb checkout, this one by default) first on
        ``PYTHONPATH``, output to a file.
        """
        self.spawned += 1
        output = self.workdir / f"{name}.{self.spawned}.out"
        path = os.pathsep.join(dict.fromkeys([str(source), str(ROOT)]))
        env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")
        env.update(kwargs.pop("env", {}))
        with open(output, "wb") as out:
            process = subprocess.Popen(
                list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=kwargs.pop("cwd", self.workdir), env=env, start_new_session=True,
                preexec_fn=_child_setup, **kwargs,
            )
        child = Child(name, process, output)
        self.started.append(child)
        return child

    def stop(self, child: Child, timeout: float = 5.0) -> None:
        """SIGTERM the child's process group, then SIGKILL it if it lingers."""
        process = child.process
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout)
        if child in self.started:
            self.started.remove(child)

    def stop_all(self) -> None:
        """Stop every child still running, the last started first."""
        for child in list(reversed(self.started)):
            self.stop(child)


def wait_for(child: Child, pattern: str, timeout: float = STARTUP_TIMEOUT) -> re.Match[str]:
    """Poll the child's output until ``pattern`` matches; fail if it exits or times out."""
    regex = re.compile(pattern)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = regex.search(child.text())
        if match:
            return match
        if child.process.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"{child.name} did not report /{pattern}/:\n{child.text()[-3000:]}")


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


# -- /proc ------------------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (field 3 onwards)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rpartition(")")[2].split()


def descendants(pid: int) -> list[int]:
    """``pid`` and every live descendant (nginx: master + workers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(_stat_fields(int(entry))[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(children.get(current, []))
    return out


def cpu_seconds(pids: Sequence[int]) -> float:
    """Sum of utime + stime of ``pids`` (not of reaped children), in seconds."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):
            fields = _stat_fields(pid)
            total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def cpu_ns(pids: Sequence[int]) -> int:
    """On-CPU nanoseconds of every thread of ``pids`` (``/proc/PID/task/*/schedstat``).

    ``/proc/PID/stat`` counts in 10 ms ticks, too coarse for a few hundred idle requests.
    """
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError, ValueError, IndexError), \
                        open(f"/proc/{pid}/task/{task}/schedstat") as stat:
                    total += int(stat.read().split()[0])
    return total


def rss_kb(pids: Sequence[int]) -> int:
    """Sum of VmRSS of ``pids`` in KiB."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
                    break
    return total


def core_times() -> list[tuple[int, int]]:
    """(busy, total) jiffies of every CPU, from /proc/stat (idle and iowait count as idle)."""
    out = []
    with open("/proc/stat") as stat:
        for line in stat:
            name, _, rest = line.partition(" ")
            if not (name.startswith("cpu") and name[3:].isdigit()):
                continue
            fields = [int(x) for x in rest.split()]
            total = sum(fields[:8])
            out.append((total - fields[3] - fields[4], total))
    return out


# -- targets ----------------------------------------------------------------------------------


@dataclass
class Target:
    """Something clients connect to: the backend itself, nginx or txlb."""

    name: str
    port: int
    child: Child | None  # None for "direct" (the backend is shared, not owned)
    note: str = ""
    pids_cache: list[int] = field(default_factory=list)

    def pids(self) -> list[int]:
        """The proxy's processes (empty for direct)."""
        if self.child is None:
            return []
        if not self.pids_cache:
            self.pids_cache = descendants(self.child.process.pid)
        return self.pids_cache

    def cpu(self) -> float:
        """The proxy's CPU seconds so far (0 for direct)."""
        return cpu_seconds(self.pids())

    def rss(self) -> int:
        """The proxy's RSS in KiB (0 for direct)."""
        return rss_kb(self.pids())


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """One ``GET`` on a fresh connection, ``Connection: close``; (status, raw response)."""
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n"
                     .encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    match = re.match(rb"HTTP/1\.[01] (\d{3})", data)
    return (int(match.group(1)) if match else 0), data


def chat_status(port: int, timeout: float = 5.0) -> int:
    """One small ``POST /v1/chat/completions`` on a fresh connection: the answer's status."""
    from bench.chat import Instruction, chat_request

    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        sock.sendall(chat_request(HOST, port, Instruction("json")).replace(
            b"HTTP/1.1\r\n", b"HTTP/1.1\r\nConnection: close\r\n", 1))
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    match = re.match(rb"HTTP/1\.[01] (\d{3})", data)
    return int(match.group(1)) if match else 0


def wait_routing(port: int, timeout: float = 60.0,
                 alive: Callable[[], bool] = lambda: True) -> None:
    """
    Until a chat request through the proxy on ``port`` answers 200: it listens, has probed
    its workers and routes to one (the routers take a few probe rounds to admit a worker).
    """
    _until_200(port, lambda: chat_status(port), timeout, alive, "does not route chat requests")


def wait_ready(port: int, path: str = "/json", timeout: float = STARTUP_TIMEOUT,
               alive: Callable[[], bool] = lambda: True) -> None:
    """Until ``GET path`` answers 200 (the proxy listens and reaches a backend)."""
    _until_200(port, lambda: http_get(port, path)[0], timeout, alive, "not ready")


def _until_200(port: int, status: Callable[[], int], timeout: float,
               alive: Callable[[], bool], failing: str) -> None:
    """Ask ``status`` every 0.1 s until it says 200, the child dies, or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline and alive():
        try:
            answer = status()
            if answer == 200:
                return
            last = answer
        except OSError as exc:
            last = exc
        time.sleep(0.1)
    raise RuntimeError(f"port {port} {failing}: {last}")


def start_backend(children: Children, core: int | None, count: int) -> tuple[Child, list[int]]:
    """The benchmark backend, ``count`` ports in one process."""
    import json

    child = children.spawn("backend", pinned(core, [
        sys.executable, "-m", "bench.backend", "--count", str(count)]))
    ports = json.loads(wait_for(child, r"(\{.*\})").group(1))["ports"]
    return child, ports


def nginx_config(prefix: Path, backends: str, port: int,
                 patches: Sequence[tuple[str, str]]) -> str:
    """``python -m txlb.nginx --standalone``'s file with the harness's documented patches."""
    subprocess.run(
        [sys.executable, "-m", "txlb.nginx", "--standalone", str(prefix),
         "--backends", backends, "--listen", f"tcp:{port}:interface={HOST}",
         "--read-timeout", "600"],
        capture_output=True, text=True, check=True, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    text = (prefix / "nginx.conf").read_text()
    for pattern, replacement in patches:
        text, n = re.subn(pattern, replacement, text)
        if not n:
            raise RuntimeError(f"nginx config patch /{pattern}/ matched nothing")
    return text


def start_nginx(children: Children, core: int | None, backends: str, workdir: Path,
                patches: Sequence[tuple[str, str]], name: str = "nginx") -> Target:
    """nginx in the foreground (``daemon off``) with a generated config under ``workdir``."""
    prefix = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=workdir))
    prefix.chmod(0o777)  # the worker runs as nobody when the master is root
    port = free_port()
    (prefix / "nginx.conf").write_text(nginx_config(prefix, backends, port, patches))
    child = children.spawn(name, pinned(core, [
        NGINX, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-g", "daemon off;"]))
    wait_ready(port, alive=lambda: child.process.poll() is None)
    target = Target(name, port, child)
    deadline = time.monotonic() + 5
    while len(target.pids()) < 2 and time.monotonic() < deadline:  # master + worker
        target.pids_cache = []
        time.sleep(0.05)
    return target


def twistd_of(source: Path) -> list[str]:
    """The ``twistd`` to run txlb from checkout ``source``: its own venv's, else this one's."""
    own = source / ".venv" / "bin" / "twistd"
    return [str(own)] if source != ROOT and own.exists() else [TWISTD]


def start_txlb(children: Children, core: int | None, backends: str,
               python: Sequence[str] | None = None, name: str = "txlb",
               reactor: str | None = None, source: Path = ROOT,
               extra: Sequence[str] = (), log_file: str | None = "none",
               health_interval: float = 30.0) -> Target:
    """
    ``twistd -n llmlb`` from a source tree (this one by default; ``PYTHONPATH`` is that tree
    alone, so its ``txlb`` and its ``twisted/plugins`` are the ones found) on a free port
    (``--listen tcp:0``), with Twisted's default reactor or the one named (``txlb-epoll``).
    ``log_file`` None keeps txlb's default result log (a file in the bench's working
    directory); ``extra`` is appended to the command line, so it overrides what comes before.
    """
    twistd = list(python) if python else twistd_of(source)
    selected = ["--reactor", reactor] if reactor else []
    logging = [] if log_file is None else ["--log-file", log_file]
    child = children.spawn(name, pinned(core, [
        *twistd, *selected, "-n", "--pidfile=", "llmlb",
        "--listen", f"tcp:0:interface={HOST}",
        "--backends", backends,
        "--admin", "none", *logging,
        "--read-timeout", "600", "--health-interval", f"{health_interval:g}",
        *extra,
    ]), env={"PYTHONPATH": str(source)})
    port = int(wait_for(child, r"ProxySite starting on (\d+)").group(1))
    wait_ready(port, alive=lambda: child.process.poll() is None)
    return Target(name, port, child)


def start_router(children: Children, core: int | None, kind: str, backends: str,
                 policy: str = "round_robin", health_interval: float = 300.0) -> Target:
    """
    ``vllm-router`` or ``sglang-router`` (from :mod:`bench.routers`' venv, installed on first
    use) in front of ``backends`` (``host:port,...``), quiet (``RUST_LOG=warn``), probing
    the workers every ``health_interval`` s once started; ready once it routes a chat request.
    """
    from bench.routers import ROUTER_ENV, router_argv

    port = free_port()
    urls = [f"http://{b}" for b in backends.split(",")]
    child = children.spawn(kind, pinned(core, router_argv(
        kind, port, urls, policy, free_port(), host=HOST, health_interval=health_interval)),
        env=ROUTER_ENV)
    try:
        wait_routing(port, alive=lambda: child.process.poll() is None)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}\n{child.text()[-2000:]}") from None
    return Target(kind, port, child)
