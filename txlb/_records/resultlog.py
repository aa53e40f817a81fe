"""
The result log: one line per proxied request, the file on-call engineers grep.

Two promises shape this module:

* **Failure isolation.**  A log that cannot be written (disk full, directory gone,
  permission denied) must never fail, delay or drop a request.  Every write is guarded;
  the first failure is reported once on the service log, lines are dropped (and counted)
  while it lasts, the file is reopened at most every :data:`RETRY_SECONDS`, and recovery
  is reported with the number of lines lost.
* **Nothing per chunk.**  The balancer hands over a finished request's :class:`Summary`; the
  summary is computed and written once, when the request has ended.

Rotation is Twisted's own ``LogFile`` (size-based; ``name.1`` is the newest backup).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Protocol

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.logfile import LogFile

from txlb._config.config import Config
from txlb._records.fields import FIELDS, json_formatter, text_formatter
from txlb._records.summary import Summary

log = Logger()

#: How often a failed log is retried, and how often a healthy one checks that its file is
#: still the one at its path (a deleted directory or an external move would otherwise send
#: every line into an unlinked file).
RETRY_SECONDS = 5.0


format_text = text_formatter(FIELDS, doc="""
    The contract's text line for ``summary`` (without the newline), made from the field
    table (:data:`txlb._records.fields.FIELDS`).  Every value that a client or a backend
    chose is escaped: before the first ``|`` a space, ``=`` or ``|`` only ever separates
    txlb's own fields.
    """)

format_json = json_formatter(FIELDS, doc="""
    The same fields as one JSON object (``--log-format json``), made from the field table:
    the same values (clipped in :func:`~txlb._records.summary.summarize`), and no character
    left raw that a line-based tool or a terminal would act on.
    """)


FORMATS = {"text": format_text, "json": format_json}


class _Sink(Protocol):
    def write(self, data: bytes) -> Any: ...

    def close(self) -> None: ...


class ResultLog:
    """
    Writes one line per finished request to a rotating file (or standard output).

    ``path`` ``"-"`` means standard output: the process's file descriptor 1, not
    ``sys.stdout``, which twistd redirects into its own service log.
    """

    def __init__(self, path: str, max_bytes: int, backups: int, fmt: str,
                 clock: IReactorTime) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.format = FORMATS[fmt]
        self.clock = clock
        self.written = 0
        self.dropped = 0
        self._sink: _Sink | None = None
        self._failing = False
        self._next_check = 0.0
        self._identity: tuple[int, int] | None = None
        self._open()

    def reconfigure(self, config: Config) -> None:
        """``config``'s ``--log-format``, ``--log-max-bytes`` and ``--log-backups``."""
        self.retune(config.log_format, config.log_max_bytes, config.log_backups)

    def retune(self, fmt: str, max_bytes: int, backups: int) -> None:
        """
        A reload's ``--log-format``, ``--log-max-bytes`` and ``--log-backups``, without
        reopening the file (``--log-file`` itself needs a restart).
        """
        self.format = FORMATS[fmt]
        self.max_bytes = max_bytes
        self.backups = backups
        sink = self._sink
        if isinstance(sink, LogFile):
            sink.rotateLength = max_bytes
            sink.maxRotatedFiles = backups

    def write(self, summary: Summary) -> None:
        """Write one summarised request.  Never raises."""
        try:
            # backslashreplace: a client's JSON may hold a lone surrogate, which has no
            # UTF-8 form; the line is written with it escaped rather than lost
            data = (self.format(summary) + "\n").encode("utf-8", "backslashreplace")
        except Exception:
            log.failure("could not format a result log line")
            return
        self._write(data)

    def close(self) -> None:
        if self._sink is not None:
            sink, self._sink = self._sink, None
            with contextlib.suppress(OSError):
                sink.close()

    # -- the guarded file ---------------------------------------------------------------

    def _open(self) -> None:
        self._next_check = self.clock.seconds() + RETRY_SECONDS
        try:
            if self.path == "-":
                self._sink = open(1, "wb", buffering=0, closefd=False)  # noqa: SIM115
            else:
                self._sink = LogFile.fromFullPath(
                    self.path, rotateLength=self.max_bytes, maxRotatedFiles=self.backups
                )
                self._identity = self._file_identity()
        except OSError as error:
            self._sink = None
            self._failed(error)

    def _write(self, data: bytes) -> None:
        now = self.clock.seconds()
        if now >= self._next_check:
            self._check_file()
        if self._sink is None:
            self.dropped += 1
            return
        try:
            self._sink.write(data)
        except (OSError, ValueError) as error:  # ValueError: write to a closed file
            self.dropped += 1
            self.close()
            self._failed(error)
            return
        self.written += 1
        if self._failing:
            self._failing = False
            log.info("result log {path} is writable again; {dropped} lines were lost",
                     path=self.path, dropped=self.dropped)

    def _check_file(self) -> None:
        """Reopen a failed log, or one whose file is no longer the one at its path."""
        self._next_check = self.clock.seconds() + RETRY_SECONDS
        if self._sink is None:
            self._open()
            return
        if self.path == "-":
            return
        try:
            if self._file_identity() == self._identity:
                return
        except OSError:
            pass  # the path is gone: reopen (which recreates it, or reports why not)
        # Reopening after our own rotation is harmless: it appends to the same new file.
        self.close()
        self._open()

    def _file_identity(self) -> tuple[int, int]:
        on_disk = os.stat(self.path)
        return (on_disk.st_dev, on_disk.st_ino)

    def _failed(self, error: Exception) -> None:
        if not self._failing:
            self._failing = True
            log.error(
                "cannot write the result log {path}: {error}; requests are unaffected, "
                "lines are dropped until it can be written again (retried every {retry:g}s)",
                path=self.path, error=error, retry=RETRY_SECONDS,
            )


def open_result_log(path: str, max_bytes: int, backups: int, fmt: str,
                    clock: IReactorTime) -> ResultLog | None:
    """The result log for the ``--log-file`` value, or ``None`` for ``none``."""
    if path == "none":
        return None
    return ResultLog(path, max_bytes, backups, fmt, clock)
