"""
What a Redis reply may be before txlb reads it: its size and nesting bounded as it arrives,
and its meaning checked once it has.

txredisapi's parser trusts its server.  A ``$N`` header makes it buffer N bytes, whatever N
is (a server announcing ``$99999999999`` and then sending bytes grows the process without
end); it nests arrays as deep as it is told (200,000 ``*1`` headers); it keeps every reply
nobody asked for; and it splits each line off the whole buffer that holds it, which is
quadratic in the lines of one read.  :func:`bounded` gives txlb's connections a parser of
their own, put in place of txredisapi's ``dataReceived``: the same replies handed to the
same ``replyReceived`` (so authentication, ``SELECT``, the command queue and the
subscriber's messages work unchanged), read in one pass, and refused -- the connection
aborted, every call waiting on it failed with :class:`ReplyRefused` saying why -- as soon
as a header says more than the bounds below allow, not once the bytes arrived.

The bounds are sized to what txlb's own scripts and commands ever return:

* :data:`MAX_LINE`: a status, error or integer line, or a header (Redis's longest error
  texts, a script's, are a few hundred bytes);
* :data:`MAX_BULK`: one string; the longest txlb reads is a shared cache-aware stream
  entry's chain list (:data:`txlb._shared.prefixes.ENTRY_BLOCKS` blocks of 16 hex digits
  and their backends' names: about 40 KiB, under 300 KiB with 253-character host names);
* :data:`MAX_DEPTH`: nesting; the deepest reply txlb reads is ``XREAD``'s, 5 levels
  (streams, a stream, its entries, an entry, its fields);
* :data:`MAX_ELEMENTS`: the elements of one reply at all levels; the largest is the poll's,
  two per backend in the other replicas' rows, and the marks hold at most
  :data:`txlb._shared.marks.MAX_FIELDS` backends;
* :data:`MAX_REPLY`: the bytes of one reply; the largest txlb foresees is a poll or a read
  of changed marks over that many backends, a few MiB.

A reply that arrives with no command waiting for it is refused too: on a connection whose
replies come in order it means the server is not answering what was asked.

:class:`Shape` is the other half: what each script and command must answer (an integer, a
text, an array of N texts ...).  :class:`~txlb._shared.link.RedisLink` checks every reply
against its call's shape; a server that answers ``+OK`` to everything is not connected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.interfaces import IReactorTime

from txlb._shared.marks import MAX_FIELDS

#: Bytes of one line: a status, an error, an integer, or a ``$``/``*`` header.
MAX_LINE = 4096
#: Bytes of one bulk string.
MAX_BULK = 1 << 20
#: Levels of arrays in one reply.
MAX_DEPTH = 8
#: Elements of one reply, at all levels together.
MAX_ELEMENTS = 2 * MAX_FIELDS + 64
#: Bytes of one reply, headers included.
MAX_REPLY = 16 << 20


class ReplyRefused(Exception):
    """Redis sent what no reply of txlb's can be; the connection was dropped."""


class _Array:
    __slots__ = ("items", "left")

    def __init__(self, left: int) -> None:
        self.items: list[Any] = []
        self.left = left


def bounded(base: Any, clock: IReactorTime | None = None,
            on_refused: Callable[[str], object] = lambda why: None) -> Any:
    """
    A subclass of the txredisapi protocol class ``base`` whose replies are read within the
    module's bounds (the module's doc says why and how).  ``clock``, if given, is what the
    protocol schedules on (txredisapi's parser reads the global reactor; this one never
    schedules while parsing, but the base's other code might).  ``on_refused`` is told the
    words of each refusal, also of one that no call was waiting for (during the login).
    """
    import txredisapi  # type: ignore[import-untyped]  # loaded already: base is its

    response_error = txredisapi.ResponseError

    class Bounded(base):
        MAX_LENGTH = MAX_LINE
        #: the base's: told once the connection is usable
        _waiting_for_connect: list[Deferred[Any]]

        if clock is not None:
            callLater = clock.callLater

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._pending = bytearray()
            #: the arrays of the reply being read, outermost first
            self._open: list[_Array] = []
            #: bytes still to come of the bulk string being read (None: reading a line)
            self._bulk: int | None = None
            self._elements = 0
            self._bytes = 0
            #: why this connection was dropped, once it was
            self.refused: str | None = None
            queue = self.replyQueue
            put = queue.put

            def put_asked(reply: object) -> None:
                if queue.waiting:
                    put(reply)
                else:
                    self.refuse("a reply no command asked for")

            queue.put = put_asked

        def connectionMade(self) -> Deferred[None]:
            return ensureDeferred(self._login())

        async def _login(self) -> None:
            """
            txredisapi's ``AUTH`` and ``SELECT``, but only Redis saying no (a wrong password,
            an unknown database) stops the reconnecting: txredisapi's own stops it for any
            failure, so a connection lost or refused mid-login would never be made again.
            """
            steps: list[tuple[str, Callable[[], Deferred[Any]]]] = []
            if self.password is not None:
                steps.append(("auth", lambda: self.auth(self.password, self.username)))
            if self.dbid is not None:
                steps.append((f"set dbid={self.dbid}", lambda: self.select(self.dbid)))
            for words, step in steps:
                try:
                    response = await step()
                    if isinstance(response, response_error):
                        raise response
                except response_error as error:
                    self.factory.stopTrying()
                    self.transport.loseConnection()
                    self.factory.connectionError(f"Redis error: could not {words}: {error}")
                    return
                except Exception:
                    # the connection failed, not the login: dropped, and made again
                    self.transport.abortConnection()
                    return
            self.connected = 1
            self._ready = True
            ready: list[Deferred[Any]] = self._waiting_for_connect
            self._waiting_for_connect = []
            for waiting in ready:
                waiting.callback(self)

        @property
        def buffered(self) -> int:
            """Bytes received and not yet parsed (at most a line, or a bulk string)."""
            return len(self._pending)

        def dataReceived(self, data: bytes, unpause: bool = False) -> None:
            if self.refused is not None:
                return
            pending = self._pending
            pending += data
            at = 0
            try:
                while self.refused is None:
                    if self._bulk is not None:
                        end = at + self._bulk
                        if len(pending) < end + 2:
                            break
                        if pending[end:end + 2] != b"\r\n":
                            self.refuse("a bulk string longer than its header said")
                            break
                        value = bytes(pending[at:end])
                        self._bytes += self._bulk + 2
                        self._bulk = None
                        at = end + 2
                        self._element(self.tryConvertData(value))
                        continue
                    end = pending.find(b"\r\n", at, at + MAX_LINE + 2)
                    if end < 0:
                        if len(pending) - at > MAX_LINE:
                            self.refuse(f"a line over {MAX_LINE} bytes")
                        break
                    line = bytes(pending[at:end])
                    self._bytes += end + 2 - at
                    at = end + 2
                    self._line(line)
            finally:
                del pending[:at]

        def _line(self, line: bytes) -> None:
            token, data = line[:1], line[1:]
            if token in (b"$", b"*"):
                try:
                    n = int(data)
                except ValueError:
                    self.refuse(f"a {token.decode()} header that is not a number")
                    return
                if n == -1:
                    self._element(None)
                elif n < -1:
                    self.refuse(f"a {token.decode()} header of {n}")
                elif token == b"$":
                    if n > MAX_BULK:
                        self.refuse(f"a string of {n} bytes (at most {MAX_BULK} allowed)")
                    elif self._bytes + n > MAX_REPLY:
                        self.refuse(f"a reply over {MAX_REPLY} bytes")
                    else:
                        self._bulk = n
                elif len(self._open) >= MAX_DEPTH:
                    self.refuse(f"arrays nested over {MAX_DEPTH} deep")
                elif self._elements + n > MAX_ELEMENTS:
                    self.refuse(f"a reply of over {MAX_ELEMENTS} elements")
                elif n == 0:
                    self._element([])
                else:
                    self._elements += n
                    self._open.append(_Array(n))
                return
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                self.refuse("a line that is not UTF-8 text")
                return
            if token == b"+":
                self._element(text)
            elif token == b"-":
                self._element(response_error(text))  # as txredisapi's: "ERR" kept
            elif token == b":":
                try:
                    self._element(int(text))
                except ValueError:
                    self.refuse("an integer reply that is not a number")
            else:
                self.refuse("a line of no reply type")

        def _element(self, value: object) -> None:
            if self._bytes > MAX_REPLY:
                self.refuse(f"a reply over {MAX_REPLY} bytes")
                return
            while self._open:
                top = self._open[-1]
                top.items.append(value)
                top.left -= 1
                if top.left:
                    return
                self._open.pop()
                value = top.items
            self._elements = self._bytes = 0
            self.replyReceived(value)

        def refuse(self, why: str) -> None:
            """
            Drop the connection: every call waiting on it fails with ``why``, nothing more
            is read, and the factory reconnects as after any lost connection.
            """
            if self.refused is not None:
                return
            self.refused = why
            self._pending.clear()
            self._open.clear()
            self._bulk = None
            error = ReplyRefused(f"Redis sent {why}; connection dropped")
            on_refused(str(error))
            queue = self.replyQueue
            while queue.waiting:
                queue.waiting.pop(0).callback(error)
            transport = self.transport
            if transport is not None:
                abort = getattr(transport, "abortConnection", None)
                (abort or transport.loseConnection)()

    Bounded.__name__ = Bounded.__qualname__ = f"Bounded{base.__name__}"
    return Bounded


# -- what a reply means ------------------------------------------------------------------

def _text(value: object) -> bool:
    return isinstance(value, (str, bytes))


@attrs.frozen
class Shape:
    """What one script or command answers: ``fits(reply)``, in words for ``last_error``."""

    words: str
    fits: Callable[[object], bool]


#: Anything Redis may answer (a call whose reply nobody reads).
ANY = Shape("anything", lambda reply: True)
INTEGER = Shape("an integer", lambda reply: type(reply) is int)
TEXT = Shape("a text", _text)
#: ``XREAD``'s: nothing new, or the streams read.
ARRAY_OR_NIL = Shape("an array or nil", lambda reply: reply is None or isinstance(reply, list))


def texts(minimum: int = 0, *, exactly: int | None = None, even: bool = False) -> Shape:
    """An array of texts: at least ``minimum`` of them, or ``exactly``, an even number."""

    def fits(reply: object) -> bool:
        if not isinstance(reply, list) or not all(_text(item) for item in reply):
            return False
        if exactly is not None:
            return len(reply) == exactly
        return len(reply) >= minimum and not (even and len(reply) % 2)

    count = f"{exactly}" if exactly is not None else f"at least {minimum}"
    return Shape(f"an array of {count} texts" + (", two by two" if even else ""), fits)


def integers(exactly: int) -> Shape:
    """An array of ``exactly`` integers."""
    return Shape(f"an array of {exactly} integers", lambda reply: isinstance(reply, list)
                 and len(reply) == exactly and all(type(item) is int for item in reply))


#: ``HSCAN``'s: the next cursor, and a page of fields and values.
SCAN_REPLY = Shape("a cursor and an array of texts, two by two", lambda reply: (
    isinstance(reply, list) and len(reply) == 2 and _text(reply[0])
    and texts(even=True).fits(reply[1])))


def preview(reply: object, most: int = 40) -> str:
    """A reply in a few printable characters, for ``last_error`` (never the whole of it)."""
    if isinstance(reply, list):
        shown = f"an array of {len(reply)}"
    elif isinstance(reply, (str, bytes)):
        shown = repr(reply[:most]) + ("..." if len(reply) > most else "")
    else:
        shown = repr(reply)[:most]
    return "".join(c if c.isprintable() else "?" for c in shown)
