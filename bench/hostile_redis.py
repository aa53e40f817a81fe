"""
A hostile Redis against a real ``twistd -n llmlb`` (``python -m bench.hostile_redis``).

Three servers that speak just enough of Redis's protocol to be connected to, each run for
``--seconds`` (4 by default) behind ``--shared-state redis://127.0.0.1:PORT`` while one
keep-alive client sends ``GET /json`` through txlb as fast as it answers:

``ok``        answers ``+OK`` to every command (a proxy or a broken server that is "up");
``endless``   answers the first command with ``$99999999999`` and then bytes without end;
``nested``    answers every command with 200,000 nested ``*1`` headers.

A fourth run, ``none``, has no ``--shared-state``: the requests per second the machine gives
without any Redis.  For each: txlb's RSS growth over the run (VmRSS), the requests per
second it served, the connections the hostile server saw, and ``/status``'s shared-state.
``--source /path/to/checkout`` runs another checkout's txlb (read only; its own venv's
``twistd`` if it has one).  docs/scale-out.md quotes the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import socket
import tempfile
import threading
import time
from pathlib import Path

from bench.harness import (
    HOST,
    ROOT,
    Children,
    rss_kb,
    start_backend,
    start_txlb,
    wait_for,
)

KINDS = ("none", "ok", "endless", "nested")
#: Bytes of each write of the endless answer.
CHUNK = 64 * 1024


def commands(buffer: bytearray) -> int:
    """Complete RESP commands at the start of ``buffer`` (removed from it): how many."""
    done = 0
    while True:
        at = 0
        try:
            end = buffer.index(b"\r\n", at)
            count = int(buffer[1:end])
            at = end + 2
            for _ in range(count):
                end = buffer.index(b"\r\n", at)
                at = end + 2 + int(buffer[at + 1:end]) + 2
                if at > len(buffer):
                    return done
        except ValueError:
            return done
        del buffer[:at]
        done += 1


class HostileRedis:
    """A server on a free loopback port that answers as ``kind`` says; :meth:`stop` ends it."""

    def __init__(self, kind: str, deadline: float) -> None:
        self.kind = kind
        self.deadline = deadline
        self.connections = 0
        self.sent = 0
        self._stopped = threading.Event()
        self._listener = socket.create_server((HOST, 0))
        self._listener.settimeout(0.2)
        self.port = int(self._listener.getsockname()[1])
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stopped.is_set() and time.monotonic() < self.deadline:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                continue
            self.connections += 1
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = bytearray()
        conn.settimeout(0.5)
        with conn, contextlib.suppress(OSError):
            while not self._stopped.is_set() and time.monotonic() < self.deadline:
                try:
                    data = conn.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    return
                buffer += data
                for _ in range(commands(buffer)):
                    if self.kind == "ok":
                        conn.sendall(b"+OK\r\n")
                    elif self.kind == "nested":
                        conn.sendall(b"*1\r\n" * 200_000)
                    else:
                        conn.sendall(b"$99999999999\r\n")
                        chunk = b"x" * CHUNK
                        while not self._stopped.is_set() and time.monotonic() < self.deadline:
                            conn.sendall(chunk)
                            self.sent += CHUNK

    def stop(self) -> None:
        self._stopped.set()
        self._listener.close()
        for thread in self._threads:
            thread.join(timeout=2)


def served(port: int, seconds: float) -> int:
    """``GET /json`` through txlb on one keep-alive connection for ``seconds``: how many."""
    done = 0
    deadline = time.monotonic() + seconds
    conn = http.client.HTTPConnection(HOST, port, timeout=5)
    with contextlib.closing(conn):
        while time.monotonic() < deadline:
            try:
                conn.request("GET", "/json")
                response = conn.getresponse()
                response.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                continue
            done += response.status == 200
    return done


def shared_state(admin_port: int) -> dict[str, object]:
    conn = http.client.HTTPConnection(HOST, admin_port, timeout=5)
    with contextlib.closing(conn):
        conn.request("GET", "/status")
        status: dict[str, object] = json.loads(conn.getresponse().read())
    shared = status.get("shared_state") or {}
    assert isinstance(shared, dict)
    return {key: shared.get(key) for key in ("connected", "last_error", "fallbacks")}


def run(kind: str, source: Path, seconds: float, children: Children, backends: str) -> str:
    hostile = None
    extra = ["--admin", "tcp:0:interface=127.0.0.1"]
    if kind != "none":
        hostile = HostileRedis(kind, time.monotonic() + seconds + 30)
        extra += ["--shared-state", f"redis://{HOST}:{hostile.port}"]
    target = start_txlb(children, None, backends, source=source, name=f"txlb-{kind}",
                        extra=extra)
    try:
        assert target.child is not None
        (pid,) = target.pids()
        admin = int(wait_for(target.child, r"_AdminSite starting on (\d+)").group(1))
        before = rss_kb([pid])
        count = served(target.port, seconds)
        grown = (rss_kb([pid]) - before) / 1024
        status = shared_state(admin) if hostile else {}
    finally:
        children.stop(target.child)
        if hostile:
            hostile.stop()
    seen = f"{hostile.connections} connections" if hostile else "-"
    return (f"| {kind} | {grown:+.1f} MiB | {count / seconds:,.0f} | {seen} | "
            f"{json.dumps(status) if status else '-'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=ROOT)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--kinds", default=",".join(KINDS))
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="txlb-bench-hostile-") as workdir:
        children = Children(Path(workdir))
        try:
            _, ports = start_backend(children, None, 1)
            backends = f"{HOST}:{ports[0]}"
            print(f"txlb from {options.source}, {options.seconds:g} s each")
            print("| attack | RSS growth | requests/s | hostile server saw | shared_state |")
            print("|---|---|---|---|---|")
            for kind in options.kinds.split(","):
                print(run(kind, options.source, options.seconds, children, backends),
                      flush=True)
        finally:
            children.stop_all()


if __name__ == "__main__":
    main()
