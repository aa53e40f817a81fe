"""
A stream survives its engine: the real ``twistd -n llmlb`` before simulated vLLMs run as
processes, one killed with SIGKILL while it streams.  The simulator's answers are the words
``tok0 tok1 ...`` and it continues its own answer, so the client's text can be checked
token-exact: one uninterrupted answer, no byte twice, one ``id``, the usage of the whole.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor

from ..processes import Chunks, chat_body, header, wait_until
from ..redis import RedisServer
from .test_faults import FaultTestCase
from .test_integration import JSON

#: the answer each test asks for: long enough to be cut part-way at 20 tokens a second
TOKENS = 30


def events(body: bytes) -> list[Any]:
    """The stream's events, ``[DONE]`` as a string; every event whole and in order."""
    parts = body.decode().split("\n\n")
    assert parts[-1] == "", f"the stream ends mid-event: {parts[-1]!r}"
    found: list[Any] = []
    for part in parts[:-1]:
        assert part.startswith("data: "), part
        payload = part[len("data: "):]
        found.append(payload if payload == "[DONE]" else json.loads(payload))
    return found


def longest_wait(stream: Chunks, failed_at: float) -> float:
    """The longest time between two reads of ``stream`` from its failure on."""
    times = [failed_at, *(at for at, _ in stream.chunks if at > failed_at)]
    assert len(times) > 1, "nothing came after the failure"
    return max(later - sooner for sooner, later in itertools.pairwise(times))


class ResumeTests(FaultTestCase):
    async def start(self, *args: str) -> tuple[Any, Path]:
        sims = await self.sims(2, "--tokens-per-second", "20", "--ttft", "0.01")
        directory = Path(tempfile.mkdtemp(prefix="txlb-resume-"))
        self.addCleanup(shutil.rmtree, directory, True)
        log = directory / "results.log"
        lb = await self.balancer([s.key for s in sims], "--health-interval", "1",
                                 "--log-file", str(log), "--log-format", "json", *args)
        self.fleet = sims
        return lb, log

    async def killed_mid_stream(self, lb: Any, body: bytes, how: str = "kill",
                                ) -> tuple[Chunks, str, float]:
        """
        A stream, its engine killed (or stopped: ``how="stop"``) after its fifth event:
        (its body, the engine, when).
        """
        response = await self.client.request(
            lb.url + "/v1/chat/completions", b"POST", body,
            {**JSON, b"x-sim-tokens": [str(TOKENS).encode()]})
        self.assertEqual(response.code, 200)
        stream = Chunks()
        response.deliverBody(stream)
        first = header(response, b"x-backend")
        await wait_until(lambda: stream.body.count(b"data:") >= 5, what="five events")
        victim = next(sim for sim in self.fleet if sim.key == first)
        killed_at = time.monotonic()
        if how == "kill":
            victim.kill()
        else:
            victim.process.send_signal(signal.SIGSTOP)
            self.addCleanup(victim.process.send_signal, signal.SIGCONT)
        await stream.done
        assert first is not None
        return stream, first, killed_at

    def result_line(self, log: Path) -> Any:
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        return next(line for line in lines if line["path"] == "/v1/chat/completions")

    @defer.inlineCallbacks
    def test_a_killed_engines_stream_completes_token_exact(self) -> Any:
        yield from self.check_killed_engines_stream()

    @defer.inlineCallbacks
    def test_the_same_under_workers(self) -> Any:
        yield from self.check_killed_engines_stream("--workers", "2")

    @defer.inlineCallbacks
    def test_the_same_with_shared_state(self) -> Any:
        redis = RedisServer()
        self.addCleanup(redis.stop)
        yield from self.check_killed_engines_stream("--shared-state", redis.url)

    def check_killed_engines_stream(self, *args: str) -> Any:
        lb, log = yield defer.ensureDeferred(self.start(*args))
        body = chat_body(stream=True, stream_options={"include_usage": True})
        stream, first, killed_at = yield defer.ensureDeferred(
            self.killed_mid_stream(lb, body))
        self.assertTrue(stream.clean)
        found = events(stream.body)
        self.assertEqual(found[-1], "[DONE]")
        chunks = found[:-1]
        text = "".join(c["choices"][0]["delta"].get("content") or ""
                       for c in chunks if c["choices"])
        self.assertEqual(text, "".join(f"tok{i} " for i in range(TOKENS)))
        self.assertEqual({c["id"] for c in chunks}, {chunks[0]["id"]})
        self.assertEqual({c["model"] for c in chunks}, {"sim-model"})
        roles = [c for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
        self.assertEqual(len(roles), 1)
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        self.assertEqual([f for f in finishes if f], ["stop"])
        usage = chunks[-1]["usage"]
        self.assertEqual(usage["completion_tokens"], TOKENS)
        self.assertEqual(usage["prompt_tokens"], 1)  # "hello": the original prompt
        # the longest wait between two reads, the kill's included: under 1 s
        self.assertLess(longest_wait(stream, killed_at), 1.0)
        yield defer.ensureDeferred(wait_until(log.exists, what="the result log"))
        yield defer.ensureDeferred(wait_until(
            lambda: any('"/v1/chat/completions"' in line
                        for line in log.read_text().splitlines()), what="the log line"))
        line = self.result_line(log)
        other = next(sim.key for sim in self.fleet if sim.key != first)
        self.assertEqual((line["backend"], line["resumed"], line["resumed_on"]),
                         (first, 1, other))
        self.assertEqual((line["end"], line["finish"], line["ctok"]), ("ok", "stop", TOKENS))
        self.assertIn(f"backend {first} failed part-way through a stream", lb.output())

    @defer.inlineCallbacks
    def test_a_reset_connections_stream_completes(self) -> Any:
        """The engine resets the connection (a TCP RST) after its fifth token."""
        lb, log = yield defer.ensureDeferred(self.start())
        response = yield defer.ensureDeferred(self.client.request(
            lb.url + "/v1/chat/completions", b"POST", chat_body(stream=True),
            {**JSON, b"x-sim-tokens": [str(TOKENS).encode()], b"x-sim-reset-after": [b"5"]}))
        stream = Chunks()
        response.deliverBody(stream)
        yield stream.done
        yield defer.ensureDeferred(wait_until(
            lambda: log.exists() and '"/v1/chat/completions"' in log.read_text(),
            what="the log line"))
        self.assertTrue(stream.clean, (self.result_line(log), stream.body[-300:]))
        self.assertEqual(self.text_of(stream), "".join(f"tok{i} " for i in range(TOKENS)))
        first = header(response, b"x-backend")
        failed = [line for line in lb.output().splitlines()
                  if f"backend {first} failed part-way through a stream" in line]
        self.assertEqual(len(failed), 1, lb.output())
        self.assertIn("reset", failed[0])  # a TCP RST, as the engine sent it

    def text_of(self, stream: Chunks) -> str:
        return "".join(c["choices"][0]["delta"].get("content") or ""
                       for c in events(stream.body)[:-1] if c["choices"])

    @defer.inlineCallbacks
    def test_a_hung_engines_stream_completes_within_3_5s(self) -> Any:
        """
        SIGSTOP: the engine accepts and answers nothing.  The hung-engine detector takes
        it out (it judges from silence while other requests are answered: a client's
        short requests run beside the stream), and the stream goes on elsewhere.
        """
        lb, log = yield defer.ensureDeferred(self.start())
        done = False

        async def beside() -> None:
            deadline = time.monotonic() + 30
            while not done and time.monotonic() < deadline:
                fetch = defer.ensureDeferred(self.client.fetch(
                    lb.url + "/v1/chat/completions", b"POST", chat_body(stream=False),
                    {**JSON, b"x-sim-tokens": [b"1"]}))
                fetch.addTimeout(1.0, reactor)
                with contextlib.suppress(Exception):  # a try that gave up after 1 s
                    await fetch

        loop = defer.ensureDeferred(beside())
        try:
            stream, first, stopped_at = yield defer.ensureDeferred(
                self.killed_mid_stream(lb, chat_body(stream=True), how="stop"))
        finally:
            done = True
            yield loop
        self.assertTrue(stream.clean)
        self.assertEqual(self.text_of(stream), "".join(f"tok{i} " for i in range(TOKENS)))
        gap = longest_wait(stream, stopped_at)
        self.assertLess(gap, 3.5, lb.output())
        self.assertIn("judged hung", lb.output())
        print(f"\nSIGSTOPped engine mid-stream: the next token {gap:.2f}s later",
              file=sys.stderr)

    @defer.inlineCallbacks
    def test_with_resume_off_the_stream_is_cut(self) -> Any:
        lb, log = yield defer.ensureDeferred(self.start("--resume", "off"))
        stream, _, _ = yield defer.ensureDeferred(
            self.killed_mid_stream(lb, chat_body(stream=True)))
        self.assertFalse(stream.clean)  # truncated, never a fake clean end
        self.assertNotIn(b"[DONE]", stream.body)

    @defer.inlineCallbacks
    def test_a_request_it_cannot_continue_is_cut(self) -> Any:
        lb, log = yield defer.ensureDeferred(self.start())
        stream, _, _ = yield defer.ensureDeferred(
            self.killed_mid_stream(lb, chat_body(stream=True, logprobs=True)))
        self.assertFalse(stream.clean)
        yield defer.ensureDeferred(wait_until(
            lambda: log.exists() and '"/v1/chat/completions"' in log.read_text(),
            what="the log line"))
        self.assertNotIn("resumed", self.result_line(log))
