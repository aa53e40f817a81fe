"""
The one bookkeeper: where each finished request is counted, once.

A finished :class:`~txlb._records.record.RequestRecord` is summarised once
(:func:`~txlb._records.summary.summarize`) and the :class:`~txlb._records.summary.Summary`
is handed to a declared list of :class:`SummaryConsumer`\\ s -- the pool's result and
outlier accounting, the policy's ``observe``, the metrics, the dashboard's history, the
result log and the token budgets.  The consumers are declared rather than called inline so
that what a finished request costs follows from who reads it: with no consumer at all
nothing is summarised, and each consumer declares what it reads of the answer
(:class:`~txlb._records.needs.Needs`): the proxy captures and parses no more than the
most any of them reads -- with the result log off, a stream's texts are never parsed.

:class:`Bookkeeper` is the local :class:`~txlb._records.observer.IRequestObserver`: a
single process's proxy reports to it directly, and a ``--workers`` supervisor feeds it what
its workers report (:mod:`txlb._workers.reports`), so both modes keep the same books.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs
from twisted.logger import Logger
from zope.interface import implementer

from txlb._cluster.backend import Backend
from txlb._cluster.pool import Pool
from txlb._config.config import Config
from txlb._records.metrics import Metrics
from txlb._records.needs import Needs
from txlb._records.observer import IRequestObserver
from txlb._records.privacy import KEEP_ALL, Privacy, privacy_of
from txlb._records.record import RequestRecord
from txlb._records.summary import Summary, summarize
from txlb._scheduling.budgets import TokenBudgets
from txlb._scheduling.fairness import FairShares
from txlb._scheduling.outcome import RequestOutcome
from txlb._scheduling.policies import IPolicy
from txlb._scheduling.request import RoutingRequest

log = Logger()

#: The start of a hung-backend detector's reason (txlb._cluster.hung): such a report is a
#: hang verdict, which the pool weighs against the rest of the fleet before acting on it.
HUNG = "hung:"


@attrs.frozen
class SummaryConsumer:
    """
    One reader of finished requests' summaries.  ``consume(summary, answered)``:
    ``answered`` says a backend's answer reached txlb, so the timings say something about
    that backend.  ``name`` says who it is when it fails.
    """

    name: str
    consume: Callable[[Summary, bool], object]
    #: what it reads of the answer: all of it (the result log's texts) unless it says less
    needs: Needs = Needs.TEXTS


@attrs.frozen
class OutcomeConsumer:
    """
    One reader of finished requests' :class:`~txlb._scheduling.outcome.RequestOutcome`\\ s --
    what a policy (or a budget) learns: the feed builds each outcome once, with the
    request's client key, for every consumer of this kind.
    """

    name: str
    consume: Callable[[RequestOutcome], object]
    #: an outcome carries the answer's counts, never its texts
    needs: Needs = Needs.USAGE


Consumer = SummaryConsumer | OutcomeConsumer


class SummaryFeed:
    """
    Summarise a finished request once and hand the summary to every declared consumer,
    in the order they were declared.  One consumer failing is logged and does not keep
    the summary from the others (bookkeeping must never fail a request).
    """

    def __init__(self, privacy: Privacy = KEEP_ALL,
                 consumers: Iterable[Consumer] = ()) -> None:
        self._privacy = privacy
        self._consumers: list[Consumer] = list(consumers)
        #: records summarised (none while nobody reads summaries)
        self.summarised = 0

    @property
    def consumers(self) -> tuple[Consumer, ...]:
        return tuple(self._consumers)

    @property
    def needs(self) -> Needs:
        """
        The most any consumer reads of an answer: what a request starting now captures
        and parses of it (nothing while no one reads summaries).
        """
        return max((consumer.needs for consumer in self._consumers), default=Needs.NOTHING)

    def add(self, consumer: Consumer) -> None:
        """Declare one more reader of summaries (after those declared already)."""
        self._consumers.append(consumer)

    def replace(self, consumer: Consumer) -> None:
        """
        Put ``consumer`` in the place of the one of the same name (a reload's new policy
        learns where the old one did); added last if there was none.
        """
        for index, existing in enumerate(self._consumers):
            if existing.name == consumer.name:
                self._consumers[index] = consumer
                return
        self._consumers.append(consumer)

    def keep_private(self, privacy: Privacy) -> None:
        """What summaries keep of a request's content and its user from now on."""
        self._privacy = privacy

    def reconfigure(self, config: Config) -> None:
        """``config``'s ``--log-content``, ``--log-user`` and ``--log-error-body``."""
        self.keep_private(privacy_of(config))

    @property
    def privacy(self) -> Privacy:
        """What summaries keep of a request's content and its user."""
        return self._privacy

    def ended(self, record: RequestRecord) -> None:
        """A request finished here: summarise it, if anyone reads summaries, and feed them."""
        if not self._consumers:
            return
        try:
            summary = summarize(record, self._privacy)
        except Exception:
            log.failure("could not summarise a finished request")
            return
        self.summarised += 1
        self.feed(summary, record.status is not None, record.client, record.routing,
                  record.events)

    def feed(self, summary: Summary, answered: bool, client: str | None = None,
             routing: RoutingRequest | None = None,
             relayed_events: int | None = None) -> None:
        """
        A summary made already (here, or by a worker, whose client keys and routing
        requests stay with it): hand it to every consumer, and its outcome to those that
        read outcomes.
        """
        outcome: RequestOutcome | None = None
        for consumer in self._consumers:
            try:
                if isinstance(consumer, OutcomeConsumer):
                    if outcome is None:
                        outcome = RequestOutcome.of(summary, answered, client, routing,
                                                    relayed_events)
                    consumer.consume(outcome)
                else:
                    consumer.consume(summary, answered)
            except Exception:
                log.failure("{consumer} could not count a finished request",
                            consumer=consumer.name)


def pool_results(pool: Pool) -> SummaryConsumer:
    """
    The pool's per-backend status counts, latency averages and prompt-token totals
    (answered requests only).
    """

    def consume(summary: Summary, answered: bool) -> None:
        backend = pool.get(summary.backend) if answered else None
        if backend is not None:
            pool.record_result(backend, summary.status, summary.dur, summary.ttft)
            if summary.prompt_tokens is not None:
                pool.record_prompt(backend, summary.prompt_tokens,
                                   summary.cached_prompt_tokens)

    return SummaryConsumer("the pool's result counts", consume, Needs.USAGE)


def policy_learns(pool: Pool, policy: IPolicy) -> OutcomeConsumer:
    """
    What the policy learns from each request a backend answered (its ``observe``); a
    policy that fails to is logged by the feed, like any consumer.
    """

    def consume(outcome: RequestOutcome) -> None:
        backend = pool.get(outcome.backend) if outcome.answered else None
        if backend is None:
            return
        policy.observe(backend, outcome)

    return OutcomeConsumer("the policy", consume)


def budget_reconciles(budgets: TokenBudgets) -> OutcomeConsumer:
    """
    The token budgets' reconciliation: what a request cost replaces what was reserved
    for it.  Declared where the request was admitted (the reservation rides on its
    routing request, which does not cross to a ``--workers`` supervisor).
    """
    return OutcomeConsumer("the token budgets", budgets.reconcile)


def fair_shares_settle(fairness: FairShares) -> OutcomeConsumer:
    """
    The fair queue's counters: what a request cost replaces what its grant charged its
    tenant.  Declared where the request was routed (the charge rides on its routing
    request), as the token budgets' reconciliation is.
    """
    return OutcomeConsumer("the fair shares", fairness.settle)


def metrics_counts(metrics: Metrics) -> SummaryConsumer:
    """The Prometheus request counters and histograms."""
    return SummaryConsumer("the metrics", metrics.observe, Needs.USAGE)


@implementer(IRequestObserver)
class Bookkeeper:
    """
    Keeps the books of this process's pool: summaries to the declared consumers, answers
    to the outlier detector, suspects to the prober, retries and queue waits to the
    metrics, and other proxies' down verdicts (a worker's) to the pool.
    """

    def __init__(self, pool: Pool, metrics: Metrics, summaries: SummaryFeed,
                 probe_soon: Callable[[Backend], object]) -> None:
        self._pool = pool
        self._metrics = metrics
        self._probe_soon = probe_soon
        self.summaries = summaries

    @property
    def needs(self) -> Needs:
        return self.summaries.needs

    def ended(self, record: RequestRecord) -> None:
        self.summaries.ended(record)

    def finished(self, summary: Summary, answered: bool = True) -> None:
        """A request another process (a worker) finished and summarised: count it here."""
        self.summaries.feed(summary, answered)

    def answered(self, backend: Backend, status: int, client: str | None) -> None:
        self._pool.record_answer(backend, status, client)

    def suspect(self, backend: Backend) -> None:
        self._probe_soon(backend)

    def retried(self) -> None:
        self._metrics.retries.inc()

    def waited(self, seconds: float) -> None:
        self._metrics.queue_wait.observe(seconds)

    def down(self, backend: Backend, reason: str, reporter: str | None = None) -> None:
        """
        A proxy took ``backend`` out of rotation: so does this pool (a no-op when it is
        this pool that did, since a backend already down is not marked again).  A hang
        verdict (a reason starting ``hung:``) goes through the pool's half-the-fleet
        guard.  ``reporter`` (``worker 2``) prefixes the reason in the log.
        """
        said = reason if reporter is None else f"{reporter}: {reason}"
        if reason.startswith(HUNG):
            self._pool.mark_hung(backend, said)
        else:
            self._pool.mark_down(backend, said)
