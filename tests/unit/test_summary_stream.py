"""
A stream summarised as it passes: however its bytes are split into chunks, the summary is
the one-shot summary of the whole capture (the reference, kept as the path a record takes
when its bytes are kept raw); what no reader needs is never parsed; and the end of a long
answer parses a bounded amount, whatever its length.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from txlb import LoadBalancer
from txlb._records.bookkeeper import (
    Bookkeeper,
    OutcomeConsumer,
    SummaryConsumer,
    SummaryFeed,
)
from txlb._records.needs import Needs
from txlb._records.observer import NullObserver
from txlb._records.sse import EventSplitter, data_payload
from txlb._records.summary import (
    CAPTURE_LIMIT,
    TAIL_LIMIT,
    RequestRecord,
    Summary,
    dechunk,
    parse_json_object,
    summarize,
)
from txlb._workers.reports import SupervisorForwarder

from ..helpers import ClientConnection, FakeResponse, FakeUpstream
from .test_summary import SSE_TYPE, delta, recorded, sse

A = "127.0.0.1:8003"

CHAT, COMPLETIONS = b"/v1/chat/completions", b"/v1/completions"
RESPONSES, MESSAGES = b"/v1/responses", b"/v1/messages"

USAGE = {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 7,
                                  "prompt_tokens_details": {"cached_tokens": 4}}}

#: representative streamed answers: the engines' recorded ones, and hand-made ones with
#: the shapes the summary reads (reasoning, <think>, usage, broken events, CRLF lines)
ANSWERS: list[tuple[bytes, bytes]] = [
    (CHAT, recorded("llamacpp/chat.sse")),
    (COMPLETIONS, recorded("llamacpp/completions.sse")),
    (RESPONSES, recorded("llamacpp/responses.sse")),
    (MESSAGES, recorded("llamacpp/messages.sse")),
    (RESPONSES, recorded("engines/vllm-responses.sse")),
    (CHAT, sse(delta(reasoning="hmm"), delta("Hel"), delta("lo é"),
               delta(finish="stop"), USAGE)),
    (CHAT, sse(delta("<think>x</think>"), delta("  "), delta(finish="length"))),
    (CHAT, b"data: {broken\n\ndata: " + json.dumps(delta("a")).encode()
     + b"\r\n\r\ndata: [1, 2]\n\n: comment\nevent: x\ndata:" + json.dumps(USAGE).encode()),
    (CHAT, b"data: " + json.dumps(delta("no newline at the end")).encode()),
    (CHAT, b"data: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"NaN\"}}], "
     b"\"x\": NaN, \"big\": 123456789012345678901234567890}\n\n"),
]


def frames(body: bytes, sizes: list[int]) -> list[bytes]:
    """``body`` as chunks of chunked framing, of ``sizes`` bytes (cycled)."""
    out, position, index = [], 0, 0
    while position < len(body):
        size = max(1, sizes[index % len(sizes)]) if sizes else len(body)
        part = body[position:position + size]
        out.append(b"%x\r\n%s\r\n" % (len(part), part))
        position += size
        index += 1
    return out


def frame(body: bytes, sizes: list[int], final: bytes = b"0\r\n\r\n") -> bytes:
    """``body`` in chunked framing, in chunks of ``sizes`` (cycled), then ``final``."""
    return b"".join(frames(body, sizes)) + final


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    """``data`` cut at ``cuts`` (positions, any order, repeats allowed)."""
    points = sorted({0, len(data), *(cut % (len(data) + 1) for cut in cuts)})
    return [data[a:b] for a, b in zip(points, points[1:], strict=False)]


def streamed(path: bytes, pieces: list[bytes], chunked: bool = False,
             needs: Needs = Needs.TEXTS, raw: bool = False,
             content_type: bytes = SSE_TYPE) -> RequestRecord:
    """
    A record fed ``pieces`` as the proxy feeds it; ``raw``: kept whole and summarised in
    one go at the end -- the reference the incremental summary must equal.
    """
    record = RequestRecord(started=100.0, method=b"POST", path=path, orid_header=None,
                           request_body=b'{"user": "u", "max_tokens": 9}',
                           backend="127.0.0.1:8003", status=200, ended=106.5,
                           first_byte=100.25, content_type=content_type, chunked=chunked,
                           needs=needs)
    if raw:
        record._keep = record.response.append
    for piece in pieces:
        record.capture(piece)
    return record


def counts(summary: Summary) -> tuple[object, ...]:
    """What the readers of an answer's usage read (Needs.USAGE)."""
    return (summary.kind, summary.status, summary.stream,
            summary.completion_tokens, summary.prompt_tokens, summary.cached_prompt_tokens,
            summary.dur, summary.ttft)


class AnyChunkingTests(SynchronousTestCase):
    """However the answer is cut into chunks, its summary is the whole one's."""

    @settings(max_examples=300, deadline=None)
    @given(st.sampled_from(ANSWERS), st.lists(st.integers(0, 10**6), max_size=30),
           st.booleans(), st.lists(st.integers(1, 300), min_size=1, max_size=5))
    def test_the_same_summary_as_the_whole(self, answer: tuple[bytes, bytes],
                                           cuts: list[int], chunked: bool,
                                           sizes: list[int]) -> None:
        path, body = answer
        data = frame(body, sizes) if chunked else body
        whole = summarize(streamed(path, [data], chunked, raw=True))
        incremental = streamed(path, split(data, cuts), chunked)
        self.assertIsNotNone(incremental.stream)  # it was summarised as it passed
        self.assertEqual(summarize(incremental), whole)

    @settings(max_examples=100, deadline=None)
    @given(st.sampled_from(ANSWERS), st.lists(st.integers(1, 300), min_size=1, max_size=5),
           st.sampled_from([b"1f", b"3;x=y", b"0x1", b"zz", b"-2", b"", b" 4 "]))
    def test_a_read_a_chunk(self, answer: tuple[bytes, bytes], sizes: list[int],
                            odd: bytes) -> None:
        """The usual read, one whole chunk each (and an odd size line among them)."""
        path, body = answer
        pieces = frames(body, sizes)
        pieces.insert(len(pieces) // 2, odd + b"\r\n" + b"data: {}\n\n" + b"\r\n")
        pieces.append(b"0\r\n\r\n")
        whole = summarize(streamed(path, [b"".join(pieces)], chunked=True, raw=True))
        self.assertEqual(summarize(streamed(path, pieces, chunked=True)), whole)

    @settings(max_examples=100, deadline=None)
    @given(st.sampled_from(ANSWERS), st.lists(st.integers(0, 10**6), max_size=30),
           st.booleans(), st.lists(st.integers(1, 300), min_size=1, max_size=5))
    def test_usage_only_reads_the_same_counts(self, answer: tuple[bytes, bytes],
                                              cuts: list[int], chunked: bool,
                                              sizes: list[int]) -> None:
        """Without the result log the texts are not parsed, but the counts are the same."""
        path, body = answer
        data = frame(body, sizes) if chunked else body
        whole = summarize(streamed(path, [data], chunked, raw=True))
        usage = summarize(streamed(path, split(data, cuts), chunked, Needs.USAGE))
        self.assertEqual(counts(usage), counts(whole))
        # the texts, and the finish reason, are the result log's: not read
        self.assertEqual((usage.clen, usage.preview, usage.finish), (0, "", None))

    def test_the_summary_is_read_once(self) -> None:
        """Summarised twice (a consumer failed, a test), the end is not folded in twice."""
        path, body = ANSWERS[5]
        record = streamed(path, [body[:-3], body[-3:]])
        self.assertEqual(summarize(record), summarize(record))


class BrokenFramingTests(SynchronousTestCase):
    """The chunked framing is read as the one-shot dechunk reads it, broken or not."""

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.sampled_from([
        b"5\r\ndata:\r\n", b"a;ext=1\r\ndata: {}\n\n\r\n", b"3\r\n\nda\r\n", b"\r\n",
        b"zz\r\n", b"-1\r\n", b"0\r\n\r\n", b"1_0\r\n", b"data: x\n", b"4\r", b"\n",
        b"ffff\r\ndata: {\"choices\": []}\n"]), max_size=12),
        st.lists(st.integers(0, 10**4), max_size=20))
    def test_same_payloads_as_dechunk(self, parts: list[bytes], cuts: list[int]) -> None:
        framed = b"".join(parts)
        expected = [p for p in map(data_payload, dechunk(framed).split(b"\n"))
                    if p is not None]
        found: list[bytes] = []
        splitter = EventSplitter(found.append, chunked=True)
        for piece in split(framed, cuts):
            splitter.feed(piece)
        splitter.close()
        self.assertEqual(found, expected)


class LongAnswerTests(SynchronousTestCase):
    """A 512 KiB answer's end parses a bounded amount, and the same summary comes out."""

    EVENT = b"data: " + json.dumps(delta("token ")).encode() + b"\n\n"
    END = sse(delta(finish="length"), USAGE)

    def body(self, size: int) -> bytes:
        return self.EVENT * (size // len(self.EVENT)) + self.END

    def check(self, size: int, chunked: bool, bound: int) -> None:
        body = self.body(size)
        data = body
        if chunked:  # an event a chunk, as engines send them (the tail keeps the framing)
            events = body[:-len(self.END)]
            data = frame(events, [len(self.EVENT)], b"") + frame(self.END, [len(self.END)])
        pieces = split(data, list(range(0, len(data), 997)))
        record = streamed(CHAT, pieces, chunked)
        stream = record.stream
        assert stream is not None
        before = stream.parsed
        summary = summarize(record)
        self.assertLessEqual(stream.parsed_at_end, bound)
        self.assertEqual(stream.parsed - before, stream.parsed_at_end)
        # the tail past the capture holds what the last chunks held: fed the same ones
        self.assertEqual(summary, summarize(streamed(CHAT, pieces, chunked, raw=True)))
        self.assertEqual((summary.completion_tokens, summary.finish), (7, "length"))

    def test_within_the_capture_the_end_parses_nothing_more(self) -> None:
        # every line ends in a newline: all were parsed as they came
        self.check(CAPTURE_LIMIT - 4096, chunked=False, bound=0)
        self.check(CAPTURE_LIMIT * 8 // 10, chunked=True, bound=0)  # the framing counts

    def test_past_the_capture_the_end_parses_at_most_the_tail(self) -> None:
        self.check(CAPTURE_LIMIT * 3, chunked=False, bound=TAIL_LIMIT)
        self.check(CAPTURE_LIMIT * 2, chunked=True, bound=TAIL_LIMIT)

    def test_the_last_line_without_its_newline_is_all_that_is_left(self) -> None:
        last = json.dumps(USAGE).encode()
        body = self.EVENT * ((CAPTURE_LIMIT - 4096) // len(self.EVENT)) + b"data: " + last
        record = streamed(CHAT, split(body, list(range(0, len(body), 4096))))
        summary = summarize(record)
        assert record.stream is not None
        self.assertEqual(record.stream.parsed_at_end, len(last) + 1)  # and its space
        self.assertEqual(summary.completion_tokens, 7)

    def test_the_splice_reads_each_whole_event_once(self) -> None:
        """
        Past the capture, the events read are exactly those whose line ends inside the
        capture, and those whose line starts inside the tail (after the line the tail
        cut): worked out here from where each event lies, not from the splice itself.
        """
        events = [b"data: " + json.dumps(delta("x" * (1 + i % 13))).encode() + b"\n\n"
                  for i in range(CAPTURE_LIMIT * 5 // 4 // 40)]
        data = b"".join(events) + self.END
        for step in (1499, 4096, 65536):
            record = streamed(CHAT, split(data, list(range(0, len(data), step))))
            window = len(data) - record.tail_size  # where the tail's bytes start
            expected, start = 0, 0
            for i, line in enumerate(events):
                end = start + len(line) - 2  # the line's newline
                if end < CAPTURE_LIMIT or start > window:
                    expected += 1 + i % 13
                start += len(line)
            summary = summarize(record)
            self.assertTrue(summary.truncated)
            self.assertEqual(summary.clen, expected, step)
            self.assertEqual(summary.completion_tokens, 7)

    def test_the_splice_at_its_edges(self) -> None:
        """
        The capture ends right after an event's ``}`` (its newline past it: not read), the
        tail starts on a newline and ends on the usage event's one newline (both read).
        """
        line = b"data: " + json.dumps(delta("abc")).encode() + b"\n\n"
        # a comment line first, so that event number ``count``'s newline falls at
        # CAPTURE_LIMIT exactly: the ``count`` before it are the capture's
        count = (CAPTURE_LIMIT - len(line)) // len(line)
        lead = CAPTURE_LIMIT - (len(line) - 2) - count * len(line)
        head = b":" + b"p" * (lead - 2) + b"\n" + line * (count + 40)
        for pad in range(200):  # the last event's length moves the tail's start
            last = b"data: " + json.dumps({**USAGE, "pad": "q" * pad}).encode() + b"\n"
            data = head + line * 1200 + last
            if data[len(data) - TAIL_LIMIT] == 0x0A:
                break
        self.assertEqual(data[CAPTURE_LIMIT - 1:CAPTURE_LIMIT + 1], b"}\n")
        window = len(data) - TAIL_LIMIT
        self.assertEqual(data[window], 0x0A)
        expected = 3 * (count + data[window + 1:].count(line))
        for needs, clen in ((Needs.TEXTS, expected), (Needs.USAGE, 0)):
            summary = summarize(streamed(CHAT, [data], needs=needs))
            self.assertEqual((summary.clen, summary.completion_tokens), (clen, 7))
            self.assertEqual(summary, summarize(streamed(CHAT, [data], needs=needs,
                                                         raw=True)))

    def test_usage_only_parses_the_events_with_counts(self) -> None:
        record = streamed(CHAT, [self.body(CAPTURE_LIMIT // 2)], needs=Needs.USAGE)
        summary = summarize(record)
        assert record.stream is not None
        self.assertLess(record.stream.parsed, len(self.END))  # the usage event alone
        self.assertEqual((summary.completion_tokens, summary.prompt_tokens,
                          summary.finish), (7, 11, None))


class NothingNobodyReadsTests(SynchronousTestCase):
    """What no consumer reads of an answer is neither kept nor parsed."""

    BODY = sse(delta("secret answer"), delta(finish="stop"), USAGE)

    def test_no_reader_of_the_answer_keeps_none_of_it(self) -> None:
        record = streamed(CHAT, [self.BODY], needs=Needs.NOTHING)
        self.assertEqual((record.response, record.stream, record.captured),
                         ([], None, len(self.BODY)))
        summary = summarize(record)
        self.assertEqual((summary.completion_tokens, summary.clen, summary.finish),
                         (None, 0, None))
        self.assertEqual((summary.status, summary.dur), (200, 6.5))

    def test_a_reader_of_the_counts_gets_them_but_not_the_texts(self) -> None:
        summary = summarize(streamed(CHAT, [self.BODY], needs=Needs.USAGE))
        self.assertEqual((summary.completion_tokens, summary.prompt_tokens), (7, 11))
        self.assertEqual((summary.clen, summary.preview, summary.orid), (0, "", "-"))

    def test_the_result_log_gets_everything(self) -> None:
        summary = summarize(streamed(CHAT, [self.BODY], needs=Needs.TEXTS))
        self.assertEqual((summary.completion_tokens, summary.preview, summary.orid),
                         (7, "secret answer", "u"))

    def test_a_json_answer_is_kept_only_for_a_reader(self) -> None:
        answer = json.dumps({**USAGE, "choices": [{"index": 0, "message": {
            "content": "hi"}}]}).encode()
        for needs, tokens in ((Needs.NOTHING, None), (Needs.USAGE, 7), (Needs.TEXTS, 7)):
            record = streamed(CHAT, [answer], needs=needs, content_type=b"application/json")
            self.assertEqual(summarize(record).completion_tokens, tokens)
            self.assertEqual(record.response, [] if needs == Needs.NOTHING else [answer])

    def test_an_error_body_is_kept_only_for_the_result_log(self) -> None:
        for needs, kept in ((Needs.USAGE, []), (Needs.TEXTS, [b"oops"])):
            record = RequestRecord(started=1.0, method=b"POST", path=CHAT,
                                   orid_header=None, request_body=b"{}", needs=needs)
            record.answered_by_proxy(502, b"oops")
            self.assertEqual(record.response, kept)
            self.assertEqual(summarize(record).err_body, "oops" if kept else "")

    def test_a_path_no_summary_reads_keeps_nothing(self) -> None:
        record = streamed(b"/metrics", [b"x" * 1000])
        self.assertEqual(record.response, [])
        self.assertEqual(summarize(record).kind, "other")


def consumer(needs: Needs) -> SummaryConsumer:
    return SummaryConsumer(f"needs {needs.name}", lambda summary, answered: None, needs)


class DeclaredNeedsTests(SynchronousTestCase):
    """A feed needs the most its consumers declare; the proxy reads that of its observer."""

    def test_the_most_any_consumer_needs(self) -> None:
        self.assertEqual(SummaryFeed().needs, Needs.NOTHING)
        feed = SummaryFeed(consumers=[consumer(Needs.NOTHING)])
        self.assertEqual(feed.needs, Needs.NOTHING)
        feed.add(OutcomeConsumer("policy", lambda outcome: None))
        self.assertEqual(feed.needs, Needs.USAGE)
        feed.add(consumer(Needs.TEXTS))
        self.assertEqual(feed.needs, Needs.TEXTS)
        # a consumer that does not say reads everything
        self.assertEqual(SummaryConsumer("x", lambda s, a: None).needs, Needs.TEXTS)

    def test_observers_say_what_their_readers_need(self) -> None:
        self.assertEqual(NullObserver.needs, Needs.NOTHING)
        books = Bookkeeper(None, None, SummaryFeed(consumers=[consumer(Needs.USAGE)]),
                           lambda backend: None)  # type: ignore[arg-type]
        self.assertEqual(books.needs, Needs.USAGE)
        # a worker's summaries go to a supervisor that may write the result log
        self.assertEqual(SupervisorForwarder(lambda message: None).needs, Needs.TEXTS)

    def test_the_balancer_without_a_result_log_reads_no_texts(self) -> None:
        for log_file, needs in (("none", Needs.USAGE), (self.mktemp(), Needs.TEXTS)):
            lb = LoadBalancer([A], reactor=Clock(), agent=FakeUpstream(),
                              probe_agent=FakeUpstream(), log_file=log_file)
            self.assertEqual(lb.observer.needs, needs)
            if lb.result_log is not None:
                lb.result_log.close()


class NeedsTap:
    """The balancer's own observer, with each finished record kept for the test."""

    def __init__(self, inner: Bookkeeper) -> None:
        self.inner = inner
        self.records: list[RequestRecord] = []
        self.needs = inner.needs

    def ended(self, record: RequestRecord) -> None:
        self.records.append(record)
        self.inner.ended(record)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


class ThroughTheProxyTests(SynchronousTestCase):
    """The proxy reads its observer's needs into each record, and captures no more."""

    BODY = sse(*[delta("secret answer")] * 20, delta(finish="stop"), USAGE)

    def stream(self, log_file: str) -> tuple[LoadBalancer, RequestRecord]:
        upstream = FakeUpstream()
        lb = LoadBalancer([A], reactor=Clock(), agent=upstream,
                          probe_agent=FakeUpstream(), log_file=log_file)
        if lb.result_log is not None:
            self.addCleanup(lb.result_log.close)
        tap = NeedsTap(lb.bookkeeper)
        lb.proxy.context.observer = tap  # type: ignore[assignment]
        client = ClientConnection(lb.site())
        client.request(b"POST", CHAT, body=b'{"model": "m", "stream": true}')
        response = upstream.last.respond(FakeResponse(
            200, headers=[(b"content-type", b"text/event-stream")]))
        for piece in split(self.BODY, [17, 40, 99]):
            response.send(piece)
        response.end()
        self.assertEqual(client.response().status, 200)
        [record] = tap.records
        return lb, record

    def test_without_the_result_log_the_texts_are_never_parsed(self) -> None:
        lb, record = self.stream("none")
        self.assertEqual(record.needs, Needs.USAGE)
        assert record.stream is not None
        self.assertLess(record.stream.parsed, len(self.BODY) // 3)  # its last few events
        self.assertEqual(lb.metrics.registry.get_sample_value(
            "txlb_completion_tokens_total", {"backend": A}), 7)

    def test_with_the_result_log_every_event_is_parsed(self) -> None:
        path = self.mktemp()
        lb, record = self.stream(path)
        self.assertEqual(record.needs, Needs.TEXTS)
        assert record.stream is not None
        self.assertGreater(record.stream.parsed, len(self.BODY) * 2 // 3)  # all of them
        assert lb.result_log is not None
        lb.result_log.close()
        with open(path, encoding="utf-8") as log:
            self.assertIn("ctok=7/- ", log.read())


class OrjsonOutcomeTests(SynchronousTestCase):
    """orjson parses, and every body gets the outcome Python's json gave it."""

    BODIES: list[bytes] = [
        b'{"a": NaN, "b": Infinity, "c": -Infinity}',
        b'{"n": 123456789012345678901234567890, "m": -99999999999999999999999}',
        b'{"n": -9223372036854775809, "m": 18446744073709551616, "o": 1234567890123456789}',
        b'{"user": 99999999999999999999, "tools": [{"x": [1, 123456789012345678901]}]}',
        b'{"s": "\\ud800 lone", "t": "\\udfff"}',
        b'{"k": 1, "k": 2}',
        b'{"x": ' + b"[" * 1500 + b"]" * 1500 + b"}",
        b'{"x": ' + b"[" * 900 + b"]" * 900 + b"}",
        b'{"deep": ' + b"[" * 100000 + b"]" * 100000 + b"}",
        b'{"e": 1e400, "f": -0.0, "g": 0.1}',
        b'{"u": "\xff\xfe"}',
        b'{"ok": "\xc3\xa9", "emoji": "\\ud83d\\ude00"}',
        b'  {"ws": true}  ',
        b'{"trailing": 1} x',
        b'{"a": 1,}',
        b"[1, 2]",
        b"",
    ]

    def test_the_same_outcome_as_the_standard_library(self) -> None:
        def stdlib(body: bytes) -> object:
            if not body or body.lstrip()[:1] != b"{":
                return None
            try:
                value = json.loads(body)
            except (ValueError, RecursionError):
                return None
            return value if isinstance(value, dict) else None

        for body in self.BODIES:
            found, expected = parse_json_object(body), stdlib(body)
            if expected is not None and any(v != v for v in expected.values()
                                            if isinstance(v, float)):
                self.assertEqual(repr(found), repr(expected), body[:40])  # NaN != NaN
            else:
                self.assertEqual(found, expected, body[:40])

    def test_a_huge_integer_in_an_answer_is_no_count(self) -> None:
        body = sse({"choices": [], "usage": {"completion_tokens": 2**70,
                                             "prompt_tokens": 3}})
        for pieces in ([body], split(body, list(range(0, len(body), 7)))):
            summary = summarize(streamed(CHAT, pieces))
            self.assertEqual((summary.completion_tokens, summary.prompt_tokens), (None, 3))
