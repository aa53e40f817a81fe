"""
Tests written for ``_records/resultlog``'s full mutation run
(``bench/results/mutation-full/_records-resultlog.json``): when a failed result log is tried
again, what a reload changes of it, and standard output left open.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from txlb._records.resultlog import ResultLog
from txlb._records.summary import summarize

from .test_resultlog import a_record


class ResultLogFullRunTests(SynchronousTestCase):
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
