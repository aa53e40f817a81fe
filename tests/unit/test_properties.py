"""
Property-based tests (hypothesis): header filtering, the summariser and config parsing
hold their promises for any input, not only the examples we thought of.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from txlb._config import ConfigError, build_config, parse_backends, parse_size
from txlb._http.headers import HOP_BY_HOP, downstream_response_headers, upstream_request_headers
from txlb._records.resultlog import format_json, format_text
from txlb._records.summary import CAPTURE_LIMIT, RequestRecord, summarize

token = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-0123456789", min_size=1, max_size=12)
header_name = st.one_of(
    token.map(str.encode),
    st.sampled_from(sorted(HOP_BY_HOP)),
    st.sampled_from([b"x-forwarded-for", b"host", b"content-length", b"authorization"]),
)
header_value = st.binary(max_size=40).filter(lambda v: b"\r" not in v and b"\n" not in v)
headers = st.lists(st.tuples(header_name, header_value), max_size=20)

SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class HeaderProperties(SynchronousTestCase):
    @SETTINGS
    @given(headers)
    def test_no_hop_by_hop_or_connection_named_header_survives(self, given_headers: list[
            tuple[bytes, bytes]]) -> None:
        named = {t.strip().lower() for n, v in given_headers if n == b"connection"
                 for t in v.split(b",") if t.strip()}
        for result in (downstream_response_headers(given_headers),
                       upstream_request_headers(given_headers, "10.0.0.1", b"http")):
            names = {n for n, _ in result}
            self.assertFalse(names & HOP_BY_HOP)
            self.assertFalse(names & (named - {b"x-forwarded-for", b"x-forwarded-proto"}))

    @SETTINGS
    @given(headers)
    def test_end_to_end_headers_kept_in_order_with_repeats(self, given_headers: list[
            tuple[bytes, bytes]]) -> None:
        named = {t.strip().lower() for n, v in given_headers if n == b"connection"
                 for t in v.split(b",") if t.strip()}
        expected = [(n, v) for n, v in given_headers
                    if n not in HOP_BY_HOP and n not in named and n != b"content-length"]
        self.assertEqual(downstream_response_headers(given_headers), expected)

    @SETTINGS
    @given(headers)
    def test_forwarded_for_always_ends_with_the_client(self, given_headers: list[
            tuple[bytes, bytes]]) -> None:
        result = upstream_request_headers(given_headers, "10.0.0.1", b"https")
        forwarded = [v for n, v in result if n == b"x-forwarded-for"]
        self.assertEqual(len(forwarded), 1)
        self.assertTrue(forwarded[0].endswith(b"10.0.0.1"))
        self.assertEqual([v for n, v in result if n == b"x-forwarded-proto"], [b"https"])


json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


def sse_stream(events: list[object]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + \
        b"data: [DONE]\n\n"


class SummaryProperties(SynchronousTestCase):
    @SETTINGS
    @given(st.binary(max_size=2000), st.binary(max_size=300),
           st.sampled_from([200, 400, 500, None]),
           st.sampled_from([b"/v1/chat/completions", b"/v1/completions", b"/other"]))
    def test_any_bytes_give_one_line(self, response: bytes, request: bytes,
                                     status: int | None, path: bytes) -> None:
        record = RequestRecord(started=0.0, method=b"POST", path=path, orid_header=None,
                               request_body=request, backend="b:1", status=status, ended=1.0)
        record.capture(response)
        summary = summarize(record)
        line = format_text(summary)
        self.assertNotIn("\n", line)
        self.assertEqual(json.loads(format_json(summary))["status"], summary.status)

    @SETTINGS
    @given(st.lists(st.text(max_size=20), min_size=1, max_size=30), st.integers(1, 50))
    def test_sse_content_is_the_joined_deltas_wherever_the_reads_split(
            self, pieces: list[str], cut: int) -> None:
        events = [{"choices": [{"index": 0, "delta": {"content": p}}]} for p in pieces]
        stream = sse_stream(events)
        record = RequestRecord(started=0.0, method=b"POST", path=b"/v1/chat/completions",
                               orid_header=None, request_body=b"{}", status=200, ended=1.0,
                               content_type=b"text/event-stream")
        for start in range(0, len(stream), cut):
            record.capture(stream[start:start + cut])
        summary = summarize(record)
        self.assertEqual(summary.clen, len("".join(pieces)))

    @SETTINGS
    @given(st.lists(json_value, max_size=10))
    def test_odd_json_events_never_break_the_summary(self, events: list[object]) -> None:
        record = RequestRecord(started=0.0, method=b"POST", path=b"/v1/chat/completions",
                               orid_header=None, request_body=b"{}", status=200, ended=1.0,
                               content_type=b"text/event-stream")
        record.capture(sse_stream(events))
        format_text(summarize(record))

    @SETTINGS
    @given(st.lists(st.binary(min_size=1, max_size=200_000), max_size=8))
    def test_capture_never_exceeds_the_limit(self, chunks: list[bytes]) -> None:
        record = RequestRecord(started=0.0, method=b"GET", path=b"/", orid_header=None,
                               request_body=b"")
        for chunk in chunks:
            record.capture(chunk)
        total = sum(len(c) for c in chunks)
        self.assertEqual(record.captured, min(total, CAPTURE_LIMIT))
        self.assertEqual(record.truncated, total > CAPTURE_LIMIT)


class ConfigProperties(SynchronousTestCase):
    @SETTINGS
    @given(st.text(max_size=40))
    def test_any_option_text_parses_or_names_the_option(self, text: str) -> None:
        for option in ("health-interval", "fall", "listen", "backends", "max-body",
                       "policy", "rate-limit", "affinity", "admin"):
            try:
                build_config({option: text}, {})
            except ConfigError as error:
                message = str(error)
                self.assertIn(f"--{option}", message)
                self.assertNotIn("\n", message)

    @SETTINGS
    @given(st.lists(st.tuples(st.sampled_from(["127.0.0.1", "gpu-1", "10.2.3.4"]),
                              st.integers(1, 65535)), min_size=1, max_size=8, unique=True))
    def test_backend_lists_round_trip(self, pairs: list[tuple[str, int]]) -> None:
        text = ",".join(f"{host}:{port}" for host, port in pairs)
        self.assertEqual([(b.host, b.port) for b in parse_backends("backends", text)], pairs)

    @SETTINGS
    @given(st.integers(0, 2**40), st.sampled_from(["", "B", "KiB", "MiB", "GiB"]))
    def test_sizes(self, number: int, unit: str) -> None:
        factor = {"": 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}[unit]
        self.assertEqual(parse_size("max-body", f"{number}{unit}"), number * factor)
