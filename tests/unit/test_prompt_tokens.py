"""
What every answer says about its prompt: the prompt tokens and the tokens the engine served
from its prefix cache, read from each LLM API's answer (plain and streamed), carried to the
result log (both formats), the policies' outcome, the metrics and the ``--workers`` pipe --
and hostile counts refused or clamped.
"""

from __future__ import annotations

import json
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from txlb import LoadBalancer
from txlb._cluster.pool import Pool
from txlb._records.bookkeeper import SummaryConsumer
from txlb._records.fields import BadSummary, from_wire, to_wire
from txlb._records.metrics import TOKEN_TIME_BUCKETS, Metrics
from txlb._records.needs import Needs
from txlb._records.resultlog import format_json, format_text
from txlb._records.summary import RequestRecord, Summary, summarize
from txlb._scheduling.outcome import RequestOutcome
from txlb._workers.reports import WorkerReports
from txlb._workers.wire import Finished, decode, encode

from ..helpers import FakeUpstream
from .test_summary import SSE_TYPE, STAMP, record, recorded, sse

A = "127.0.0.1:8003"
CHAT, RESPONSES, MESSAGES = b"/v1/chat/completions", b"/v1/responses", b"/v1/messages"


def counts(path: bytes, answer: object, stream: bool = False) -> tuple[object, object]:
    """The (prompt, cached) tokens txlb reads from ``answer`` (an object, or raw bytes)."""
    body = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
    summary = summarize(record(path=path, chunks=[body],
                               content_type=SSE_TYPE if stream else b"application/json"))
    return summary.prompt_tokens, summary.cached_prompt_tokens


def chat(usage: object = None, **extra: object) -> dict[str, Any]:
    answer: dict[str, Any] = {"choices": [{"index": 0, "finish_reason": "stop",
                                           "message": {"content": "hi"}}], **extra}
    if usage is not None:
        answer["usage"] = usage
    return answer


def chunk(content: str | None = None, finish: str | None = None, **extra: object
          ) -> dict[str, Any]:
    delta = {} if content is None else {"content": content}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


class RecordedAnswersTests(SynchronousTestCase):
    """The real engines' answers, as recorded in tests/fixtures."""

    def fixture(self, path: bytes, name: str, stream: bool) -> tuple[object, object]:
        return counts(path, recorded(name), stream)

    def test_llamacpp_every_api(self) -> None:
        # the first request of a slot found nothing cached; the streamed ones came after
        self.assertEqual(self.fixture(CHAT, "llamacpp/chat.json", False), (26, 0))
        self.assertEqual(self.fixture(CHAT, "llamacpp/chat.sse", True), (26, 25))
        self.assertEqual(self.fixture(b"/v1/completions", "llamacpp/completions.json", False),
                         (7, 2))
        self.assertEqual(self.fixture(b"/v1/completions", "llamacpp/completions.sse", True),
                         (7, 6))
        self.assertEqual(self.fixture(RESPONSES, "llamacpp/responses.json", False), (26, 25))
        self.assertEqual(self.fixture(RESPONSES, "llamacpp/responses.sse", True), (26, 25))
        # Messages: input_tokens is the uncached part (1), cache_read_input_tokens the rest
        self.assertEqual(self.fixture(MESSAGES, "llamacpp/messages.json", False), (26, 25))
        self.assertEqual(self.fixture(MESSAGES, "llamacpp/messages.sse", True), (26, 25))

    def test_vllm_responses(self) -> None:
        self.assertEqual(self.fixture(RESPONSES, "engines/vllm-responses.json", False), (12, 0))
        self.assertEqual(self.fixture(RESPONSES, "engines/vllm-responses.sse", True), (9, 0))


class OpenAIAnswersTests(SynchronousTestCase):
    def test_plain_json_usage_and_its_details(self) -> None:
        usage = {"prompt_tokens": 812, "completion_tokens": 5,
                 "prompt_tokens_details": {"cached_tokens": 768}}
        self.assertEqual(counts(CHAT, chat(usage)), (812, 768))
        self.assertEqual(counts(b"/v1/completions", {
            "choices": [{"index": 0, "text": "x", "finish_reason": "stop"}],
            "usage": usage}), (812, 768))

    def test_vllm_without_prompt_tokens_details_says_no_cached_count(self) -> None:
        """vLLM without --enable-prompt-tokens-details: the details are null."""
        usage = {"prompt_tokens": 40, "completion_tokens": 5, "prompt_tokens_details": None}
        self.assertEqual(counts(CHAT, chat(usage)), (40, None))

    def test_a_stream_says_it_in_its_final_usage_chunk(self) -> None:
        body = sse(chunk("a"), chunk("b", "stop"),
                   {"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 2,
                                             "prompt_tokens_details": {"cached_tokens": 64}}})
        self.assertEqual(counts(CHAT, body, stream=True), (100, 64))

    def test_continuous_usage_the_last_chunk_counts(self) -> None:
        body = sse(*(chunk("t", usage={"prompt_tokens": 50, "completion_tokens": n,
                                       "prompt_tokens_details": {"cached_tokens": 48}})
                     for n in range(1, 4)))
        self.assertEqual(counts(CHAT, body, stream=True), (50, 48))

    def test_a_stream_without_usage_says_nothing(self) -> None:
        self.assertEqual(counts(CHAT, sse(chunk("a"), chunk("b", "stop")), stream=True),
                         (None, None))

    def test_llamacpp_timings_when_usage_says_nothing(self) -> None:
        """llama-server's stream without include_usage: ``timings`` on the final chunk."""
        timings = {"cache_n": 60, "prompt_n": 1, "predicted_n": 2}
        body = sse(chunk("a"), chunk("b"), chunk(None, "length", timings=timings))
        self.assertEqual(counts(CHAT, body, stream=True), (61, 60))
        self.assertEqual(counts(CHAT, chat(timings=timings)), (61, 60))

    def test_timings_only_at_the_end_of_a_stream_are_read(self) -> None:
        """Only the last few events are searched: timings in the middle are not."""
        timings = {"cache_n": 60, "prompt_n": 1}
        body = sse(chunk("a", timings=timings), *(chunk("b") for _ in range(5)))
        self.assertEqual(counts(CHAT, body, stream=True), (None, None))

    def test_usage_wins_over_timings(self) -> None:
        answer = chat({"prompt_tokens": 30, "prompt_tokens_details": {"cached_tokens": 10}},
                      timings={"cache_n": 1, "prompt_n": 1})
        self.assertEqual(counts(CHAT, answer), (30, 10))
        # a prompt count without a cached one: the cached one from timings.cache_n
        answer = chat({"prompt_tokens": 30}, timings={"cache_n": 12, "prompt_n": 18})
        self.assertEqual(counts(CHAT, answer), (30, 12))


class CountsOnlyTests(SynchronousTestCase):
    """
    With no result log, the metrics and the policies still read a stream's counts
    (Needs.USAGE): only its events that hold them are parsed, and both kinds are found --
    an OpenAI final ``usage`` chunk and llama.cpp's ``timings`` without any usage.
    """

    def counts_only(self, body: bytes) -> tuple[object, object]:
        record_ = RequestRecord(started=100.0, method=b"POST", path=CHAT, orid_header=None,
                                request_body=b"{}", backend=A, status=200, ended=101.0,
                                content_type=SSE_TYPE, needs=Needs.USAGE)
        record_.capture(body)
        summary = summarize(record_)
        return summary.prompt_tokens, summary.cached_prompt_tokens

    def test_a_final_usage_chunk_without_timings_is_read(self) -> None:
        body = sse(chunk("a"), chunk("b", "stop"),
                   {"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 2,
                                             "prompt_tokens_details": {"cached_tokens": 64}}})
        self.assertEqual(self.counts_only(body), (100, 64))

    def test_llamacpp_timings_without_usage_are_read(self) -> None:
        timings = {"cache_n": 60, "prompt_n": 1, "predicted_n": 2}
        body = sse(chunk("a"), chunk("b"), chunk(None, "length", timings=timings))
        self.assertEqual(self.counts_only(body), (61, 60))


class OtherAPIsTests(SynchronousTestCase):
    def test_responses_api(self) -> None:
        answer = {"status": "completed", "output": [],
                  "usage": {"input_tokens": 41, "output_tokens": 2,
                            "input_tokens_details": {"cached_tokens": 40}}}
        self.assertEqual(counts(RESPONSES, answer), (41, 40))
        stream = sse({"type": "response.output_text.delta", "delta": "x"},
                     {"type": "response.completed", "response": answer})
        self.assertEqual(counts(RESPONSES, stream, stream=True), (41, 40))
        self.assertEqual(counts(RESPONSES, {**answer, "usage": {"input_tokens": 41}}),
                         (41, None))

    def test_messages_api_sums_the_three_parts_of_a_prompt(self) -> None:
        usage = {"input_tokens": 5, "cache_read_input_tokens": 700,
                 "cache_creation_input_tokens": 100, "output_tokens": 9}
        answer = {"type": "message", "content": [{"type": "text", "text": "x"}],
                  "stop_reason": "end_turn", "usage": usage}
        self.assertEqual(counts(MESSAGES, answer), (805, 700))
        self.assertEqual(counts(MESSAGES, {**answer, "usage": {"input_tokens": 5}}),
                         (5, None))

    def test_messages_stream_message_start_then_message_delta(self) -> None:
        start = {"type": "message_start", "message": {
            "type": "message", "content": [],
            "usage": {"input_tokens": 1, "cache_read_input_tokens": 60, "output_tokens": 0}}}
        end = {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
               "usage": {"output_tokens": 2}}
        self.assertEqual(counts(MESSAGES, sse(start, end), stream=True), (61, 60))
        # a message_delta that says the input again (Anthropic's does) is the final word
        later = {**end, "usage": {"output_tokens": 2, "input_tokens": 3,
                                  "cache_read_input_tokens": 58}}
        self.assertEqual(counts(MESSAGES, sse(start, later), stream=True), (61, 58))

    def test_embeddings_have_prompt_tokens_but_no_cached_count(self) -> None:
        summary = summarize(record(path=b"/v1/embeddings", chunks=[
            b'{"data": [{}], "usage": {"prompt_tokens": 7}}']))
        self.assertEqual((summary.prompt_tokens, summary.cached_prompt_tokens), (7, None))

    def test_an_error_answer_has_no_counts(self) -> None:
        summary = summarize(record(status=400, chunks=[
            json.dumps(chat({"prompt_tokens": 9})).encode()]))
        self.assertEqual((summary.prompt_tokens, summary.cached_prompt_tokens), (None, None))


#: values no engine counts with: none of them is a count of tokens
NOT_COUNTS: list[object] = [-1, 2**63, 10**400, 1.5, 3.0, "12", True,
                            None, [], {"n": 1}]


class HostileCountsTests(SynchronousTestCase):
    """A backend's answer at its worst: no exception, and no count that is not one."""

    def test_a_prompt_count_that_is_no_count_is_unknown(self) -> None:
        for value in NOT_COUNTS:
            usage = {"prompt_tokens": value, "prompt_tokens_details": {"cached_tokens": 1}}
            self.assertEqual(counts(CHAT, chat(usage)), (None, None), repr(value)[:40])
            self.assertEqual(counts(RESPONSES, {"usage": {"input_tokens": value}}),
                             (None, None), repr(value)[:40])
            self.assertEqual(counts(MESSAGES, {"content": [], "usage": {
                "input_tokens": value, "cache_read_input_tokens": 1}}), (None, None))

    def test_a_cached_count_that_is_no_count_is_unknown(self) -> None:
        for value in NOT_COUNTS:
            usage = {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": value}}
            self.assertEqual(counts(CHAT, chat(usage)), (10, None), repr(value)[:40])
            self.assertEqual(counts(MESSAGES, {"content": [], "usage": {
                "input_tokens": 10, "cache_read_input_tokens": value}}), (10, None))

    def test_more_cached_than_prompt_is_the_whole_prompt(self) -> None:
        usage = {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 10**9}}
        self.assertEqual(counts(CHAT, chat(usage)), (10, 10))
        answer = {"usage": {"input_tokens": 4, "input_tokens_details": {"cached_tokens": 5}}}
        self.assertEqual(counts(RESPONSES, answer), (4, 4))

    def test_a_cached_count_without_a_prompt_count_is_dropped(self) -> None:
        usage = {"prompt_tokens_details": {"cached_tokens": 8}}
        self.assertEqual(counts(CHAT, chat(usage)), (None, None))
        self.assertEqual(counts(MESSAGES, {"content": [], "usage": {
            "cache_read_input_tokens": 8}}), (None, None))

    def test_sums_beyond_64_bits_are_unknown(self) -> None:
        big = 2**63 - 1
        self.assertEqual(counts(CHAT, chat(timings={"cache_n": big, "prompt_n": big})),
                         (None, None))
        self.assertEqual(counts(MESSAGES, {"content": [], "usage": {
            "input_tokens": big, "cache_read_input_tokens": big}}), (None, None))

    def test_hostile_timings(self) -> None:
        for value in NOT_COUNTS:
            answer = chat(timings={"cache_n": value, "prompt_n": 5})
            self.assertEqual(counts(CHAT, answer), (None, None), repr(value)[:40])
            answer = chat(timings={"cache_n": 5, "prompt_n": value})
            self.assertEqual(counts(CHAT, answer), (None, None), repr(value)[:40])

    def test_shapes_that_are_not_objects_are_ignored(self) -> None:
        for usage in ([1], "usage", 3, True):
            self.assertEqual(counts(CHAT, chat(usage)), (None, None))
        for details in ([1], "x", 4):
            self.assertEqual(counts(CHAT, chat({"prompt_tokens": 3,
                                                "prompt_tokens_details": details})),
                             (3, None))
        for timings in ([1], "x", 4, None):
            self.assertEqual(counts(CHAT, chat(timings=timings)), (None, None))
        stream = sse({"type": "message_start", "message": {"usage": [1]}},
                     {"type": "message_delta", "usage": "x"})
        self.assertEqual(counts(MESSAGES, stream, stream=True), (None, None))


def completion(prompt: int | None, cached: int | None, **extra: Any) -> Summary:
    fields: dict[str, Any] = dict(
        time=106.9135, orid="-", backend=A, method="POST", path="/v1/chat/completions",
        status=200, kind="completion", outcome="ok", dur=6.913, ttft=0.213, finish="stop",
        completion_tokens=101, max_tokens=None, clen=2, preview="hi", empty=False,
        prompt_tokens=prompt, cached_prompt_tokens=cached, stream=True)
    return Summary(**{**fields, **extra})


class ResultLogTests(SynchronousTestCase):
    def test_the_text_line_says_them_before_the_answer(self) -> None:
        self.assertEqual(
            format_text(completion(812, 768)),
            f"{STAMP} orid=- {A} status=200 finish=stop ctok=101/- thinking=False think=False "
            "empty=False clen=2 ttft=0.213 dur=6.913 ptok=812 cached=768 | hi")

    def test_the_text_line_says_a_dash_for_what_the_answer_did_not_say(self) -> None:
        """Always there on a completion's line, as ``ctok`` is: a field stays where awk's
        recipes count it, whatever the engine reported."""
        line = format_text(completion(None, None))
        self.assertIn(" dur=6.913 ptok=- cached=- | hi", line)
        self.assertIn(" ptok=812 cached=- | ", format_text(completion(812, None)))

    def test_the_json_line_has_both_null_when_unknown(self) -> None:
        fields = json.loads(format_json(completion(812, 768)))
        self.assertEqual((fields["ptok"], fields["cached"]), (812, 768))
        fields = json.loads(format_json(completion(None, None)))
        self.assertEqual((fields["ptok"], fields["cached"]), (None, None))

    def test_the_json_line_says_whether_it_was_a_stream(self) -> None:
        body = sse(chunk("a"), chunk("b", "stop"))
        streamed = summarize(record(chunks=[body], content_type=SSE_TYPE))
        plain = summarize(record(chunks=[json.dumps(chat()).encode()]))
        self.assertEqual((streamed.stream, plain.stream), (True, False))
        self.assertIs(json.loads(format_json(streamed))["stream"], True)
        self.assertNotIn("stream", format_text(streamed).split(" | ")[0])

    def test_from_an_answer_to_the_line(self) -> None:
        usage = {"prompt_tokens": 812, "completion_tokens": 5,
                 "prompt_tokens_details": {"cached_tokens": 768}}
        summary = summarize(record(chunks=[json.dumps(chat(usage)).encode()]))
        self.assertIn(" ptok=812 cached=768 | hi", format_text(summary))
        self.assertEqual(json.loads(format_json(summary))["cached"], 768)


class OutcomeTests(SynchronousTestCase):
    def test_the_policies_see_both_counts(self) -> None:
        outcome = RequestOutcome.of(completion(812, 768), answered=True)
        self.assertEqual((outcome.prompt_tokens, outcome.cached_prompt_tokens), (812, 768))
        outcome = RequestOutcome.of(completion(None, None), answered=True)
        self.assertEqual((outcome.prompt_tokens, outcome.cached_prompt_tokens), (None, None))

    def test_time_per_output_token(self) -> None:
        outcome = RequestOutcome.of(completion(1, 0), answered=True)
        self.assertAlmostEqual(outcome.time_per_output_token or 0, (6.913 - 0.213) / 100)
        for unmeasured in (RequestOutcome.of(completion(1, 0), answered=False),
                           RequestOutcome.of(completion(1, 0, completion_tokens=1), True),
                           RequestOutcome.of(completion(1, 0, ttft=None), True)):
            self.assertIsNone(unmeasured.time_per_output_token)


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for found in family.samples:
            if found.name == name and found.labels == labels:
                return float(found.value)
    return None


class MetricsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.metrics = Metrics(Pool())

    def test_prompt_and_cached_prompt_tokens_per_backend(self) -> None:
        self.metrics.observe(completion(800, 600))
        self.metrics.observe(completion(200, None))  # an answer without a cached count
        self.metrics.observe(completion(None, None, backend="127.0.0.1:8004"))
        self.assertEqual(sample(self.metrics, "txlb_prompt_tokens_total", backend=A), 1000)
        self.assertEqual(sample(self.metrics, "txlb_cached_prompt_tokens_total", backend=A),
                         600)
        self.assertIsNone(sample(self.metrics, "txlb_prompt_tokens_total",
                                 backend="127.0.0.1:8004"))

    def test_a_backend_whose_engine_caches_nothing_has_a_hit_rate_of_0(self) -> None:
        """
        The cached counter starts at 0 beside the prompt counter: the documented ratio is
        then 0 for an engine reporting no hits, where before its series did not exist and
        the PromQL division returned nothing for that backend, as if it had no traffic.
        """
        self.metrics.observe(completion(800, 0))
        self.assertEqual(sample(self.metrics, "txlb_prompt_tokens_total", backend=A), 800)
        self.assertEqual(sample(self.metrics, "txlb_cached_prompt_tokens_total", backend=A), 0)

    def test_the_help_says_how_to_get_the_hit_rate(self) -> None:
        text = self.metrics.exposition().decode()
        self.assertIn("rate(txlb_cached_prompt_tokens_total) / rate(txlb_prompt_tokens_total)",
                      text)

    def test_time_per_output_token_histogram(self) -> None:
        self.metrics.observe(completion(1, 0))  # (6.913 - 0.213) / 100 = 0.067 s
        self.metrics.observe(completion(1, 0, dur=0.213 + 100 * 0.004))  # 4 ms
        self.metrics.observe(completion(1, 0, completion_tokens=1))  # no second token
        self.metrics.observe(completion(1, 0), answered=False)  # no backend's timing
        self.metrics.observe(completion(1, 0, stream=False))  # no first-token time
        name = "txlb_time_per_output_token_seconds"
        self.assertEqual(sample(self.metrics, name + "_count", backend=A), 2)
        self.assertEqual(sample(self.metrics, name + "_bucket", backend=A, le="0.005"), 1)
        self.assertEqual(sample(self.metrics, name + "_bucket", backend=A, le="0.05"), 1)
        self.assertEqual(sample(self.metrics, name + "_bucket", backend=A, le="0.075"), 2)
        self.assertEqual((TOKEN_TIME_BUCKETS[0], TOKEN_TIME_BUCKETS[-1]), (0.005, 1.0))

    def test_the_bookkeeper_tells_the_metrics_whether_it_was_answered(self) -> None:
        lb = LoadBalancer([A], reactor=Clock(), agent=FakeUpstream(),
                          probe_agent=FakeUpstream(), log_file="none")
        lb.bookkeeper.finished(completion(1, 0), answered=False)
        lb.bookkeeper.finished(completion(1, 0), answered=True)
        self.assertEqual(lb.metrics.registry.get_sample_value(
            "txlb_time_per_output_token_seconds_count", {"backend": A}), 1)


class WorkersTests(SynchronousTestCase):
    """Under --workers the counts cross the pipe to the supervisor, which keeps the books."""

    def test_the_end_message_carries_both(self) -> None:
        summary = completion(812, 768)
        message = decode(encode(Finished(summary, True)))
        assert isinstance(message, Finished)
        self.assertEqual((message.summary.prompt_tokens, message.summary.cached_prompt_tokens),
                         (812, 768))
        self.assertEqual(message.summary, summary)
        unknown = completion(None, None)
        self.assertEqual(from_wire(to_wire(unknown)), unknown)

    def test_a_wrong_type_from_a_worker_is_refused(self) -> None:
        for name in ("ptok", "cached"):
            for value in ("812", 1.5, True, [1]):
                with self.assertRaises(BadSummary):
                    from_wire({**to_wire(completion(812, 768)), name: value})

    def test_the_supervisor_counts_what_a_worker_reported(self) -> None:
        lb = LoadBalancer([A], reactor=Clock(), agent=FakeUpstream(),
                          probe_agent=FakeUpstream(), log_file="none")
        lines: list[str] = []  # what the result log writes, as text
        lb.summaries.add(SummaryConsumer(
            "lines", lambda summary, answered: lines.append(format_text(summary))))
        reports = WorkerReports(1, lb.pool, lb.bookkeeper)
        message = decode(encode(Finished(completion(812, 768), True)))
        reports.apply(message)
        self.assertEqual(lb.metrics.registry.get_sample_value(
            "txlb_cached_prompt_tokens_total", {"backend": A}), 768)
        self.assertEqual(lb.metrics.registry.get_sample_value(
            "txlb_prompt_tokens_total", {"backend": A}), 812)
        self.assertIn(" ptok=812 cached=768 | ", lines[0])
