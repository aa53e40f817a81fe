"""
The two ways an exchange leaves its client (:mod:`txlb._proxy.exchange`): the answer
finished, or cut.

A failure after the head was sent must show as a truncated response, never as a clean
(fake) success: the connection is closed without the final chunk.  Either way the exchange
first stops being the client's producer, if the client is still there.  Each is a
function of the client's request alone, so the exchange hands one to its single way out.
"""

from __future__ import annotations

from twisted.web.server import Request


def detach(request: Request) -> None:
    """Unregister the exchange as the client's producer, if the client is still there."""
    if request.channel is not None:
        request.unregisterProducer()


def finish_answer(request: Request) -> None:
    """The whole answer is out: its end (the last chunk, or nothing more)."""
    detach(request)
    request.finish()


def cut_answer(request: Request) -> None:
    """
    Close the client connection without the final chunk, so a failure after the head was
    sent shows as a truncated response, never as a clean (fake) success.
    """
    detach(request)
    channel = getattr(request, "channel", None)
    if channel is not None and channel.transport is not None:
        channel.transport.abortConnection()
