"""
Token budgets (``[[budgets]]``): prompt + completion tokens per client key, per minute and
per day.

A request rate says nothing about a 100k-token prompt; a token budget does.  Each budget
keeps, per client key it limits and per window, a **token bucket** whose capacity is the
window's tokens and which refills continuously at capacity / window: a rolling window in
O(1) time and memory per key (a key that used its whole minute gets a sixtieth of it back
every second, rather than all of it at the top of the minute, so there is no burst at a
window's edge for clients to race for).

Admission cannot know what a request will cost, so it **reserves an estimate** made from
the body (its bytes / 4 for the prompt, plus ``max_tokens`` -- or the configured default --
times ``n`` for the completion) in every bucket that applies, and refuses the request with
429 when any of them does not hold it.  When the request ends, the reservation is
**reconciled** from the ``usage`` the answer carried (:meth:`TokenBudgets.reconcile`, a
consumer of finished requests): the difference goes back (an over-estimate) or is taken
as a debt the bucket pays off as it refills (an under-estimate).  Without ``usage`` the
estimate stands; see :func:`charge` for every case.

The levels live behind :class:`~txlb._cluster.store.ITokenLevels`
(:class:`~txlb._cluster.local_store.TokenLevels` in this process's memory) so that a store
shared between balancers can hold them instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import attrs
from twisted.web.server import Request

from txlb._cluster.local_store import TokenLevels
from txlb._cluster.store import Bucket, ITokenLevels
from txlb._config.config import Config
from txlb._config.limits import BudgetSpec
from txlb._http.apis import API_PATHS
from txlb._scheduling.outcome import RequestOutcome
from txlb._scheduling.ratelimit import client_key
from txlb._scheduling.request import RoutingRequest

#: Characters of request body per prompt token, for the estimate: OpenAI's rule of thumb
#: for English text.  JSON's own syntax makes it err high, which reconciliation gives back.
CHARS_PER_TOKEN = 4

#: Choices (``n``) counted at most: the engines refuse far fewer, and a hostile ``n`` then
#: makes a request that can never fit rather than an overflowing estimate.
MAX_CHOICES = 1024

#: Separates a bucket key's parts: budget name, window, client key (names cannot hold it).
_SEP = "\x1f"

_WINDOW_NAMES = {60.0: "minute", 86400.0: "day"}


@attrs.frozen
class Estimate:
    """What admission reserves for a request: its prompt and its most completion tokens."""

    prompt: int
    completion: int

    @property
    def total(self) -> int:
        return self.prompt + self.completion


#: Where a hostile count stops growing: far above any budget, far below float trouble.
MAX_COUNT = 2**62


#: Digits of a numeric string read at most: a longer one is past :data:`MAX_COUNT` anyway.
_MAX_DIGITS = 24


def _whole(value: object) -> int | None:
    """
    A count as the engines' pydantic models accept one for an ``int`` field: a JSON
    integer, a float with no fraction (``5000.0``) or a string of one (``"5000"``), as far
    as :data:`MAX_COUNT` (a larger one is that: a request asking for 10**30 tokens can
    never fit, it does not get the default).  A bool, a fraction, a negative number or
    anything else is no count at all (the engine refuses such a request).
    """
    if isinstance(value, str):
        text = value.strip()
        if len(text) > _MAX_DIGITS:
            return MAX_COUNT if text.isdigit() else None
        try:
            value = int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                return None
    if isinstance(value, float):
        if math.isnan(value) or value < 0:
            return None
        if math.isinf(value) or value >= MAX_COUNT:
            return MAX_COUNT
        if not value.is_integer():
            return None
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return min(value, MAX_COUNT)
    return None


#: The fields that bound a completion, in the APIs txlb knows.
_MAXIMA = ("max_tokens", "max_completion_tokens", "max_output_tokens")


#: Paths of the engines' own that generate nothing (vLLM, SGLang): their body alone.
_NOT_GENERATING = frozenset({b"/tokenize", b"/detokenize", b"/v1/tokenize",
                             b"/v1/detokenize"})


def estimate_tokens(body: bytes, parsed: Mapping[str, object] | None, path: bytes,
                    default_completion: int, method: bytes = b"POST") -> Estimate:
    """
    The tokens a request may cost, from what it says before it runs: its body's bytes over
    :data:`CHARS_PER_TOKEN` for the prompt (any API's shape, tools and images included,
    without parsing it twice), and for the completion the largest of its ``max_tokens``,
    ``max_completion_tokens`` and (the Responses API's) ``max_output_tokens`` -- else
    ``default_completion`` -- times its ``n``.  Only what may generate has a completion:
    an embedding, a ``GET`` (``/metrics``), or a ``/tokenize`` costs its body alone, while
    a ``POST`` to a path txlb does not know as an LLM API is estimated like a completion
    (an engine's own generate endpoints: SGLang's and TGI's ``/generate``, llama.cpp's
    ``/completion``).
    """
    prompt = math.ceil(len(body) / CHARS_PER_TOKEN)
    api = API_PATHS.get(path)
    if api == "embeddings" or (api is None and (method != b"POST"
                                                or path in _NOT_GENERATING)):
        return Estimate(prompt, 0)
    most = None
    choices = 1
    if parsed is not None:
        # the largest: which one an engine obeys when a request gives several differs
        # (vLLM's chat takes max_completion_tokens first)
        counts = [count for count in (_whole(parsed.get(field)) for field in _MAXIMA)
                  if count is not None]
        most = max(counts, default=None)
        choices = min(MAX_CHOICES, max(1, _whole(parsed.get("n")) or 1))
    return Estimate(prompt, (default_completion if most is None else most) * choices)


def charge(outcome: RequestOutcome, estimate: Estimate) -> int:
    """
    The tokens a finished request costs, from what it reported (its ``usage``) or else
    what it was estimated to cost:

    * answered with a success: ``usage``'s prompt and completion tokens; a part ``usage``
      did not give (a stream without ``include_usage``, a client that left mid-answer) is
      charged its estimate -- the whole ``max_tokens`` -- or, for the completion, the
      events the stream relayed if there were more (a token at least each: a request
      without ``max_tokens`` estimated at the default cannot generate 2,000 tokens for
      256);
    * answered with an error (4xx, 5xx): nothing, the engine generated nothing;
    * never answered: the prompt's estimate when the client left, or the backend fell
      silent, after the request was sent (the engine may have read the prompt: leaving
      early must not make a huge prompt free); nothing when it was never sent (no backend,
      the queue timed out, every try was refused).
    """
    prompt, completion = served(outcome, estimate)
    return prompt + completion


def served(outcome: RequestOutcome, estimate: Estimate) -> tuple[int, int]:
    """
    The prompt and the completion tokens :func:`charge` charges, apart (the fair queue
    prices them differently).
    """
    if not outcome.answered:
        sent = outcome.backend not in ("", "-")
        abandoned = sent and outcome.end in ("client_abort", "timeout")
        return (estimate.prompt if abandoned else 0), 0
    if not 200 <= outcome.status < 300:
        return 0, 0
    prompt = estimate.prompt if outcome.prompt_tokens is None else outcome.prompt_tokens
    completion = outcome.completion_tokens
    if completion is None:
        completion = max(estimate.completion, outcome.relayed_events or 0)
    return prompt, completion


@attrs.frozen
class Reservation:
    """What one admitted request holds: the buckets it reserved in, and how much."""

    #: per bucket: (budget name, window seconds, client key)
    buckets: tuple[Where, ...]
    estimate: Estimate


@attrs.frozen
class Admission:
    """Admission's verdict on one request, and the headers its answer carries."""

    refused: bool = False
    message: str = ""
    #: whole seconds for ``Retry-After`` (``None``: never, or not refused)
    retry_after: int | None = None
    #: the budget that refused it
    budget: str | None = None
    #: the x-ratelimit-*-tokens headers for the tightest budget that applies
    headers: tuple[tuple[bytes, bytes], ...] = ()
    #: tokens were reserved: the request is charged at its end (and its answer's events
    #: are counted, for an answer that brings no usage)
    reserved: bool = False


#: A request no budget applies to.
ADMITTED = Admission()

#: Where a budget's buckets are, by name: (budget name, window seconds, client key).
Where = tuple[str, float, str]


def go_duration(seconds: float) -> str:
    """
    A wait as OpenAI's ``x-ratelimit-reset-tokens`` writes it (Go's duration format):
    ``"6ms"``, ``"1s"``, ``"6m0s"``, ``"1h0m0s"``; rounded up, so it is never early.
    """
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def _bucket_key(name: str, window: float, client: str) -> str:
    return f"{name}{_SEP}{window:g}{_SEP}{client}"


class TokenBudgets:
    """
    The configured budgets: admission (:meth:`admit`, from the proxy), reconciliation
    (:meth:`reconcile`, from the books of each finished request), live changes
    (:meth:`reconfigure`) and what ``/status`` and the metrics show.
    """

    def __init__(self, config: Config, levels: ITokenLevels) -> None:
        self.levels = levels
        self._specs: tuple[BudgetSpec, ...] = ()
        self._windows: dict[tuple[str, float], float] = {}
        self.default_completion = config.budget_completion_estimate
        #: requests refused, and tokens charged, by budget name (for the metrics)
        self.refused: dict[str, int] = {}
        self.charged: dict[str, int] = {}
        #: told of every change this process makes to its levels -- ``(buckets, amount
        #: taken, tokens charged)`` -- and of every refusal (a budget's name): a
        #: ``--workers`` worker passes them on, so every process keeps the fleet's levels
        self.on_spent: Callable[[Sequence[Where], float, int], object] | None = None
        self.on_refused: Callable[[str], object] | None = None
        self.reconfigure(config)

    def report_to(self, spent: Callable[[Sequence[Where], float, int], object],
                  refused: Callable[[str], object]) -> None:
        """Tell ``spent`` of every change this process makes, ``refused`` of every refusal."""
        self.on_spent = spent
        self.on_refused = refused

    @property
    def specs(self) -> tuple[BudgetSpec, ...]:
        return self._specs

    def reconfigure(self, config: Config) -> None:
        """
        Apply a new config's budgets in place.  A budget keeps its levels by name (and
        window): raising its limit gives no one a fresh bucket, lowering it caps the
        levels above it on their next use; a removed budget (or window) stops applying
        and its levels are dropped.  Requests admitted before are reconciled against the
        budgets that still exist.
        """
        self._specs = config.budgets
        self.default_completion = config.budget_completion_estimate
        self._windows = {(spec.name, window): float(tokens)
                         for spec in config.budgets for window, tokens in spec.windows}
        kept = {f"{name}{_SEP}{window:g}" for name, window in self._windows}
        # split from the left: a client key (a header's value) may hold anything
        self.levels.forget(lambda key: _SEP.join(key.split(_SEP, 2)[:2]) in kept)
        names = {spec.name for spec in config.budgets}
        for counts in (self.refused, self.charged):
            for name in [name for name in counts if name not in names]:
                del counts[name]

    def _bucket(self, name: str, window: float, client: str) -> Bucket | None:
        capacity = self._windows.get((name, window))
        if capacity is None:
            return None
        return (_bucket_key(name, window, client), capacity, capacity / window)

    def admit(self, request: Request, routing: RoutingRequest, path: bytes,
              priority: str | None) -> Admission:
        """
        Reserve the request's estimated tokens in every budget that applies to it (by its
        client keys -- its tenant's name, with ``--auth keys`` -- and its priority class
        ``priority``), or refuse it.  An admitted
        request's reservation rides on ``routing`` to :meth:`reconcile`.
        """
        keys: dict[str, str] = {}
        applies: list[Where] = []
        for spec in self._specs:
            if spec.priority is not None and spec.priority != priority:
                continue
            client = keys.get(spec.kind)
            if client is None:
                # with --auth keys the tenant is the client, whatever the budget's key
                client = keys[spec.kind] = (client_key(request, spec.kind)
                                            if routing.tenant is None
                                            else "tenant:" + routing.tenant)
            if spec.key is not None and client != spec.key:
                continue
            applies.extend((spec.name, window, client) for window, _ in spec.windows)
        if not applies:
            return ADMITTED
        estimate = estimate_tokens(routing.body, routing.json, path, self.default_completion,
                                   request.method)
        amount = estimate.total
        buckets = [self._bucket(*where) for where in applies]
        ready = [bucket for bucket in buckets if bucket is not None]
        for (name, window, _), (_, capacity, _) in zip(applies, ready, strict=True):
            if amount > capacity:
                return self._refused(name, None, ready, (
                    f"token budget {name!r} exceeded: this request may use about {amount} "
                    f"tokens (its body, plus {estimate.completion} to generate), more than "
                    f"the {int(capacity)} the budget allows per {_WINDOW_NAMES[window]}; "
                    "it can never fit: lower max_tokens or shorten the prompt"))
        wait = self.levels.reserve(ready, amount)
        if wait > 0:
            retry = max(1, math.ceil(wait))
            name = self._short(applies, ready, amount)
            return self._refused(name, retry, ready, (
                f"token budget {name!r} exceeded for this client: this request may use "
                f"about {amount} tokens; retry in {retry}s"))
        routing.memo[self] = Reservation(tuple(applies), estimate)
        if self.on_spent is not None and amount:
            self.on_spent(applies, amount, 0)
        return Admission(headers=self._headers(ready), reserved=True)

    def _short(self, applies: list[Where], buckets: list[Bucket],
               amount: int) -> str:
        """The budget that keeps a request waiting longest."""
        def wait(bucket: Bucket) -> float:
            return (amount - self.levels.level(bucket)) / bucket[2]

        waits = [wait(bucket) for bucket in buckets]
        return applies[waits.index(max(waits))][0]

    def _refused(self, name: str, retry: int | None, buckets: Sequence[Bucket],
                 message: str) -> Admission:
        self.refused[name] = self.refused.get(name, 0) + 1
        if self.on_refused is not None:
            self.on_refused(name)
        return Admission(True, message, retry, name, self._headers(buckets))

    def _headers(self, buckets: Sequence[Bucket]) -> tuple[tuple[bytes, bytes], ...]:
        """OpenAI's token headers, for the bucket with the fewest tokens left."""
        levels = [self.levels.level(bucket) for bucket in buckets]
        level = min(levels)
        _, capacity, rate = buckets[levels.index(level)]
        return (
            (b"x-ratelimit-limit-tokens", b"%d" % capacity),
            (b"x-ratelimit-remaining-tokens", b"%d" % max(0, math.floor(level))),
            (b"x-ratelimit-reset-tokens", go_duration((capacity - level) / rate).encode()),
        )

    def reconcile(self, outcome: RequestOutcome) -> None:
        """
        A request ended: replace its reservation by what it cost (:func:`charge`), in the
        buckets of the budgets that still exist.  Once per request (the reservation is
        taken off the request), whoever reports it.
        """
        routing = outcome.routing
        if routing is None:
            return  # a request of another process, or one no budget applied to
        reservation = routing.memo.pop(self, None)
        if not isinstance(reservation, Reservation):
            return
        cost = charge(outcome, reservation.estimate)
        back = reservation.estimate.total - cost
        self._apply(reservation.buckets, -back, cost)
        if self.on_spent is not None and (back or cost):
            self.on_spent(reservation.buckets, -back, cost)

    def spent_elsewhere(self, buckets: Sequence[Where], amount: float, charged: int) -> None:
        """
        Another process's budgets took ``amount`` from these buckets (a negative amount:
        gave it back), and a request there cost ``charged``: apply it here too, for the
        budgets that exist here.
        """
        self._apply(buckets, amount, charged)

    def _apply(self, buckets: Sequence[Where], amount: float, charged: int) -> None:
        ready = [bucket for bucket in (self._bucket(*where) for where in buckets)
                 if bucket is not None]
        if amount and ready:
            self.levels.adjust(ready, -amount)
        if charged:
            for name in dict.fromkeys(name for name, _, _ in buckets):
                if any(budget == name for budget, _ in self._windows):
                    self.charged[name] = self.charged.get(name, 0) + charged

    def deficits(self) -> list[tuple[Where, float]]:
        """
        Every bucket of this process's own levels that is below its capacity, and by how
        much: what a ``--workers`` worker that starts (a respawn) is sent after its Hello,
        as :meth:`spent_elsewhere`, so that it starts with the fleet's levels and not full.
        Empty when the levels are a shared store's (every process reads them there).
        """
        levels = self.levels
        if not isinstance(levels, TokenLevels):
            return []
        found: list[tuple[Where, float]] = []
        for key in levels.held():
            name, window, client = key.split(_SEP, 2)
            where = (name, float(window), client)
            bucket = self._bucket(*where)
            if bucket is None:
                continue
            short = bucket[1] - levels.level(bucket)
            if short > 0:
                found.append((where, short))
        return found

    def count_refused(self, name: str) -> None:
        """Another process's budget ``name`` refused a request."""
        if any(budget == name for budget, _ in self._windows):
            self.refused[name] = self.refused.get(name, 0) + 1

    def status(self) -> dict[str, object]:
        """What ``/status`` shows: the budgets (never a client key) and the buckets kept."""
        budgets = []
        for spec in self._specs:
            entry: dict[str, object] = {"name": spec.name, "key": spec.kind,
                                        "one_client": spec.key is not None,
                                        "class": spec.priority}
            for window, tokens in spec.windows:
                entry[f"tokens_per_{_WINDOW_NAMES[window]}"] = tokens
            budgets.append(entry)
        return {"budgets": budgets, "budget_keys_tracked": len(self.levels)}
