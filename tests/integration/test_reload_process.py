"""
Reloading a real ``twistd -n llmlb`` over real ``twistd vllm-sim`` engines: a SIGHUP under
32 live streams loses none of them, a broken file is refused and the process keeps
serving, ``POST /reload`` works, and ``--check`` / ``python -m txlb.check`` exit 0 or 2.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from twisted.internet import defer
from twisted.trial.unittest import TestCase

from ..processes import (
    ROOT,
    Chunks,
    Client,
    TwistdProcess,
    chat_body,
    clean_environment,
    header,
    twistd_command,
    wait_until,
)
from .test_faults import SimProcess

STREAMS = 32
TOKENS = 60  # at 10 tokens/s: a stream lasts 6 s, long enough to open 32 and reload under them
JSON = {b"content-type": [b"application/json"]}


def backends_toml(*keys: str) -> str:
    return "".join(f'[[backends]]\nurl = "http://{key}"\n\n' for key in keys)


class ReloadProcessTests(TestCase):
    timeout = 120

    async def start(self, *keys: str, extra: str = "") -> TwistdProcess:
        self.config = Path(self.mktemp()).resolve()
        self.config.parent.mkdir(parents=True, exist_ok=True)
        self.write(*keys, extra=extra)
        lb = TwistdProcess("--config", str(self.config), "--admin",
                           "tcp:0:interface=127.0.0.1", "--health-interval", "1")
        self.addCleanup(lambda: defer.ensureDeferred(lb.stop()))
        await lb.started()
        # the HUP handler is in once the reactor runs: a HUP before it would end the process
        await wait_until(lambda: "re-reads" in lb.output(), what="the SIGHUP handler")
        self.client = Client()
        self.addCleanup(self.client.pool.closeCachedConnections)
        return lb

    def write(self, *keys: str, extra: str = "") -> None:
        self.config.write_text('log-file = "none"\n' + extra + backends_toml(*keys))

    async def sims(self, count: int, *args: str) -> list[SimProcess]:
        sims = [SimProcess(0, *args) for _ in range(count)]
        for sim in sims:
            self.addCleanup(sim.cleanup)
        for sim in sims:
            await sim.started()
        return sims

    async def admin(self, lb: TwistdProcess, method: bytes, path: str) -> tuple[int, Any]:
        response, chunks = await self.client.fetch(lb.admin_url + path, method)
        return response.code, json.loads(chunks.body)

    async def backend_of_new_requests(self, lb: TwistdProcess, count: int) -> set[str]:
        served = set()
        for _ in range(count):
            response, _ = await self.client.fetch(
                lb.url + "/v1/chat/completions", b"POST",
                chat_body(stream=False, max_tokens=1), JSON)
            self.assertEqual(response.code, 200)
            served.add(header(response, b"x-backend") or "")
        return served

    @defer.inlineCallbacks
    def test_a_reload_under_32_live_streams_loses_none(self) -> Any:
        yield defer.ensureDeferred(self._under_streams())

    async def _under_streams(self) -> None:
        kept, leaving, idle, new = await self.sims(4, "--tokens-per-second", "10")
        lb = await self.start(kept.key, leaving.key, idle.key)
        code, _ = await self.admin(lb, b"POST", f"/backends/{idle.key}/drain")
        self.assertEqual(code, 200)  # holds none of the streams

        streams: list[tuple[Any, Chunks]] = []
        opened = []
        for _ in range(STREAMS):
            response = await self.client.request(
                lb.url + "/v1/chat/completions", b"POST",
                chat_body(max_tokens=TOKENS, stream_options={"include_usage": True}), JSON)
            self.assertEqual(response.code, 200)
            chunks = Chunks()
            response.deliverBody(chunks)
            streams.append((response, chunks))
            opened.append(header(response, b"x-backend"))
        self.assertEqual(set(opened), {kept.key, leaving.key})
        self.assertTrue(all(not chunks.done.called for _, chunks in streams))

        # the new config: `leaving` (half the streams) and `idle` go, `new` joins
        self.write(kept.key, new.key, extra='policy = "round-robin"\n')
        os.kill(lb.pid, signal.SIGHUP)
        await wait_until(lambda: "generation 2 applied" in lb.output(), what="the reload")
        reloaded = time.monotonic()

        served = await self.backend_of_new_requests(lb, 6)
        self.assertEqual(served, {kept.key, new.key})

        bodies = [await chunks.done for _, chunks in streams]
        for _, chunks in streams:
            self.assertTrue(chunks.clean)  # ended as HTTP says, not cut
            # each was still streaming when the reload was applied: it went through it
            self.assertGreater(chunks.chunks[-1][0], reloaded)
        for body in bodies:
            events = [line[6:] for line in body.decode().split("\n\n")
                      if line.startswith("data: ")]
            self.assertEqual(events[-1], "[DONE]")
            usage = json.loads(events[-2])["usage"]
            self.assertEqual(usage["completion_tokens"], TOKENS)
            deltas = [json.loads(e)["choices"][0]["delta"].get("content")
                      for e in events[:-2] if json.loads(e)["choices"]]
            self.assertEqual(len([d for d in deltas if d]), TOKENS)

        code, status = await self.admin(lb, b"GET", "/status")
        self.assertEqual(code, 200)
        self.assertEqual(sorted(b["backend"] for b in status["backends"]),
                         sorted([kept.key, new.key]))
        self.assertEqual((status["config"]["generation"], status["config"]["last_error"]),
                         (2, None))

    @defer.inlineCallbacks
    def test_a_storm_of_hangups_is_a_few_lines_and_breaks_nothing(self) -> Any:
        yield defer.ensureDeferred(self._storm())

    async def _storm(self) -> None:
        (first,) = await self.sims(1)
        lb = await self.start(first.key)
        before = len(lb.output().splitlines())
        # another process sends SIGHUP as fast as it can for 4 s (bounded in time)
        storm = subprocess.Popen([sys.executable, "-c", (
            "import os, signal, sys, time\n"
            "end = time.monotonic() + 4\n"
            "while time.monotonic() < end:\n"
            f"    os.kill({lb.pid}, signal.SIGHUP)\n")])
        self.addCleanup(lambda: storm.poll() is None and storm.kill())
        await wait_until(lambda: storm.poll() is not None, timeout=20, what="the storm")
        await wait_until(lambda: "generation 2 applied" in lb.output(), what="a reload")
        code, status = await self.admin(lb, b"GET", "/status")
        self.assertEqual(code, 200)
        self.assertEqual(await self.backend_of_new_requests(lb, 2), {first.key})
        said = lb.output().splitlines()[before:]
        self.assertLess(len(said), 10, said)  # hundreds of thousands of HUPs
        for word in ("Traceback", "RecursionError", "Exception ignored", "critical"):
            self.assertNotIn(word, lb.output())

    @defer.inlineCallbacks
    def test_a_broken_file_is_refused_and_post_reload_applies_a_good_one(self) -> Any:
        yield defer.ensureDeferred(self._broken_then_good())

    async def _broken_then_good(self) -> None:
        first, second = await self.sims(2)
        lb = await self.start(first.key)
        self.config.write_text("backends = [\n")
        os.kill(lb.pid, signal.SIGHUP)
        await wait_until(lambda: "reload (SIGHUP) refused" in lb.output(), what="the refusal")
        refusals = [line for line in lb.output().splitlines() if "reload (SIGHUP) refused" in line]
        self.assertEqual(len(refusals), 1, refusals)
        self.assertIn("not valid TOML", refusals[0])
        self.assertEqual(await self.backend_of_new_requests(lb, 3), {first.key})
        code, status = await self.admin(lb, b"GET", "/status")
        self.assertEqual(status["config"]["generation"], 1)
        self.assertIn("not valid TOML", status["config"]["last_error"])

        code, refused = await self.admin(lb, b"POST", "/reload")
        self.assertEqual(code, 400)
        self.write(first.key, second.key)
        code, answer = await self.admin(lb, b"POST", "/reload")
        self.assertEqual((code, answer["generation"]), (200, 2))
        self.assertEqual(await self.backend_of_new_requests(lb, 4), {first.key, second.key})
        self.assertIsNone(lb.process.poll())

    async def refused_count(self, lb: TwistdProcess) -> float:
        response, chunks = await self.client.fetch(lb.admin_url + "/metrics")
        self.assertEqual(response.code, 200)
        [line] = [line for line in chunks.body.decode().splitlines()
                  if line.startswith('txlb_config_reload_total{result="refused"}')]
        return float(line.split()[-1])

    @defer.inlineCallbacks
    def test_a_file_that_cannot_be_parsed_or_names_no_backends_is_refused_and_counted(
            self) -> Any:
        yield defer.ensureDeferred(self._unparsable_files())

    async def _unparsable_files(self) -> None:
        (first,) = await self.sims(1)
        lb = await self.start(first.key)
        cases = (
            ("SIGHUP", b'log-file = "none"\nadmin-token = "\xff"\n' +
             backends_toml(first.key).encode(), "is not UTF-8 text"),
            ("POST /reload", b"retries = " + b"[" * 5000, "nested too deeply"),
            ("SIGHUP", b'log-file = "none"\nretries = 1\n', "has no 'backends' key"),
            ("POST /reload", b'log-file = "none"\n', "has no 'backends' key"),
        )
        for count, (trigger, raw, words) in enumerate(cases, start=1):
            self.config.write_bytes(raw)
            if trigger == "SIGHUP":
                os.kill(lb.pid, signal.SIGHUP)
                await wait_until(lambda c=count: lb.output().count(" refused, still running")
                                 >= c, what=f"refusal {count}")
            else:
                code, answer = await self.admin(lb, b"POST", "/reload")
                self.assertEqual(code, 400, answer)
                self.assertIn(words, answer["error"]["message"])
            code, status = await self.admin(lb, b"GET", "/status")
            self.assertEqual(status["config"]["generation"], 1)
            self.assertIn(f"reload ({trigger}) refused", status["config"]["last_error"])
            self.assertIn(words, status["config"]["last_error"])
            self.assertEqual(await self.refused_count(lb), count)
            # the running backends still serve, not 127.0.0.1:8002-8009
            self.assertEqual(await self.backend_of_new_requests(lb, 2), {first.key})
        output = lb.output()
        self.assertNotIn("Traceback", output)
        self.assertEqual(output.count(" refused, still running generation 1"), len(cases),
                         output)
        self.assertIsNone(lb.process.poll())

    def test_a_file_that_cannot_be_parsed_is_one_line_at_start(self) -> None:
        path = Path(self.mktemp()).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        env = clean_environment()
        for raw, words in ((b'backends = ["\xff"]\n', "not UTF-8 text"),
                           (b"retries = " + b"{a = " * 5000, "nested too deeply"),
                           (b'policy = "p2c"\n', "has no 'backends' key")):
            path.write_bytes(raw)
            for command in ([sys.executable, "-m", "txlb.check", str(path)],
                            twistd_command("--config", str(path), "--listen", "tcp:0")):
                done = subprocess.run(command, capture_output=True, text=True, env=env,
                                      cwd=ROOT, timeout=60, check=False)
                output = done.stdout + done.stderr
                self.assertEqual(done.returncode, 2, output)
                self.assertIn(words, output)
                self.assertNotIn("Traceback", output)
                self.assertEqual(len(output.strip().splitlines()), 1, output)

    @defer.inlineCallbacks
    def test_with_workers_every_worker_and_a_respawned_one_take_the_reload(self) -> Any:
        yield defer.ensureDeferred(self._workers())

    async def model_requests(self, lb: TwistdProcess, model: str, count: int,
                             ) -> list[tuple[int, str | None]]:
        answers = []
        for _ in range(count):
            response, _ = await self.client.fetch(
                lb.url + "/v1/chat/completions", b"POST",
                json.dumps({"model": model, "max_tokens": 1,
                            "messages": [{"role": "user", "content": "hi"}]}).encode(), JSON)
            answers.append((response.code, header(response, b"x-backend")))
        return answers

    async def _workers(self) -> None:
        first, second = await self.sims(2)
        self.config = Path(self.mktemp()).resolve()
        self.config.parent.mkdir(parents=True, exist_ok=True)
        self.write(first.key)
        lb = TwistdProcess("--config", str(self.config), "--admin",
                           "tcp:0:interface=127.0.0.1", "--workers", "2")
        self.addCleanup(lambda: defer.ensureDeferred(lb.stop()))
        await lb.started()
        await wait_until(lambda: lb.output().count(") serving") >= 2, timeout=30,
                         what="both workers")
        await wait_until(lambda: "re-reads" in lb.output(), what="the SIGHUP handler")
        self.client = Client()
        self.addCleanup(self.client.pool.closeCachedConnections)
        self.assertEqual({code for code, _ in await self.model_requests(lb, "chat", 4)},
                         {404})

        # routes are the workers' (their routers), backends the supervisor's (mirrored)
        self.write(first.key, second.key,
                   extra='[[routes]]\nmodel = "chat"\nto = { "sim-model" = 1 }\n\n')
        os.kill(lb.pid, signal.SIGHUP)
        await wait_until(lambda: "generation 2 applied" in lb.output(), what="the reload")
        answers = await self.model_requests(lb, "chat", 20)  # fresh connections: both workers
        self.assertEqual({code for code, _ in answers}, {200})
        self.assertEqual({backend for _, backend in answers}, {first.key, second.key})

        # a worker started after the reload starts with the new config
        _, body = await self.client.fetch(lb.admin_url + "/status")
        workers = json.loads(body.body)["workers"]
        os.kill(workers[0]["pid"], signal.SIGKILL)
        await wait_until(lambda: lb.output().count(") serving") >= 3, timeout=30,
                         what="the replacement worker")
        answers = await self.model_requests(lb, "chat", 20)
        self.assertEqual({code for code, _ in answers}, {200})

    def test_check_exits_0_or_2_without_starting(self) -> None:
        good = Path(self.mktemp()).resolve()
        good.parent.mkdir(parents=True, exist_ok=True)
        good.write_text('listen = "tcp:1"\nbackends = ["127.0.0.1:9"]\n')
        bad = Path(self.mktemp()).resolve()
        bad.write_text("health-interval = 0\n")
        env = clean_environment()
        for command, code, words in (
                ([sys.executable, "-m", "txlb.check", str(good)], 0, "OK: "),
                ([sys.executable, "-m", "txlb.check", str(bad)], 2, "--health-interval"),
                (twistd_command("--check", "--config", str(good)), 0, "OK: "),
                (twistd_command("--check", "--config", str(bad)), 2, "--health-interval"),
        ):
            done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT,
                                  timeout=60, check=False)
            self.assertEqual(done.returncode, code, done)
            output = done.stdout + done.stderr
            self.assertIn(words, output)
            self.assertEqual(len(output.strip().splitlines()), 1, output)
