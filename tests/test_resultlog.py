"""The result-log writer: rotation, and a log that fails without failing anything else."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from twisted.internet.task import Clock
from twisted.logger import LogLevel, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from txlb._resultlog import RETRY_SECONDS, ResultLog, open_result_log
from txlb._summary import RequestRecord


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
            log.record(a_record(n))
        lines = self.lines()
        self.assertEqual(len(lines), 3)
        self.assertTrue(lines[2].endswith("GET /v1/models/2 status=200 dur=0.500"), lines[2])

    def test_json_lines(self) -> None:
        log = self.result_log(fmt="json")
        log.record(a_record(7))
        self.assertEqual(json.loads(self.lines()[0])["path"], "/v1/models/7")

    def test_lone_surrogate_in_a_request_key_is_written_escaped(self) -> None:
        """JSON allows "\\ud800", which has no UTF-8 form: the line must not be lost."""
        for fmt in ("text", "json"):
            self.path.unlink(missing_ok=True)
            log = self.result_log(fmt=fmt)
            record = RequestRecord(started=0.0, method=b"POST", path=b"/v1/completions",
                                   orid_header=None, request_body=b'{"\\ud800": 1}',
                                   backend="127.0.0.1:8002", status=404, ended=0.5)
            log.record(record)
            log.close()
            self.assertEqual(len(self.lines()), 1, fmt)
            self.assertIn("ud800", self.lines()[0])
            self.assertEqual(self.errors(), [])

    def test_a_body_of_many_keys_makes_a_bounded_line(self) -> None:
        log = self.result_log()
        body = json.dumps({f"k{n:06d}" + "x" * 200: n for n in range(5000)}).encode()
        log.record(RequestRecord(started=0.0, method=b"POST", path=b"/v1/completions",
                                 orid_header=None, request_body=body,
                                 backend="127.0.0.1:8002", status=400, ended=0.5))
        line = self.lines()[0]
        self.assertLess(len(line), 10_000)
        self.assertIn(",'…+4936']", line)

    def test_rotation_by_size(self) -> None:
        log = self.result_log(max_bytes=300, backups=2)
        for n in range(40):
            log.record(a_record(n))
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
        log.record(a_record(0))
        shutil.rmtree(self.directory)
        self.clock.advance(RETRY_SECONDS)
        for n in range(1, 6):
            log.record(a_record(n))  # never raises
        self.assertEqual(len(self.errors()), 1)
        self.assertIn("cannot write the result log", str(self.errors()[0]["log_format"]))
        self.assertEqual(log.dropped, 5)
        self.directory.mkdir()
        self.clock.advance(RETRY_SECONDS)
        log.record(a_record(6))
        self.assertEqual(self.lines()[-1].split()[5], "/v1/models/6")
        self.assertEqual(len(self.errors()), 1)
        recovered = [e for e in self.events if "writable again" in str(e.get("log_format"))]
        self.assertEqual(len(recovered), 1)
        self.assertEqual(recovered[0]["dropped"], 5)

    def test_disk_full_drops_lines_not_requests(self) -> None:
        self.path = Path("/dev/full")
        log = self.result_log()
        for n in range(5):
            log.record(a_record(n))
            self.clock.advance(RETRY_SECONDS)  # every retry fails again: still one report
        self.assertEqual(log.written, 0)
        self.assertEqual(log.dropped, 5)
        self.assertEqual(len(self.errors()), 1)

    def test_unopenable_at_start_does_not_raise(self) -> None:
        self.path = self.directory / "missing-dir" / "x.log"
        log = self.result_log()
        log.record(a_record())
        self.assertEqual((log.written, log.dropped), (0, 1))
        self.assertEqual(len(self.errors()), 1)

    def test_summariser_bug_does_not_escape(self) -> None:
        log = self.result_log()
        broken = a_record()
        broken.response = [None]  # type: ignore[list-item]
        log.record(broken)
        log.record(a_record(1))
        self.assertEqual(len(self.lines()), 1)
        self.assertEqual(len(self.flushLoggedErrors(TypeError)), 1)

    def test_none_disables(self) -> None:
        self.assertIsNone(open_result_log("none", 1, 1, "text", self.clock))
