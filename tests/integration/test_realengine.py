"""
txlb in front of three real llama.cpp ``llama-server`` processes: what a fleet that is not
pure vLLM meets.  Real sockets on 127.0.0.1, the real ``twistd -n llmlb``, a generated
1.8 MB model (random weights, ~4000 tokens/s on one core).

The engine is ``../shared/realengine/llama-server`` beside the project (or in the directory
``TXLB_REALENGINE`` names); ``bench/build_llama_server.sh`` builds it from the PyPI source
distribution where the prebuilt one does not run, and ``bench/make_model.py`` makes the
model.  Without
it (or without the ``gguf``/``numpy`` packages the model generator needs) every test here
is skipped with "NOT RUN".
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor, task
from twisted.trial.unittest import TestCase

from ..parts import missing, real_engine_dir
from ..processes import ROOT, Chunks, Client, TwistdProcess, header, wait_until

ENGINE_DIR = real_engine_dir()
ENGINE = ENGINE_DIR / "llama-server"
#: the project's own copy of the engine kit's model generator
MAKE_MODEL = ROOT / "bench" / "make_model.py"
#: the fast model of the engine's README: 1.8 MB, ~4000 tokens/s per stream
MODEL_ARGS = ["--n-embd", "128", "--n-layer", "2", "--n-head", "4", "--n-head-kv", "2",
              "--n-ff", "352"]
MODEL = "fast"

_model_path: Path | None = None


def engine_model() -> Path:
    """The engine and a model for it, generated once per test run; else SkipTest."""
    global _model_path
    if not os.access(ENGINE, os.X_OK):
        missing("llama-server", f"no llama-server engine at {ENGINE_DIR} (set "
                "TXLB_REALENGINE, or build one with bench/build_llama_server.sh)")
    if _model_path is None:
        try:
            import gguf  # noqa: F401
            import numpy  # noqa: F401
        except ImportError as error:
            missing("gguf", f"the model generator needs {error.name} (pip install gguf numpy)")
        directory = Path(tempfile.mkdtemp(prefix="txlb-realengine-"))
        atexit.register(shutil.rmtree, directory, True)
        path = directory / "fast.gguf"
        subprocess.run([sys.executable, str(MAKE_MODEL), str(path), *MODEL_ARGS],
                       check=True, capture_output=True, timeout=60)
        _model_path = path
    return _model_path


def free_port() -> int:
    """A port nothing listens on now (llama-server cannot be given port 0)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Engine:
    """One ``llama-server`` child process."""

    def __init__(self, model: Path, *extra: str, port: int | None = None,
                 context: int = 8192) -> None:
        self.port = port or free_port()
        handle, name = tempfile.mkstemp(prefix="txlb-llama-", suffix=".log")
        self.log_path = Path(name)
        self._log = os.fdopen(handle, "wb")
        self.process = subprocess.Popen(
            [str(ENGINE), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
             "--alias", MODEL, "--parallel", "2", "-c", str(context), "-t", "1", "-tb", "1",
             "--metrics", "--no-webui", *extra],
            stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def key(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.key}"

    def signal(self, number: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(number)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
        self.process.wait(10)
        self._log.close()
        self.log_path.unlink(missing_ok=True)


def chat(stream: bool = True, max_tokens: int = 16, **extra: Any) -> bytes:
    return json.dumps({"model": MODEL, "stream": stream, "max_tokens": max_tokens,
                       "temperature": 0, "messages": [{"role": "user", "content": "hello"}],
                       **extra}).encode()


_VOLATILE = [
    (re.compile(rb'"id":"chatcmpl-[A-Za-z0-9]+"'), b'"id":"-"'),
    (re.compile(rb'"created":\d+'), b'"created":0'),
    (re.compile(rb'"timings":\{[^}]*\}'), b'"timings":{}'),
    (re.compile(rb'"prompt_tokens_details":\{[^}]*\}'), b'"prompt_tokens_details":{}'),
]


def stable(body: bytes) -> bytes:
    """A response with what differs between two identical requests (ids, clocks, cache
    hits) blanked out."""
    for pattern, replacement in _VOLATILE:
        body = pattern.sub(replacement, body)
    return body


class RealEngineTestCase(TestCase):
    timeout = 60

    async def start(self, *lb_args: str, engines: int = 3, late: bool = False) -> None:
        """
        ``engines`` llama-servers, then txlb in front of them; ``late``: txlb in front of
        the ports before the last engine starts (it is left to the test to start).
        """
        model = engine_model()
        self.client = Client()
        self.addCleanup(self.client.pool.closeCachedConnections)
        self.engines = [Engine(model) for _ in range(engines - late)]
        for engine in self.engines:
            self.addCleanup(engine.stop)
        for engine in self.engines:
            await wait_until(lambda e=engine: self.answers(e) == 200, timeout=20,
                             what=f"llama-server on {engine.key}")
        keys = [e.key for e in self.engines]
        if late:
            self.late_port = free_port()
            keys.append(f"127.0.0.1:{self.late_port}")
        self.lb = TwistdProcess("--backends", ",".join(keys), *lb_args)
        self.addCleanup(self.lb.stop)
        await self.lb.started()
        await wait_until(lambda: self.lb_healthy() == len(self.engines), timeout=20,
                         what="every backend healthy")

    def answers(self, engine: Engine) -> int | None:
        """The status of the engine's ``/health`` now (``None``: nothing answers)."""
        if engine.process.poll() is not None:
            raise AssertionError(f"llama-server exited:\n{engine.log_path.read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", engine.port), timeout=1) as conn:
                conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                line = conn.recv(64)
                return int(line.split()[1]) if line.startswith(b"HTTP/1.1 ") else None
        except (OSError, ValueError, IndexError):
            return None

    def lb_status(self) -> dict[str, Any]:
        with socket.create_connection(("127.0.0.1", self.lb.port), timeout=2) as conn:
            conn.sendall(b"GET /__lb_status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            raw = b""
            while chunk := conn.recv(65536):
                raw += chunk
        status: dict[str, Any] = json.loads(raw.partition(b"\r\n\r\n")[2])
        return status

    def lb_healthy(self) -> int:
        try:
            return int(self.lb_status()["healthy"])
        except OSError:
            return 0

    def healthy(self, key: str) -> bool:
        return any(b["healthy"] for b in self.lb_status()["backends"] if b["backend"] == key)

    async def post(self, url: str, body: bytes) -> tuple[Any, Chunks]:
        return await self.client.fetch(url + "/v1/chat/completions", b"POST", body,
                                       {b"content-type": [b"application/json"]})

    async def engine_metric(self, engine: Engine, name: str) -> float:
        _, chunks = await self.client.fetch(engine.url + "/metrics")
        for line in chunks.body.decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"no {name} in {engine.key}/metrics")


class AnswersTests(RealEngineTestCase):
    async def test_content_and_sse_bytes_as_direct(self) -> None:
        """Through txlb, the same bytes as from the engine itself (but for ids/clocks)."""
        await self.start()
        for stream in (False, True):
            body = chat(stream=stream, stream_options={"include_usage": True}) if stream \
                else chat(stream=False)
            response, via = await self.post(self.lb.url, body)
            self.assertEqual(response.code, 200)
            backend = header(response, b"x-backend")
            engine = next(e for e in self.engines if e.key == backend)
            direct_response, direct = await self.post(engine.url, body)
            self.assertTrue(via.clean)
            self.assertEqual(stable(via.body), stable(direct.body))
            self.assertEqual(header(response, b"content-type"),
                             header(direct_response, b"content-type"))
            if stream:
                self.assertTrue(via.body.endswith(b"data: [DONE]\n\n"))
                self.assertIn(b'"usage":', via.body)

    async def test_models_are_learned(self) -> None:
        await self.start()
        seen: list[list[str]] = []

        async def learned() -> None:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                _, models = await self.client.fetch(self.lb.url + "/v1/models")
                seen.append([m["id"] for m in json.loads(models.body)["data"]])
                if seen[-1]:
                    return
                await task.deferLater(reactor, 0.05)

        await learned()
        self.assertEqual(seen[-1], [MODEL])

    async def test_garbage_posts_do_not_eject(self) -> None:
        """
        llama-server answers 500 to a body that is not JSON, or JSON only Python's parser
        takes (NaN, 1e400, a lone surrogate): that is not its failure -- even when the
        garbage comes from several clients (``--rate-key header:x-user``), so the
        two-client rule alone would not keep it in.
        """
        await self.start("--rate-key", "header:x-user")
        bodies = [b"this is not json", chat(stream=False)[:-1] + b', "t": NaN}',
                  chat(stream=False)[:-1] + b', "t": 1e400}',
                  chat(stream=False)[:-1] + b', "t": "\\ud800"}']
        for n in range(40):
            response, _ = await self.client.fetch(
                self.lb.url + "/v1/chat/completions", b"POST", bodies[n % len(bodies)],
                {b"content-type": [b"application/json"], b"x-user": [b"u%d" % (n % 2)]})
            self.assertEqual(response.code, 500, bodies[n % len(bodies)])
        self.assertEqual(self.lb_healthy(), 3, self.lb.output()[-3000:])
        response, _ = await self.post(self.lb.url, chat(stream=False))
        self.assertEqual(response.code, 200)


class FailureTests(RealEngineTestCase):
    async def test_client_disconnect_cancels_the_slot(self) -> None:
        """A client leaving mid-stream frees the engine's slot at once."""
        await self.start()
        response = await self.client.request(
            self.lb.url + "/v1/chat/completions", b"POST", chat(max_tokens=3000),
            {b"content-type": [b"application/json"]})
        engine = next(e for e in self.engines if e.key == header(response, b"x-backend"))
        chunks = Chunks()
        response.deliverBody(chunks)
        await wait_until(lambda: len(chunks.chunks) > 3, what="the stream to flow")
        self.assertEqual(await self.engine_metric(engine, "llamacpp:requests_processing"), 1)
        assert chunks.transport is not None
        chunks.transport.stopProducing()  # the client goes away
        deadline = time.monotonic() + 5
        while await self.engine_metric(engine, "llamacpp:requests_processing") != 0:
            self.assertLess(time.monotonic(), deadline, "the slot was never freed")
            await task.deferLater(reactor, 0.02)
        predicted = await self.engine_metric(engine, "llamacpp:tokens_predicted_total")
        self.assertLess(predicted, 3000)  # stopped well before the end

    async def flowing_stream(self, asked: int) -> tuple[Engine, Chunks]:
        """A stream of ``asked`` tokens (``ignore_eos``), once it flows: its engine, its body."""
        response = await self.client.request(
            self.lb.url + "/v1/chat/completions", b"POST",
            chat(max_tokens=asked, ignore_eos=True, stream_options={"include_usage": True}),
            {b"content-type": [b"application/json"]})
        victim = next(e for e in self.engines if e.key == header(response, b"x-backend"))
        chunks = Chunks()
        response.deliverBody(chunks)
        await wait_until(lambda: chunks.body.count(b"data:") > 5, what="the stream to flow")
        return victim, chunks

    async def test_kill_9_resumes_the_stream_on_another_engine(self) -> None:
        """
        A llama-server killed mid-stream: the stream goes on on another one (llama.cpp
        continues a final assistant message by itself), the client reads one answer with
        its finish reason and the usage of the whole, every token asked for.
        """
        await self.start()
        asked = 2000
        victim, chunks = await self.flowing_stream(asked)
        before = chunks.body
        killed_at = time.monotonic()
        victim.signal(signal.SIGKILL)
        await chunks.done
        self.assertTrue(chunks.clean)
        # the longest wait between two reads, the kill's included: under 1 s
        times = [at for at, _ in chunks.chunks]
        gap = max(later - sooner for sooner, later in itertools.pairwise(times))
        self.assertLess(gap, 1.0)
        self.assertGreater(times[-1], killed_at)
        print(f"\nllama-server killed mid-stream: the next token {gap:.2f}s later",
              file=sys.stderr)
        self.assertTrue(chunks.body.startswith(before))  # nothing sent twice
        events = [json.loads(part[6:]) for part in chunks.body.decode().split("\n\n")
                  if part.startswith("data: {")]
        self.assertTrue(chunks.body.endswith(b"data: [DONE]\n\n"))
        self.assertEqual(len({event["id"] for event in events}), 1)
        finishes = [c["finish_reason"] for e in events for c in e["choices"]
                    if c.get("finish_reason")]
        self.assertEqual(finishes, ["length"])
        self.assertEqual(events[-1]["usage"]["completion_tokens"], asked)
        self.assertIn(f"backend {victim.key} failed part-way through a stream",
                      self.lb.output())
        for _ in range(6):  # new ones: refused there, answered elsewhere
            answer, _ = await self.post(self.lb.url, chat(stream=False))
            self.assertEqual(answer.code, 200)
            self.assertNotEqual(header(answer, b"x-backend"), victim.key)

    async def test_sigstop_mid_stream_resumes_within_3_5s(self) -> None:
        """
        A llama-server stopped mid-stream (accepts TCP, answers nothing): the hung-engine
        detector takes it out -- short requests beside the stream, given up after 1 s, are
        what it judges by -- and the stream goes on on another engine.
        """
        await self.start()
        asked = 3000
        victim, chunks = await self.flowing_stream(asked)
        victim.signal(signal.SIGSTOP)
        self.addCleanup(victim.signal, signal.SIGCONT)
        stopped_at = time.monotonic()
        done = False

        async def beside() -> None:
            deadline = time.monotonic() + 30
            while not done and time.monotonic() < deadline:
                fetch = defer.ensureDeferred(self.post(self.lb.url, chat(stream=False)))
                fetch.addTimeout(1.0, reactor)
                with contextlib.suppress(Exception):  # a try that gave up after 1 s
                    await fetch

        loop = defer.ensureDeferred(beside())
        try:
            await chunks.done
        finally:
            done = True
            await loop
        self.assertTrue(chunks.clean)
        self.assertTrue(chunks.body.endswith(b"data: [DONE]\n\n"))
        events = [json.loads(part[6:]) for part in chunks.body.decode().split("\n\n")
                  if part.startswith("data: {")]
        self.assertEqual(events[-1]["usage"]["completion_tokens"], asked)
        times = [stopped_at, *(at for at, _ in chunks.chunks if at > stopped_at)]
        gap = max(later - sooner for sooner, later in itertools.pairwise(times))
        self.assertLess(gap, 3.5, self.lb.output())
        self.assertIn("judged hung", self.lb.output())
        print(f"\nllama-server stopped mid-stream: the next token {gap:.2f}s later",
              file=sys.stderr)

    async def test_kill_9_truncates_then_new_requests_go_elsewhere(self) -> None:
        await self.start("--resume", "off")
        response = await self.client.request(
            self.lb.url + "/v1/chat/completions", b"POST", chat(max_tokens=3000),
            {b"content-type": [b"application/json"]})
        victim = next(e for e in self.engines if e.key == header(response, b"x-backend"))
        chunks = Chunks()
        response.deliverBody(chunks)
        await wait_until(lambda: len(chunks.chunks) > 3, what="the stream to flow")
        victim.signal(signal.SIGKILL)
        await chunks.done
        self.assertFalse(chunks.clean)  # cut, never a fake clean end
        self.assertNotIn(b"[DONE]", chunks.body)
        for _ in range(6):  # new ones: refused there, answered elsewhere
            answer, body = await self.post(self.lb.url, chat(stream=False))
            self.assertEqual(answer.code, 200)
            self.assertNotEqual(header(answer, b"x-backend"), victim.key)
        self.assertFalse(self.healthy(victim.key))

    async def test_sigstop_is_out_within_3s(self) -> None:
        """
        A stopped llama-server (accepts TCP, answers nothing) stops getting new requests
        within 3 s at the default settings, under steady traffic; once it continues, the
        requests it held finish.
        """
        await self.start()
        stopping = False
        results: list[int] = []

        async def loop() -> None:
            deadline = time.monotonic() + 30
            while not stopping and time.monotonic() < deadline:
                response, chunks = await self.post(self.lb.url, chat(max_tokens=200))
                results.append(response.code if chunks.clean else -1)

        loops = [defer.ensureDeferred(loop()) for _ in range(6)]
        await wait_until(lambda: len(results) > 30, what="traffic to flow")
        victim = self.engines[0]
        victim.signal(signal.SIGSTOP)
        self.addCleanup(victim.signal, signal.SIGCONT)  # before txlb drains, if we fail
        stopped = time.monotonic()
        await wait_until(lambda: not self.healthy(victim.key), timeout=10,
                         what="the stopped backend to be marked down")
        detected = time.monotonic() - stopped
        before = len(results)
        await wait_until(lambda: len(results) > before + 30, timeout=10,
                         what="traffic to flow on the others")
        victim.signal(signal.SIGCONT)
        stopping = True
        await defer.gatherResults(loops)
        self.assertEqual(set(results), {200})
        self.assertLess(detected, 3.0)
        self.assertIn("hung: no byte from any of", self.lb.output())
        print(f"\nSIGSTOP detected in {detected:.2f}s", file=sys.stderr)


class LoadingTests(RealEngineTestCase):
    async def test_loading_503_window_at_start_up(self) -> None:
        """
        An engine still loading its model answers ``/health`` with 503: txlb keeps it out
        of rotation (no client sees its 503s) and takes it in once it answers 200.
        """
        await self.start("--health-interval", "0.2", late=True)
        big = engine_model().parent / "big.gguf"  # zeros: quick to write, slow to load
        subprocess.run([sys.executable, str(MAKE_MODEL), str(big), "--zeros", "--n-embd",
                        "1024", "--n-layer", "8", "--n-head", "8", "--n-head-kv", "4",
                        "--n-ff", "2816"], check=True, capture_output=True, timeout=60)
        self.addCleanup(big.unlink)
        late = Engine(big, "--load-mode", "none", port=self.late_port, context=1024)
        self.addCleanup(late.stop)
        seen: set[int | None] = set()
        codes: list[int] = []
        while self.answers(late) != 200:
            seen.add(self.answers(late))
            response, _ = await self.post(self.lb.url, chat(stream=False, max_tokens=2))
            codes.append(response.code)
        self.assertIn(503, seen)  # the window was there, and txlb answered meanwhile
        await wait_until(lambda: self.lb_healthy() == 3, timeout=10,
                         what="the loaded engine back in rotation")
        self.assertEqual(set(codes), {200})
