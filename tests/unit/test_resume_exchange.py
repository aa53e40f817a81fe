"""
A stream resumed on another engine, in memory: the exchange's side of ``--resume`` -- what
is sent, what the client reads, every count back to 0 whatever fails.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet import error as neterror
from twisted.python.failure import Failure
from twisted.web.client import ResponseFailed

from ..helpers import FakeResponse
from .test_failover import FailoverTestCase

SSE = [(b"Content-Type", b"text/event-stream")]
CHAT = json.dumps({"model": "m", "stream": True, "max_tokens": 10,
                   "messages": [{"role": "user", "content": "hi"}]}).encode()


def chunk(content: str | None = None, ident: str = "chatcmpl-1", role: bool = False,
          finish: str | None = None) -> bytes:
    delta: dict[str, Any] = {"role": "assistant"} if role else {}
    if content is not None:
        delta["content"] = content
    return b"data: " + json.dumps({
        "id": ident, "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}).encode() + b"\n\n"


def answer(code: int = 200) -> FakeResponse:
    """A streamed 200, or an empty answer of ``code``."""
    if code == 200:
        return FakeResponse(200, SSE)
    return FakeResponse(code, length=0)


def died() -> Failure:
    return Failure(ResponseFailed([Failure(neterror.ConnectionLost("engine killed"))]))


class ResumeExchangeTests(FailoverTestCase):
    def setUp(self) -> None:
        self.build()

    def stream(self, n: int, *events: bytes) -> Any:
        response = self.upstream.calls[n].respond(answer())
        for data in events:
            response.send(data)
        return response

    def started(self, body: bytes = CHAT) -> Any:
        client = self.client()
        client.request(b"POST", b"/v1/chat/completions", body=body)
        first = self.stream(0, chunk("", role=True), chunk("a "), chunk("b "))
        return client, first

    def tokenized(self, n: int, count: int | None = None) -> None:
        """Call ``n`` is the count of the text so far: answered ``count``, or 404 (none)."""
        call = self.upstream.calls[n]
        self.assertTrue(call.uri.endswith(b"/tokenize"), call.uri)
        if count is None:
            call.respond(FakeResponse(404, length=0)).end()
            return
        body = json.dumps({"count": count, "tokens": list(range(count))}).encode()
        response = call.respond(FakeResponse(200, [(b"Content-Type", b"application/json")],
                                             length=len(body)))
        response.send(body)
        response.end()

    def sample(self, name: str, **labels: str) -> float | None:
        return self.lb.metrics.registry.get_sample_value(name, labels)

    def test_a_dead_engines_stream_goes_on_elsewhere(self) -> None:
        client, first = self.started()
        first.end(died())
        self.assertEqual(len(self.upstream.calls), 2)
        self.assertNotEqual(self.backend_of(0), self.backend_of(1))
        asked = json.loads(self.upstream.calls[1].body)  # the text counted where it goes on
        self.assertEqual((asked["prompt"], asked["add_special_tokens"]), ("a b ", False))
        self.tokenized(1, 2)
        self.assertEqual(self.backend_of(1), self.backend_of(2))
        sent = json.loads(self.upstream.calls[2].body)
        self.assertEqual(sent["messages"][-1], {"role": "assistant", "content": "a b "})
        self.assertEqual((sent["max_tokens"], sent["continue_final_message"],
                          sent["add_generation_prompt"]), (8, True, False))
        second = self.stream(2, chunk("", ident="chatcmpl-9", role=True),
                             chunk("c ", ident="chatcmpl-9"),
                             chunk(ident="chatcmpl-9", finish="stop"), b"data: [DONE]\n\n")
        second.end()
        response = client.response()
        self.assertTrue(response.complete)
        events = [part for part in response.body.split(b"\n\n") if part]
        self.assertEqual(len(events), 6)  # one role chunk, a b c, the finish, [DONE]
        texts = [json.loads(e[6:])["choices"][0]["delta"].get("content") for e in events[:-1]]
        self.assertEqual(texts, ["", "a ", "b ", "c ", None])
        self.assertNotIn(b"chatcmpl-9", response.body)
        record = self.records[-1]
        self.assertEqual((record.resumes, record.resumed_backend, record.outcome),
                         (1, self.backend_of(2), "ok"))
        self.assertEqual(self.lb.pool.slots.in_flight, 0)
        self.assertEqual(self.sample("txlb_stream_resumes_total", result="resumed"), 1)
        self.assertEqual(self.lb.metrics.resume_status(), {"resumed": 1, "cut": {}})

    def test_the_engines_count_makes_the_limits_and_the_usage(self) -> None:
        """Two events held four tokens (speculative decoding): the engine's count wins."""
        client, first = self.started(json.dumps({**json.loads(CHAT), "stream_options": {
            "include_usage": True}}).encode())
        first.end(died())
        self.tokenized(1, 4)
        self.assertEqual(json.loads(self.upstream.calls[2].body)["max_tokens"], 6)
        usage = b"data: " + json.dumps({"id": "x", "choices": [], "usage": {
            "prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}}).encode()
        self.stream(2, chunk("c "), usage + b"\n\n", b"data: [DONE]\n\n").end()
        events = [json.loads(e[6:]) for e in client.response().body.split(b"\n\n")
                  if e.startswith(b"data: {")]
        self.assertEqual(events[-1]["usage"], {"prompt_tokens": 1, "completion_tokens": 10,
                                               "total_tokens": 11})

    def test_an_engine_without_tokenize_keeps_the_events_count(self) -> None:
        client, first = self.started()
        first.end(died())
        self.tokenized(1)
        self.assertEqual(json.loads(self.upstream.calls[2].body)["max_tokens"], 8)

    def test_a_count_that_never_comes_is_not_waited_for(self) -> None:
        client, first = self.started()
        first.end(died())
        self.clock.advance(1.0)  # TOKENIZE_TIMEOUT
        self.assertEqual(len(self.upstream.calls), 3)
        self.assertEqual(json.loads(self.upstream.calls[2].body)["max_tokens"], 8)

    def test_a_continuation_refused_is_tried_on_another_engine(self) -> None:
        client, first = self.started()
        first.end(died())
        self.tokenized(1, 2)
        self.upstream.calls[2].respond(answer(503)).end()
        self.tokenized(3, 2)
        self.assertEqual(len({self.backend_of(n) for n in (0, 2, 4)}), 3)
        self.stream(4, chunk("c "), b"data: [DONE]\n\n").end()
        self.assertTrue(client.response().complete)
        self.assertEqual(self.lb.pool.slots.in_flight, 0)

    def test_no_engine_left_cuts_the_stream(self) -> None:
        client, first = self.started()
        first.end(died())
        self.tokenized(1)
        self.upstream.calls[2].fail(neterror.ConnectionRefusedError())
        self.tokenized(3)
        self.upstream.calls[4].fail(neterror.ConnectionRefusedError())
        response = client.response()
        self.assertFalse(response.complete)  # cut short, never a fake end
        self.assertEqual(self.records[-1].resume_refused, "continuation_failed")
        self.assertEqual(self.lb.pool.slots.in_flight, 0)
        self.assertEqual(
            self.sample("txlb_stream_resumes_total", result="continuation_failed"), 1)

    def test_the_client_leaving_meanwhile_ends_it(self) -> None:
        client, first = self.started()
        first.end(died())
        client.disconnect()
        self.assertEqual(self.lb.pool.slots.in_flight, 0)
        self.assertEqual(self.records[-1].outcome, "client_abort")

    def test_a_request_that_cannot_be_continued_is_cut(self) -> None:
        body = json.loads(CHAT)
        body["n"] = 2
        client, first = self.started(json.dumps(body).encode())
        first.end(died())
        self.assertEqual(len(self.upstream.calls), 1)
        self.assertFalse(client.response().complete)
        self.assertEqual(self.records[-1].resume_refused, "n")
        self.assertEqual(self.sample("txlb_stream_resumes_total", result="n"), 1)
        self.assertEqual(self.lb.metrics.resume_status(), {"resumed": 0, "cut": {"n": 1}})

    def test_a_cut_inside_an_event_is_not_resumed(self) -> None:
        client, first = self.started()
        first.send(chunk("c ")[:15])
        first.end(died())
        self.assertEqual(len(self.upstream.calls), 1)
        self.assertEqual(self.records[-1].resume_refused, "mid_event")

    def test_past_the_bound_a_stream_is_not_resumable(self) -> None:
        client, first = self.started()
        filler = chunk("x" * 4000)
        for _ in range(140):  # 140 x 4 KiB: past 512 KiB
            first.send(filler)
        first.end(died())
        self.assertEqual(len(self.upstream.calls), 1)
        self.assertEqual(self.records[-1].resume_refused, "too_long")

    def test_one_resume_at_most_by_default(self) -> None:
        client, first = self.started()
        first.end(died())
        self.tokenized(1, 2)
        self.stream(2, chunk("c ")).end(died())
        self.assertEqual(len(self.upstream.calls), 3)
        self.assertFalse(client.response().complete)
        self.assertEqual(self.lb.pool.slots.in_flight, 0)

    def test_with_two_tries_it_resumes_twice_with_all_the_text(self) -> None:
        self.build(resume_tries=2)
        client, first = self.started()
        first.end(died())
        self.tokenized(1, 2)
        self.stream(2, chunk("", role=True), chunk("c ")).end(died())
        self.tokenized(3, 3)
        sent = json.loads(self.upstream.calls[4].body)
        self.assertEqual(sent["messages"][-1]["content"], "a b c ")
        self.assertEqual(sent["max_tokens"], 7)
        self.stream(4, chunk("", role=True), chunk("d "), b"data: [DONE]\n\n").end()
        texts = [json.loads(e[6:])["choices"][0]["delta"].get("content")
                 for e in client.response().body.split(b"\n\n") if e.startswith(b"data: {")]
        self.assertEqual(texts, ["", "a ", "b ", "c ", "d "])
        self.assertEqual(self.records[-1].resumes, 2)

    def test_silence_past_the_read_timeout_resumes(self) -> None:
        self.build(read_timeout=5)
        client, first = self.started()
        self.clock.advance(6)
        self.assertEqual(len(self.upstream.calls), 2)
        self.assertTrue(first.transport.stopped)  # the silent try is closed
        self.tokenized(1, 2)
        self.stream(2, chunk("c "), b"data: [DONE]\n\n").end()
        self.assertTrue(client.response().complete)
        self.assertEqual(self.lb.pool.slots.in_flight, 0)

    def test_resume_off_cuts(self) -> None:
        self.build(resume=False)
        client, first = self.started()
        first.end(died())
        self.assertEqual(len(self.upstream.calls), 1)
        self.assertFalse(client.response().complete)

    def test_a_completions_stream_continues_its_prompt(self) -> None:
        client = self.client()
        client.request(b"POST", b"/v1/completions", body=json.dumps(
            {"model": "m", "prompt": "say ", "stream": True, "max_tokens": 5}).encode())

        def text(value: str, ident: str = "cmpl-1") -> bytes:
            return b"data: " + json.dumps({"id": ident, "object": "text_completion",
                                           "created": 1, "model": "m", "choices": [
                                               {"index": 0, "text": value,
                                                "finish_reason": None}]}).encode() + b"\n\n"

        self.stream(0, text("a "), text("b ")).end(died())
        self.tokenized(1, 2)
        sent = json.loads(self.upstream.calls[2].body)
        self.assertEqual((sent["prompt"], sent["max_tokens"]), ("say a b ", 3))
        self.assertNotIn("continue_final_message", sent)
        self.stream(2, text("c ", "cmpl-7"), b"data: [DONE]\n\n").end()
        body = client.response().body
        self.assertNotIn(b"cmpl-7", body)
        texts = [json.loads(e[6:])["choices"][0]["text"] for e in body.split(b"\n\n")
                 if e.startswith(b"data: {")]
        self.assertEqual(texts, ["a ", "b ", "c "])
        self.assertEqual(self.lb.pool.slots.in_flight, 0)

    def exchange(self) -> Any:
        (live,) = self.lb.proxy.live
        return live

    def test_a_silent_continuation_is_left_for_another_engine(self) -> None:
        self.build(read_timeout=5)
        client, first = self.started()
        first.end(died())
        self.tokenized(1, 2)
        self.clock.advance(6)  # call 2, the continuation, never answers
        self.assertTrue(self.upstream.calls[2].cancelled)  # its engine stops generating
        self.tokenized(3, 2)
        self.assertEqual(self.lb.pool.slots.in_flight, 1)  # the next engine's slot only
        self.stream(4, chunk("c "), b"data: [DONE]\n\n").end()
        self.assertTrue(client.response().complete)
        self.assertEqual(self.lb.pool.slots.in_flight, 0)
        self.assertEqual(len(self.records), 1)

    def test_a_count_whose_body_stalls_is_stopped_and_not_waited_for(self) -> None:
        client, first = self.started()
        first.end(died())
        counting = self.upstream.calls[1].respond(
            FakeResponse(200, [(b"Content-Type", b"application/json")], length=100))
        counting.send(b'{"count": ')  # and nothing more
        self.clock.advance(1.0)
        self.assertTrue(counting.transport.stopped)
        self.assertEqual(json.loads(self.upstream.calls[2].body)["max_tokens"], 8)

    def test_a_hung_verdict_before_the_first_token_loses_nothing(self) -> None:
        client = self.client()
        client.request(b"POST", b"/v1/chat/completions", body=CHAT)
        first = self.stream(0, chunk("", role=True))
        self.exchange().backend_hung()  # nothing to continue yet: the stream goes on
        self.assertEqual(len(self.upstream.calls), 1)
        first.send(chunk("a "))
        first.end(died())  # now it has a token: resumed
        self.tokenized(1, 1)
        self.stream(2, chunk("b "), b"data: [DONE]\n\n").end()
        self.assertTrue(client.response().complete)
        self.assertEqual((self.records[-1].resumes, self.records[-1].resume_refused), (1, None))

    def test_a_continuation_dead_before_its_first_byte_goes_to_another_engine(self) -> None:
        client, first = self.started()
        first.end(died())
        self.tokenized(1, 2)
        self.upstream.calls[2].respond(answer()).end(died())  # a 200 head, no byte
        self.tokenized(3, 2)
        self.stream(4, chunk("c "), b"data: [DONE]\n\n").end()
        self.assertTrue(client.response().complete)
        self.assertEqual(self.lb.pool.slots.in_flight, 0)

    def test_a_continuation_event_without_end_is_cut_at_the_bound(self) -> None:
        client, first = self.started()
        first.end(died())
        self.tokenized(1, 2)
        second = self.stream(2, b"data: {")
        for _ in range(140):
            second.send(b"x" * 4096)  # 560 KiB of one event, never ended
        self.assertTrue(second.transport.stopped)
        self.assertFalse(client.response().complete)
        self.assertEqual(self.records[-1].resume_refused, "event_too_long")
        self.assertEqual(self.lb.pool.slots.in_flight, 0)
