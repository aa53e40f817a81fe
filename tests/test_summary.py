"""The result-log fields, from records built by hand: every field, both shapes, every end."""

from __future__ import annotations

import json
import time

from twisted.trial.unittest import SynchronousTestCase

from txlb._resultlog import format_json, format_text
from txlb._summary import CAPTURE_LIMIT, RequestRecord, summarize


def record(path: bytes = b"/v1/chat/completions", request: object = None,
           chunks: list[bytes] = (), status: int | None = 200, outcome: str = "ok",
           content_type: bytes | None = b"application/json", orid: bytes | None = None,
           method: bytes = b"POST") -> RequestRecord:
    body = request if isinstance(request, bytes) else json.dumps(request or {}).encode()
    result = RequestRecord(started=100.0, method=method, path=path, orid_header=orid,
                           request_body=body, backend="127.0.0.1:8003", status=status,
                           outcome=outcome, ended=106.9135, first_byte=100.2121,
                           content_type=content_type)
    for chunk in chunks:
        result.capture(chunk)
    return result


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + \
        b"data: [DONE]\n\n"


def delta(content: str | None = None, reasoning: str | None = None,
          finish: str | None = None) -> dict[str, object]:
    d: dict[str, object] = {}
    if content is not None:
        d["content"] = content
    if reasoning is not None:
        d["reasoning_content"] = reasoning
    return {"choices": [{"index": 0, "delta": d, "finish_reason": finish}]}


STAMP = time.strftime("%m-%d %H:%M:%S", time.localtime(106.9135))


class TextLineTests(SynchronousTestCase):
    def test_plain_json_completion(self) -> None:
        answer = {"choices": [{"index": 0, "finish_reason": "stop",
                               "message": {"role": "assistant", "content": "Hello\nworld"}}],
                  "usage": {"prompt_tokens": 3, "completion_tokens": 432}}
        line = format_text(summarize(record(
            request={"model": "m", "max_tokens": 1024, "user": "905112"},
            chunks=[json.dumps(answer).encode()], orid=b"ORD-123")))
        self.assertEqual(
            line,
            f"{STAMP} orid=ORD-123 127.0.0.1:8003 status=200 finish=stop ctok=432/1024 "
            "thinking=False think=False empty=False clen=11 ttft=0.212 dur=6.913 "
            "| Hello\\nworld",
        )

    def test_sse_split_anywhere_with_reasoning_and_usage(self) -> None:
        stream = sse(
            delta(content=""), delta(reasoning="Let me"), delta(reasoning=" think."),
            delta(content="图片显示"), delta(content="一位年长的男性"), delta(finish="length"),
            {"choices": [], "usage": {"completion_tokens": 5}},
        )
        pieces = [stream[i:i + 7] for i in range(0, len(stream), 7)]  # events cut mid-way
        summary = summarize(record(
            request={"max_completion_tokens": 5, "user": "u-1",
                     "chat_template_kwargs": {"enable_thinking": True}},
            chunks=pieces, content_type=b"text/event-stream"))
        self.assertEqual((summary.finish, summary.completion_tokens, summary.max_tokens),
                         ("length", 5, 5))
        self.assertEqual((summary.thinking, summary.think, summary.empty), (True, True, False))
        self.assertEqual(summary.orid, "u-1")
        self.assertEqual(summary.clen, 11)
        self.assertEqual(summary.preview, "图片显示一位年长的男性")

    def test_completions_endpoint_text(self) -> None:
        stream = sse({"choices": [{"index": 0, "text": "abc", "finish_reason": None}]},
                     {"choices": [{"index": 0, "text": "def", "finish_reason": "stop"}]})
        summary = summarize(record(path=b"/v1/completions", chunks=[stream],
                                   content_type=b"text/event-stream"))
        self.assertEqual((summary.preview, summary.finish, summary.clen), ("abcdef", "stop", 6))
        self.assertIn("ctok=-/-", format_text(summary))

    def test_think_block_in_content(self) -> None:
        answer = {"choices": [{"index": 0, "finish_reason": "length",
                               "message": {"content": "<think>hmm, long thoughts"}}]}
        summary = summarize(record(chunks=[json.dumps(answer).encode()]))
        self.assertEqual((summary.think, summary.empty, summary.preview), (True, True, ""))
        answer["choices"][0]["message"]["content"] = "<think>x</think>\n\nThe answer."
        summary = summarize(record(chunks=[json.dumps(answer).encode()]))
        self.assertEqual((summary.think, summary.empty, summary.preview),
                         (True, False, "The answer."))

    def test_preview_is_200_characters(self) -> None:
        answer = {"choices": [{"index": 0, "message": {"content": "x" * 500}}]}
        summary = summarize(record(chunks=[json.dumps(answer).encode()]))
        self.assertEqual((len(summary.preview), summary.clen), (200, 500))

    def test_error_line_has_request_keys_and_whole_body(self) -> None:
        error = b'{"object":"error","message":"max_tokens too large\\nreally","code":400}'
        line = format_text(summarize(record(
            request={"model": "m", "messages": [], "max_tokens": 9, "stream": True,
                     "temperature": 0, "user": "905112"},
            chunks=[error], status=400)))
        self.assertTrue(line.startswith(f"{STAMP} orid=905112 127.0.0.1:8003 status=400 "
                                        "req_keys=['max_tokens','messages','model','stream',"
                                        "'temperature','user'] "), line)
        self.assertTrue(line.endswith(" ERR_BODY | " + error.decode()), line)
        self.assertNotIn("\n", line)

    def test_error_with_non_json_request(self) -> None:
        line = format_text(summarize(record(request=b"not json", chunks=[b"nope"], status=500)))
        self.assertIn("status=500 req_keys=- ", line)

    def test_other_paths_short_line(self) -> None:
        line = format_text(summarize(record(path=b"/v1/models", method=b"GET",
                                            request=b"", chunks=[b'{"data": []}'])))
        self.assertEqual(line, f"{STAMP} orid=- 127.0.0.1:8003 GET /v1/models status=200 "
                               "dur=6.913")

    def test_client_abort_before_response(self) -> None:
        line = format_text(summarize(record(status=None, outcome="client_abort")))
        self.assertIn("status=499 ", line)
        self.assertIn(" end=client_abort ", line)

    def test_client_abort_mid_stream(self) -> None:
        line = format_text(summarize(record(
            chunks=[sse(delta(content="par"))[:-14]], outcome="client_abort",
            content_type=b"text/event-stream")))
        self.assertIn("status=200 finish=- ", line)
        self.assertIn(" end=client_abort | par", line)

    def test_capture_is_bounded(self) -> None:
        big = record(chunks=[b"x" * 300_000, b"y" * 300_000, b"z" * 10])
        self.assertEqual(big.captured, CAPTURE_LIMIT)
        self.assertTrue(big.truncated)
        self.assertIn(" trunc=True", format_text(summarize(big)))

    def test_json_format_same_fields(self) -> None:
        answer = {"choices": [{"index": 0, "finish_reason": "stop",
                               "message": {"content": "a\nb"}}],
                  "usage": {"completion_tokens": 2}}
        fields = json.loads(format_json(summarize(record(
            request={"max_tokens": 8}, chunks=[json.dumps(answer).encode()], orid=b"o1"))))
        self.assertEqual(fields["orid"], "o1")
        self.assertEqual(fields["backend"], "127.0.0.1:8003")
        self.assertEqual((fields["status"], fields["finish"], fields["ctok"],
                          fields["max_tokens"]), (200, "stop", 2, 8))
        self.assertEqual((fields["thinking"], fields["think"], fields["empty"], fields["clen"]),
                         (False, False, False, 3))
        self.assertEqual(fields["preview"], "a\nb")
        self.assertEqual((fields["ttft"], fields["dur"]), (0.212, 6.913))
        error = json.loads(format_json(summarize(record(request={"b": 1, "a": 2},
                                                        chunks=[b"bad"], status=400))))
        self.assertEqual((error["req_keys"], error["err_body"]), (["a", "b"], "bad"))

    def test_authorization_never_logged(self) -> None:
        """The record holds no request headers but X-Orid, so nothing secret can leak."""
        line = format_text(summarize(record(request={"api_key": "sk-secret"}, status=401,
                                            chunks=[b"unauthorized"])))
        self.assertNotIn("sk-secret", line)
        self.assertIn("'api_key'", line)  # the key's name, never its value
