"""
The result-log writer: its text and JSON lines, rotation, and a log that fails without
failing anything else -- when a failed log is tried again (and says so once), a log moved
away, what a reload changes of it, standard output unbuffered and left open.  Several were
written for ``_records/resultlog``'s full mutation run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from twisted.internet.task import Clock
from twisted.logger import LogLevel, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.server import Site

from txlb import (
    LoadBalancer,
)
from txlb._log.escape import escape
from txlb._records.resultlog import RETRY_SECONDS, ResultLog, format_text, open_result_log
from txlb._records.summary import MAX_LINE, MAX_ORID, RequestRecord, summarize

from ..helpers import ClientConnection, FakeResponse, FakeUpstream
from ..parts import missing


def a_record(n: int = 0) -> RequestRecord:
    return RequestRecord(started=0.0, method=b"GET", path=f"/v1/models/{n}".encode(),
                         orid_header=None, request_body=b"", backend="127.0.0.1:8002",
                         status=200, ended=0.5)


class ResultLogTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.directory = Path(self.mktemp()).resolve()
        self.directory.mkdir()
        self.path = self.directory / "lb_results.log"
        self.events: list[dict[str, object]] = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def result_log(self, **kwargs: object) -> ResultLog:
        options: dict[str, object] = {"max_bytes": 10_000_000, "backups": 3, "fmt": "text"}
        options.update(kwargs)
        log = ResultLog(str(self.path), clock=self.clock, **options)  # type: ignore[arg-type]
        self.addCleanup(log.close)
        return log

    def lines(self, path: Path | None = None) -> list[str]:
        return (path or self.path).read_text().splitlines()

    def errors(self) -> list[dict[str, object]]:
        return [e for e in self.events if e.get("log_level") == LogLevel.error]

    def test_one_line_per_record(self) -> None:
        log = self.result_log()
        for n in range(3):
            log.write(summarize(a_record(n)))
        lines = self.lines()
        self.assertEqual(len(lines), 3)
        self.assertTrue(lines[2].endswith("GET /v1/models/2 status=200 dur=0.500"), lines[2])

    def test_json_lines(self) -> None:
        log = self.result_log(fmt="json")
        log.write(summarize(a_record(7)))
        self.assertEqual(json.loads(self.lines()[0])["path"], "/v1/models/7")

    def test_lone_surrogate_in_a_request_key_is_written_escaped(self) -> None:
        """JSON allows "\\ud800", which has no UTF-8 form: the line must not be lost."""
        for fmt in ("text", "json"):
            self.path.unlink(missing_ok=True)
            log = self.result_log(fmt=fmt)
            record = RequestRecord(started=0.0, method=b"POST", path=b"/v1/completions",
                                   orid_header=None, request_body=b'{"\\ud800": 1}',
                                   backend="127.0.0.1:8002", status=404, ended=0.5)
            log.write(summarize(record))
            log.close()
            self.assertEqual(len(self.lines()), 1, fmt)
            self.assertIn("ud800", self.lines()[0])
            self.assertEqual(self.errors(), [])

    def test_a_body_of_many_keys_makes_a_bounded_line(self) -> None:
        log = self.result_log()
        body = json.dumps({f"k{n:06d}" + "x" * 200: n for n in range(5000)}).encode()
        log.write(summarize(RequestRecord(
            started=0.0, method=b"POST", path=b"/v1/completions", orid_header=None,
            request_body=body, backend="127.0.0.1:8002", status=400, ended=0.5)))
        line = self.lines()[0]
        self.assertLess(len(line), 10_000)
        self.assertIn(",'…+4936']", line)

    def test_rotation_by_size(self) -> None:
        log = self.result_log(max_bytes=300, backups=2)
        for n in range(40):
            log.write(summarize(a_record(n)))
        names = sorted(p.name for p in self.directory.iterdir())
        self.assertEqual(names, ["lb_results.log", "lb_results.log.1", "lb_results.log.2"])
        newest_backup = self.lines(self.directory / "lb_results.log.1")
        current = self.lines()
        # no line lost or split between the newest backup and the current file
        numbers = [int(line.split("/v1/models/")[1].split()[0])
                   for line in newest_backup + current]
        self.assertEqual(numbers, list(range(numbers[0], 40)))
        self.assertLessEqual(os.path.getsize(self.directory / "lb_results.log.1"), 300 + 100)

    def test_vanished_directory_reported_once_then_recovered(self) -> None:
        log = self.result_log()
        log.write(summarize(a_record(0)))
        shutil.rmtree(self.directory)
        self.clock.advance(RETRY_SECONDS)
        for n in range(1, 6):
            log.write(summarize(a_record(n)))  # never raises
        self.assertEqual(len(self.errors()), 1)
        self.assertIn("cannot write the result log", str(self.errors()[0]["log_format"]))
        self.assertEqual(log.dropped, 5)
        self.directory.mkdir()
        self.clock.advance(RETRY_SECONDS)
        log.write(summarize(a_record(6)))
        self.assertEqual(self.lines()[-1].split()[5], "/v1/models/6")
        self.assertEqual(len(self.errors()), 1)
        recovered = [e for e in self.events if "writable again" in str(e.get("log_format"))]
        self.assertEqual(len(recovered), 1)
        self.assertEqual(recovered[0]["dropped"], 5)

    def test_disk_full_drops_lines_not_requests(self) -> None:
        self.path = Path("/dev/full")
        log = self.result_log()
        for n in range(5):
            log.write(summarize(a_record(n)))
            self.clock.advance(RETRY_SECONDS)  # every retry fails again: still one report
        self.assertEqual(log.written, 0)
        self.assertEqual(log.dropped, 5)
        self.assertEqual(len(self.errors()), 1)

    def test_unopenable_at_start_does_not_raise(self) -> None:
        self.path = self.directory / "missing-dir" / "x.log"
        log = self.result_log()
        log.write(summarize(a_record()))
        self.assertEqual((log.written, log.dropped), (0, 1))
        self.assertEqual(len(self.errors()), 1)

    def test_summariser_bug_does_not_escape(self) -> None:
        lb = LoadBalancer(["127.0.0.1:8002"], reactor=self.clock, agent=FakeUpstream(),
                          probe_agent=FakeUpstream(), log_file=str(self.path))
        self.addCleanup(lambda: lb.result_log and lb.result_log.close())
        broken = a_record()
        broken.response = [None]  # type: ignore[list-item]
        lb.bookkeeper.ended(broken)
        lb.bookkeeper.ended(a_record(1))
        self.assertEqual(len(self.lines()), 1)
        self.assertEqual(len(self.flushLoggedErrors(TypeError)), 1)

    def test_none_disables(self) -> None:
        self.assertIsNone(open_result_log("none", 1, 1, "text", self.clock))


#: Characters that end a line for some line-based tool, or act on a terminal.
RAW_UNSAFE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029]")
COMPLETION_FIELDS = {"orid", "status", "finish", "ctok", "thinking", "think", "empty", "clen",
                     "ttft", "dur", "ptok", "cached", "class"}
ERROR_FIELDS = {"orid", "status", "req_keys", "method", "path", "dur", "class"}
OTHER_FIELDS = {"orid", "status", "dur", "class"}


def answer(content: str = "ok", finish: str = "stop") -> bytes:
    return json.dumps({"choices": [{"index": 0, "finish_reason": finish,
                                    "message": {"content": content}}]}).encode()


#: The issue's payloads and their kin, each as (method, path, X-Orid, request body,
#: backend status, backend body, the fields the line must have).
HOSTILE: list[tuple[bytes, bytes, bytes | None, bytes, int, bytes, set[str]]] = [
    # ESC/BEL in X-Orid: a terminal running tail -f would act on them
    (b"POST", b"/v1/chat/completions", b"\x1b]0;pwned\x07\x1b[2J", b"{}", 200, answer(),
     COMPLETION_FIELDS),
    # fields forged in X-Orid, which the recipes would then trust
    (b"POST", b"/v1/chat/completions", b"ORD-1 127.0.0.9:9999 status=200", b"{}", 500,
     b"boom", ERROR_FIELDS),
    # U+2028, NEL and VT split lines for line-based tools
    (b"POST", b"/v1/chat/completions", "a\u2028b\x85c\x0bd".encode(), b"{}", 200,
     answer(), COMPLETION_FIELDS),
    (b"POST", b"/v1/chat/completions", None,
     json.dumps({"user": "x\u2028y\x85z\x0bw status=200"}).encode(), 200, answer(),
     COMPLETION_FIELDS),
    # a body "user" of 8 MiB
    (b"POST", b"/v1/chat/completions", None, json.dumps({"user": "u" * (8 << 20)}).encode(),
     200, answer(), COMPLETION_FIELDS),
    # a literal backslash-n is not a newline
    (b"POST", b"/v1/chat/completions", b"a\\nb", b"{}", 200, answer("x\\ny"),
     COMPLETION_FIELDS),
    # request keys, an error body and a finish reason chosen to forge
    (b"POST", b"/v1/completions", None,
     json.dumps({"a','b": 1, "c d=e|f]": 2, "\x1b\u2028": 3, "k" * 100_000: 4}).encode(),
     400, "no\u2028 status=200\x1b[2J\r\n11-29 14:22:01 orid=X 127.0.0.9:1 status=200 \x07"
     .encode() + b"e" * 100_000, ERROR_FIELDS),
    (b"POST", b"/v1/chat/completions", None, b"{}", 200,
     answer("fine", finish="stop empty=True\x1b\u2028" + "f" * 10_000), COMPLETION_FIELDS),
    # numbers JSON allows but no count is: 4,000 digits from the client, 400 from a backend
    (b"POST", b"/v1/chat/completions", None, b'{"max_tokens": 1%s}' % (b"0" * 4000), 200,
     b'{"choices": [{"index": 0, "message": {"content": "ok"}, "finish_reason": "stop"}], '
     b'"usage": {"completion_tokens": 1%s}}' % (b"0" * 400), COMPLETION_FIELDS),
    # what twisted.web lets through in a method and a path
    (b"G|T'", b"/a\x7fb|c=d'e\\f\x85%0a?x=1&y=status=200", b"-", b"", 200, b"{}",
     OTHER_FIELDS),
]


class HostileRequestTests(SynchronousTestCase):
    """
    The hostile payloads through the real path -- a client connection to the proxy's Site,
    a backend answering -- with the log read back from disk: one line per request, no raw
    control character, and the recipes' field parsing finds only the true fields.
    """

    def run_hostile(self, fmt: str) -> list[str]:
        path = Path(self.mktemp()).resolve()
        clock = Clock()
        upstream = FakeUpstream()
        lb = LoadBalancer(["127.0.0.1:8002"], reactor=clock, agent=upstream,
                          probe_agent=FakeUpstream(), log_file=str(path), log_format=fmt)
        self.addCleanup(lambda: lb.result_log and lb.result_log.close())
        site = Site(lb.resource(), reactor=clock)
        for number, (method, target, orid, body, status, reply, _) in enumerate(HOSTILE):
            client = ClientConnection(site)
            client.request(method, target, body=body,
                           headers=[] if orid is None else [(b"X-Orid", orid)])
            self.assertEqual(len(upstream.calls), number + 1, ascii(target))  # forwarded
            response = upstream.last.respond(FakeResponse(
                status, [(b"content-type", b"application/json")], phrase=b"X"))
            response.send(reply)
            response.end()
            self.assertEqual(client.response().status, status)
        raw = path.read_bytes()
        self.assertEqual(raw.count(b"\n"), len(HOSTILE))
        text = raw.decode("utf-8")  # strict: nothing undecodable was written
        self.assertIsNone(RAW_UNSAFE.search(text), ascii(text))
        lines = text.splitlines()  # splits on every Unicode line boundary
        self.assertEqual(len(lines), len(HOSTILE))
        for line in lines:
            self.assertLessEqual(len(line.encode()), MAX_LINE)
        return lines

    def test_text(self) -> None:
        for line, (method, _, orid, _, status, _, fields) in zip(
                self.run_hostile("text"), HOSTILE, strict=True):
            words = line.split("|", 1)[0].split()  # every kind of whitespace: more than awk
            found = dict(word.split("=", 1) for word in words if "=" in word)
            self.assertEqual(set(found), fields, ascii(line))
            self.assertEqual(found["status"], str(status), ascii(line))
            self.assertEqual(words[3], "127.0.0.1:8002", ascii(line))
            self.assertTrue(words[2].startswith("orid="), ascii(line))
            if orid == b"ORD-1 127.0.0.9:9999 status=200":
                self.assertEqual(found["orid"], "ORD-1\\x20127.0.0.9:9999\\x20status\\x3d200")
            if fields is OTHER_FIELDS:
                self.assertEqual(words[4], escape(method.decode()))
                # (the log shows the path without the query string, percent-decoded)
                self.assertEqual(words[5], "/a\\x7fb\\x7cc\\x3dd'e\\\\f\ufffd\\n")

    def test_json(self) -> None:
        for line, (method, _, _, _, status, _, _) in zip(
                self.run_hostile("json"), HOSTILE, strict=True):
            fields = json.loads(line)
            self.assertEqual((fields["status"], fields["backend"], fields["method"]),
                             (status, "127.0.0.1:8002", method.decode()))
            self.assertLessEqual(len(fields["orid"].encode()), MAX_ORID)


DOCS = Path(__file__).resolve().parents[2] / "docs" / "result-log.md"


def recipe_log() -> str:
    """
    True lines -- one 400 that says "why", one cut by length (orid ``cut``), ``ORD-123``
    -- among lines whose client- and backend-chosen values try to look like each recipe's
    target: another backend, status=400, finish=length, empty=True, a slow ttft, a timeout.
    """
    forged = "x 127.0.0.9:9999 status=400 finish=length empty=True ttft=99 end=timeout |"

    def line(orid: str, status: int = 200, body: bytes = b"", content: str = "fine",
             finish: str = "stop", path: bytes = b"/v1/chat/completions") -> str:
        if status == 200 and path == b"/v1/chat/completions":
            body = answer(content, finish)
        record = RequestRecord(started=0.0, method=b"POST", path=path,
                               orid_header=orid.encode(), request_body=b"{}",
                               backend="127.0.0.1:8003", status=status, ended=0.5,
                               first_byte=0.25)
        record.capture(body)
        return format_text(summarize(record)) + "\n"

    return "".join([
        line("ORD-123", content="real answer"),
        line("e1", status=400, body=b"why"),
        line("cut", finish="length"),
        line(forged),
        line("ORD-123" + forged),
        line("x", content=forged + " orid=ORD-123 " + forged),
        line("y", finish=forged),
        line("z", status=500, body=("ERR_BODY | " + forged + " orid=ORD-123 ").encode()),
        line(forged, path=b"/v1/models|" + forged.replace(" ", "").encode()),
    ])


class RecipeTests(SynchronousTestCase):
    """The grep/awk recipes of docs/result-log.md, run by the shell on a hostile log."""

    #: what each ```sh block prints, in the order of the page
    EXPECTED = [
        "      1 127.0.0.1:8003\n      1 why\n",
        "      1 127.0.0.1:8003 status=500\n      1 127.0.0.1:8003 status=400\n",
        "      1 orid=cut\n",
        "",
        "",
        None,  # the line of ORD-123: checked below
        "",
    ]

    def test_recipes_find_only_true_fields(self) -> None:
        tools = ["sh", "grep", "awk", "sed", "sort", "uniq", "tail"]
        absent = [tool for tool in tools if shutil.which(tool) is None]
        if absent:
            missing("coreutils", f"the recipes need {', '.join(absent)}")
        page = DOCS.read_text()
        blocks = re.findall(r"```sh\n(.*?)```", page.split("## Grep recipes", 1)[1], re.DOTALL)
        self.assertEqual(len(blocks), len(self.EXPECTED), "a recipe was added or removed")
        directory = Path(self.mktemp()).resolve()
        directory.mkdir()
        log = recipe_log()
        (directory / "lb_results.log").write_text(log)
        for block, expected in zip(blocks, self.EXPECTED, strict=True):
            result = subprocess.run(["sh", "-c", block], cwd=directory, capture_output=True,
                                    text=True, timeout=30, env={"LC_ALL": "C.UTF-8",
                                                                "PATH": os.environ["PATH"]})
            self.assertEqual(result.stderr, "", block)
            if expected is None:
                self.assertEqual(result.stdout, log.splitlines(keepends=True)[0], block)
            else:
                self.assertEqual(result.stdout, expected, block)


class FormatAndRecoveryTests(SynchronousTestCase):
    """The result log's formats and its recovery after a failed write."""

    def summary(self, **fields: Any) -> Any:
        from txlb._records.summary import summarize

        record = RequestRecord(started=1.0, method=b"POST", path=b"/v1/completions",
                               orid_header=None, request_body=b'{"max_tokens": 9}',
                               backend="127.0.0.1:8002", status=200, ended=2.5,
                               content_type=b"application/json")
        record.capture(b'{"choices": [{"text": "hi"}]}')
        import attrs

        return attrs.evolve(summarize(record), **fields)

    def test_text_line_fields(self) -> None:
        from txlb._records.resultlog import format_text

        line = format_text(self.summary())
        self.assertIn(" finish=- ctok=-/9 thinking=False think=False empty=False clen=2 ",
                      line)
        line = format_text(self.summary(finish="stop", completion_tokens=2, think=True))
        self.assertIn(" finish=stop ctok=2/9 thinking=False think=True ", line)

    def test_json_line_fields(self) -> None:
        from txlb._records.resultlog import format_json

        plain = json.loads(format_json(self.summary()))
        self.assertNotIn("trunc", plain)
        self.assertNotIn("tries", plain)
        from datetime import datetime
        self.assertEqual(datetime.fromisoformat(plain["time"]).timestamp(), 2.5, plain["time"])
        marked = json.loads(format_json(self.summary(truncated=True, tries=2)))
        self.assertEqual((marked["trunc"], marked["tries"]), (True, 2))

    def test_a_failed_write_recovers_and_says_so_once(self) -> None:
        from pathlib import Path

        from twisted.logger import globalLogPublisher

        from txlb._records.resultlog import RETRY_SECONDS, ResultLog

        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        path = Path(self.mktemp())
        path.parent.mkdir(parents=True, exist_ok=True)
        clock = Clock()
        log = ResultLog(str(path), max_bytes=10**7, backups=1, fmt="text", clock=clock)
        self.addCleanup(log.close)
        sink: Any = log._sink

        def full(data: bytes) -> None:
            raise OSError(28, "No space left on device")

        original, sink.write = sink.write, full
        log.write(self.summary())
        self.assertEqual(log.dropped, 1)
        sink.write = original
        clock.advance(RETRY_SECONDS)
        for _ in range(3):
            log.write(self.summary())
        self.assertEqual(log.written, 3)
        self.assertEqual(len(path.read_text().splitlines()), 3)
        again = [e for e in events if "writable again" in str(e.get("log_format", ""))]
        self.assertEqual(len(again), 1)

    def test_standard_output_is_written_unbuffered(self) -> None:
        import os
        import tempfile

        from txlb._records.resultlog import ResultLog

        with tempfile.TemporaryFile() as captured:
            saved = os.dup(1)
            os.dup2(captured.fileno(), 1)
            try:
                log = ResultLog("-", max_bytes=0, backups=0, fmt="text", clock=Clock())
                log.write(self.summary())
                captured.seek(0)
                written = captured.read()  # before close: nothing held in a buffer
                log.close()
            finally:
                os.dup2(saved, 1)
                os.close(saved)
        self.assertEqual(written.count(b"\n"), 1)
        self.assertIn(b"status=200", written)

    def test_a_formatter_bug_loses_the_line_not_the_request(self) -> None:
        from pathlib import Path

        from txlb._records.resultlog import ResultLog

        path = Path(self.mktemp())
        path.parent.mkdir(parents=True, exist_ok=True)
        log = ResultLog(str(path), max_bytes=10**7, backups=1, fmt="text", clock=Clock())
        self.addCleanup(log.close)

        def broken(summary: object) -> str:
            raise KeyError("a formatter bug")

        log.format = broken
        log.write(self.summary())
        self.assertEqual(len(self.flushLoggedErrors(KeyError)), 1)

    def test_text_line_says_tries_only_when_retried(self) -> None:
        from txlb._records.resultlog import format_text

        self.assertNotIn("tries=", format_text(self.summary()))
        self.assertIn(" tries=2", format_text(self.summary(tries=2)))

    def test_a_log_moved_away_is_reopened_at_its_path(self) -> None:
        from pathlib import Path

        from txlb._records.resultlog import RETRY_SECONDS, ResultLog

        directory = Path(self.mktemp())
        directory.mkdir(parents=True)
        path = directory / "lb_results.log"
        clock = Clock()
        log = ResultLog(str(path), max_bytes=10**7, backups=1, fmt="text", clock=clock)
        self.addCleanup(log.close)
        summary = self.summary()
        log.write(summary)
        path.rename(directory / "moved.log")  # logrotate's move,
        path.write_text("")  # and its create: another file at the same path
        clock.advance(RETRY_SECONDS)
        log.write(summary)
        self.assertEqual(len(path.read_text().splitlines()), 1)
        self.assertEqual(len((directory / "moved.log").read_text().splitlines()), 1)
        clock.advance(RETRY_SECONDS)
        log.write(summary)  # unchanged file: kept open, appended to
        self.assertEqual(len(path.read_text().splitlines()), 2)


class RetryAndReloadTests(SynchronousTestCase):
    """Mutants of ``_records/resultlog`` that survived its full run."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1000)  # a process that has run a while
        self.directory = Path(self.mktemp()).resolve()
        self.directory.mkdir()
        self.path = self.directory / "lb_results.log"

    def test_a_failed_log_is_tried_again_every_five_seconds(self) -> None:
        """
        Not on every request (a failing disk must not cost each one an open), and not
        less often than the documented 5 s: lines written before that are dropped, the
        first one after it is written.
        """
        log = ResultLog(str(self.path), 10_000_000, 3, "text", self.clock)
        self.addCleanup(log.close)
        shutil.rmtree(self.directory)
        self.clock.advance(5)
        log.write(summarize(a_record(0)))  # fails: tried again 5 s from now
        self.directory.mkdir()
        self.clock.advance(4.9)
        log.write(summarize(a_record(1)))
        self.assertEqual((log.written, log.dropped), (0, 2))
        self.clock.advance(0.1)
        log.write(summarize(a_record(2)))
        self.assertEqual((log.written, log.dropped), (1, 2))
        self.assertEqual(len(self.path.read_text().splitlines()), 1)

    def test_a_moved_file_is_noticed_within_five_seconds_not_at_every_line(self) -> None:
        log = ResultLog(str(self.path), 10_000_000, 3, "text", self.clock)
        self.addCleanup(log.close)
        self.clock.advance(5)
        log.write(summarize(a_record(0)))  # checked: still the file at the path
        self.path.rename(self.directory / "moved.log")  # an operator's (or logrotate's) move
        log.write(summarize(a_record(1)))  # within 5 s of that check: into the moved file
        self.assertFalse(self.path.exists())
        self.clock.advance(5)
        log.write(summarize(a_record(2)))  # checked: a new file at the path
        self.assertEqual(len(self.path.read_text().splitlines()), 1)
        self.assertEqual(len((self.directory / "moved.log").read_text().splitlines()), 2)

    def test_a_reload_rotates_at_the_new_size(self) -> None:
        log = ResultLog(str(self.path), 10_000_000, 3, "text", self.clock)
        self.addCleanup(log.close)
        log.retune("text", 200, 2)
        for n in range(10):
            log.write(summarize(a_record(n)))
        self.assertTrue((self.directory / "lb_results.log.1").exists())
        self.assertFalse((self.directory / "lb_results.log.3").exists())  # 2 backups kept
        self.assertLessEqual(self.path.stat().st_size, 200 + 100)

    def test_standard_output_stays_open_after_the_log_closes(self) -> None:
        """``--log-file -`` writes to descriptor 1, which is the process's, not the log's."""
        read_end, write_end = os.pipe()
        saved = os.dup(1)
        os.dup2(write_end, 1)
        try:
            log = ResultLog("-", 10_000_000, 3, "text", self.clock)
            log.retune("json", 1000, 1)  # a reload with standard output: nothing to rotate
            log.write(summarize(a_record(0)))
            log.close()
            os.fstat(1)  # raises if closing the log closed descriptor 1
            os.write(1, b"still open\n")
        finally:
            os.dup2(saved, 1)
            os.close(saved)
            os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            written = pipe.read().decode()
        self.assertIn('"/v1/models/0"', written)
        self.assertTrue(written.endswith("still open\n"))
