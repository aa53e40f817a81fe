"""
What a result-log line says of an answer (:mod:`txlb._records.summary`), to the documented
limit (docs/result-log.md, "Limits"), for answers the rest of the suite never sent -- odd but
possible shapes, chunked captures, several choices, streams told apart from plain answers,
privacy options.

Written for the survivors of the full mutation run of ``_records/summary``
(``bench/results/mutation-full/_records-summary.json``).  The limits are written out here
(512 KiB, 1,000 characters, 32 / 2,048 / 64 / 64 bytes, 8 KiB), not imported: a test that
reads the constant it checks moves with it.
"""

from __future__ import annotations

import json

from twisted.trial.unittest import SynchronousTestCase

from txlb._config import ConfigError, build_config
from txlb._log.escape import clip
from txlb._records.resultlog import format_json
from txlb._records.summary import Privacy, RequestRecord, dechunk, privacy_of, summarize

from .test_prompt_tokens import CHAT, MESSAGES, RESPONSES, chat, chunk, counts
from .test_summary import SSE_TYPE, record, recorded, sse


class LimitTests(SynchronousTestCase):
    """Answers the full run of ``_records/summary``: each documented limit, to the byte."""

    def test_the_first_512_kib_are_read_and_no_more(self) -> None:
        whole = RequestRecord(started=0, method=b"POST", path=CHAT, orid_header=None,
                              request_body=b"")
        whole.capture(b"x" * (512 * 1024))
        self.assertEqual((whole.captured, whole.truncated), (512 * 1024, False))
        over = RequestRecord(started=0, method=b"POST", path=CHAT, orid_header=None,
                             request_body=b"")
        over.capture(b"x" * (512 * 1024 + 1))  # one read, over the limit
        self.assertEqual((over.captured, over.truncated), (512 * 1024, True))

    def test_the_tail_past_the_capture_keeps_the_last_64_kib_and_no_more(self) -> None:
        """What usage is read from past the 512 KiB: a bound on memory, to the byte."""
        record_ = RequestRecord(started=0, method=b"POST", path=CHAT, orid_header=None,
                                request_body=b"")
        record_.capture(b"x" * (512 * 1024))
        record_.capture(b"a" + b"y" * (64 * 1024))  # one read, one byte over the tail
        self.assertEqual(record_.tail_size, 64 * 1024)
        self.assertEqual(b"".join(record_.tail), b"y" * (64 * 1024))

    def test_log_content_goes_up_to_1000_characters(self) -> None:
        self.assertEqual(build_config({"log-content": "1000"}).log_content, 1000)
        self.assertRaises(ConfigError, build_config, {"log-content": "1001"})
        answer = chat()
        answer["choices"][0]["message"]["content"] = "w" * 3000
        summary = summarize(record(chunks=[json.dumps(answer).encode()]), Privacy(content=5000))
        self.assertEqual(len(summary.preview), 1000)

    def test_method_path_and_finish_are_cut_to_their_limits(self) -> None:
        answer = {"choices": [{"index": 0, "message": {"content": "x"},
                               "finish_reason": "f" * 100}]}
        summary = summarize(record(path=b"/v1/chat/completions", method=b"M" * 100,
                                   chunks=[json.dumps(answer).encode()]))
        self.assertEqual((summary.method, summary.finish),
                         (clip("M" * 100, 32), clip("f" * 100, 64)))
        other = summarize(record(path=b"/p" * 2000))
        self.assertEqual(other.path, clip("/p" * 2000, 2048))

    def test_request_keys_are_cut_to_64_bytes_and_listed_up_to_64(self) -> None:
        keys = {f"k{n:02}": 1 for n in range(64)}
        summary = summarize(record(request=keys, status=400, chunks=[b"bad"]))
        self.assertEqual(summary.req_keys, sorted(keys))  # 64 of them: no "…+0"
        long = summarize(record(request={"k" * 100: 1}, status=400, chunks=[b"bad"]))
        self.assertEqual(long.req_keys, [clip("k" * 100, 64, "key")])

    def test_an_error_body_is_cut_to_8_kib(self) -> None:
        summary = summarize(record(status=500, chunks=[b"e" * 9000]))
        self.assertEqual(summary.err_body, clip("e" * 9000, 8192, "text"))

    def test_a_sum_of_counts_stops_at_64_bits(self) -> None:
        """llama.cpp's prompt is cache_n + prompt_n: a sum past 2**63 - 1 is no count."""
        for cache_n, prompt_n, expected in ((2**62, 2**62 - 1, 2**63 - 1),
                                            (2**62, 2**62, None),
                                            (2**62, 0, 2**62)):
            timings = {"cache_n": cache_n, "prompt_n": prompt_n}
            prompt, _ = counts(CHAT, chat(timings=timings))
            self.assertEqual(prompt, expected, (cache_n, prompt_n))


class AnswerShapeTests(SynchronousTestCase):
    """Answers the full run of ``_records/summary``: answers the other tests never sent."""

    def test_the_first_choice_counts_wherever_it_is_in_the_list(self) -> None:
        answer = {"choices": [{"index": 1, "message": {"content": "second"}},
                              {"index": 0, "message": {"content": "first"},
                               "finish_reason": "stop"}]}
        summary = summarize(record(chunks=[json.dumps(answer).encode()]))
        self.assertEqual((summary.preview, summary.finish), ("first", "stop"))

    def test_llamacpp_timings_are_read_from_the_last_event_that_has_them(self) -> None:
        body = sse(chunk("a"), chunk(None, "stop", timings={"cache_n": 1, "prompt_n": 1}),
                   chunk(None, timings={"cache_n": 60, "prompt_n": 2}))
        self.assertEqual(counts(CHAT, body, stream=True), (62, 60))

    def test_timings_are_looked_for_in_the_last_three_events(self) -> None:
        timings = {"cache_n": 60, "prompt_n": 2}
        third = sse(chunk("a", timings=timings), chunk("b"), chunk(None, "stop"))
        self.assertEqual(counts(CHAT, third, stream=True), (62, 60))
        fourth = sse(chunk("a", timings=timings), chunk("b"), chunk("c"), chunk(None, "stop"))
        self.assertEqual(counts(CHAT, fourth, stream=True), (None, None))

    def test_cached_tokens_without_prompt_tokens_take_the_prompt_from_timings(self) -> None:
        answer = chat({"prompt_tokens_details": {"cached_tokens": 5}},
                      timings={"cache_n": 5, "prompt_n": 3})
        self.assertEqual(counts(CHAT, answer), (8, 5))

    def test_a_responses_stream_is_a_stream(self) -> None:
        for path, fixture in ((RESPONSES, "llamacpp/responses.sse"),
                              (MESSAGES, "llamacpp/messages.sse")):
            summary = summarize(record(path=path, chunks=[recorded(fixture)],
                                       content_type=SSE_TYPE))
            self.assertTrue(summary.stream, path)
            self.assertIs(json.loads(format_json(summary))["stream"], True)

    def test_an_event_stream_that_opens_with_a_comment_is_a_stream(self) -> None:
        """SSE allows ``: keep-alive`` comments: the content type says it is a stream."""
        body = b": ping\n\n" + b"".join(
            b"data: " + json.dumps(e).encode() + b"\n\n" for e in (
                {"type": "response.output_text.delta", "delta": "hi"},
                {"type": "response.completed", "response": {"status": "completed"}}))
        summary = summarize(record(path=RESPONSES, chunks=[body], content_type=SSE_TYPE))
        self.assertEqual((summary.stream, summary.preview, summary.finish),
                         (True, "hi", "completed"))

    def test_a_responses_answer_without_a_content_type(self) -> None:
        answer = {"status": "completed", "output": [
            {"type": "message", "content": [{"type": "output_text", "text": "ok"}]}]}
        summary = summarize(record(path=RESPONSES, chunks=[json.dumps(answer).encode()],
                                   content_type=None))
        self.assertEqual((summary.stream, summary.preview), (False, "ok"))

    def test_a_function_call_delta_is_not_reasoning(self) -> None:
        body = sse({"type": "response.function_call_arguments.delta", "delta": '{"a": 1}'},
                   {"type": "response.output_text.delta", "delta": "done"})
        summary = summarize(record(path=RESPONSES, chunks=[body], content_type=SSE_TYPE))
        self.assertEqual((summary.think, summary.preview), (False, "done"))

    def test_an_event_of_no_string_type_is_skipped_not_the_end(self) -> None:
        body = sse({"type": ["odd"]}, {"type": "response.output_text.delta", "delta": "hi"})
        summary = summarize(record(path=RESPONSES, chunks=[body], content_type=SSE_TYPE))
        self.assertEqual(summary.preview, "hi")

    def test_an_output_item_that_is_no_object_is_skipped(self) -> None:
        answer = {"status": "completed", "output": [
            "odd", {"type": "message", "content": [{"type": "output_text", "text": "ok"}]}]}
        summary = summarize(record(path=RESPONSES, chunks=[json.dumps(answer).encode()]))
        self.assertEqual(summary.preview, "ok")

    def test_a_responses_answer_says_only_its_output_text_blocks(self) -> None:
        """A message's other blocks (a refusal, an odd one holding ``text``) are no answer."""
        answer = {"status": "completed", "output": [{"type": "message", "content": [
            {"type": "refusal", "refusal": "no", "text": "not the answer"},
            {"type": "output_text", "text": "ok"}]}]}
        summary = summarize(record(path=RESPONSES, chunks=[json.dumps(answer).encode()]))
        self.assertEqual((summary.preview, summary.finish), ("ok", "completed"))

    def test_a_content_block_that_is_no_object_is_skipped(self) -> None:
        answer = {"type": "message", "stop_reason": "end_turn",
                  "content": ["odd", {"type": "tool_use", "text": "not text"},
                              {"type": "text", "text": "ok"}]}
        summary = summarize(record(path=MESSAGES, chunks=[json.dumps(answer).encode()]))
        self.assertEqual((summary.preview, summary.finish), ("ok", "end_turn"))

    def test_a_message_start_without_its_message_is_skipped(self) -> None:
        body = sse({"type": "message_start", "message": "odd"},
                   {"type": "content_block_delta", "delta": {"type": "text_delta",
                                                             "text": "hi"}},
                   {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                    "usage": {"output_tokens": 1}})
        summary = summarize(record(path=MESSAGES, chunks=[body], content_type=SSE_TYPE))
        self.assertEqual((summary.preview, summary.finish), ("hi", "end_turn"))

    def test_a_capture_cut_in_a_two_digit_size_line(self) -> None:
        self.assertEqual(dechunk(b"5\r\nhello\r\n1a"), b"hello")


class PrivacyOptionTests(SynchronousTestCase):
    """Answers the full run of ``_records/summary``: --log-user from the configuration."""

    def test_log_user_from_the_configuration(self) -> None:
        mail = {"user": "alice@example.com"}
        for mode, orid in (("keep", "alice@example.com"), ("drop", "-")):
            privacy = privacy_of(build_config({"log-user": mode}))
            self.assertEqual(summarize(record(request=mail), privacy).orid, orid, mode)
        privacy = privacy_of(build_config({"log-user": "hash", "log-user-key": "k" * 32}))
        self.assertEqual(summarize(record(request=mail), privacy).orid,
                         summarize(record(request=mail),
                                   Privacy(user="hash", user_key=b"k" * 32)).orid)
        self.assertRegex(summarize(record(request=mail), privacy).orid, r"^h:[0-9a-f]{16}$")

    def test_the_user_key_is_never_in_a_repr(self) -> None:
        """A Privacy may be logged or shown in a traceback: the HMAC key must not be."""
        self.assertNotIn("sekrit", repr(Privacy(user="hash", user_key=b"sekrit")))


class DechunkAndChoiceTests(SynchronousTestCase):
    def test_dechunk(self) -> None:
        from txlb._records.summary import dechunk

        self.assertEqual(dechunk(b"1\r\na\r\n10\r\n" + b"b" * 16 + b"\r\n2;x=1\r\ncc\r\n0\r\n\r\n"),
                         b"a" + b"b" * 16 + b"cc")
        self.assertEqual(dechunk(b"1\r\na\r\n"), b"a")
        self.assertEqual(dechunk(b"zz\r\nbad\r\n"), b"")
        self.assertEqual(dechunk(b"1\r\na\r\n5"), b"a")  # capture cut in a size line

    def test_only_the_first_choice_counts(self) -> None:
        from txlb._records.summary import summarize

        record = RequestRecord(started=0.0, method=b"POST", path=b"/v1/chat/completions",
                               orid_header=None, request_body=b'{"n": 2}',
                               backend="127.0.0.1:8002", status=200, ended=1.0,
                               content_type=b"application/json")
        record.capture(json.dumps({"choices": [
            {"index": 0, "message": {"content": "one"}, "finish_reason": "stop"},
            {"index": 1, "message": {"content": "second choice"}},
            "not a choice",
        ]}).encode())
        summary = summarize(record)
        self.assertEqual((summary.preview, summary.clen), ("one", 3))

    def test_an_sse_answer_that_opens_with_a_comment(self) -> None:
        from txlb._records.summary import summarize

        record = RequestRecord(started=0.0, method=b"POST", path=b"/v1/chat/completions",
                               orid_header=None, request_body=b"{}",
                               backend="127.0.0.1:8002", status=200, ended=1.0,
                               content_type=b"text/event-stream")
        record.capture(b': ping\n\ndata: {"choices": [{"index": 0, "delta": {"content": "hi"},'
                       b' "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n')
        summary = summarize(record)
        self.assertEqual((summary.finish, summary.preview), ("stop", "hi"))
