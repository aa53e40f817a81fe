"""
Fair shares of the fleet between tenants: the Virtual Token Counter (``--fairness vtc``).

The algorithm is the one of Sheng et al., "Fairness in Serving Large Language Models"
(OSDI 2024).  Each tenant has a counter of the service it has received, in weighted
tokens: a prompt token costs :data:`INPUT_PRICE`, a generated one :data:`OUTPUT_PRICE`,
both divided by the tenant's weight.  When a slot frees up and requests wait, the queue
serves the waiting tenant whose counter is lowest.  A tenant that was not waiting and
starts to has its counter lifted to ``max(its own, the lowest of the tenants waiting)``
(or, when no one waits, of the tenant last served): idling earns no credit to spend in a
burst later.  Between two tenants that stay backlogged the difference of their counters
stays within ``2 * max(w * L_input, w * M)`` -- ``L_input`` the longest prompt, ``M`` the
tokens the fleet holds in flight -- whatever their demands.

Every request of a tenant is charged, queued or not (a slot it got at once is service
too), as txlb sees it served.  At its grant, its prompt (from the body's size).  A streamed
answer (``"stream": true``) is charged its output as it streams: each SSE ``data:`` event
counts as one token, charged :data:`STREAM_STEP` tokens at a time (:class:`StreamMeter`).
A non-streamed answer shows nothing until its end, so its grant also charges its completion
at the estimate the token budgets use (``max_tokens``, else
``--budget-completion-estimate``): its long answer counts against it while it runs, the
error on the side of the others.  At the end, the difference to what ``usage`` reports
(:meth:`FairShares.settle`) makes the counter exact.

Only the order of the queue changes: priority classes, starvation guards and each
request's deadline (503 when it runs out) are the router's, as without tenants.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Protocol, TypeVar

import attrs

from txlb._config.config import Config, fairness_of
from txlb._scheduling.budgets import Estimate, estimate_tokens, served
from txlb._scheduling.outcome import RequestOutcome
from txlb._scheduling.request import RoutingRequest

#: The weighted price of a prompt token and of a generated one (the paper's defaults:
#: decoding a token costs an engine about twice what prefilling one does).
INPUT_PRICE = 1.0
OUTPUT_PRICE = 2.0
#: Streamed tokens charged at a time: a counter (and, under ``--workers``, the message that
#: carries it) moves once per this many events of one answer, not once per token.  The
#: paper's bound grows by at most this many output tokens per answer in flight.
STREAM_STEP = 16


class Queued(Protocol):
    """What the fair order needs of a waiter: its request (its tenant)."""

    @property
    def request(self) -> RoutingRequest: ...


W = TypeVar("W", bound=Queued)


@attrs.define
class Charge:
    """What a request is charged at its grant: its tenant and the estimate, in tokens."""

    tenant: str
    weight: float
    estimate: Estimate
    #: the answer streams: its output is charged as it comes, not at the grant
    streamed: bool = False
    #: charged already (a failover's second slot is not charged again)
    applied: bool = False
    #: settled: the counter holds what the answer cost, and nothing more is charged
    settled: bool = False
    #: weighted tokens charged so far: the grant's, then each streamed step's
    charged: float = 0.0
    #: output tokens charged as they streamed
    streamed_tokens: int = 0

    @property
    def cost(self) -> float:
        """What the grant charges: the prompt, and the completion unless it streams."""
        completion = 0 if self.streamed else self.estimate.completion
        return cost_of(self.estimate.prompt, completion, self.weight)

    def apply(self) -> bool:
        """Mark the grant's charge made (:attr:`cost`); ``False`` if it was made already."""
        if self.applied:
            return False
        self.applied = True
        self.charged = self.cost
        return True

    def streamed_more(self, tokens: int) -> float:
        """``tokens`` more streamed: what they cost, now charged."""
        amount = cost_of(0, tokens, self.weight)
        self.charged += amount
        self.streamed_tokens += tokens
        return amount

    def settle(self) -> bool:
        """Mark the charge settled; ``False`` if it was already."""
        if self.settled:
            return False
        self.settled = True
        return True


def cost_of(prompt: int, completion: int, weight: float) -> float:
    """The weighted service of ``prompt`` and ``completion`` tokens to a tenant."""
    return (INPUT_PRICE * prompt + OUTPUT_PRICE * completion) / weight


class StreamMeter:
    """
    A streamed answer's output charged as it passes: fed each chunk of the body (``feed``),
    it counts the SSE ``data:`` events (one token each: an engine streams a token, or a
    few, per event; the role, usage and ``[DONE]`` events make the count a little high
    until the settle corrects it) and charges every :data:`STREAM_STEP` of them.  Cheap on
    the relay's path: one ``bytes.count`` a chunk.
    """

    __slots__ = ("_shares", "_charge", "_seen", "_billed")

    def __init__(self, shares: FairShares, charge: Charge) -> None:
        self._shares = shares
        self._charge = charge
        self._seen = 0
        self._billed = 0

    def feed(self, data: bytes) -> None:
        """A chunk of the answer's body, as relayed."""
        self.tokens(data.count(b"data:"))

    def tokens(self, count: int) -> None:
        """``count`` more tokens streamed (the bench's engines say it directly)."""
        self._seen += count
        if self._seen - self._billed >= STREAM_STEP:
            self._shares.charge_streamed(self._charge, self._seen - self._billed)
            self._billed = self._seen


class FairShares:
    """
    The tenants' counters, and the order they give a class's waiters.  ``enabled`` is
    ``--fairness vtc``; with ``fifo`` the counters are still kept (the admin API and the
    bench show them) but the queue keeps arrival order.
    """

    def __init__(self, enabled: bool = False, default_completion: int = 256) -> None:
        self.enabled = enabled
        self.default_completion = default_completion
        #: each tenant's service received, in weighted tokens
        self.counters: dict[str, float] = {}
        #: the counter of the tenant last given a slot: where a tenant returning while no
        #: one waits starts
        self._last_served = 0.0
        #: per class, the tenants with requests waiting there, and how many
        self._waiting: dict[str, dict[str, int]] = {}
        #: told every change this process makes to a counter (``--workers``: the worker
        #: passes it on, so every process holds the fleet's counters)
        self.on_served: Callable[[str, float], object] | None = None
        #: told every change of this host's -- this process's and its workers' -- which
        #: ``--shared-state`` sends to the fleet's counters
        self.on_host_change: list[Callable[[str, float], object]] = []
        #: told every change the fleet's counters brought (a supervisor's workers hear it)
        self.on_fleet_change: list[Callable[[str, float], object]] = []
        #: the tenants of the keys file (``None``: any name), past which nothing is counted
        self._tenants: frozenset[str] | None = None
        #: ``--workers``: the tenants waiting in a class in the other workers (the fair
        #: handoff's, :mod:`txlb._workers.handoff`), whose counters an arrival is lifted to
        self.waiting_elsewhere: Callable[[str], Iterable[str]] | None = None

    def lift_with(self, waiting_elsewhere: Callable[[str], Iterable[str]]) -> None:
        """Lift an arrival to the lowest counter waiting in the other workers too."""
        self.waiting_elsewhere = waiting_elsewhere

    def report_to(self, served: Callable[[str, float], object]) -> None:
        """Tell ``served`` of every change this process makes to a counter."""
        self.on_served = served

    def served_elsewhere(self, tenant: str, amount: float) -> None:
        """Another process of this host (a worker) changed ``tenant``'s counter by ``amount``."""
        if self._tenants is not None and tenant not in self._tenants:
            return
        self.counters[tenant] = self.counters.get(tenant, 0.0) + amount
        for listener in self.on_host_change:
            listener(tenant, amount)

    def take_fleet(self, fleet: dict[str, float], unsent: dict[str, float]) -> None:
        """
        The fleet's counters as the shared state answered them: each counter here is the
        fleet's plus what this host changed and has not sent yet.  A change is told to
        :attr:`on_fleet_change` (a supervisor's workers apply it as theirs).
        """
        for tenant in set(fleet) | set(self.counters):
            if self._tenants is not None and tenant not in self._tenants:
                continue
            value = fleet.get(tenant, 0.0) + unsent.get(tenant, 0.0)
            change = value - self.counters.get(tenant, 0.0)
            if abs(change) > 1e-9:
                self.counters[tenant] = value
                for listener in self.on_fleet_change:
                    listener(tenant, change)

    def _add(self, tenant: str, amount: float) -> float:
        """Change ``tenant``'s counter by ``amount`` (told on); its value now."""
        value = self.counters[tenant] = self.counters.get(tenant, 0.0) + amount
        if amount:
            if self.on_served is not None:
                self.on_served(tenant, amount)
            for listener in self.on_host_change:
                listener(tenant, amount)
        return value

    def reconfigure(self, config: Config) -> None:
        """
        ``config``'s ``--fairness`` and completion estimate; with ``--auth keys``, the
        tenants its keys file has: a removed tenant's counter is dropped.
        """
        self.enabled = fairness_of(config) == "vtc"
        self.default_completion = config.budget_completion_estimate
        self._tenants = None
        if config.auth == "keys" and config.keys is not None:
            self._tenants = frozenset(tenant.name for tenant in config.keys.tenants)
            self.counters = {name: value for name, value in self.counters.items()
                             if name in self._tenants}

    def arrived(self, klass: str, request: RoutingRequest) -> None:
        """
        ``request`` asks for a slot in class ``klass``, queued or not: the paper's arrival
        in the queue.  A tenant with nothing waiting there is lifted to the lowest counter
        of the tenants that have (to the last one served's when none have): what it did
        not use -- while idle, or while everyone was served at once -- is not saved up to
        spend when the queue forms.  A failover's second slot is no arrival.
        """
        tenant = request.tenant
        charge = request.memo.get(self)
        if tenant is None or (isinstance(charge, Charge) and charge.applied):
            return
        waiting = self._waiting.get(klass, {})
        if tenant in waiting:
            return
        names: Iterable[str] = waiting
        if self.waiting_elsewhere is not None:  # --workers: the other workers' waiters too
            names = [*waiting, *self.waiting_elsewhere(klass)]
        floor = min((self.counters.get(name, 0.0) for name in names),
                    default=self._last_served)
        own = self.counters.get(tenant, 0.0)
        if floor > own:
            self._add(tenant, floor - own)  # a lift is an addition too: it travels

    def joined(self, klass: str, request: RoutingRequest) -> None:
        """``request`` starts to wait in class ``klass`` (it :meth:`arrived` first)."""
        tenant = request.tenant
        if tenant is None:
            return
        waiting = self._waiting.setdefault(klass, {})
        waiting[tenant] = waiting.get(tenant, 0) + 1

    def left(self, klass: str, request: RoutingRequest) -> None:
        """``request`` no longer waits in ``klass`` (served, expired, cancelled)."""
        tenant = request.tenant
        waiting = self._waiting.get(klass)
        if tenant is None or waiting is None or tenant not in waiting:
            return
        waiting[tenant] -= 1
        if not waiting[tenant]:
            del waiting[tenant]

    def waiting_in(self, klass: str) -> Collection[str]:
        """The tenants with requests waiting in class ``klass``."""
        return self._waiting.get(klass, {}).keys()

    def regroup(self, waiters: Iterable[tuple[str, RoutingRequest]]) -> None:
        """The queue was regrouped (a reload's classes): who waits where, afresh."""
        self._waiting = {}
        for klass, request in waiters:
            if request.tenant is not None:
                waiting = self._waiting.setdefault(klass, {})
                waiting[request.tenant] = waiting.get(request.tenant, 0) + 1

    def price(self, request: RoutingRequest, path: bytes, method: bytes) -> None:
        """
        Work out what ``request`` will be charged when it gets its slot (its tenant, its
        estimate), before it is routed: the path and method are the proxy's to know.
        """
        if request.tenant is None:
            return
        estimate = estimate_tokens(request.body, request.json, path, self.default_completion,
                                   method)
        body = request.json
        streamed = isinstance(body, dict) and body.get("stream") is True
        request.memo[self] = Charge(request.tenant, request.weight, estimate, streamed)

    def meter(self, request: RoutingRequest) -> StreamMeter | None:
        """
        What charges ``request``'s streamed output as it is relayed (:class:`StreamMeter`);
        ``None`` when it has no tenant or does not stream.
        """
        charge = request.memo.get(self)
        if not isinstance(charge, Charge) or not charge.streamed:
            return None
        return StreamMeter(self, charge)

    def charge_streamed(self, charge: Charge, tokens: int) -> None:
        """``tokens`` more of ``charge``'s answer streamed: its tenant is charged them."""
        if (not charge.applied or charge.settled
                or (self._tenants is not None and charge.tenant not in self._tenants)):
            return
        self._add(charge.tenant, charge.streamed_more(tokens))

    def granted(self, request: RoutingRequest) -> None:
        """``request`` got its first slot: its tenant is charged what :meth:`price` said."""
        charge = request.memo.get(self)
        if not isinstance(charge, Charge) or not charge.apply():
            return  # no tenant, or a failover's second slot: charged once
        self._last_served = self._add(charge.tenant, charge.cost)

    def settle(self, outcome: RequestOutcome) -> None:
        """
        A request ended: what it cost (its ``usage``, else its estimate, as a token budget
        charges it) replaces what its grant and its streamed steps charged.
        """
        routing = outcome.routing
        if routing is None:
            return
        charge = routing.memo.pop(self, None)
        if (not isinstance(charge, Charge) or not charge.applied
                or charge.tenant not in self.counters or not charge.settle()):
            return
        prompt, completion = served(outcome, charge.estimate)
        if outcome.completion_tokens is None:
            # no usage (a client that left mid-stream, a cut answer): what streamed was
            # served all the same
            completion = max(completion, charge.streamed_tokens)
        # what was charged is in the counter: the difference never takes it below 0
        self._add(charge.tenant, cost_of(prompt, completion, charge.weight) - charge.charged)

    def order(self, waiters: Sequence[W]) -> Iterator[W]:
        """
        A class's ``waiters`` (in arrival order) in the order slots go to them: each time
        the head of the waiting tenant with the lowest counter, read afresh at every step
        (a waiter served meanwhile has charged its tenant), ties to the earliest arrival;
        waiters without a tenant are a tenant of their own, ``None``, at counter 0.  With
        fairness off, arrival order.
        """
        if not self.enabled:
            yield from waiters
            return
        lines: dict[str | None, list[W]] = {}
        for waiter in waiters:
            lines.setdefault(waiter.request.tenant, []).append(waiter)
        heads = {tenant: 0 for tenant in lines}
        arrival = {id(waiter): index for index, waiter in enumerate(waiters)}

        def rank(tenant: str | None) -> tuple[float, int]:
            counter = 0.0 if tenant is None else self.counters.get(tenant, 0.0)
            return counter, arrival[id(lines[tenant][heads[tenant]])]

        while heads:
            tenant = min(heads, key=rank)
            yield lines[tenant][heads[tenant]]
            heads[tenant] += 1
            if heads[tenant] == len(lines[tenant]):
                del heads[tenant]

    def status(self) -> dict[str, object]:
        """The order in force and each tenant's counter, rounded: what the admin API shows."""
        return {"order": "vtc" if self.enabled else "fifo",
                "counters": {name: round(value, 1)
                             for name, value in sorted(self.counters.items())}}
