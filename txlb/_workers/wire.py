"""
The messages between a ``--workers`` supervisor and its worker processes: JSON lines.

Supervisor to worker (the worker's standard input): ``hello`` (its row, the config, the
backends), ``state`` (the backends again, whenever the supervisor's pool changed), ``kick``
(a slot was freed in another worker: look at your max_conns queue again), ``stop``.

Worker to supervisor (the worker's file descriptor 3): ``end`` (one finished request's
summary, for the one result log and the metrics), ``answer`` (a status a backend
answered and the key of the client who caused it, for outlier ejection), ``down`` (this
worker marked a backend down: refused, reset or hung), ``suspect`` (probe this backend
now), ``wait`` (a request waited this long in the max_conns queue), ``ready``.

JSON rather than pickle on the per-request path: a line is self-delimiting and readable in
a debugger; the summary travels as an object keyed by the result log's field names
(:mod:`txlb._records.fields`), and the supervisor refuses one whose fields or types are not
the table's (:class:`~txlb._records.fields.BadSummary`).
"""

from __future__ import annotations

import base64
import json
import pickle
from typing import Any

from txlb._config import Config
from txlb._records.fields import from_wire, to_wire
from txlb._records.summary import Summary

#: A line longer than this is dropped (a summary carries at most the 512 KiB captured from
#: the response, JSON-escaped; a state push one entry per backend).
MAX_LINE = 16 * 1024 * 1024


def encode(message: object) -> bytes:
    """
    One message as one line.  ASCII-escaped: a client's JSON may hold a lone surrogate
    ("\\ud800"), which has no UTF-8 encoding and would otherwise lose the request's summary.
    """
    return json.dumps(message, separators=(",", ":")).encode("ascii") + b"\n"


def decode(line: bytes) -> Any:
    return json.loads(line)


def summary_message(summary: Summary, answered: bool) -> bytes:
    """The ``end`` message: one finished request's summary, field by field."""
    return encode(["end", answered, to_wire(summary)])


def summary_from(fields: object) -> Summary:
    """
    The summary of an ``end`` message; :class:`~txlb._records.fields.BadSummary` if it is
    not one (a missing, unknown or mistyped field).
    """
    return from_wire(fields)


def config_blob(config: Config) -> str:
    """The validated config for a worker (it must not re-read files or environment)."""
    return base64.b64encode(pickle.dumps(config)).decode("ascii")


def config_from(blob: str) -> Config:
    config = pickle.loads(base64.b64decode(blob))
    if not isinstance(config, Config):
        raise TypeError("not a Config")
    return config


class Lines:
    """
    Splits a byte stream into lines, keeping a partial line for the next chunk.

    Linear in what it is fed: only new data is searched for the line end and a partial
    line is kept as a list of pieces (pipes are read 8 KiB at a time, so re-joining and
    re-splitting the partial line on every read made a long line quadratic -- seconds of
    CPU for a few megabytes).  A line over :data:`MAX_LINE` is dropped whole and counted
    in ``dropped``, and the lines around it still arrive.
    """

    def __init__(self) -> None:
        self._pieces: list[bytes] = []
        self._size = 0
        self._dropping = False
        self.dropped = 0

    def feed(self, data: bytes) -> list[bytes]:
        lines = []
        start = 0
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                break
            line = data[start:end]
            if self._pieces:
                self._pieces.append(line)
                line = b"".join(self._pieces)
                self._pieces = []
                self._size = 0
            if self._dropping:
                self._dropping = False  # the end of the oversize line
            elif line:
                lines.append(line)
            start = end + 1
        if start < len(data) and not self._dropping:
            rest = data[start:]
            self._pieces.append(rest)
            self._size += len(rest)
            if self._size > MAX_LINE:
                self._pieces = []
                self._size = 0
                self._dropping = True
                self.dropped += 1
        return lines
