"""
A real ``redis-server`` for the tests: on a free loopback port, with nothing saved to disk.

Redis cannot listen on port 0 and say which port it got, so a free port is found by binding
a socket first and handed to the server; a clash with another program that took the port
in between is retried.  Missing ``redis-server`` is a ``NOT RUN`` skip locally and a failure
under CI (:mod:`tests.parts`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from .parts import find_program, missing

#: Tries at a free port before giving up (another process may take one between our bind
#: and the server's).
PORT_TRIES = 5


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class RedisServer:
    """``redis-server`` as a child process; :meth:`kill`, :meth:`pause` and start again."""

    def __init__(self, password: str | None = None,
                 tls: tuple[Path, Path] | None = None) -> None:
        """``tls``: (certificate, key) files -- the server then speaks TLS only."""
        program = find_program("redis-server", "/usr/bin/redis-server")
        if program is None:
            missing("redis-server", "redis-server is not installed (apt-get install "
                                    "redis-server)")
        self.program = program
        self.password = password
        self.tls = tls
        self.directory = Path(tempfile.mkdtemp(prefix="txlb-redis-"))
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        credentials = f":{self.password}@" if self.password else ""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{credentials}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start (again, on the same port once it has one)."""
        for _ in range(PORT_TRIES):
            port = self.port or free_port()
            args = [self.program, "--port", str(port), "--bind", "127.0.0.1",
                    "--save", "", "--appendonly", "no", "--dir", str(self.directory)]
            if self.tls:
                cert, key = self.tls
                args[1:3] = ["--port", "0", "--tls-port", str(port), "--tls-cert-file",
                             str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file",
                             str(cert), "--tls-auth-clients", "no"]
            if self.password:
                args += ["--requirepass", self.password]
            output = self.directory / "server.log"
            with open(output, "wb") as log:
                self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
            if self._answers(port):
                self.port = port
                return
            self.process.kill()
            self.process.wait()
            said = output.read_text(errors="replace")
            if self.tls and "Bad directive" in said and "tls" in said:
                missing("redis-server-tls", "this redis-server was built without TLS "
                                            "(--tls-port is a bad directive to it)")
            if self.port:
                break
        raise AssertionError("redis-server did not start")

    def _answers(self, port: int, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                with self._connect(port) as sock:
                    sock.sendall(b"PING\r\n")
                    reply = sock.recv(64)
                    if reply.startswith((b"+PONG", b"-NOAUTH")):
                        return True
            except OSError:
                pass
            time.sleep(0.02)  # a child process starting: polled, bounded by the deadline
        return False

    def _connect(self, port: int) -> socket.socket:
        """A connection to the server (over TLS, not verified, if it speaks TLS)."""
        sock = socket.create_connection(("127.0.0.1", port), timeout=1)
        if not self.tls:
            return sock
        import ssl

        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context.wrap_socket(sock)

    def command(self, *args: str) -> bytes:
        """One command over a plain socket (the test's own look at what is stored)."""
        parts = [b"*%d\r\n" % len(args)] + [
            b"$%d\r\n%s\r\n" % (len(arg.encode()), arg.encode()) for arg in args]
        with self._connect(self.port) as sock:
            sock.settimeout(5)
            if self.password:
                sock.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n"
                             % (len(self.password), self.password.encode()))
                sock.recv(64)
            sock.sendall(b"".join(parts))
            time.sleep(0.05)
            return sock.recv(65536)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def pause(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.resume()
        self.kill()
