"""
How much of what users wrote or were answered a result-log line may keep: the
``--log-content``, ``--log-user`` and ``--log-error-body`` options as one value.

Kept apart from the record and the summary because the configuration decides it once, per
start-up or reload (:func:`privacy_of`), and the summary only applies it (it is carried by
the bookkeeper and the workers' forwarder, which need nothing else of the summary's).
"""

from __future__ import annotations

from typing import Literal, Protocol

import attrs

from txlb._config.bounds import DEFAULT_PREVIEW_CHARS

#: Characters of content shown after ``|`` by default (``--log-content``); the most that can
#: be asked for is :data:`~txlb._config.bounds.MAX_PREVIEW_CHARS`.
PREVIEW_CHARS = DEFAULT_PREVIEW_CHARS
#: What happens to an orid taken from the request body's ``user`` (often an e-mail address).
UserMode = Literal["keep", "hash", "drop"]


@attrs.frozen
class Privacy:
    """
    How much of what users wrote or were answered a summary keeps, applied once in
    :func:`~txlb._records.summary.summarize` -- so both formats and the ``--workers`` pipe
    carry only what is kept.

    ``content``: characters of the answer kept after ``|`` (0: none).  ``user``: an orid
    taken from the body's ``user`` is kept, replaced by a keyed digest (``user_key``; the
    same user always gets the same digest under one key, and no one without the key can
    recover or test a guess of the address), or dropped (``-``); an ``X-Orid`` header is the
    operator's own id and always kept.  ``err_body``: characters of an error body kept
    (``None``: all, up to :data:`~txlb._records.summary.MAX_ERR_BODY` bytes; 0: none) -- a
    backend's 400 often quotes the prompt back.
    """

    content: int = PREVIEW_CHARS
    user: UserMode = "keep"
    user_key: bytes = attrs.field(default=b"", repr=False)
    err_body: int | None = None


KEEP_ALL = Privacy()


class LogOptions(Protocol):
    """
    The ``--log-*`` options :func:`privacy_of` reads (a :class:`~txlb.Config` has them):
    declared here so that the records need nothing of the config's table, which imports
    the policies, which import the records.
    """

    @property
    def log_content(self) -> int: ...
    @property
    def log_user(self) -> str: ...
    @property
    def log_user_key(self) -> str | None: ...
    @property
    def log_error_body(self) -> int | None: ...


def privacy_of(config: LogOptions) -> Privacy:
    """The :class:`Privacy` of a :class:`~txlb.Config`'s ``--log-*`` options."""
    key = config.log_user_key
    user: UserMode = "hash" if config.log_user == "hash" else (
        "drop" if config.log_user == "drop" else "keep")
    return Privacy(content=config.log_content, user=user,
                   user_key=b"" if key is None else key.encode("utf-8", "surrogatepass"),
                   err_body=config.log_error_body)
