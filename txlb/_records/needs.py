"""
What the readers of finished requests need of an answer, so that the proxy reads no more.

Every summary consumer (:mod:`txlb._records.bookkeeper`) declares one :class:`Needs`; the
proxy asks its observer for the greatest of them when a request starts and the record
captures and parses that much of the answer (:class:`~txlb._records.record.RequestRecord`):

* :attr:`Needs.NOTHING` -- status, timings, outcome: no byte of the answer is kept;
* :attr:`Needs.USAGE` -- also its token counts and whether it streamed: a stream's events
  are split as they pass but only those holding ``usage`` (or llama.cpp's ``timings``)
  are parsed; a plain JSON answer is parsed once;
* :attr:`Needs.TEXTS` -- everything a result-log line shows (the texts, the finish reason,
  an error's body, the request's keys): each event of a stream is parsed and folded in as
  it passes.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["Needs"]


class Needs(IntEnum):
    """How much of an answer a reader of its summary uses; more includes less."""

    NOTHING = 0
    USAGE = 1
    TEXTS = 2
