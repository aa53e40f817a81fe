"""
A stream's ``data:`` payloads, found as its bytes pass: chunked framing undone and lines
split incrementally, so that nothing proportional to the whole answer is left for its end.

:class:`EventSplitter` is fed the response bytes exactly as the proxy relays them (in the
backend's chunked framing, or not) and hands each complete ``data:`` line's payload to a
sink.  It reads the framing the way :func:`txlb._records.capture.dechunk` reads a whole
capture -- the same sizes accepted, the same point where a malformed or final chunk stops
it -- so that a summary made as the chunks pass is the summary of the whole.  It keeps only
the line (or chunk-size line) not yet complete: bounded by the capture it is fed.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["EventSplitter", "data_payload"]

_DONE = b"[DONE]"


def data_payload(line: bytes) -> bytes | None:
    """The payload of an SSE ``data:`` line, or ``None`` for another line or ``[DONE]``."""
    if line[:5] != b"data:":
        return None
    payload = line[5:]
    return None if _is_done(payload) else payload


def _is_done(payload: bytes) -> bool:
    """``payload`` is ``[DONE]`` (give or take whitespace): the last byte tells most apart."""
    last = payload[-1:]
    return (last == b"]" or last.isspace()) and payload.strip() == _DONE


class EventSplitter:
    """
    Incremental ``data:`` payloads of an SSE body, in the backend's chunked framing when
    ``chunked``.  ``feed(data)`` per chunk (the body's next bytes as relayed: the
    instance's :meth:`_unframe` or :meth:`_lines` itself, one call less a chunk); at the
    end, :meth:`close` when the whole answer was fed (its last line, even without a
    newline, is a line), or :meth:`drop_partial` when the feed stopped at the capture
    limit (a line cut there is not parsed).
    """

    __slots__ = ("_sink", "_chunked", "_partial", "_size_line", "_remaining", "_skip",
                 "_stopped", "feed")

    def __init__(self, sink: Callable[[bytes], object], chunked: bool) -> None:
        self._sink = sink
        self._chunked = chunked
        self.feed: Callable[[bytes], None] = self._unframe if chunked else self._lines
        #: the line not yet ended by a newline
        self._partial = bytearray()
        # the chunked framing: the size line so far, the chunk's bytes still to come, the
        # two bytes (CRLF) to skip after them, and whether a final or broken chunk ended it
        self._size_line = bytearray()
        self._remaining = 0
        self._skip = 0
        self._stopped = False

    def close(self) -> None:
        """The body is over: a last line without its newline is still a line."""
        if self._partial:
            self._line(bytes(self._partial))
            self._partial.clear()

    def drop_partial(self) -> None:
        """The feed stopped part-way (the capture limit): forget the line it cut."""
        self._partial.clear()

    def lines(self, text: bytes) -> None:
        """Complete lines from elsewhere (the tail past the capture), after those fed."""
        for line in text.split(b"\n"):
            self._line(line)

    def _line(self, line: bytes) -> None:
        payload = data_payload(line)
        if payload is not None:
            self._sink(payload)

    def _lines(self, data: bytes) -> None:
        """
        Per chunk: one ``split`` and a slice test a line, the sink called with each
        payload -- no call per line besides it (this runs for every relayed event).
        """
        lines = data.split(b"\n")
        last = lines.pop()
        partial = self._partial
        if partial and lines:
            partial += lines[0]
            lines[0] = bytes(partial)
            partial.clear()
        sink = self._sink
        for line in lines:
            if line[:5] == b"data:":
                payload = line[5:]
                end = payload[-1:]
                if (end == b"]" or end.isspace()) and payload.strip() == _DONE:
                    continue
                sink(payload)
        if last:
            partial += last

    def _unframe(self, data: bytes) -> None:
        """
        Chunked framing, as :func:`~txlb._records.capture.dechunk` reads it: a size line
        (hex, extensions after ``;``) ending in CRLF, that many bytes (a chunk the feed
        stops inside gives what came of it), two bytes skipped; a size that is not a
        positive hex number ends the body.
        """
        if not (self._remaining or self._skip or self._size_line or self._stopped):
            # the usual read: exactly one whole chunk (an engine writes one event a chunk)
            end = data.find(b"\r\n")
            if end > 0:
                try:
                    length = int(data[:end], 16)  # a size with extensions goes the long way
                except ValueError:
                    length = 0
                if length > 0 and end + length + 4 == len(data):
                    self._lines(data[end + 2:end + 2 + length])
                    return
        position, size = 0, len(data)
        while position < size and not self._stopped:
            if self._remaining:
                end = min(size, position + self._remaining)
                self._lines(data[position:end])
                self._remaining -= end - position
                position = end
                if not self._remaining:
                    self._skip = 2
                continue
            if self._skip:
                skipped = min(self._skip, size - position)
                self._skip -= skipped
                position += skipped
                continue
            if self._size_line:
                searched = len(self._size_line) - 1
                self._size_line += data[position:]
                end = self._size_line.find(b"\r\n", searched)
                if end < 0:
                    return
                line = bytes(self._size_line[:end])
                data = bytes(self._size_line[end + 2:])
                position, size = 0, len(data)
                self._size_line.clear()
            else:
                end = data.find(b"\r\n", position)
                if end < 0:
                    self._size_line += data[position:]
                    return
                line = data[position:end]
                position = end + 2
            try:
                length = int(line.split(b";", 1)[0], 16)
            except ValueError:
                length = 0
            if length <= 0:
                self._stopped = True
                return
            self._remaining = length
