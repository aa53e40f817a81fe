"""
The messages between a ``--workers`` supervisor and its worker processes: typed messages,
one JSON line each, encoded and decoded here and nowhere else.

Supervisor to worker (the worker's standard input): :class:`Hello` (its row, the config,
the backends), :class:`State` (the backends again, whenever the supervisor's pool changed),
:class:`Kick` (a slot was freed in another worker: look at your max_conns queue again),
:class:`Stop`, :class:`Spent` (tokens another worker's budgets took or gave back),
:class:`Served` (a change of a tenant's fair-share counter made elsewhere), and with
``--shared-state`` :class:`Revoked` (the keys the fleet revoked),
``--shared-state`` :class:`Shared` (whether Redis answers, and how many replicas share it)
:class:`Taken` (the answer to a worker's :class:`Take`) and :class:`Levels` (the fleet's levels
of token-budget buckets, as the shared state answered the supervisor).

Worker to supervisor (the worker's file descriptor 3): what its proxy observed
(:class:`Finished`, :class:`Answer`, :class:`Suspect`, :class:`Retry`, :class:`Wait`,
:class:`Down`; see :class:`txlb._records.observer.IRequestObserver`), :class:`Ready`,
its token budgets' :class:`Spent` and :class:`BudgetRefused`, its fair queue's
:class:`Served`, and :class:`Take` (a
``--rate-limit`` token the supervisor takes from the fleet's bucket for it, through its store:
see txlb._workers.relay).  Every message says what it means in the balancer's terms, never
how a store does it (no script, no key of Redis's), so any shared store serves the workers.
On its standard output: :class:`Log`, one per log event.

Every message is a JSON object whose ``t`` names its type, with one key per field --
except :class:`Finished`, a list ``["end", answered, summary]`` whose summary is an object
keyed by the result log's field names (:func:`summary_message`, :func:`summary_from`).
:func:`decode` refuses (:class:`WireError`) a line that is too long, not JSON, of an
unknown type, or whose fields are missing, extra or of the wrong type, so a broken or
hostile worker costs its supervisor one logged line, never a crash.

JSON rather than pickle on the per-request path: a line is self-delimiting and readable in
a debugger; the summary travels as an object keyed by the result log's field names
(:mod:`txlb._records.fields`), and the supervisor refuses one whose fields or types are not
the table's (:class:`~txlb._records.fields.BadSummary`).
"""

from __future__ import annotations

import base64
import json
import math
import pickle
import re
from collections.abc import Callable
from typing import Any, ClassVar, TypeAlias

import attrs

from txlb._config.config import Config
from txlb._config.keys import TENANT_NAME
from txlb._records.fields import from_wire, to_wire
from txlb._records.summary import Summary

#: A line longer than this is dropped (a summary carries at most the 512 KiB captured from
#: the response, JSON-escaped; a state push one entry per backend).
MAX_LINE = 16 * 1024 * 1024


class WireError(ValueError):
    """A line that is no message of this protocol."""


def _is_str(value: object) -> bool:
    return isinstance(value, str)


def _is_int(value: object) -> bool:
    return type(value) is int


def _is_bool(value: object) -> bool:
    return type(value) is bool


def _is_seconds(value: object) -> bool:
    return type(value) in (int, float) and math.isfinite(value)  # type: ignore[arg-type]


def _is_client(value: object) -> bool:
    return value is None or isinstance(value, str)


#: Buckets one ``spent`` message may name (budgets x windows of one request)
MAX_SPENT_BUCKETS = 256


def _is_spent_buckets(value: object) -> bool:
    return (isinstance(value, list) and len(value) <= MAX_SPENT_BUCKETS
            and all(isinstance(entry, list) and len(entry) == 3
                    and isinstance(entry[0], str) and _is_seconds(entry[1])
                    and isinstance(entry[2], str) for entry in value))


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _is_states(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(entry, dict) for entry in value)


def _checked(check: Callable[[object], bool]) -> Any:
    """An attrs field whose wire value :func:`decode` checks with ``check``."""
    return attrs.field(metadata={"check": check})


# -- supervisor to worker ---------------------------------------------------------------


@attrs.frozen
class Hello:
    """The first message a worker gets: who it is and what it serves."""

    kind: ClassVar[str] = "hello"
    #: how many workers share the table, and its slots per worker
    workers: int = _checked(_is_int)
    slots: int = _checked(_is_int)
    #: the listening socket's address family
    family: int = _checked(_is_int)
    #: the validated config (:func:`config_blob`)
    config: str = _checked(_is_str)
    #: the supervisor's backends (:meth:`txlb._cluster.pool.Pool.shared_state`)
    state: list[dict[str, Any]] = _checked(_is_states)


@attrs.frozen
class State:
    """The supervisor's backends, after its pool changed."""

    kind: ClassVar[str] = "state"
    state: list[dict[str, Any]] = _checked(_is_states)


@attrs.frozen
class Reload:
    """
    The supervisor applied a reloaded config: apply it too (the workers' settings follow;
    their backends follow the supervisor's pool through :class:`State` as always).
    """

    kind: ClassVar[str] = "reload"
    #: the validated config (:func:`config_blob`)
    config: str = _checked(_is_str)


@attrs.frozen
class Kick:
    """A slot was freed in another worker: look at the max_conns queue again."""

    kind: ClassVar[str] = "kick"


@attrs.frozen
class Stop:
    """Drain and end."""

    kind: ClassVar[str] = "stop"


@attrs.frozen
class Spent:
    """
    Tokens one worker's budgets took (a positive ``amount``: a reservation) or gave back
    (negative: a reconciliation) in these buckets, each ``[budget, window, client key]``;
    ``charged`` is what a finished request cost (0 for a reservation).  Both ways: a
    worker tells the supervisor, which applies it and passes it to every other worker, so
    that every process's levels are the fleet's.
    """

    kind: ClassVar[str] = "spent"
    buckets: list[list[Any]] = _checked(_is_spent_buckets)
    amount: float = _checked(_is_seconds)
    charged: int = _checked(_is_count)


def _is_tenant(value: object) -> bool:
    return isinstance(value, str) and TENANT_NAME.fullmatch(value) is not None


def _is_service(value: object) -> bool:
    return _is_seconds(value) and abs(value) <= MAX_SERVICE  # type: ignore[arg-type]


#: The largest change of a tenant's fair-share counter one message may carry: far above
#: any request's weighted tokens (10**15 over a weight of 0.001), far below float trouble
MAX_SERVICE = 1e18


@attrs.frozen
class Served:
    """
    A change of one tenant's fair-share counter (``--fairness vtc``), in weighted tokens:
    a charge at a grant, a settlement at an end (negative when the estimate was high), a
    lift when the tenant came back from idle.  Both ways, as :class:`Spent`: every change
    is an addition, so every process that applies them all holds the same counters,
    whatever order they arrive in.
    """

    kind: ClassVar[str] = "served"
    tenant: str = _checked(_is_tenant)
    amount: float = _checked(_is_service)


def _is_digests(value: object) -> bool:
    return (isinstance(value, list) and len(value) <= MAX_REVOKED
            and all(isinstance(d, str) and _HEX_DIGEST.fullmatch(d) for d in value))


#: Revoked keys one message may carry (the keys file's bound)
MAX_REVOKED = 100_000
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")


@attrs.frozen
class Revoked:
    """
    The keys a ``--shared-state`` fleet revoked (their SHA-256 digests), as the shared
    state answered the supervisor: its workers refuse them too, before their keys file is
    reloaded without them.
    """

    kind: ClassVar[str] = "revoked"
    digests: list[str] = _checked(_is_digests)


#: The longest name of a fleet's rate bucket a ``take`` may carry (the names are digests)
MAX_BUCKET_NAME = 64


def _is_bucket_name(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_BUCKET_NAME


def _is_level(value: object) -> bool:
    return value is None or _is_seconds(value)


@attrs.frozen
class Shared:
    """
    ``--shared-state`` as the supervisor sees it: whether the shared state answers, and how
    many replicas (hosts) share it.  Sent after :class:`Hello` and whenever either changed.
    """

    kind: ClassVar[str] = "shared"
    connected: bool = _checked(_is_bool)
    replicas: int = _checked(_is_count)


def _is_levels(value: object) -> bool:
    return (isinstance(value, list) and len(value) <= MAX_SPENT_BUCKETS
            and all(isinstance(entry, list) and len(entry) == 4
                    and isinstance(entry[0], str) and len(entry[0]) <= 4096
                    and all(_is_seconds(number) for number in entry[1:])
                    for entry in value))


@attrs.frozen
class Levels:
    """
    The fleet's levels of some token-budget buckets, each ``[key, capacity, rate, level]``,
    as the supervisor's shared buckets last answered: every worker's copy takes them.
    """

    kind: ClassVar[str] = "levels"
    levels: list[list[Any]] = _checked(_is_levels)


@attrs.frozen
class Taken:
    """
    The fleet's answer to the worker's :class:`Take` ``id``: whether the shared state
    answered at all, and the bucket's level after the take (``None``: an answer that is no
    level, or none).
    """

    kind: ClassVar[str] = "taken"
    id: int = _checked(_is_count)
    answered: bool = _checked(_is_bool)
    level: float | None = _checked(_is_level)


# -- worker to supervisor ---------------------------------------------------------------


@attrs.frozen
class Take:
    """
    Take one token from the fleet's ``--rate-limit`` bucket named ``bucket`` (a client
    key's digest) of ``rate`` tokens a second and ``burst`` at most, and answer
    :class:`Taken` ``id`` (the worker never waits: its request was decided already on a
    local copy).
    """

    kind: ClassVar[str] = "take"
    id: int = _checked(_is_count)
    bucket: str = _checked(_is_bucket_name)
    rate: float = _checked(_is_seconds)
    burst: int = _checked(_is_count)


@attrs.frozen
class Ready:
    """The worker serves the port."""

    kind: ClassVar[str] = "ready"
    pid: int = _checked(_is_int)


@attrs.frozen
class Finished:
    """One finished request's summary, for the one result log, the metrics and the policy."""

    kind: ClassVar[str] = "end"
    summary: Summary
    #: a backend's answer reached the worker (its timings say something about the backend)
    answered: bool


@attrs.frozen
class Answer:
    """A status a backend answered and the key of the client who caused it (outliers)."""

    kind: ClassVar[str] = "answer"
    backend: str = _checked(_is_str)
    status: int = _checked(_is_int)
    client: str | None = _checked(_is_client)


@attrs.frozen
class Suspect:
    """A connection to this backend was reset: probe it now."""

    kind: ClassVar[str] = "suspect"
    backend: str = _checked(_is_str)


@attrs.frozen
class Retry:
    """A request left a backend that failed it for another one."""

    kind: ClassVar[str] = "retry"


@attrs.frozen
class Wait:
    """A request waited this long in the max_conns queue."""

    kind: ClassVar[str] = "wait"
    seconds: float = _checked(_is_seconds)


@attrs.frozen
class Down:
    """The worker took this backend out of rotation (refused, reset, hung, outlier)."""

    kind: ClassVar[str] = "down"
    backend: str = _checked(_is_str)
    reason: str = _checked(_is_str)


@attrs.frozen
class BudgetRefused:
    """A token budget refused a request (the supervisor's metrics count it)."""

    kind: ClassVar[str] = "refused"
    budget: str = _checked(_is_str)


@attrs.frozen
class Log:
    """One of the worker's log events, to be logged by the supervisor as its own."""

    kind: ClassVar[str] = "log"
    level: str = _checked(_is_str)
    namespace: str = _checked(_is_str)
    text: str = _checked(_is_str)


ToWorker: TypeAlias = (Hello | State | Reload | Kick | Stop | Spent | Served | Revoked | Shared
                      | Taken | Levels)
FromWorker: TypeAlias = (Ready | Finished | Answer | Suspect | Retry | Wait | Down | Log
                         | Spent | Served | BudgetRefused | Take)
Message: TypeAlias = ToWorker | FromWorker

#: Every message type but :class:`Finished` (a list on the wire), by its ``t``.
_TYPES: dict[str, type[Any]] = {
    cls.kind: cls for cls in (Hello, State, Reload, Kick, Stop, Spent, Served, Revoked, Shared,
                              Taken, Levels, Ready, Answer, Suspect, Retry, Wait, Down,
                              BudgetRefused, Log, Take)
}


@attrs.frozen
class _Shape:
    """
    A message type's fields as :func:`encode` and :func:`decode` use them, read from attrs
    once: a worker's messages cross per request (an ``answer`` each), and reading
    ``attrs.fields`` and their metadata again for every one cost as much as the JSON.
    """

    names: tuple[str, ...]
    keys: frozenset[str]
    checks: tuple[tuple[str, Callable[[object], bool]], ...]


_SHAPES: dict[type[Any], _Shape] = {
    cls: _Shape(tuple(field.name for field in attrs.fields(cls)),
                frozenset(field.name for field in attrs.fields(cls)),
                tuple((field.name, field.metadata["check"]) for field in attrs.fields(cls)))
    for cls in _TYPES.values()
}


def _line(value: object) -> bytes:
    """
    One JSON value as one line.  ASCII-escaped: a client's JSON may hold a lone surrogate
    ("\\ud800"), which has no UTF-8 encoding and would otherwise lose the request's summary.
    """
    return json.dumps(value, separators=(",", ":")).encode("ascii") + b"\n"


def encode(message: Message) -> bytes:
    """One message as one line."""
    if isinstance(message, Finished):
        return summary_message(message.summary, message.answered)
    line = {"t": message.kind}
    for name in _SHAPES[type(message)].names:
        line[name] = getattr(message, name)
    return _line(line)


def decode(line: bytes) -> Message:
    """The message one line holds; :class:`WireError` if it holds none."""
    if len(line) > MAX_LINE:
        raise WireError(f"a line of {len(line)} bytes, over the limit of {MAX_LINE}")
    try:
        value = json.loads(line)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        raise WireError(f"not JSON: {error}") from None
    if isinstance(value, list):
        return _finished(value)
    if not isinstance(value, dict):
        raise WireError(f"not a message: a JSON {type(value).__name__}")
    kind = value.pop("t", None)
    cls = _TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise WireError(f"unknown message type {str(kind)[:40]!r}")
    shape = _SHAPES[cls]
    if value.keys() != shape.keys:
        raise WireError(f"{kind}: fields {sorted(value)[:10]}, not {sorted(shape.keys)}")
    for name, check in shape.checks:
        if not check(value[name]):
            raise WireError(f"{kind}: {name} cannot be {value[name]!r:.40}")
    message: Message = cls(**value)
    return message


def _finished(value: list[Any]) -> Finished:
    if len(value) != 3 or value[0] != Finished.kind:
        raise WireError("a list that is no finished request")
    _, answered, fields = value
    if not _is_bool(answered) or not isinstance(fields, dict):
        raise WireError("end: answered must be a boolean and the summary an object")
    try:
        summary = summary_from(fields)
    except (TypeError, ValueError) as error:
        raise WireError(f"end: not a summary: {error}") from None
    return Finished(summary, answered)


def summary_message(summary: Summary, answered: bool) -> bytes:
    """The ``end`` message: one finished request's summary, keyed by field name."""
    return _line(["end", answered, to_wire(summary)])


def summary_from(fields: object) -> Summary:
    """
    The summary of an ``end`` message; :class:`~txlb._records.fields.BadSummary` if it is
    not one (a missing, unknown or mistyped field).
    """
    return from_wire(fields)


def config_blob(config: Config) -> str:
    """The validated config for a worker (it must not re-read files or environment)."""
    return base64.b64encode(pickle.dumps(config)).decode("ascii")


def config_from(blob: str) -> Config:
    config = pickle.loads(base64.b64decode(blob))
    if not isinstance(config, Config):
        raise TypeError("not a Config")
    return config


class Lines:
    """
    Splits a byte stream into lines, keeping a partial line for the next chunk.

    Linear in what it is fed: only new data is searched for the line end and a partial
    line is kept as a list of pieces (pipes are read 8 KiB at a time, so re-joining and
    re-splitting the partial line on every read made a long line quadratic -- seconds of
    CPU for a few megabytes).  A line over :data:`MAX_LINE` is dropped whole and counted
    in ``dropped``, and the lines around it still arrive.
    """

    def __init__(self) -> None:
        self._pieces: list[bytes] = []
        self._size = 0
        self._dropping = False
        self.dropped = 0

    def feed(self, data: bytes) -> list[bytes]:
        lines = []
        start = 0
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                break
            line = data[start:end]
            if self._pieces:
                self._pieces.append(line)
                line = b"".join(self._pieces)
                self._pieces = []
                self._size = 0
            if self._dropping:
                self._dropping = False  # the end of the oversize line
            elif line:
                lines.append(line)
            start = end + 1
        if start < len(data) and not self._dropping:
            rest = data[start:]
            self._pieces.append(rest)
            self._size += len(rest)
            if self._size > MAX_LINE:
                self._pieces = []
                self._size = 0
                self._dropping = True
                self.dropped += 1
        return lines
