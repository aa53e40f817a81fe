"""
Shared pieces of the integration tests: real sockets on 127.0.0.1, port 0 everywhere.

Waiting is always for a condition with a deadline (:func:`wait_until`), never a fixed
sleep: the test proceeds the moment the condition holds and fails loudly if it never does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor, task
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool, ResponseDone
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse

from txlb._upstream.agent import BytesProducer

ROOT = Path(__file__).resolve().parent.parent


async def wait_until(condition: Callable[[], bool], timeout: float = 10.0,
                     what: str = "condition") -> None:
    """Poll ``condition`` on the reactor every 10 ms until it holds, or fail after timeout."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await task.deferLater(reactor, 0.01)


class Chunks(Protocol):
    """Collects a response body, remembering when each read arrived."""

    def __init__(self) -> None:
        self.chunks: list[tuple[float, bytes]] = []
        self.done: defer.Deferred[bytes] = defer.Deferred()
        self.clean: bool | None = None

    def dataReceived(self, data: bytes) -> None:
        self.chunks.append((time.monotonic(), data))

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.clean = reason.check(ResponseDone) is not None
        self.done.callback(self.body)

    @property
    def body(self) -> bytes:
        return b"".join(data for _, data in self.chunks)


def chat_body(stream: bool = True, **extra: Any) -> bytes:
    return json.dumps({
        "model": "sim-model", "stream": stream,
        "messages": [{"role": "user", "content": "hello"}], **extra,
    }).encode()


class Client:
    """An HTTP client for the tests (Agent, so nothing is decoded or followed)."""

    def __init__(self) -> None:
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        self.agent = Agent(reactor, pool=self.pool)

    async def request(self, url: str, method: bytes = b"GET", body: bytes | None = None,
                      headers: dict[bytes, list[bytes]] | None = None) -> IResponse:
        producer = BytesProducer(body) if body is not None else None
        return await self.agent.request(method, url.encode(), Headers(headers or {}), producer)

    async def fetch(self, url: str, method: bytes = b"GET", body: bytes | None = None,
                    headers: dict[bytes, list[bytes]] | None = None,
                    ) -> tuple[IResponse, Chunks]:
        response = await self.request(url, method, body, headers)
        chunks = Chunks()
        response.deliverBody(chunks)
        await chunks.done
        return response, chunks


def header(response: IResponse, name: bytes) -> str | None:
    values = response.headers.getRawHeaders(name)
    return values[0].decode() if values else None


def twistd_command(*args: str, reactor: str | None = None) -> list[str]:
    selected = ["--reactor", reactor] if reactor else []
    return [os.path.join(os.path.dirname(sys.executable), "twistd"), *selected, "-n",
            "--pidfile=", "llmlb", *args]


def clean_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LB_")}
    env["PYTHONPATH"] = str(ROOT)  # the source tree under test, not a stale install
    return env


class TwistdProcess:
    """``twistd -n llmlb`` as a child process; learns its port from its own log."""

    @staticmethod
    def defaults(args: tuple[str, ...]) -> list[str]:
        """No fixed admin port (8001 may be taken) and no stray log file, unless asked."""
        extra = []
        if "--admin" not in args:
            extra += ["--admin", "none"]
        if "--log-file" not in args:
            extra += ["--log-file", "none"]
        return extra

    def __init__(self, *args: str, reactor: str | None = None, **popen: Any) -> None:
        handle, name = tempfile.mkstemp(prefix="txlb-twistd-", suffix=".log")
        self.log_path = Path(name)
        self._log = os.fdopen(handle, "wb")
        self.args = args
        self.process = subprocess.Popen(
            twistd_command("--listen", "tcp:0:interface=127.0.0.1", *self.defaults(args), *args,
                           reactor=reactor),
            stdout=self._log, stderr=subprocess.STDOUT, env=clean_environment(), cwd=ROOT,
            **popen,
        )
        self.port = 0
        self.admin_port = 0
        self.final_output = ""

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def started(self) -> None:
        def listening() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"twistd exited early:\n{self.output()}")
            output = self.output()
            match = re.search(r"\bProxySite(?: \(TLS\))? starting on (\d+)", output)
            if match:
                self.port = int(match.group(1))
            admin = re.search(r"_AdminSite starting on (\d+)", output)
            if admin:
                self.admin_port = int(admin.group(1))
            return bool(match) and (admin is not None or "--admin" not in self.args)

        await wait_until(listening, timeout=30, what="twistd to listen")

    async def stop(self, signal_it: bool = True) -> int:
        """
        SIGTERM (unless ``signal_it`` is false: the test already sent one), wait for the
        exit, and return the exit status (Popen's convention).
        """
        if signal_it and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        await wait_until(lambda: self.process.poll() is not None, timeout=30,
                         what="twistd to exit")
        self._log.close()
        if self.log_path.exists():
            self.final_output = self.output()
            self.log_path.unlink()
        return self.process.returncode

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")


def throwaway_certificate(directory: Path, ip: str | None = "127.0.0.1",
                          name: str = "localhost") -> tuple[Path, Path]:
    """
    A self-signed certificate for ``ip`` and ``name`` (valid for a day), written as
    ``key.pem`` and ``cert.pem`` under ``directory``: a client that trusts ``cert.pem``
    verifies the server as it would a real one (``ip=None``: a certificate for ``name``
    only, which a client connecting to an address must refuse).  Made with
    ``cryptography`` (which Twisted's TLS support installs), else with the ``openssl``
    command.
    """
    import datetime
    import ipaddress
    import shutil

    key_path, cert_path = directory / "key.pem", directory / "cert.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        openssl = shutil.which("openssl")
        if openssl is None:
            from .parts import missing
            missing("openssl", "neither the cryptography package nor openssl is installed "
                    "to make a test certificate")
        alt = ",".join([*([f"IP:{ip}"] if ip else []), f"DNS:{name}"])
        subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt",
                        "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
                        "-subj", f"/CN={name}", "-addext", f"subjectAltName={alt}",
                        "-keyout", str(key_path), "-out", str(cert_path)],
                       check=True, capture_output=True)
        return key_path, cert_path
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([
            *([x509.IPAddress(ipaddress.ip_address(ip))] if ip else []), x509.DNSName(name)]),
            critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path
