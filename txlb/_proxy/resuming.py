"""
The exchange's resume: a stream whose engine fails after its first byte is continued on
another engine and relayed into the same client response (``--resume``,
``--resume-tries``), so the client reads one uninterrupted answer.

Kept beside :mod:`txlb._proxy.exchange` as the part of its state machine that only a failing
stream runs: while it relays, an exchange keeps the bytes it sent the client (at most
:data:`RESUME_KEEP`; past that the stream is cut as it would be without resumes); when its
engine fails -- the connection closes or resets without the stream's end, or sends nothing
for ``--read-timeout`` -- :meth:`Resuming._try_resume` reads what the client has
(:mod:`txlb._resume.progress`), asks another engine for the rest
(:mod:`txlb._resume.continuation`) and relays its events made the first try's
(:mod:`txlb._resume.rewrite`).  Never onto the engine that failed, never when the client
left, at most ``--resume-tries`` times a stream; a continuation that fails before its first
byte is tried on another engine within ``--retries``, one that fails after it is resumed
again while tries are left, else cut.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import attrs
from twisted.internet.defer import Deferred, fail, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from txlb._cluster.slots import Lease
from txlb._json_body import parse_json_object
from txlb._proxy.context import ProxyContext, RetryPlan
from txlb._proxy.head import CREDENTIALS, UpstreamHead, with_credentials
from txlb._records.record import RequestRecord
from txlb._resume.continuation import continuation_body, refusal_of
from txlb._resume.progress import NotResumable, Progress, read_progress
from txlb._resume.rewrite import ContinuationRewriter
from txlb._resume.tokens import TOKENIZE_TIMEOUT, WholeAnswer, count_of, tokenize_body
from txlb._upstream.interfaces import IRelayOwner, UpstreamResponse

log = Logger(namespace="txlb._proxy.resource")

#: the bytes of a stream kept for its resume: past them it is not resumable, and the
#: memory is given back (the result log's capture limit)
RESUME_KEEP = 512 * 1024


def frame(data: bytes) -> bytes:
    """``data`` as one chunk of HTTP/1.1 chunked framing."""
    return b"%x\r\n%s\r\n" % (len(data), data)


class Resuming:
    """The resume half of :class:`~txlb._proxy.exchange.Exchange` (a mixin: its state)."""

    if not TYPE_CHECKING:
        # no slots of its own (the exchange's hold its state); hidden from the type
        # checker, which would otherwise refuse every assignment to the exchange's
        __slots__ = ()

    # what the exchange holds (declared for the type checker; the exchange's slots)
    record: RequestRecord
    lease: Lease
    context: ProxyContext
    retry: RetryPlan | None
    tried: set[str]
    state: str
    client_gone: bool
    _upstream: Deferred[Any] | None
    _write: Callable[[bytes], object]
    _client_write: Callable[[bytes], object]
    _relayed: bytearray | None
    _unresumable: str | None
    _raw_to_client: bool
    _continuation: ContinuationRewriter | None
    _continuation_body: bytes
    _continuation_tries: int
    _resume_plan: tuple[dict[str, Any], bool, Progress]
    _head: UpstreamHead
    _last_activity: float

    def _send(self, body: bytes | None = None) -> None: ...  # the exchange's

    def _arm_watchdog(self) -> None: ...

    def _cut(self, outcome: str) -> None: ...

    def _stop_try(self) -> None: ...

    # -- keeping what the client got --------------------------------------------------------

    def _keep_for_resume(self, response: UpstreamResponse, raw: bool) -> None:
        """A 200 stream of chat or completions: its bytes are kept for a resume."""
        if (self.context.resume_tries <= self.record.resumes or response.length is not None
                or response.code != 200 or self.retry is None):
            return
        content_type = self.record.content_type or b""
        if not content_type.startswith(b"text/event-stream"):
            return
        if self.record.path not in _RESUMABLE_PATHS:
            self._unresumable = "api"  # the Responses or Messages API: not continued
            return
        self._relayed = bytearray()
        self._raw_to_client = raw

    def _kept(self, data: bytes) -> None:
        """``data`` went to the client: kept, until the bound (then never resumable)."""
        relayed = self._relayed
        if relayed is not None:
            relayed += data
            if len(relayed) > RESUME_KEEP:
                self._too_long()

    def _too_long(self) -> None:
        """Past :data:`RESUME_KEEP`: the stream is no longer resumable, its bytes let go."""
        self._relayed = None
        self._unresumable = "too_long"

    # -- the resume -------------------------------------------------------------------------

    def _try_resume(self, why: str, cut: bool = True) -> bool:
        """
        The stream's engine failed (``why``, for the service log): continue it elsewhere.
        ``False`` when it cannot be: with ``cut``, the stream is cut (the reason is the
        record's); without (a hung verdict: the engine may yet answer), the stream goes
        on as it was, still resumable later.
        """
        relayed = self._relayed
        record = self.record
        if relayed is None:
            if cut:
                record.resume_refused = record.resume_refused or self._unresumable
            return False
        if self.client_gone or self.retry is None or record.resumes >= self.context.resume_tries:
            return False
        chat = b"chat" in record.path
        try:
            payload = parse_json_object(record.request_body or b"")
            if payload is None:
                raise NotResumable("unreadable")
            reason = refusal_of(payload, chat)
            if reason is not None:
                raise NotResumable(reason)
            progress = read_progress(bytes(relayed), self._raw_to_client, chat)
            body = continuation_body(payload, chat, progress)
        except NotResumable as refused:
            if cut:
                self._relayed = None
                record.resume_refused = refused.reason
            return False
        failed = self.lease.backend
        tried = self.tried | {failed.key}
        if not self.retry.possible(frozenset(tried)):
            if cut:
                self._relayed = None
                record.resume_refused = "no_backend"
            return False
        self._relayed = None
        log.warn("backend {backend} failed part-way through a stream ({why}); resuming it "
                 "on another engine after {tokens} tokens", backend=failed.key, why=why,
                 tokens=progress.tokens)
        self.tried.add(failed.key)
        # probed now: a dead engine leaves rotation at once, a restarting one comes back
        self.context.observer.suspect(failed)
        record.resumes += 1
        record.resume_refused = None
        self._leave_try()
        if record.resumes < self.context.resume_tries:
            self._relayed = relayed  # what the client has, for another resume
        if self._continuation is None:
            self._client_write = self._write
        self._continuation = ContinuationRewriter(progress, chat, self._to_client,
                                                  self._continuation_overflowed)
        self._write = self._continuation.feed
        self._continuation_body = body
        self._resume_plan = (payload, chat, progress)
        self._continuation_tries = 0
        self._next_engine()
        return True

    def _abandon_try(self) -> None:
        """Cancel the try in flight (a silent continuation): its errback is ignored."""
        pending, self._upstream = self._upstream, None
        self.state = "leaving"
        try:
            if pending is not None:
                pending.cancel()
        finally:
            self.state = "waiting"

    def _leave_try(self) -> None:
        """Close the failed try: its timer, its request and body, its slot."""
        self.state = "waiting"
        self._stop_try()
        self.lease.release()

    def _next_engine(self) -> None:
        assert self.retry is not None
        acquiring = self._upstream = self.retry.acquire(frozenset(self.tried))
        acquiring.addCallbacks(self._resume_on, self._no_engine).addErrback(self._resume_bug)

    def _resume_on(self, lease: Lease) -> None:
        self._upstream = None
        if self.state == "ended":
            lease.release()  # the client left while we waited for an engine
            return
        self.lease = lease
        self.record.resumed_backend = lease.backend.key
        # asked from now: the first engine's silence is not the new one's
        self._last_activity = self.context.clock.seconds()
        self._count_tokens()

    def _count_tokens(self) -> None:
        """
        The text so far counted by the engine about to continue it (``/tokenize``, at
        most :data:`~txlb._resume.tokens.TOKENIZE_TIMEOUT`), then the continuation sent.
        """
        payload, _, progress = self._resume_plan
        spec = self.lease.backend.spec
        headers = with_credentials(
            [*((n, v) for n, v in self._head.headers if n in CREDENTIALS),
             (b"content-type", b"application/json")],
            self.context.auth == "keys", spec.api_key)
        try:
            asking = self.context.upstream.send(
                spec.host, spec.port, b"POST", b"/tokenize", headers,
                tokenize_body(payload.get("model"), progress.text))
        except Exception:
            asking = fail()
        answer: Deferred[bytes | None] = asking.addCallback(_whole_answer)
        # the head and the whole body within the time: a body that stalls is stopped
        answer.addTimeout(TOKENIZE_TIMEOUT, self.context.clock)
        answer.addErrback(lambda failure: None)  # no count: the events' stands
        answer.addCallback(self._counted).addErrback(self._resume_bug)
        self._upstream = answer

    def _counted(self, answer: bytes | None) -> None:
        self._upstream = None
        if self.state == "ended":
            return
        payload, chat, progress = self._resume_plan
        count = None if answer is None else count_of(answer, len(progress.text))
        if count is not None and count != progress.tokens:
            try:
                body = continuation_body(payload, chat, attrs.evolve(progress, tokens=count))
            except NotResumable:
                pass  # counted, it used every token asked: the events' count goes on
            else:
                self._continuation_body = body
                if self._continuation is not None:
                    self._continuation.recount(count)
        self._send(self._continuation_body)

    def _no_engine(self, failure: Failure) -> None:
        self._upstream = None
        if self.state != "ended":
            self.record.resume_refused = "no_backend"
            self._cut("upstream_error")

    def _resume_bug(self, failure: Failure) -> None:
        log.failure("unexpected error resuming a stream", failure)
        if self.state != "ended":
            self._cut("proxy_error")

    def _continuation_head(self, response: UpstreamResponse) -> None:
        """The continuation answered: relayed if it streams, else another engine tried."""
        content_type = b"".join(value for name, value in response.headers
                                if name == b"content-type")
        if response.code != 200 or not content_type.startswith(b"text/event-stream"):
            response.discard()
            self._continuation_failed(f"answered {response.code}")
            return
        self.state = "relaying"
        self._arm_watchdog()
        response.deliver(cast(IRelayOwner, self), False)

    def _continuation_overflowed(self) -> None:
        """The continuation sent an event past :data:`RESUME_KEEP`: cut, not kept."""
        self.record.resume_refused = "event_too_long"
        self._cut("upstream_error")

    def _continuation_failed(self, why: str) -> None:
        """Before its first byte: another engine within ``--retries``, else the cut."""
        backend = self.lease.backend
        self.tried.add(backend.key)
        self._leave_try()
        assert self.retry is not None
        if (self._continuation_tries < self.context.retries and not self.client_gone
                and self.retry.possible(frozenset(self.tried))):
            self._continuation_tries += 1
            log.info("the continuation on {backend} failed ({why}); trying another engine",
                     backend=backend.key, why=why)
            self._next_engine()
            return
        self.record.resume_refused = "continuation_failed"
        self._cut("upstream_error")

    def _to_client(self, data: bytes) -> None:
        """The continuation's events, rewritten, to the client (and kept, as the first's)."""
        if self._raw_to_client:
            data = frame(data)
        self._client_write(data)
        self.record.capture(data)
        self._kept(data)


def _whole_answer(response: UpstreamResponse) -> Deferred[bytes | None]:
    """A 200's body, read whole (bounded); ``None`` for any other answer (discarded)."""
    if response.code != 200:
        response.discard()
        return succeed(None)
    reader = WholeAnswer()
    response.deliver(reader, False)
    return reader.done


#: the paths whose streams can be continued: chat completions and completions
_RESUMABLE_PATHS = frozenset({b"/v1/chat/completions", b"/chat/completions",
                              b"/v1/completions", b"/completions"})
