"""
Where txlb reads Twisted's private state: each use in one place, with the reason, so that a
Twisted release that changes one fails a test in ``tests/test_compat.py`` instead of
silently changing what txlb does.
"""

from __future__ import annotations

from typing import Any


def unsent_bytes(transport: object) -> int | None:
    """
    How many bytes written to a TCP ``transport`` it has not yet handed to the kernel, or
    ``None`` when it is not one of Twisted's socket transports (a ``StringTransport``).

    Why: a backend that resets the connection while part of the request is still here
    provably never had the whole request, so it cannot have started generating, and the
    request may be tried on another backend.  Twisted keeps unsent data in
    ``FileDescriptor.dataBuffer`` (from ``offset``) and ``_tempDataBuffer``, and leaves both
    as they were when the connection is lost; txlb's eager transports (``txlb-epoll``) also
    hold the writes of the current event in ``_corked``.
    """
    conn: Any = transport
    buffer = getattr(conn, "dataBuffer", None)
    queued = getattr(conn, "_tempDataBuffer", None)
    if not isinstance(buffer, bytes | memoryview) or not isinstance(queued, list):
        return None
    pending = len(buffer) - int(getattr(conn, "offset", 0)) + sum(len(part) for part in queued)
    corked = getattr(conn, "_corked", None)
    if corked:
        pending += sum(len(part) for part in corked)
    return pending
