"""
The messages between a ``--workers`` supervisor and its worker processes: JSON lines.

Supervisor to worker (the worker's standard input): ``hello`` (its row, the config, the
backends), ``state`` (the backends again, whenever the supervisor's pool changed), ``kick``
(a slot was freed in another worker: look at your max_conns queue again), ``stop``.

Worker to supervisor (the worker's file descriptor 3): ``end`` (one finished request's
summary, for the one result log and the metrics), ``answer`` (a status a backend
answered, for outlier ejection), ``down`` (this worker marked a backend down: refused or
reset), ``suspect`` (probe this backend now), ``wait`` (a request waited this long in the
max_conns queue), ``ready``.

JSON rather than pickle on the per-request path: a line is self-delimiting and readable in
a debugger; the summary travels as a list in :class:`Summary`'s field order, which both ends
share because they run the same code.
"""

from __future__ import annotations

import base64
import json
import pickle
from typing import Any

import attrs

from ._config import Config
from ._summary import Summary

#: A line longer than this is a bug (or a backend list of absurd size): refuse it.
MAX_LINE = 64 * 1024 * 1024


def encode(message: object) -> bytes:
    """One message as one line."""
    return json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def decode(line: bytes) -> Any:
    return json.loads(line)


def summary_message(summary: Summary, answered: bool) -> bytes:
    return encode(["end", answered, attrs.astuple(summary, recurse=False)])


def summary_from(fields: list[Any]) -> Summary:
    return Summary(*fields)


def config_blob(config: Config) -> str:
    """The validated config for a worker (it must not re-read files or environment)."""
    return base64.b64encode(pickle.dumps(config)).decode("ascii")


def config_from(blob: str) -> Config:
    config = pickle.loads(base64.b64decode(blob))
    if not isinstance(config, Config):
        raise TypeError("not a Config")
    return config


class Lines:
    """Splits a byte stream into lines, keeping a partial line for the next chunk."""

    def __init__(self) -> None:
        self._partial = b""

    def feed(self, data: bytes) -> list[bytes]:
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > MAX_LINE:
            raise ValueError("message line too long")
        return [line for line in lines if line]
