"""
Every request-framing case the main port is held to, as data: the raw bytes a client sends,
what it gets back, whether the connection is closed, and what reaches the backend.

One table, with the same answers for every server path -- the main port's lean server
(``lb.main_factory()``) and twisted.web's (``lb.site()``): read by the in-memory tests (each
server over a ``StringTransport``), by the raw-socket tests (the real ``twistd -n llmlb``;
``lb.site()`` listening in process), and by the fuzz (``bench/fuzz.py``) as hostile payloads.
The rules are RFC 9112 (framing) and RFC 9110 (Host, Connection) as nginx and HAProxy apply
them; txlb refuses whatever a second parser (the backend's) could read differently, and then
closes, so nothing after a refused request is ever parsed -- let alone forwarded.

The table is run with ``--max-body 1KiB``; rows marked ``wait`` get no answer until the
header timeout.
"""

from __future__ import annotations

import attrs

#: In :attr:`Case.answers`: the backend's own answer, relayed (it has ``X-Backend``).
BACKEND = 0


@attrs.frozen
class Sent:
    """One request as the backend receives it (``headers``: pairs it must carry)."""

    method: bytes
    path: bytes
    body: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()


@attrs.frozen
class Case:
    """
    ``answers``: the status of each response, in order: :data:`BACKEND` for the backend's,
    a number for one txlb makes itself (100 is the interim ``100 Continue``).
    ``closed``: the connection is closed after them.  ``forwarded``: every request the
    backend receives, in order.  ``wait``: nothing happens until the header timeout.
    """

    name: str
    raw: bytes
    answers: tuple[int, ...]
    closed: bool
    forwarded: tuple[Sent, ...] = ()
    wait: bool = False

    @property
    def refused(self) -> bool:
        """txlb answers this one itself, and nothing of it reaches a backend."""
        return not self.forwarded


def _head(request_line: bytes, *headers: bytes, host: bool = True) -> bytes:
    lines = [request_line, *([b"Host: lb.example"] if host else []), *headers]
    return b"".join(line + b"\r\n" for line in lines) + b"\r\n"


def _get(path: bytes = b"/t", *headers: bytes, version: bytes = b"HTTP/1.1",
         host: bool = True) -> bytes:
    return _head(b"GET " + path + b" " + version, *headers, host=host)


def _post(*headers: bytes, host: bool = True) -> bytes:
    return _head(b"POST /t HTTP/1.1", *headers, host=host)


#: A request smuggled behind a framing trick; it must never reach a backend.
SMUGGLED = _get(b"/smuggled")
CHUNKED_HELLO = b"5\r\nhello\r\n0\r\n\r\n"
GET_T = Sent(b"GET", b"/t")
POST_HELLO = Sent(b"POST", b"/t", b"hello")
GET_NEXT = Sent(b"GET", b"/next")


def _trailers(section: bytes) -> bytes:
    """A chunked POST of ``hello`` whose trailer section (after the last chunk) is this."""
    return _post(b"Transfer-Encoding: chunked") + b"5\r\nhello\r\n0\r\n" + section

CASES: tuple[Case, ...] = (
    # -- well framed: forwarded, connection kept (or closed when asked) -------------------
    Case("plain GET", _get(), (BACKEND,), False, (GET_T,)),
    Case("content-length body", _post(b"Content-Length: 5") + b"hello", (BACKEND,), False,
         (POST_HELLO,)),
    Case("chunked body", _post(b"Transfer-Encoding: chunked")
         + b"2\r\nhe\r\n3;ext=1\r\nllo\r\n0\r\nX-Trailer: t\r\n\r\n", (BACKEND,), False,
         (POST_HELLO,)),
    Case("chunked, any case and spacing", _post(b"Transfer-Encoding:  Chunked ")
         + CHUNKED_HELLO, (BACKEND,), False, (POST_HELLO,)),
    Case("pipelined", _get(b"/a") + _get(b"/b"), (BACKEND, BACKEND), False,
         (Sent(b"GET", b"/a"), Sent(b"GET", b"/b"))),
    Case("content-length 0 then a pipelined request",
         _post(b"Content-Length: 0") + _get(b"/next"), (BACKEND, BACKEND), False,
         (Sent(b"POST", b"/t"), Sent(b"GET", b"/next"))),
    Case("expect 100-continue", _post(b"Content-Length: 5", b"Expect: 100-continue")
         + b"hello", (100, BACKEND), False, (POST_HELLO,)),
    Case("HTTP/1.0 without Host", _get(version=b"HTTP/1.0", host=False), (BACKEND,), True,
         (GET_T,)),
    Case("IPv6 Host with port", _head(b"GET /t HTTP/1.1", b"Host: [::1]:8000", host=False),
         (BACKEND,), False, (GET_T,)),
    Case("obs-fold is refused", _get(b"/t", b"X-Folded: one", b" two") + SMUGGLED,
         (400,), True),
    Case("Proxy-Connection: close closes after the answer",
         _get(b"/t", b"Proxy-Connection: close") + _get(b"/next"), (BACKEND,), True,
         (GET_T,)),
    Case("Connection: close", _get(b"/t", b"Connection: close"), (BACKEND,), True,
         (GET_T,)),
    Case("Connection: keep-alive,close", _get(b"/t", b"Connection: keep-alive,close")
         + SMUGGLED, (BACKEND,), True, (GET_T,)),
    Case("Connection: close on a second line",
         _get(b"/t", b"Connection: keep-alive", b"Connection: Close") + SMUGGLED,
         (BACKEND,), True, (GET_T,)),
    Case("HTTP/1.0 keep-alive still closes",
         _get(b"/t", b"Connection: keep-alive", version=b"HTTP/1.0") + SMUGGLED,
         (BACKEND,), True, (GET_T,)),
    # -- Upgrade: txlb does not switch protocols (llhttp stops at such a head) -----------
    Case("Upgrade without a body, then a pipelined request",
         _get(b"/a", b"Connection: Upgrade", b"Upgrade: h2c") + _get(b"/b"),
         (BACKEND, BACKEND), False, (Sent(b"GET", b"/a"), Sent(b"GET", b"/b"))),
    Case("Upgrade with a Content-Length body, then a pipelined request",
         _post(b"Connection: Upgrade", b"Upgrade: h2c", b"Content-Length: 5") + b"hello"
         + _get(b"/next"), (BACKEND, BACKEND), False, (POST_HELLO, Sent(b"GET", b"/next"))),
    Case("an Upgrade request's body is its body, not a request",
         _post(b"Connection: Upgrade", b"Upgrade: websocket",
               b"Content-Length: %d" % len(SMUGGLED)) + SMUGGLED,
         (BACKEND,), False, (Sent(b"POST", b"/t", SMUGGLED),)),
    # -- Transfer-Encoding: only "chunked", once, on HTTP/1.1 ------------------------------
    Case("TE identity (no length) smuggles nothing",
         _post(b"Transfer-Encoding: identity") + SMUGGLED, (400,), True),
    Case("TE chunked then TE identity", _post(b"Transfer-Encoding: chunked",
                                              b"Transfer-Encoding: identity") + CHUNKED_HELLO
         + SMUGGLED, (400,), True),
    Case("TE identity then TE chunked", _post(b"Transfer-Encoding: identity",
                                              b"Transfer-Encoding: chunked") + CHUNKED_HELLO,
         (400,), True),
    Case("TE chunked, identity", _post(b"Transfer-Encoding: chunked, identity")
         + CHUNKED_HELLO, (400,), True),
    Case("TE gzip", _post(b"Transfer-Encoding: gzip") + SMUGGLED, (400,), True),
    Case("TE chunked twice", _post(b"Transfer-Encoding: chunked, chunked") + CHUNKED_HELLO,
         (400,), True),
    Case("TE gzip, chunked is not supported", _post(b"Transfer-Encoding: gzip, chunked")
         + CHUNKED_HELLO, (501,), True),
    Case("TE empty", _post(b"Transfer-Encoding: ") + SMUGGLED, (400,), True),
    Case("TE with a vertical tab", _post(b"Transfer-Encoding: \x0bchunked") + CHUNKED_HELLO,
         (400,), True),
    Case("TE folded into chunked, identity",
         _post(b"Transfer-Encoding: chunked", b" , identity") + CHUNKED_HELLO, (400,), True),
    Case("TE on HTTP/1.0", _head(b"POST /t HTTP/1.0", b"Transfer-Encoding: chunked")
         + CHUNKED_HELLO, (400,), True),
    Case("TE identity with Content-Length", _post(b"Transfer-Encoding: identity",
                                                  b"Content-Length: 5") + b"hello",
         (400,), True),
    # -- Content-Length --------------------------------------------------------------------
    Case("Content-Length and TE chunked", _post(b"Content-Length: 5",
                                                b"Transfer-Encoding: chunked")
         + b"0\r\n\r\n" + SMUGGLED, (400,), True),
    Case("TE chunked and Content-Length", _post(b"Transfer-Encoding: chunked",
                                                b"Content-Length: 5") + CHUNKED_HELLO,
         (400,), True),
    Case("duplicate Content-Length, same value", _post(b"Content-Length: 5",
                                                       b"Content-Length: 5") + b"hello",
         (400,), True),
    Case("duplicate Content-Length, different values",
         _post(b"Content-Length: 5", b"Content-Length: 0") + b"hello", (400,), True),
    Case("Content-Length list", _post(b"Content-Length: 5, 5") + b"hello", (400,), True),
    Case("Content-Length negative", _post(b"Content-Length: -5") + b"hello", (400,), True),
    Case("Content-Length with a sign", _post(b"Content-Length: +5") + b"hello", (400,), True),
    Case("Content-Length in hex", _post(b"Content-Length: 0x5") + b"hello", (400,), True),
    Case("Content-Length not a number", _post(b"Content-Length: abc"), (400,), True),
    Case("Content-Length over --max-body", _post(b"Content-Length: 99999999999999999999"),
         (413,), True),
    # -- chunked body ----------------------------------------------------------------------
    Case("chunk size not hex", _post(b"Transfer-Encoding: chunked") + b"zz\r\nhello\r\n",
         (400,), True),
    Case("chunk size negative", _post(b"Transfer-Encoding: chunked") + b"-5\r\nhello\r\n",
         (400,), True),
    Case("chunk size with 0x", _post(b"Transfer-Encoding: chunked") + b"0x5\r\nhello\r\n",
         (400,), True),
    Case("chunk size with a space", _post(b"Transfer-Encoding: chunked")
         + b"5 \r\nhello\r\n0\r\n\r\n", (400,), True),
    Case("chunk size empty", _post(b"Transfer-Encoding: chunked") + b"\r\nhello\r\n",
         (400,), True),
    Case("chunk data longer than its size", _post(b"Transfer-Encoding: chunked")
         + b"5\r\nhelloXX\r\n0\r\n\r\n", (400,), True),
    Case("chunk extension with a bare LF", _post(b"Transfer-Encoding: chunked")
         + b"5;a\nb\r\nhello\r\n0\r\n\r\n", (400,), True),
    Case("huge chunk size meets --max-body", _post(b"Transfer-Encoding: chunked")
         + b"f" * 40 + b"\r\n" + b"x" * 2048, (413,), True),
    Case("chunks too small: 1,025 chunks of one byte", _post(b"Transfer-Encoding: chunked")
         + b"1\r\na\r\n" * 1025 + b"0\r\n\r\n", (400,), True),
    # -- trailers: dropped, but refused as llhttp refuses them -----------------------------
    Case("trailers with a tab, bytes over 0x7F and a Host are dropped, then a request",
         _trailers("X-T: a\tb\u2028\r\nHost: other.example\r\n\r\n".encode())
         + _get(b"/next"), (BACKEND, BACKEND), False, (POST_HELLO, GET_NEXT)),
    Case("a trailer ended by a bare LF does not swallow the next request",
         _trailers(b"X-T: 1\n\r\n") + SMUGGLED, (400,), True),
    Case("a bare LF ending the trailer section", _trailers(b"X-T: 1\r\n\n") + SMUGGLED,
         (400,), True),
    Case("a bare LF opening the trailer section", _trailers(b"\n\r\n") + SMUGGLED,
         (400,), True),
    Case("a trailer line with a bare LF, the rest never sent", _trailers(b"X-T: 1\nX"),
         (400,), True),
    Case("bare CR in a trailer", _trailers(b"X-T: a\rb\r\n\r\n") + SMUGGLED, (400,), True),
    Case("NUL in a trailer", _trailers(b"X-T: a\x00b\r\n\r\n") + SMUGGLED, (400,), True),
    Case("ESC in a trailer", _trailers(b"X-T: a\x1bb\r\n\r\n") + SMUGGLED, (400,), True),
    Case("DEL in a trailer name", _trailers(b"X-\x7fT: 1\r\n\r\n") + SMUGGLED, (400,),
         True),
    Case("obs-fold in the trailers", _trailers(b"X-T: 1\r\n folded\r\n\r\n") + SMUGGLED,
         (400,), True),
    Case("space before a trailer's colon", _trailers(b"X-T : 1\r\n\r\n") + SMUGGLED,
         (400,), True),
    Case("a trailer without a colon", _trailers(b"X-T\r\n\r\n") + SMUGGLED, (400,), True),
    Case("a trailer with an empty name", _trailers(b": 1\r\n\r\n") + SMUGGLED, (400,), True),
    Case("Content-Length as a trailer", _trailers(b"Content-Length: 5\r\n\r\n") + SMUGGLED,
         (400,), True),
    Case("Transfer-Encoding as a trailer",
         _trailers(b"transfer-encoding: chunked\r\n\r\n") + SMUGGLED, (400,), True),
    Case("Connection as a trailer", _trailers(b"Connection: close\r\n\r\n") + SMUGGLED,
         (400,), True),
    Case("Proxy-Connection as a trailer",
         _trailers(b"Proxy-Connection: keep-alive\r\n\r\n") + SMUGGLED, (400,), True),
    Case("a thousand small chunks are fine", _post(b"Transfer-Encoding: chunked")
         + b"1\r\na\r\n" * 1000 + b"0\r\n\r\n", (BACKEND,), False,
         (Sent(b"POST", b"/t", b"a" * 1000),)),
    # -- bytes that have no place in a head ------------------------------------------------
    Case("bare CR in a header value", _get(b"/t", b"X-A: a\rb"), (400,), True),
    Case("bare LF in a header value", _get(b"/t", b"X-A: a\nb"), (400,), True),
    Case("bare LF line endings only", b"GET /t HTTP/1.1\nHost: lb.example\n\n", (400,), True),
    Case("a head that never ends", b"GET /t HTTP/1.1\r\nHost: lb.example\r\n", (408,), True,
         wait=True),
    Case("NUL in a header value", _get(b"/t", b"X-A: a\x00b"), (400,), True),
    Case("ESC and BEL in a header value", _get(b"/t", b"X-Orid: \x1b]0;x\x07"), (400,), True),
    Case("DEL in a header value", _get(b"/t", b"X-A: a\x7fb"), (400,), True),
    Case("a tab and bytes over 0x7F in a header value are fine",
         _get(b"/t", "X-A: a\tb\u2028".encode()), (BACKEND,), False,
         (Sent(b"GET", b"/t", headers=((b"x-a", "a\tb\u2028".encode()),)),)),
    Case("NUL in a header name", _get(b"/t", b"X-\x00A: b"), (400,), True),
    Case("NUL in the target", _get(b"/t\x00"), (400,), True),
    Case("DEL in the target", _get(b"/t\x7f"), (400,), True),
    Case("high byte in the target", _get(b"/t\x80"), (400,), True),
    Case("space before the colon", _get(b"/t", b"Transfer-Encoding : chunked")
         + CHUNKED_HELLO, (400,), True),
    Case("space inside a name", _get(b"/t", b"X A: b"), (400,), True),
    Case("empty name", _get(b"/t", b": b"), (400,), True),
    Case("non-token name", _get(b"/t", b"(x): b"), (400,), True),
    Case("header without a colon", _get(b"/t", b"X-A"), (400,), True),
    Case("whitespace before the first header",
         _head(b"GET /t HTTP/1.1", b" X-A: b", b"Host: lb.example", host=False), (400,), True),
    Case("obs-fold into Host", _get(b"/t", b" evil.example"), (400,), True),
    # -- request line ----------------------------------------------------------------------
    Case("two spaces in the request line", b"GET  /t HTTP/1.1\r\nHost: x\r\n\r\n", (400,),
         True),
    Case("unknown version", b"GET /t HTTP/1.2\r\nHost: x\r\n\r\n", (400,), True),
    Case("lowercase version", b"GET /t http/1.1\r\nHost: x\r\n\r\n", (400,), True),
    Case("no version", b"GET /t\r\nHost: x\r\n\r\n", (400,), True),
    Case("two spaces before the version", b"GET /t  HTTP/1.1\r\nHost: x\r\n\r\n", (400,),
         True),
    Case("a space after the version", b"GET /t HTTP/1.1 \r\nHost: x\r\n\r\n", (400,), True),
    Case("leading empty lines, then two spaces", b"\r\n\r\nGET  /t HTTP/1.1\r\nHost: x\r\n\r\n",
         (400,), True),
    Case("non-token method", b"G(T /t HTTP/1.1\r\nHost: x\r\n\r\n", (400,), True),
    # -- the request target: a path, an absolute URL, or * alone --------------------------
    Case("an absolute URL as the target", _get(b"http://lb.example/t"), (BACKEND,), False,
         (GET_T,)),
    Case("a target that is no path", _get(b"t") + SMUGGLED, (400,), True),
    Case("* with a query is not the * target", _head(b"OPTIONS *?a=b HTTP/1.1") + SMUGGLED,
         (400,), True),
    Case("* followed by more", _head(b"OPTIONS ** HTTP/1.1") + SMUGGLED, (400,), True),
    # -- requests txlb answers itself, then a pipelined one --------------------------------
    Case("a body on a request txlb answers, then a pipelined request",
         _get(b"/__lb_status", b"Content-Length: 3") + b"abc" + _get(b"/next"),
         (200, BACKEND), False, (GET_NEXT,)),
    Case("a chunked body on GET /v1/models, then a pipelined request",
         _get(b"/v1/models", b"Transfer-Encoding: chunked") + CHUNKED_HELLO + _get(b"/next"),
         (200, BACKEND), False, (GET_NEXT,)),
    Case("OPTIONS * with a body, then a pipelined request",
         _head(b"OPTIONS * HTTP/1.1", b"Content-Length: 3") + b"abc" + _get(b"/next"),
         (200, BACKEND), False, (GET_NEXT,)),
    Case("POST * with a body, then a pipelined request",
         _head(b"POST * HTTP/1.1", b"Content-Length: 3") + b"abc" + _get(b"/next"),
         (405, BACKEND), False, (GET_NEXT,)),
    # -- CONNECT: a tunnel txlb never opens; what follows its head is no request ----------
    Case("CONNECT with a path", _head(b"CONNECT /t HTTP/1.1") + SMUGGLED, (405,), True),
    Case("CONNECT to an authority", _head(b"CONNECT lb.example:443 HTTP/1.1") + SMUGGLED,
         (405,), True),
    Case("CONNECT with a body", _head(b"CONNECT /t HTTP/1.1", b"Content-Length: %d"
                                      % len(SMUGGLED)) + SMUGGLED, (405,), True),
    Case("connect in lowercase", _head(b"connect /t HTTP/1.1") + SMUGGLED, (400,), True),
    Case("Connect to an authority", _head(b"Connect lb.example:443 HTTP/1.1") + SMUGGLED,
         (400,), True),
    Case("a request then CONNECT", _get() + _head(b"CONNECT /t HTTP/1.1") + SMUGGLED,
         (BACKEND, 405), True, (GET_T,)),
    # -- Host ------------------------------------------------------------------------------
    Case("HTTP/1.1 without Host", _get(host=False), (400,), True),
    Case("two Host headers", _get(b"/t", b"Host: other.example"), (400,), True),
    Case("two Host headers on HTTP/1.0", _get(b"/t", b"Host: b", version=b"HTTP/1.0"),
         (400,), True),
    Case("Host with a path", _head(b"GET /t HTTP/1.1", b"Host: a/b", host=False), (400,),
         True),
    Case("Host with userinfo", _head(b"GET /t HTTP/1.1", b"Host: user@a", host=False),
         (400,), True),
    # -- pipelined garbage and oversized heads ---------------------------------------------
    Case("good request then garbage", _get() + b"\x16\x03\x01garbage\r\n\r\n",
         (BACKEND, 400), True, (GET_T,)),
    Case("good request then a refused one then a smuggled one",
         _get() + _post(b"Transfer-Encoding: identity") + SMUGGLED, (BACKEND, 400), True,
         (GET_T,)),
    Case("header line over 16 KiB", _get(b"/t", b"X-Big: " + b"a" * 17000), (431,), True),
    Case("request line over 16 KiB", _get(b"/" + b"a" * 17000), (431,), True),
    Case("headers over 16 KiB in all",
         _get(b"/t", *(b"X-H%d: %s" % (i, b"b" * 100) for i in range(200))), (400,), True),
    Case("more than 500 headers", _get(b"/t", *(b"X: y",) * 600), (400,), True),
)
