"""
The proxy bench's chat path (``python -m bench relay``): what the load generator asks for is
what the backend reads, even after a router re-serialised the body; hostile bodies get a 400;
the events are the size and shape the report says; latencies split by phase as defined;
rounds rotate the targets and wait for a quiet machine a bounded time; the headline table's
ratios are computed within each round.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import tempfile
from array import array
from pathlib import Path
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from bench import backend, chat, chat_report, loadgen_streams
from bench.chat import Instruction
from bench.relay.targets import chosen_targets
from bench.rounds import Quiet, rotated, wait_quiet


def body_of(request: bytes) -> bytes:
    """The body of a whole HTTP request, checked against its Content-Length."""
    head, _, body = request.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    assert length == len(body), (length, len(body))
    return body


INSTRUCTIONS = (
    Instruction("json"),
    Instruction("paced", size=250, interval_ms=25, count=320, delay_ms=12.5),
    Instruction("paced", size=300, interval_ms=3000, count=100000),
    Instruction("bulk", size=250, seconds=34),
    Instruction("big", total_bytes=1 << 30, chunk=65536),
)


class InstructionTests(SynchronousTestCase):
    def test_what_the_client_asks_is_what_the_backend_reads(self) -> None:
        for instruction in INSTRUCTIONS:
            request = chat.chat_request("127.0.0.1", 8000, instruction)
            self.assertTrue(request.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n"))
            self.assertEqual(chat.instruction_from_body(body_of(request)), instruction)

    def test_a_router_reserialising_the_body_changes_nothing(self) -> None:
        """The routers drop fields they do not know and write the JSON again their own way:
        the instruction rides in the message content, which they keep."""
        for instruction in INSTRUCTIONS:
            payload = json.loads(chat.chat_body(instruction))
            for unknown in ("temperature", "stream_options", "max_tokens"):
                payload.pop(unknown, None)
            rewritten = json.dumps(payload, indent=2, ensure_ascii=True).encode()
            self.assertEqual(chat.instruction_from_body(rewritten), instruction)

    def test_stream_flag_matches_the_answer(self) -> None:
        """A router decides from ``stream`` whether to relay an event stream."""
        for instruction in INSTRUCTIONS:
            payload = json.loads(chat.chat_body(instruction))
            self.assertEqual(payload["stream"], instruction.kind != "json")
            self.assertEqual(payload["model"], chat.MODEL)
            self.assertEqual(payload["messages"][-1]["role"], "user")

    def test_hostile_bodies_are_not_instructions(self) -> None:
        def body(content: Any) -> bytes:
            return json.dumps({"messages": [{"role": "user", "content": content}]}).encode()

        hostile = [
            b"", b"not json", b"\xff\xfe", b"[]", b"null", b'{"messages": "paced"}',
            b'{"messages": []}', b'{"messages": [1]}', b"[" * 100_000,
            body(5), body(None), body(["paced", 1]), body(""), body("   "), body("nope 1 2"),
            body("paced 250 -1 10"), body("paced 250 25"), body("paced 1 2 3 4 5"),
            body("paced nan 25 10"), body("paced 250 inf 10"), body("paced 0 25 10"),
            body("bulk 250 1e9"), body("big -1 65536"), body("json 1"),
            body("paced 250 25 " + "9" * 300),
        ]
        for raw in hostile:
            self.assertIsNone(chat.instruction_from_body(raw), raw[:60])

    def test_the_last_message_carries_the_instruction(self) -> None:
        raw = json.dumps({"messages": [{"role": "system", "content": "json"},
                                       {"role": "user", "content": "bulk 100 2"}]}).encode()
        self.assertEqual(chat.instruction_from_body(raw), Instruction("bulk", size=100,
                                                                      seconds=2))


def chunk_payload(framed: bytes) -> bytes:
    """The payload of one HTTP chunk, its size line checked."""
    size, _, rest = framed.partition(b"\r\n")
    self_len = int(size, 16)
    assert rest[self_len:] == b"\r\n", rest[self_len:]
    return rest[:self_len]


class EventTests(SynchronousTestCase):
    def test_token_events_are_the_size_asked_one_chunk_each(self) -> None:
        for size in (250, 300, 1000):
            payload = chunk_payload(chat.token_event_template(size) % (1234567890123456789, 42))
            self.assertEqual(len(payload), size)
            self.assertTrue(payload.endswith(b"\n\n"))
            self.assertEqual(payload.count(b"\n\n"), 1)
            event = json.loads(payload[len(b"data: "):])
            self.assertEqual(event["object"], "chat.completion.chunk")
            self.assertIn("content", event["choices"][0]["delta"])

    def test_a_tiny_size_still_makes_a_valid_event(self) -> None:
        payload = chunk_payload(chat.token_event_template(10) % (1, 2))
        json.loads(payload[len(b"data: "):])

    def test_the_send_time_is_read_back_from_either_path(self) -> None:
        sent = 1764633600123456789
        chat_event = chunk_payload(chat.token_event_template(250) % (sent, 7))
        get_event = chunk_payload(backend.event_template(250) % (sent, 7))
        self.assertEqual(chat.send_time(chat_event.split(b"\n\n")[0]), sent)
        self.assertEqual(chat.send_time(get_event.split(b"\n\n")[0]), sent)

    def test_a_stream_ends_with_usage_then_done(self) -> None:
        """What a real vLLM sends at the end; neither event counts as a token's latency."""
        end = chat.stream_end(320)
        self.assertTrue(end.endswith(b"0\r\n\r\n"))
        events = [e for e in end.split(b"\r\n") if e.startswith(b"data: ")]
        self.assertEqual(len(events), chat.TRAILING_EVENTS)
        usage = json.loads(events[0][len(b"data: "):])
        self.assertEqual(usage["usage"]["completion_tokens"], 320)
        self.assertEqual(events[1], b"data: [DONE]\n\n")
        for event in events:
            self.assertIsNone(chat.send_time(event.rstrip(b"\n")))

    def test_non_token_events_have_no_send_time(self) -> None:
        for event in (b"", b"data: [DONE]", b'data: {"id":"chatcmpl-bench"}',
                      b'data: {"id":"chatcmpl-12x4"}', b": keep-alive"):
            self.assertIsNone(chat.send_time(event))


class PhaseTests(SynchronousTestCase):
    def test_streams_end_one_by_one_over_the_spread(self) -> None:
        self.assertEqual(chat.stream_counts(4, 100, 0.25), [100, 94, 88, 82])
        self.assertEqual(chat.stream_counts(3, 10, 0.0), [10, 10, 10])
        self.assertEqual(min(chat.stream_counts(100, 2, 0.9)), 1)

    def test_phase_boundaries(self) -> None:
        self.assertEqual(chat.phase_of(10, all_started=10, first_end=50), "starting")
        self.assertEqual(chat.phase_of(11, all_started=10, first_end=50), "steady")
        self.assertEqual(chat.phase_of(50, all_started=10, first_end=50), "ending")
        # streams ending before all started: ending wins
        self.assertEqual(chat.phase_of(5, all_started=10, first_end=3), "ending")

    def test_a_stall_as_streams_end_shows_in_the_ending_phase_only(self) -> None:
        """The stall the bench exists to catch: one p99 over the run would hide it."""
        received = list(range(0, 1000))
        latency = [1_000_000 if at >= 900 and at % 10 == 0 else 100_000 for at in received]
        phases = chat.phase_split(received, latency, all_started=100, first_end=900)
        self.assertEqual([phases[p]["count"] for p in chat.PHASES], [101, 799, 100])
        self.assertEqual(phases["starting"]["p99_us"], 100.0)
        self.assertEqual(phases["steady"]["p99_us"], 100.0)
        self.assertEqual(phases["ending"]["p99_us"], 1000.0)
        self.assertEqual(phases["ending"]["p50_us"], 100.0)

    def test_an_empty_phase_is_nan_not_an_error(self) -> None:
        phases = chat.phase_split([5], [1000], all_started=0, first_end=1 << 62)
        self.assertEqual(phases["steady"]["count"], 1)
        self.assertTrue(math.isnan(phases["ending"]["p99_us"]))

    def test_timeline_buckets(self) -> None:
        line = chat.timeline([100, 150, 700, 1600], [1000, 3000, 2000, 5000], start=100,
                             bucket_ns=500)
        self.assertEqual([(p["t_s"], p["count"]) for p in line],
                         [(0.0, 2), (5e-7, 1), (1.5e-6, 1)])
        self.assertEqual(line[0]["p99_us"], 3.0)


class ClientTests(SynchronousTestCase):
    def test_a_whole_chat_stream_counts_as_the_report_expects(self) -> None:
        """Every event is a relayed chunk (CPU per chunk divides by them all), but only the
        token events after the first carry a latency; however the bytes arrive split."""
        template = chat.token_event_template(250)
        events = b"".join(template % (1_000 + i, i) for i in range(5))
        response = backend.SSE_HEAD + events + chat.stream_end(5)
        for step in (len(response), 7, 1):
            loop = asyncio.new_event_loop()
            try:
                stats = loadgen_streams.PacedStats()
                latencies, received = array("q"), array("q")
                client = loadgen_streams.PacedClient(b"", stats, latencies, received,
                                             loop.create_future())
                client.now = 10_000
                for at in range(0, len(response), step):
                    client.parser.feed(response[at : at + step])
            finally:
                loop.close()
            self.assertEqual((stats.events, stats.tokens, stats.complete, stats.errors),
                             (5 + chat.TRAILING_EVENTS, 5, 1, 0), step)
            self.assertEqual(list(latencies), [10_000 - 1_001 - i for i in range(4)])
            self.assertEqual(list(received), [10_000] * 4)


class RoundTests(SynchronousTestCase):
    def test_every_target_leads_a_round_in_turn(self) -> None:
        targets = ["nginx", "txlb", "vllm-router"]
        self.assertEqual([rotated(targets, i)[0] for i in range(4)],
                         ["nginx", "txlb", "vllm-router", "nginx"])
        for i in range(3):
            self.assertEqual(sorted(rotated(targets, i)), sorted(targets))
        self.assertEqual(rotated([], 3), [])

    def fake(self, loads: list[float]) -> tuple[Any, Any, Any, list[float]]:
        now = [0.0]
        slept: list[float] = []

        def sleep(seconds: float) -> None:
            slept.append(seconds)
            now[0] += seconds

        readings = iter(loads)
        return (lambda: next(readings, loads[-1])), (lambda: now[0]), sleep, slept

    def test_waits_until_quiet(self) -> None:
        load, clock, sleep, slept = self.fake([1.5, 1.0, 0.5])
        quiet = wait_quiet(60, load=load, clock=clock, sleep=sleep, poll=5)
        self.assertEqual(quiet, Quiet(True, 0.5, 10.0))
        self.assertEqual(slept, [5, 5])
        self.assertIn("quiet", quiet.describe())

    def test_the_wait_is_bounded_and_says_so(self) -> None:
        load, clock, sleep, slept = self.fake([2.0])
        quiet = wait_quiet(12, load=load, clock=clock, sleep=sleep, poll=5)
        self.assertFalse(quiet.quiet)
        self.assertEqual(quiet.waited_s, 12)
        self.assertEqual(slept, [5, 5, 2])
        self.assertIn("NOT quiet", quiet.describe())

    def test_no_wait_when_told_not_to(self) -> None:
        load, clock, sleep, slept = self.fake([3.0])
        self.assertFalse(wait_quiet(0, load=load, clock=clock, sleep=sleep).quiet)
        self.assertEqual(slept, [])


class TargetTests(SynchronousTestCase):
    def test_default_targets_include_the_routers(self) -> None:
        self.assertEqual(chosen_targets(None, False, False),
                         ["direct", "nginx", "txlb", "vllm-router", "sglang-router"])
        self.assertIn("txlb-b", chosen_targets(None, False, True))

    def test_chosen_targets_in_report_order_and_direct_always(self) -> None:
        self.assertEqual(chosen_targets("vllm-router, txlb", False, False),
                         ["direct", "txlb", "vllm-router"])

    def test_unknown_target_names_the_known_ones(self) -> None:
        error = self.assertRaises(ValueError, chosen_targets, "txlb,envoy", False, False)
        self.assertIn("envoy", str(error))
        self.assertIn("sglang-router", str(error))


def figure(values: dict[str, float], with_ratio: bool = True) -> chat_report.Figure:
    return chat_report.Figure("CPU µs per chunk ↓", values, 1, with_ratio)


class ReportTests(SynchronousTestCase):
    targets = ["direct", "nginx", "txlb", "vllm-router"]

    def rows(self, lines: list[str]) -> list[list[str]]:
        return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]

    def test_ratios_within_each_round_and_their_range(self) -> None:
        rounds = [[figure({"nginx": 10, "txlb": 40, "vllm-router": 20})],
                  [figure({"nginx": 20, "txlb": 30, "vllm-router": 20})]]
        lines = chat_report.ratio_table(rounds, self.targets)
        self.assertIn("txlb/vllm-router | txlb/nginx", lines[0])
        self.assertNotIn("direct", lines[0])
        self.assertEqual(self.rows(lines), [
            ["CPU µs per chunk ↓", "1", "10.0", "40.0", "20.0", "2.00", "4.00"],
            ["CPU µs per chunk ↓", "2", "20.0", "30.0", "20.0", "1.50", "1.50"],
            ["CPU µs per chunk ↓", "**range**", "10.0–20.0", "30.0–40.0", "20.0", "1.50–2.00",
             "1.50–4.00"],
        ])

    def test_counts_have_no_ratio_and_one_round_no_range(self) -> None:
        lines = chat_report.ratio_table([[figure({"nginx": 5, "txlb": 5, "vllm-router": 5},
                                                 with_ratio=False)]], self.targets)
        self.assertEqual(self.rows(lines), [["CPU µs per chunk ↓", "1", "5.0", "5.0", "5.0",
                                             "–", "–"]])

    def test_a_missing_reference_has_no_ratio_column(self) -> None:
        lines = chat_report.ratio_table([[figure({"nginx": 1, "txlb": 2})]],
                                        ["direct", "nginx", "txlb"])
        self.assertNotIn("vllm-router", lines[0])
        self.assertIn("txlb/nginx", lines[0])

    def test_an_ab_run_compares_the_two_revisions(self) -> None:
        lines = chat_report.ratio_table([[figure({"txlb": 40, "txlb-b": 30})]],
                                        ["direct", "txlb", "txlb-b"])
        self.assertIn("txlb-b/txlb", lines[0])
        self.assertEqual(self.rows(lines)[0][-1], "0.75")

    def paced_row(self, p99: float, ending: float) -> dict[str, Any]:
        return {"us_per_chunk": 30.0, "p50_us": 100.0, "p99_us": p99,
                "phases": {"ending": {"p50_us": 100.0, "p99_us": ending, "count": 10}}}

    def test_added_figures_subtract_direct(self) -> None:
        data = {"paced": {"256": {"direct": self.paced_row(1000, 1000),
                                  "txlb": self.paced_row(3000, 301000),
                                  "vllm-router": self.paced_row(2000, 3000)}}}
        figures = {f.label: f.values for f in chat_report.key_figures(data)}
        self.assertEqual(figures["added chunk latency p99, 256 streams, ms ↓"],
                         {"txlb": 2.0, "vllm-router": 1.0})
        self.assertEqual(
            figures["added chunk latency p99 while streams end, 256 streams, ms ↓"],
            {"txlb": 300.0, "vllm-router": 2.0})
        self.assertNotIn("direct", figures["proxy CPU µs per SSE chunk, 256 streams ↓"])

    def test_the_report_shows_every_round(self) -> None:
        row = dict(self.paced_row(1000, 1000), events=10, expected=10, errors=0,
                   core_busy_pct=[50.0, 60.0])
        data = {"paced": {"64": {t: row for t in self.targets}}}
        raw = {"info": {"txlb": "abc123"}, "targets": self.targets, "notes": ["a note"],
               "config": {"paced_rate": 40, "paced_seconds": 8, "paced_spread": 0.25,
                          "bulk_streams": 4, "bulk_seconds": 4, "rps_connections": 32,
                          "rps_seconds": 8, "ttfb_count": 300, "hold_interval_ms": 3000,
                          "slow_bytes": 1 << 29},
               "rounds": [{"order": ["direct", "nginx", "txlb", "vllm-router"],
                           "quiet": "quiet", "data": data},
                          {"order": ["direct", "txlb", "vllm-router", "nginx"],
                           "quiet": "NOT quiet", "data": data}]}
        text = chat_report.render(raw)
        with tempfile.TemporaryDirectory() as tmp:
            written = chat_report.save(raw, text, Path(tmp), "sub/chat")
            self.assertEqual((Path(tmp) / "sub" / "chat.md").read_text(), text)
            self.assertEqual(json.loads((Path(tmp) / "sub" / "chat.json").read_text())
                             ["rounds"][1]["order"], raw["rounds"][1]["order"])
            plotted = importlib.util.find_spec("matplotlib") is not None
            self.assertEqual(len(written), 3 if plotted else 2)
        for needle in ("1. direct → nginx → txlb → vllm-router; quiet",
                       "2. direct → txlb → vllm-router → nginx; NOT quiet",
                       "## Every figure, round 1", "## Every figure, round 2", "a note",
                       "| 64 | ending | 2 |", "txlb/vllm-router"):
            self.assertIn(needle, text)


class FakeTransport(asyncio.Transport):
    """What the backend's handler writes, in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass


class BackendTests(SynchronousTestCase):
    def connect(self) -> tuple[backend.Handler, FakeTransport]:
        handler, transport = backend.Handler(), FakeTransport()
        handler.connection_made(transport)
        return handler, transport

    def test_small_chat_answer_even_with_the_body_split(self) -> None:
        handler, transport = self.connect()
        request = chat.chat_request("127.0.0.1", 1, Instruction("json"))
        handler.data_received(request[:-5])
        self.assertEqual(transport.written, b"")
        handler.data_received(request[-5:])
        self.assertEqual(transport.written, backend.CHAT_RESPONSE)
        self.assertIn(b'"object":"chat.completion"', transport.written)

    def test_chunked_request_body_and_pipelined_probe(self) -> None:
        handler, transport = self.connect()
        body = chat.chat_body(Instruction("json"))
        handler.data_received(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"\r\n%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\nGET /server_info HTTP/1.1\r\n\r\n"
            % (10, body[:10], len(body) - 10, body[10:]))
        self.assertEqual(transport.written,
                         backend.CHAT_RESPONSE + backend.PROBES[b"/server_info"])

    def test_not_an_instruction_is_a_400(self) -> None:
        handler, transport = self.connect()
        body = b'{"messages":[{"role":"user","content":"hello"}]}'
        handler.data_received(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: %d\r\n"
                              b"\r\n%s" % (len(body), body))
        self.assertTrue(transport.written.startswith(b"HTTP/1.1 400 "))
        self.assertFalse(transport.closed)

    def test_a_body_too_large_is_refused_and_closed(self) -> None:
        handler, transport = self.connect()
        handler.data_received(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: %d\r\n"
                              b"\r\n" % (backend.MAX_BODY + 1))
        self.assertTrue(transport.written.startswith(b"HTTP/1.1 413 "))
        self.assertTrue(transport.closed)

    def test_the_routers_probes_are_answered(self) -> None:
        for path in (b"/health", b"/server_info", b"/model_info", b"/v1/models"):
            handler, transport = self.connect()
            handler.data_received(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path)
            self.assertTrue(transport.written.startswith(b"HTTP/1.1 200 OK"), path)
            json.loads(transport.written.partition(b"\r\n\r\n")[2])
