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
import datetime
import json
import os
import time
from typing import Any, Protocol

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.logfile import LogFile

from txlb._records.escape import escape, escape_json
from txlb._records.summary import CLASSIC_PATHS, Summary

log = Logger()

#: How often a failed log is retried, and how often a healthy one checks that its file is
#: still the one at its path (a deleted directory or an external move would otherwise send
#: every line into an unlinked file).
RETRY_SECONDS = 5.0


def _flag(value: bool) -> str:
    return "True" if value else "False"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _stamp(summary: Summary) -> str:
    """The text format's ``MM-DD HH:MM:SS``, in the host's local time zone (``TZ``)."""
    return time.strftime("%m-%d %H:%M:%S", time.localtime(summary.time))


def iso_time(when: float) -> str:
    """
    ``when`` in ISO 8601 with milliseconds and the local zone's offset
    (``2026-11-29T14:22:01.123+01:00``): the JSON format is read by tools that merge logs
    from hosts in different zones and across years, so the line says both.
    """
    stamp = datetime.datetime.fromtimestamp(when, datetime.timezone.utc).astimezone()
    return stamp.isoformat(timespec="milliseconds")


def _extras(summary: Summary) -> str:
    """``key=value`` fields the seed format did not have, only when they say something."""
    extra = ""
    if summary.outcome != "ok":
        extra += f" end={summary.outcome}"
    if summary.tries > 1:
        extra += f" tries={summary.tries}"
    if summary.truncated:
        extra += " trunc=True"
    return extra


def format_text(summary: Summary) -> str:
    """
    The contract's text line (without the newline).

    Every value that a client or a backend chose is escaped (:func:`~txlb._records.escape.escape`):
    before the first ``|`` a space, ``=`` or ``|`` only ever separates txlb's own fields.
    """
    head = f"{_stamp(summary)} orid={escape(summary.orid)} {escape(summary.backend or '-')}"
    method, path = escape(summary.method), escape(summary.path)
    if summary.kind == "completion":
        ctok = (f"{'-' if summary.completion_tokens is None else summary.completion_tokens}"
                f"/{'-' if summary.max_tokens is None else summary.max_tokens}")
        return (
            f"{head} status={summary.status} finish={escape(summary.finish or '-')} "
            f"ctok={ctok} thinking={_flag(summary.thinking)} think={_flag(summary.think)} "
            f"empty={_flag(summary.empty)} clen={summary.clen} ttft={_seconds(summary.ttft)} "
            f"dur={_seconds(summary.dur)}{_path(summary)}{_extras(summary)} | "
            f"{escape(summary.preview, 'text')}"
        )
    if summary.kind == "error":
        keys = ("-" if summary.req_keys is None
                else "[" + ",".join(f"'{escape(k, 'key')}'" for k in summary.req_keys) + "]")
        return (
            f"{head} status={summary.status} req_keys={keys} method={method} "
            f"path={path} dur={_seconds(summary.dur)}{_extras(summary)} "
            f"ERR_BODY | {escape(summary.err_body, 'text')}"
        )
    if summary.kind == "embedding":
        return (f"{head} {method} {path} status={summary.status} n={_count(summary.count)} "
                f"ptok={_count(summary.prompt_tokens)} dur={_seconds(summary.dur)}"
                f"{_extras(summary)}")
    return (f"{head} {method} {path} status={summary.status} "
            f"dur={_seconds(summary.dur)}{_extras(summary)}")


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def _path(summary: Summary) -> str:
    """
    ``path=`` on a completion line of any API but the two the line was made for (chat and
    completions under ``/v1``), so that ``/v1/messages`` or a client missing ``/v1`` shows.
    """
    if summary.path.encode("utf-8", "replace") in CLASSIC_PATHS:
        return ""
    return f" path={escape(summary.path)}"


def format_json(summary: Summary) -> str:
    """
    The same fields as one JSON object (``--log-format json``), the same values (clipped
    in :func:`~txlb._records.summary.summarize`), and no character left raw that a line-based
    tool or a terminal would act on.
    """
    fields: dict[str, Any] = {
        "time": iso_time(summary.time),
        "orid": summary.orid,
        "backend": summary.backend,
        "method": summary.method,
        "path": summary.path,
        "status": summary.status,
        "kind": summary.kind,
        "end": summary.outcome,
        "ttft": None if summary.ttft is None else round(summary.ttft, 3),
        "dur": round(summary.dur, 3),
    }
    if summary.kind == "completion":
        fields.update(
            finish=summary.finish, ctok=summary.completion_tokens,
            max_tokens=summary.max_tokens, thinking=summary.thinking, think=summary.think,
            empty=summary.empty, clen=summary.clen, preview=summary.preview,
        )
    elif summary.kind == "embedding":
        fields.update(n=summary.count, ptok=summary.prompt_tokens)
    elif summary.kind == "error":
        fields.update(req_keys=summary.req_keys, err_body=summary.err_body)
    if summary.truncated:
        fields["trunc"] = True
    if summary.tries > 1:
        fields["tries"] = summary.tries
    return escape_json(json.dumps(fields, ensure_ascii=False))


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
