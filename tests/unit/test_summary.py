"""The result-log fields, from records built by hand: every field, both shapes, every end."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable

from twisted.trial.unittest import SynchronousTestCase

from txlb import Pool
from txlb._log import escape as _escape
from txlb._log.escape import clip, escape, escape_json
from txlb._records.metrics import Metrics
from txlb._records.resultlog import format_json, format_text
from txlb._records.summary import (
    CAPTURE_LIMIT,
    MAX_ERR_BODY,
    MAX_FINISH,
    MAX_KEY,
    MAX_LINE,
    MAX_ORID,
    MAX_PATH,
    TAIL_LIMIT,
    Privacy,
    RequestRecord,
    Summary,
    parse_json_object,
    summarize,
)


def record(path: bytes = b"/v1/chat/completions", request: object = None,
           chunks: list[bytes] = (), status: int | None = 200, outcome: str = "ok",
           content_type: bytes | None = b"application/json", orid: bytes | None = None,
           method: bytes = b"POST", count_events: bool = False) -> RequestRecord:
    body = request if isinstance(request, bytes) else json.dumps(request or {}).encode()
    result = RequestRecord(started=100.0, method=method, path=path, orid_header=orid,
                           request_body=body, backend="127.0.0.1:8003", status=status,
                           outcome=outcome, ended=106.9135, first_byte=100.2121,
                           content_type=content_type, count_events=count_events)
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
            "thinking=False think=False empty=False clen=11 ttft=0.212 dur=6.913 ptok=3 "
            "cached=- | Hello\\nworld",
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

    def test_a_stream_is_read_as_one_by_its_type_or_by_its_first_event(self) -> None:
        """
        Either says it: a text/event-stream that opens with a comment (': ping'), or SSE
        events sent under another Content-Type (an engine that does not set it).
        """
        from txlb._records.summary import parse_completion

        events = sse(delta(content="hi"), delta(finish="stop"))
        for body, content_type in ((b": ping\n\n" + events, b"text/event-stream"),
                                   (events, None), (events, b"application/json")):
            read = parse_completion(body, content_type)
            self.assertEqual((read.stream, "".join(read.content), read.finish),
                             (True, "hi", "stop"), (body[:8], content_type))

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
        # the body's own backslash is doubled: a literal "\n" cannot pass for a newline
        self.assertTrue(line.endswith(" ERR_BODY | " + error.decode().replace("\\", "\\\\")),
                        line)
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


#: Characters that end a line for some line-based tool, or act on a terminal.
RAW_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def recipe_view(line: str) -> tuple[list[str], dict[str, str]]:
    """
    What the grep/awk recipes of docs/result-log.md see: the words before the first ``|``
    (split on every kind of whitespace, a superset of awk's), and the ``key=value`` ones.
    """
    words = line.split("|", 1)[0].split()
    return words, dict(word.split("=", 1) for word in words if "=" in word)


class HostileValueTests(SynchronousTestCase):
    """
    Values a client or a backend chose reach the line escaped and clipped: one line, no raw
    control character, and only txlb's own fields for the recipes to find.
    """

    def assertSafe(self, line: str, keys: set[str], **true_fields: str) -> list[str]:
        self.assertIsNone(RAW_UNSAFE.search(line), ascii(line))
        self.assertEqual(len(line.splitlines()), 1, ascii(line))
        self.assertLessEqual(len(line.encode()), MAX_LINE)
        words, fields = recipe_view(line)
        self.assertEqual(set(fields), keys, ascii(line))
        for key, value in true_fields.items():
            self.assertEqual(fields[key], value, ascii(line))
        self.assertEqual(words[3], "127.0.0.1:8003")
        return words

    COMPLETION = {"orid", "status", "finish", "ctok", "thinking", "think", "empty", "clen",
                  "ttft", "dur", "ptok", "cached"}
    ERROR = {"orid", "status", "req_keys", "method", "path", "dur"}

    def completion(self, orid: bytes | None = None, request: object = None,
                   content: str = "ok", finish: str = "stop") -> str:
        answer = {"choices": [{"index": 0, "finish_reason": finish,
                               "message": {"content": content}}]}
        return format_text(summarize(record(request=request, orid=orid,
                                            chunks=[json.dumps(answer).encode()])))

    def test_terminal_escapes_in_x_orid(self) -> None:
        line = self.completion(orid=b"\x1b]0;pwned\x07\x1b[2J\x9b")
        self.assertSafe(line, self.COMPLETION, status="200",
                        orid="\\x1b]0;pwned\\x07\\x1b[2J\ufffd")  # \x9b: not UTF-8

    def test_forged_fields_in_x_orid(self) -> None:
        line = self.completion(orid=b"ORD-1 127.0.0.9:9999 status=200|x=y")
        self.assertSafe(line, self.COMPLETION,
                        orid="ORD-1\\x20127.0.0.9:9999\\x20status\\x3d200\\x7cx\\x3dy")

    def test_forged_line_in_x_orid(self) -> None:
        line = self.completion(orid=b"a\r\n11-29 14:22:01 orid=ORD-2 127.0.0.9:1 status=200")
        self.assertSafe(line, self.COMPLETION, status="200")
        self.assertIn("orid=a\\x0d\\n11-29\\x2014:22:01\\x20orid\\x3dORD-2", line)

    def test_unicode_line_breaks_in_user(self) -> None:
        line = self.completion(request={"user": "a\u2028b\x85c\x0bd\x0ce\u2029f\xa0g\U000e0001"})
        self.assertSafe(line, self.COMPLETION,
                        orid="a\\u2028b\\u0085c\\x0bd\\x0ce\\u2029f\\u00a0g\\U000e0001")

    def test_a_backslash_cannot_forge_an_escape(self) -> None:
        line = self.completion(orid=b"a\\nb\\x20c", content="x\\ny\nz")
        self.assertSafe(line, self.COMPLETION, orid="a\\\\nb\\\\x20c")
        self.assertTrue(line.endswith(" | x\\\\ny\\nz"), line)

    def test_huge_user_is_clipped(self) -> None:
        summary = summarize(record(request={"user": "u" * (8 << 20)}))
        self.assertEqual(summary.orid, "u" * (MAX_ORID - 3) + "…")
        self.assertSafe(format_text(summary), self.COMPLETION, orid=summary.orid)

    def test_user_that_is_not_a_string(self) -> None:
        for user, orid in [(905112, "905112"), (10 ** 4000, "1" + "0" * 252 + "…"),
                           (True, "-"), ({"id": "x y"}, "-"), (["a"], "-"), (1.5, "-"),
                           (0, "-"), ("", "-")]:
            self.assertEqual(summarize(record(request={"user": user})).orid, orid, user)

    def test_counts_beyond_64_bits_are_unknown(self) -> None:
        answer = {"choices": [{"index": 0, "message": {"content": "ok"}}],
                  "usage": {"completion_tokens": 10 ** 400}}
        summary = summarize(record(request={"max_tokens": 10 ** 4000},
                                   chunks=[json.dumps(answer).encode()]))
        self.assertEqual((summary.completion_tokens, summary.max_tokens), (None, None))
        self.assertSafe(format_text(summary), self.COMPLETION, ctok="-/-")
        summary = summarize(record(request={"max_tokens": 2 ** 63 - 1}))
        self.assertEqual(summary.max_tokens, 2 ** 63 - 1)

    def test_hostile_finish_reason_and_content(self) -> None:
        line = self.completion(finish="stop status=500\x1b[31m" + "f" * 5000,
                               content="<p>\u2028ESC\x1b BEL\x07 | status=500 orid=x</p>")
        words = self.assertSafe(line, self.COMPLETION, status="200")
        self.assertLessEqual(len(words[5].encode()), len("finish=") + MAX_FINISH)
        # the free text keeps spaces, '=' and '|' but no control character
        self.assertTrue(line.endswith(
            " | <p>\\u2028ESC\\x1b BEL\\x07 | status=500 orid=x</p>"), ascii(line))

    def test_hostile_request_keys(self) -> None:
        body = {"a','b": 1, "c d=e|f": 2, "g]h[": 3, "i\x1bj\u2028": 4, "k" * 10_000: 5}
        line = format_text(summarize(record(request=body, status=400, chunks=[b"no"])))
        _, fields = recipe_view(line)
        self.assertSafe(line, self.ERROR, status="400")
        keys = fields["req_keys"][2:-2].split("','")
        self.assertEqual(keys, ["a\\x27\\x2c\\x27b", "c\\x20d\\x3de\\x7cf", "g\\x5dh\\x5b",
                                "i\\x1bj\\u2028", "k" * (MAX_KEY - 3) + "…"])

    def test_hostile_method_and_path(self) -> None:
        for status, expected in [(200, {"orid", "status", "dur"}), (404, self.ERROR)]:
            line = format_text(summarize(record(
                path=b"/v1/models?q= status=200 \x1b[2J\xe2\x80\xa8" + b"p" * 10_000,
                method=b"G\x07 T=", status=status, chunks=[b"x"])))
            words = self.assertSafe(line, expected, status=str(status))
            if status == 200:
                self.assertEqual(words[4], "G\\x07\\x20T\\x3d")
                self.assertTrue(words[5].startswith(
                    "/v1/models?q\\x3d\\x20status\\x3d200\\x20\\x1b[2J\\u2028ppp"))
                self.assertLessEqual(len(words[5].encode()), MAX_PATH)

    def test_hostile_error_body(self) -> None:
        body = ("why\u2028forged line\x85\x0b\x0c\r\n\x1b[2J\x07 status=200 " + "e" * 20_000)
        summary = summarize(record(status=400, chunks=[body.encode()]))
        line = format_text(summary)
        self.assertSafe(line, self.ERROR, status="400")
        self.assertIn(" ERR_BODY | why\\u2028forged line\\u0085\\x0b\\x0c\\x0d\\n\\x1b[2J\\x07 "
                      "status=200 eee", line)
        self.assertTrue(line.endswith("e…"))
        self.assertLessEqual(len(summary.err_body.encode()), MAX_ERR_BODY)

    def test_json_escapes_what_line_tools_split_on(self) -> None:
        """json.dumps leaves DEL, C1 controls and U+2028/U+2029 raw: they are escaped."""
        weird = "a\u2028b\u2029c\x85d\x7fe\x1bf\U000e0001g\ud800"
        line = format_json(summarize(record(
            request={"user": weird, weird: 1}, status=400, chunks=[weird.encode("utf-8",
                                                                             "surrogatepass")])))
        self.assertIsNone(RAW_UNSAFE.search(line), ascii(line))
        self.assertEqual(len(line.splitlines()), 1)
        line.encode()  # no lone surrogate left raw
        fields = json.loads(line)
        self.assertEqual(fields["orid"], weird)
        self.assertEqual(fields["req_keys"], [weird, "user"])
        self.assertIn("\\u2028", line)
        self.assertIn("\\udb40\\udc01", line)

    def test_both_formats_clip_the_same_values(self) -> None:
        request = {"user": "u" * 1000, "k" * 1000: 1}
        summary = summarize(record(request=request, orid=None, status=400,
                                   chunks=[b"e" * 100_000]))
        fields = json.loads(format_json(summary))
        _, text_fields = recipe_view(format_text(summary))
        self.assertEqual(fields["orid"], text_fields["orid"])
        self.assertEqual(fields["req_keys"], text_fields["req_keys"][2:-2].split("','"))
        self.assertEqual(fields["err_body"], summary.err_body)
        self.assertEqual(len(fields["err_body"].encode()), MAX_ERR_BODY)

    def test_no_line_is_longer_than_the_bound(self) -> None:
        """Every clipped value at its widest: a character that escapes to the most bytes."""
        for wide in ["\x00", " ", "\"", "\\", "\U000e0001", "\u2028", "图", "'"]:
            many = wide * 100_000
            for status in (200, 400):
                summary = summarize(record(
                    path=many.encode("utf-8", "surrogatepass"),
                    method=many.encode("ascii", "replace"),
                    orid=many.encode(), status=status,
                    request={"user": many, **{f"{n:02d}" + many[:1000]: n for n in range(99)}},
                    chunks=[json.dumps({"choices": [{"index": 0, "finish_reason": many,
                                                      "message": {"content": many}}]}).encode()
                            if status == 200 else many.encode()]))
                for line in (format_text(summary), format_json(summary)):
                    self.assertLessEqual(len(line.encode()), MAX_LINE, (ascii(wide), status))
                    self.assertIsNone(RAW_UNSAFE.search(line))


class ClipTests(SynchronousTestCase):
    """clip() keeps a prefix whose escaped form fits the budget in both formats."""

    def test_every_kind_of_character_at_every_budget(self) -> None:
        for wide in ["a", "\x00", "\n", " ", "=", "'", "\"", "\\", "\x7f", "\x85", "é", "图",
                     "\u2028", "\ud800", "\U0001f600", "\U000e0001"]:
            for kind in ("field", "key", "text"):
                for limit in (64, 256, 2048, 8192):
                    for length in (limit // 12, limit, limit * 3):
                        text = "x" + wide * length
                        clipped = clip(text, limit, kind)  # type: ignore[arg-type]
                        as_text = escape(clipped, kind).encode()  # type: ignore[arg-type]
                        as_json = escape_json(json.dumps(clipped, ensure_ascii=False))
                        self.assertLessEqual(len(as_text), limit, (ascii(wide), kind, limit))
                        self.assertLessEqual(len(as_json.encode()) - 2, limit)
                        if clipped != text:
                            self.assertEqual(clipped[-1], "…")
                            self.assertTrue(text.startswith(clipped[:-1]))
                            # not cut much shorter than it had to be
                            self.assertGreater(max(len(as_text), len(as_json.encode()) - 2),
                                               limit - 3 - 12, (ascii(wide), kind, limit))

    def test_work_is_linear_in_what_is_kept(self) -> None:
        """
        A backend's 8 KiB error body of characters that each need a Python call to escape
        (NEL) costs about one call per kept character per format, not one per step of a
        search: 8192 / 6 bytes are kept, so about 2 x 1365 calls.
        """
        calls: list[str] = []

        def counted(original: Callable[[re.Match[str]], str]) -> Callable[..., str]:
            def escape_one(match: re.Match[str]) -> str:
                calls.append(match.group())
                return original(match)
            return escape_one

        for name in ("_unicode_escape", "_json_escape"):
            self.patch(_escape, name, counted(getattr(_escape, name)))
        clipped = clip("\x85" * 100_000, 8192, "text")
        self.assertEqual(len(clipped), 8189 // 6 + 1)
        self.assertLess(len(calls), 3 * 8192 // 6)


FIXTURES = __import__("pathlib").Path(__file__).parents[1] / "fixtures"
SSE_TYPE = b"text/event-stream"


def recorded(name: str) -> bytes:
    """A fixture: llama.cpp's recorded from the real server, vLLM's hand-written."""
    return (FIXTURES / name).read_bytes()


class EngineAPITests(SynchronousTestCase):
    """Every LLM API engines serve gets its own fields, from the engines' real answers."""

    def summary(self, path: bytes, fixture: str, request: object, stream: bool) -> object:
        return summarize(record(path=path, request=request, chunks=[recorded(fixture)],
                                content_type=SSE_TYPE if stream else b"application/json"))

    def fields(self, summary: object) -> tuple[object, ...]:
        return tuple(getattr(summary, name) for name in (
            "kind", "finish", "completion_tokens", "max_tokens", "clen", "think", "empty"))

    def test_llamacpp_responses_plain_and_streamed(self) -> None:
        request = {"model": "tiny", "input": "Hi", "max_output_tokens": 8}
        plain = self.summary(b"/v1/responses", "llamacpp/responses.json", request, False)
        self.assertEqual(self.fields(plain),
                         ("completion", "completed", 8, 8, 8, False, False))
        self.assertEqual(plain.preview, "EuPü'→Ji")  # type: ignore[attr-defined]
        streamed = self.summary(b"/v1/responses", "llamacpp/responses.sse", request, True)
        self.assertEqual(self.fields(streamed),
                         ("completion", "completed", 8, 8, 8, False, False))
        self.assertEqual(streamed.preview, "Eu9v5文hi")  # type: ignore[attr-defined]

    def test_vllm_responses_with_reasoning_and_incomplete(self) -> None:
        request = {"model": "q", "input": "Hi", "max_output_tokens": 24,
                   "reasoning": {"effort": "low"}}
        plain = self.summary(b"/v1/responses", "engines/vllm-responses.json", request, False)
        self.assertEqual(self.fields(plain),
                         ("completion", "max_output_tokens", 24, 24, 16, True, False))
        self.assertTrue(plain.thinking)  # type: ignore[attr-defined]
        streamed = self.summary(b"/v1/responses", "engines/vllm-responses.sse", request, True)
        self.assertEqual(self.fields(streamed), ("completion", "completed", 7, 24, 9, True, False))
        self.assertEqual(streamed.preview, "Hi there!")  # type: ignore[attr-defined]

    def test_a_stream_cut_before_its_deltas_uses_the_final_response(self) -> None:
        events = [line for line in recorded("engines/vllm-responses.sse").split(b"\n\n")
                  if b".delta" not in line]
        summary = summarize(record(path=b"/v1/responses", request={},
                                   chunks=[b"\n\n".join(events)], content_type=SSE_TYPE))
        self.assertEqual((summary.preview, summary.think), ("Hi there!", True))

    def test_llamacpp_messages_plain_and_streamed(self) -> None:
        request = {"model": "tiny", "messages": [], "max_tokens": 8}
        plain = self.summary(b"/v1/messages", "llamacpp/messages.json", request, False)
        self.assertEqual(self.fields(plain), ("completion", "max_tokens", 8, 8, 8, False, False))
        self.assertEqual(plain.preview, "Eu9<-Ci@")  # type: ignore[attr-defined]
        streamed = self.summary(b"/v1/messages", "llamacpp/messages.sse", request, True)
        self.assertEqual(self.fields(streamed),
                         ("completion", "max_tokens", 8, 8, 8, False, False))
        self.assertEqual(streamed.preview, "^P文hMZG(")  # type: ignore[attr-defined]

    def test_messages_thinking_blocks(self) -> None:
        # hand-written after the Messages API's thinking blocks (vLLM serves them)
        answer = {"type": "message", "role": "assistant", "stop_reason": "end_turn",
                  "content": [{"type": "thinking", "thinking": "hmm", "signature": ""},
                              {"type": "text", "text": "ok"}],
                  "usage": {"input_tokens": 3, "output_tokens": 5}}
        summary = summarize(record(path=b"/v1/messages", chunks=[json.dumps(answer).encode()],
                                   request={"thinking": {"type": "enabled"}}))
        self.assertEqual((summary.finish, summary.completion_tokens, summary.thinking,
                          summary.think, summary.clen), ("end_turn", 5, True, True, 2))

    def test_unprefixed_chat_is_chat_and_the_line_names_its_path(self) -> None:
        request = {"model": "tiny", "messages": [], "max_tokens": 8}
        summary = self.summary(b"/chat/completions", "llamacpp/unprefixed-chat.json",
                               request, False)
        self.assertEqual(self.fields(summary), ("completion", "length", 8, 8, 8, False, False))
        line = format_text(summary)  # type: ignore[arg-type]
        self.assertIn(" ptok=26 cached=25 path=/chat/completions | ", line)
        classic = self.summary(b"/v1/chat/completions", "llamacpp/chat.json", request, False)
        self.assertNotIn("path=", format_text(classic))  # type: ignore[arg-type]
        completions = self.summary(b"/completions", "llamacpp/completions.sse",
                                   {"max_tokens": 8}, True)
        self.assertEqual(completions.finish, "length")  # type: ignore[attr-defined]

    def test_embeddings_count_and_prompt_tokens(self) -> None:
        summary = self.summary(b"/v1/embeddings", "llamacpp/embeddings.json",
                               {"model": "tiny", "input": ["Hi", "there"]}, False)
        self.assertEqual((summary.kind, summary.count, summary.prompt_tokens),  # type: ignore[attr-defined]
                         ("embedding", 2, 11))
        self.assertEqual(format_text(summary),  # type: ignore[arg-type]
                         f"{STAMP} orid=- 127.0.0.1:8003 POST /v1/embeddings status=200 n=2 "
                         "ptok=11 dur=6.913")
        fields = json.loads(format_json(summary))  # type: ignore[arg-type]
        self.assertEqual((fields["kind"], fields["n"], fields["ptok"]), ("embedding", 2, 11))

    def test_nesting_too_deep_to_parse_is_not_json(self) -> None:
        """
        Python's parser recurses: 100,000 nested arrays raise RecursionError, not the
        ValueError of other bad JSON.  As a request body it failed the request with an
        HTML 500 and a traceback (the proxy reads the body's model); in a stream it lost
        the line.
        """
        deep = b'{"model": "m", "a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        self.assertIsNone(parse_json_object(deep))
        summary = summarize(record(path=b"/v1/responses", request=deep,
                                   chunks=[b"data: " + deep + b"\n\n"], content_type=SSE_TYPE))
        self.assertEqual(summary.kind, "completion")

    def test_a_negative_token_count_is_no_count(self) -> None:
        """
        A backend's ``usage`` saying -5 tokens is no count: the metrics' counter refuses a
        negative increment (ValueError), which lost the request's result-log line.
        """
        answers = [(b"/v1/chat/completions", {"choices": [{"message": {"content": "x"},
                                                            "finish_reason": "stop"}],
                                               "usage": {"completion_tokens": -5}}),
                   (b"/v1/responses", {"status": "completed", "usage": {"output_tokens": -5}}),
                   (b"/v1/messages", {"content": [], "usage": {"output_tokens": -5}})]
        for path, answer in answers:
            summary = summarize(record(path=path, chunks=[json.dumps(answer).encode()]))
            self.assertIsNone(summary.completion_tokens, path)
            Metrics(Pool()).observe(summary)
        embedding = summarize(record(path=b"/v1/embeddings", chunks=[
            b'{"data": [], "usage": {"prompt_tokens": -1}}']))
        self.assertIsNone(embedding.prompt_tokens)

    def test_hostile_shapes_never_raise(self) -> None:
        bodies = [b'{"output": 5, "status": [], "usage": {"output_tokens": 1e400}}',
                  b'{"content": {"type": "text"}, "stop_reason": 3}',
                  b'data: {"type": "message_delta", "delta": 4, "usage": []}\n\n',
                  b'data: {"type": "response.completed", "response": []}\n\n',
                  # a type that is no string (a list cannot even be looked up in a set)
                  b'data: {"type": []}\n\ndata: {"type": {"a": 1}, "delta": "x"}\n\n',
                  b'{"data": 3, "usage": {"prompt_tokens": "x"}}', b"[1]", b"\xff"]
        for path in (b"/v1/responses", b"/v1/messages", b"/v1/embeddings"):
            for body in bodies:
                summary = summarize(record(path=path, chunks=[body]))
                format_text(summary)
                format_json(summary)


class PrivacyTests(SynchronousTestCase):
    """--log-content, --log-user and --log-error-body: what users wrote stays out."""

    answer = json.dumps({"choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"content": "secret answer " * 30}}]})

    def summary(self, privacy: Privacy, **kwargs: object) -> Summary:
        kwargs.setdefault("chunks", [self.answer.encode()])
        return summarize(record(**kwargs), privacy)  # type: ignore[arg-type]

    def test_default_keeps_200_characters(self) -> None:
        self.assertEqual(len(self.summary(Privacy()).preview), 200)

    def test_content_limit_in_both_formats(self) -> None:
        for chars in (0, 7, 1000):
            summary = self.summary(Privacy(content=chars))
            self.assertEqual(summary.preview, ("secret answer " * 30).strip()[:chars])
            self.assertEqual(json.loads(format_json(summary))["preview"], summary.preview)
            self.assertTrue(format_text(summary).endswith(" | " + summary.preview))
        self.assertEqual(self.summary(Privacy(content=0)).clen, 420)  # the facts remain

    def test_user_hash_is_keyed_stable_and_never_the_address(self) -> None:
        mail = {"user": "alice@example.com"}
        one = self.summary(Privacy(user="hash", user_key=b"k" * 32), request=mail).orid
        again = self.summary(Privacy(user="hash", user_key=b"k" * 32), request=mail).orid
        other_key = self.summary(Privacy(user="hash", user_key=b"j" * 32), request=mail).orid
        bob = self.summary(Privacy(user="hash", user_key=b"k" * 32),
                           request={"user": "bob@example.com"}).orid
        self.assertEqual(one, again)
        self.assertNotEqual(one, other_key)
        self.assertNotEqual(one, bob)
        self.assertRegex(one, r"^h:[0-9a-f]{16}$")
        line = format_text(self.summary(Privacy(user="hash", user_key=b"k" * 32),
                                        request=mail))
        self.assertNotIn("alice", line)
        self.assertIn(f" orid={one} ", line)

    def test_user_drop_and_header_kept(self) -> None:
        drop = Privacy(user="drop")
        self.assertEqual(self.summary(drop, request={"user": "alice@example.com"}).orid, "-")
        self.assertEqual(self.summary(drop, request={"user": 905112}).orid, "-")
        # X-Orid is the operator's own id, not a user's address: kept
        self.assertEqual(self.summary(drop, orid=b"ORD-1",
                                      request={"user": "alice@example.com"}).orid, "ORD-1")
        self.assertEqual(self.summary(Privacy(user="hash"), request={}).orid, "-")

    def test_error_body_none_or_cut(self) -> None:
        echo = b'{"message": "prompt was: my diagnosis is ..."}'
        for limit, expected in ((None, echo.decode()), (0, ""), (12, echo.decode()[:12])):
            summary = self.summary(Privacy(err_body=limit), status=400, chunks=[echo])
            self.assertEqual(summary.err_body, expected)
            self.assertEqual(json.loads(format_json(summary))["err_body"], expected)
            self.assertTrue(format_text(summary).endswith("ERR_BODY | " + expected))

    def test_error_body_cap_holds_with_a_large_limit(self) -> None:
        summary = self.summary(Privacy(err_body=10**6), status=500,
                               chunks=[b"x" * (4 * MAX_ERR_BODY)])
        self.assertLessEqual(len(summary.err_body.encode()), MAX_ERR_BODY)

    def test_privacy_survives_the_workers_wire(self) -> None:
        """The supervisor writes what the worker summarised: nothing more comes back."""
        from txlb._workers.wire import Finished, decode, summary_message
        summary = self.summary(Privacy(content=0, user="drop", err_body=0),
                               request={"user": "alice@example.com"})
        text = summary_message(summary, True)
        self.assertNotIn(b"alice", text)
        self.assertNotIn(b"secret", text)
        self.assertEqual(decode(text), Finished(summary, True))


class TimeTests(SynchronousTestCase):
    """The JSON line's time says its year and zone; the text line keeps MM-DD HH:MM:SS."""

    def test_json_time_is_iso_8601_with_zone(self) -> None:
        import datetime
        stamp = json.loads(format_json(summarize(record())))["time"]
        self.assertRegex(stamp, r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d$")
        parsed = datetime.datetime.fromisoformat(stamp)
        self.assertLess(abs(parsed.timestamp() - 106.9135), 0.001)

    def test_text_time_unchanged(self) -> None:
        self.assertTrue(format_text(summarize(record())).startswith(STAMP + " "))


class LongStreamTests(SynchronousTestCase):
    """A stream longer than the capture: its last events (usage, finish) are still read."""

    CHUNK = sse(delta("tok"))[:-len(b"data: [DONE]\n\n")]
    END = sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
               "usage": {"prompt_tokens": 5, "completion_tokens": 12345}})

    def events(self) -> list[bytes]:
        return [self.CHUNK] * (CAPTURE_LIMIT // len(self.CHUNK) + 3000) + [self.END]

    def test_past_the_capture_the_tail_is_its_last_tail_limit_bytes(self) -> None:
        """The bound is exact: chunks that add up to it leave it full, never a chunk over."""
        past = record(content_type=b"application/octet-stream")  # kept raw
        past.capture(b"x" * CAPTURE_LIMIT)
        quarter = TAIL_LIMIT // 4
        for n in range(8):
            past.capture(bytes([65 + n]) * quarter)
        self.assertEqual(past.tail_size, TAIL_LIMIT)
        self.assertEqual(b"".join(past.tail), b"".join(
            bytes([65 + n]) * quarter for n in range(4, 8)))

    def check(self, long: RequestRecord) -> None:
        self.assertTrue(long.truncated)
        self.assertLess(sum(map(len, long.tail)), TAIL_LIMIT + 2 * len(self.END))
        self.assertEqual(long.events, len(self.events()) + 1)  # and the [DONE]
        summary = summarize(long)
        self.assertEqual((summary.prompt_tokens, summary.completion_tokens, summary.finish),
                         (5, 12345, "length"))
        self.assertTrue(summary.preview.startswith("toktok"))

    def test_plain(self) -> None:
        self.check(record(chunks=self.events(), content_type=b"text/event-stream",
                          count_events=True))

    def test_in_chunked_framing(self) -> None:
        long = record(content_type=b"text/event-stream", count_events=True)
        long.chunked = True
        for event in self.events():
            long.capture(b"%x\r\n%s\r\n" % (len(event), event))
        long.capture(b"0\r\n\r\n")
        self.check(long)

    def test_one_huge_chunk(self) -> None:
        self.check(record(chunks=[b"".join(self.events())],
                          content_type=b"text/event-stream", count_events=True))

    def test_events_are_counted_only_for_a_budget_that_will_read_them(self) -> None:
        """No token budget charges the request: its chunks are not searched for events."""
        long = record(chunks=self.events(), content_type=b"text/event-stream")
        self.assertEqual(long.events, 0)
        summary = summarize(long)  # the summary itself does not need them
        self.assertEqual((summary.prompt_tokens, summary.completion_tokens), (5, 12345))
