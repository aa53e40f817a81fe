"""
What a connection failure was, in words an operator reads.

Twisted's messages are written for programmers: a ``ResponseFailed`` says
``[<twisted.python.failure.Failure twisted.internet.error.ConnectionDone: Connection was
closed cleanly.>]`` -- a list of reprs, and "cleanly" about a backend killed with ``kill -9``
(the kernel closes a dead process's sockets with an orderly FIN, so Twisted cannot tell).
:func:`describe_failure` unwraps the wrappers and says what happened.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import defer
from twisted.internet import error as neterror
from twisted.python.failure import Failure

__all__ = ["describe_failure"]

#: (exception types, words), first match wins.
_WORDS: tuple[tuple[tuple[type[BaseException], ...], str], ...] = (
    ((neterror.ConnectionDone,), "the backend closed the connection"),
    ((neterror.ConnectionLost,), "the connection to the backend was lost or reset"),
    ((neterror.ConnectionRefusedError,),
     "connection refused (nothing listens on that port)"),
    ((neterror.TCPTimedOutError, neterror.TimeoutError, defer.TimeoutError),
     "timed out"),
    ((neterror.DNSLookupError, neterror.UnknownHostError), "the host name does not resolve"),
    ((neterror.NoRouteError,), "no route to the host"),
    ((defer.CancelledError,), "cancelled"),
)


def describe_failure(failure: Failure) -> str:
    """
    ``failure`` in words: the first underlying reason of a wrapper (``ResponseFailed``,
    ``ResponseNeverReceived``, ``RequestTransmissionFailed``), named for what it means,
    never a Python repr.
    """
    reasons: list[Any] = getattr(failure.value, "reasons", None) or []
    if reasons and isinstance(reasons[0], Failure):
        return describe_failure(reasons[0])
    for types, words in _WORDS:
        if failure.check(*types):
            return words
    message = failure.getErrorMessage()
    if message.startswith(("<", "[")) or not message:
        return type(failure.value).__name__  # nothing better than the name of what failed
    return message
