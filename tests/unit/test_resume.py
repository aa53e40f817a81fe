"""
A stream's resume, the pure parts: what its client holds (read_progress), the request that
continues it (refusal_of, continuation_body) and its events made the first try's
(ContinuationRewriter).
"""

from __future__ import annotations

import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from txlb._resume.continuation import continuation_body, refusal_of, stop_spans
from txlb._resume.progress import NotResumable, Progress, read_progress, unframed
from txlb._resume.rewrite import ContinuationRewriter
from txlb._resume.tokens import TOKENIZE_ANSWER_LIMIT, WholeAnswer, count_of, tokenize_body


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chunk(text: str | None = None, role: bool = False, finish: str | None = None,
          **delta: Any) -> bytes:
    if role:
        delta["role"] = "assistant"
    if text is not None:
        delta["content"] = text
    return event({"id": "chatcmpl-7", "object": "chat.completion.chunk", "created": 99,
                  "model": "m", "choices": [{"index": 0, "delta": delta,
                                             "logprobs": None, "finish_reason": finish}]})


def framed(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)


class ProgressTests(SynchronousTestCase):
    def test_the_text_and_head_of_the_first_try(self) -> None:
        relayed = chunk("", role=True) + chunk("tok0 ") + chunk("tok1 ")
        progress = read_progress(relayed, chunked=False, chat=True)
        self.assertEqual(progress, Progress("chatcmpl-7", 99, "m", "tok0 tok1 ", 2))

    def test_chunked_framing_read_to_a_chunk_boundary(self) -> None:
        relayed = framed(chunk("", role=True), chunk("a"), chunk("b"))
        self.assertEqual(read_progress(relayed, chunked=True, chat=True).text, "ab")
        with self.assertRaises(NotResumable) as cut:
            unframed(relayed[:-3])
        self.assertEqual(cut.exception.reason, "mid_chunk")
        with self.assertRaises(NotResumable) as ended:
            unframed(relayed + b"0\r\n\r\n")
        self.assertEqual(ended.exception.reason, "finished")

    def test_a_cut_inside_an_event_is_not_resumable(self) -> None:
        relayed = chunk("a") + chunk("b")[:20]
        with self.assertRaises(NotResumable) as cut:
            read_progress(relayed, chunked=False, chat=True)
        self.assertEqual(cut.exception.reason, "mid_event")

    def refused(self, relayed: bytes, chat: bool = True) -> str:
        with self.assertRaises(NotResumable) as cut:
            read_progress(relayed, chunked=False, chat=chat)
        return cut.exception.reason

    def test_what_cannot_be_continued(self) -> None:
        self.assertEqual(self.refused(chunk("a") + chunk(finish="stop")), "finished")
        self.assertEqual(self.refused(chunk("a") + b"data: [DONE]\n\n"), "finished")
        self.assertEqual(self.refused(chunk(tool_calls=[{"index": 0}])), "tool_call")
        self.assertEqual(self.refused(chunk(reasoning_content="hm")), "reasoning")
        self.assertEqual(self.refused(event({"choices": [{"index": 1, "delta": {}}]})), "n")
        self.assertEqual(self.refused(event({"error": {"message": "x"}})), "engine_error")
        self.assertEqual(self.refused(b"data: {nope\n\n"), "unreadable")
        self.assertEqual(self.refused(b"data: [1]\n\n"), "unreadable")
        self.assertEqual(self.refused(event({"choices": [
            {"index": 0, "text": "a", "logprobs": {"tokens": ["a"]}}]}), chat=False),
            "logprobs")

    def test_a_completion_stream(self) -> None:
        relayed = event({"id": "cmpl-1", "choices": [{"index": 0, "text": "tok0 "}]})
        progress = read_progress(relayed, chunked=False, chat=False)
        self.assertEqual((progress.text, progress.tokens, progress.ident),
                         ("tok0 ", 1, "cmpl-1"))

    def test_nothing_relayed_yet_is_an_empty_start(self) -> None:
        self.assertEqual(read_progress(b"", chunked=False, chat=True).text, "")


class ContinuationTests(SynchronousTestCase):
    chat = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}

    def test_a_chat_continues_its_final_assistant_message(self) -> None:
        body = json.loads(continuation_body(
            {**self.chat, "max_tokens": 10, "min_tokens": 3}, True,
            Progress("i", 1, "m", "tok0 tok1 ", 2)))
        self.assertEqual(body["messages"][-1], {"role": "assistant", "content": "tok0 tok1 "})
        self.assertEqual(body["messages"][:-1], self.chat["messages"])
        self.assertIs(body["continue_final_message"], True)
        self.assertIs(body["add_generation_prompt"], False)
        self.assertEqual((body["max_tokens"], body["min_tokens"]), (8, 1))

    def test_a_completion_continues_its_prompt(self) -> None:
        body = json.loads(continuation_body(
            {"prompt": "say ", "stream": True, "max_tokens": 3}, False,
            Progress("i", 1, "m", "a b", 2)))
        self.assertEqual((body["prompt"], body["max_tokens"]), ("say a b", 1))

    def test_nothing_generated_is_not_resumed(self) -> None:
        """The retry rules' case: the engine had the whole request, no token came."""
        with self.assertRaises(NotResumable) as cut:
            continuation_body(self.chat, True, Progress(None, None, None, "", 0))
        self.assertEqual(cut.exception.reason, "before_first_token")

    def test_an_answer_at_its_limit_is_finished(self) -> None:
        with self.assertRaises(NotResumable) as cut:
            continuation_body({**self.chat, "max_completion_tokens": 2}, True,
                              Progress("i", 1, "m", "a b", 2))
        self.assertEqual(cut.exception.reason, "finished")

    def test_a_stop_sequence_the_cut_may_split(self) -> None:
        self.assertTrue(stop_spans("the end is ne", ["near", "x"]))
        self.assertFalse(stop_spans("the end", "near"))
        self.assertFalse(stop_spans("abc", None))
        with self.assertRaises(NotResumable) as cut:
            continuation_body({**self.chat, "stop": "###"}, True,
                              Progress("i", 1, "m", "text #", 2))
        self.assertEqual(cut.exception.reason, "stop_sequence")

    def test_what_is_refused_from_the_request(self) -> None:
        chat = self.chat
        cases = {
            "not_streamed": {**chat, "stream": False},
            "n": {**chat, "n": 2},
            "logprobs": {**chat, "logprobs": True},
            "echo": {"prompt": "x", "stream": True, "echo": True},
            "structured": {**chat, "response_format": {"type": "json_schema"}},
            "tool_choice": {**chat, "tool_choice": "required"},
            "reasoning": {**chat, "chat_template_kwargs": {"enable_thinking": True}},
            "unreadable": {**chat, "messages": "hi"},
        }
        for reason, payload in cases.items():
            self.assertEqual(refusal_of(payload, "messages" in payload), reason, payload)
        self.assertEqual(refusal_of({"prompt": [1, 2], "stream": True}, False), "prompt_shape")
        self.assertIsNone(refusal_of({**chat, "response_format": {"type": "text"}}, True))
        self.assertIsNone(refusal_of({**chat, "tool_choice": "auto", "tools": []}, True))


class RewriterTests(SynchronousTestCase):
    progress = Progress("chatcmpl-7", 99, "m", "tok0 tok1 ", 2)

    def rewritten(self, body: bytes, sizes: int | None = None) -> list[Any]:
        out: list[bytes] = []
        rewriter = ContinuationRewriter(self.progress, True, out.append)
        step = sizes or len(body)
        for start in range(0, len(body), step):
            rewriter.feed(body[start:start + step])
        rewriter.close()
        joined = b"".join(out)
        self.assertTrue(joined.endswith(b"\n\n"))
        return [payload if payload == "[DONE]" else json.loads(payload)
                for payload in (part[6:] for part in joined.decode().split("\n\n") if part)]

    def continuation(self) -> bytes:
        usage = event({"id": "chatcmpl-99", "created": 5, "model": "other", "choices": [],
                       "usage": {"prompt_tokens": 12, "completion_tokens": 3,
                                 "total_tokens": 15}})
        again = {"id": "chatcmpl-99", "created": 5, "model": "other"}
        return (chunk("", role=True).replace(b"chatcmpl-7", b"chatcmpl-99")
                + event({**again, "choices": [{"index": 0, "delta": {"content": "tok2 "}}]})
                + usage + b"data: [DONE]\n\n")

    def test_one_stream_for_the_client(self) -> None:
        events = self.rewritten(self.continuation())
        self.assertEqual(len(events), 3)  # the role chunk dropped
        self.assertEqual(events[0]["choices"][0]["delta"], {"content": "tok2 "})
        for made in events[:2]:
            self.assertEqual((made["id"], made["created"], made["model"]),
                             ("chatcmpl-7", 99, "m"))
        # the continuation's prompt held the two tokens of the first try
        self.assertEqual(events[1]["usage"], {"prompt_tokens": 10, "completion_tokens": 5,
                                              "total_tokens": 15})
        self.assertEqual(events[2], "[DONE]")

    def test_any_chunking_gives_the_same_events(self) -> None:
        whole = self.rewritten(self.continuation())
        for size in (1, 2, 7, 33):
            self.assertEqual(self.rewritten(self.continuation(), size), whole)

    def test_an_event_that_is_not_json_passes_as_sent(self) -> None:
        out: list[bytes] = []
        rewriter = ContinuationRewriter(self.progress, True, out.append)
        rewriter.feed(b"data: hello\n\n: comment\ndata: {}\n\n")
        self.assertEqual(b"".join(out), b"data: hello\n\n: comment\ndata: {}\n\n")


class TokenCountTests(SynchronousTestCase):
    def test_vllms_and_llamacpps_answers(self) -> None:
        self.assertEqual(count_of(b'{"count": 3, "tokens": [1, 2, 3]}', 10), 3)
        self.assertEqual(count_of(b'{"tokens": [1, 2]}', 10), 2)

    def test_nonsense_is_no_count(self) -> None:
        for answer in (b"nope", b"[1]", b'{"count": "3"}', b'{"count": true}',
                       b'{"count": 0}', b'{"count": 11}', b'{"tokens": 5}', b"{}"):
            self.assertIsNone(count_of(answer, 10), answer)

    def test_the_request_carries_both_engines_fields(self) -> None:
        body = json.loads(tokenize_body("m", "a b"))
        self.assertEqual(body, {"prompt": "a b", "content": "a b",
                                "add_special_tokens": False, "model": "m"})
        self.assertNotIn("model", json.loads(tokenize_body(None, "x")))

    def test_an_answer_past_the_limit_is_stopped(self) -> None:
        reader = WholeAnswer()
        stopped: list[bool] = []

        class Producer:
            def stopProducing(self) -> None:
                stopped.append(True)

        reader.body_started(Producer())  # type: ignore[arg-type]
        reader.body_chunk(b"x" * TOKENIZE_ANSWER_LIMIT)
        reader.body_chunk(b"x")
        self.assertIsNone(self.successResultOf(reader.done))
        self.assertEqual(stopped, [True])
        reader.body_ended(None)  # nothing more happens

    def test_a_whole_answer(self) -> None:
        reader = WholeAnswer()
        reader.body_chunk(b'{"count"')
        reader.body_chunk(b": 1}")
        reader.body_ended(None)
        self.assertEqual(self.successResultOf(reader.done), b'{"count": 1}')
