"""
What a ``--workers`` worker's proxy observes, on its way to the one bookkeeper.

A worker keeps no books of its own: the result log, the metrics, outlier ejection and
probing exist once, in the supervisor.  :class:`SupervisorForwarder` is the worker's
:class:`~txlb._records.observer.IRequestObserver`: each event becomes a typed message
(:mod:`txlb._workers.wire`) to the supervisor, where :class:`WorkerReports` hands it to
the supervisor's :class:`~txlb._records.bookkeeper.Bookkeeper` -- the same one a single
process's proxy reports to directly.  Only what the worker's own routing needs stays in
the worker: its policy learns from the requests it served (a summary consumer of its own).
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.logger import Logger
from zope.interface import implementer

from txlb._cluster.backend import Backend
from txlb._cluster.pool import Pool
from txlb._records.bookkeeper import Bookkeeper, SummaryConsumer, SummaryFeed
from txlb._records.needs import Needs
from txlb._records.observer import IRequestObserver
from txlb._records.privacy import KEEP_ALL, Privacy
from txlb._records.record import RequestRecord
from txlb._records.summary import Summary
from txlb._scheduling.budgets import TokenBudgets
from txlb._scheduling.fairness import FairShares
from txlb._workers.wire import (
    Answer,
    BudgetRefused,
    Down,
    Finished,
    FromWorker,
    Message,
    Ready,
    Retry,
    Served,
    Spent,
    Suspect,
    Wait,
)

log = Logger()


@implementer(IRequestObserver)
class SupervisorForwarder:
    """
    A worker's observer: every event is sent to the supervisor.  A finished request is
    summarised here (once, by :attr:`summaries`, whose last consumer sends it), so the
    worker's own summary consumers -- its policy -- read the same summary.
    """

    def __init__(self, send: Callable[[Message], object],
                 privacy: Privacy = KEEP_ALL) -> None:
        self._send = send
        self.summaries = SummaryFeed(privacy, [
            SummaryConsumer("the pipe to the supervisor", self._finished)])

    @property
    def needs(self) -> Needs:
        """The supervisor may write the result log: the pipe's consumer reads it all."""
        return self.summaries.needs

    def _finished(self, summary: Summary, answered: bool) -> None:
        self._send(Finished(summary, answered))

    def ended(self, record: RequestRecord) -> None:
        self.summaries.ended(record)

    def answered(self, backend: Backend, status: int, client: str | None) -> None:
        self._send(Answer(backend.key, status, client))

    def suspect(self, backend: Backend) -> None:
        self._send(Suspect(backend.key))

    def retried(self) -> None:
        self._send(Retry())

    def waited(self, seconds: float) -> None:
        self._send(Wait(seconds))

    def down(self, backend: Backend, reason: str) -> None:
        self._send(Down(backend.key, reason))


class WorkerReports:
    """
    The supervisor's side: one worker's messages, applied to the supervisor's bookkeeper.
    Reports naming a backend the supervisor no longer has are ignored (it was removed
    while the message travelled).
    """

    def __init__(self, index: int, pool: Pool, bookkeeper: Bookkeeper,
                 budgets: TokenBudgets | None = None,
                 fairness: FairShares | None = None) -> None:
        self._index = index
        self._pool = pool
        self._bookkeeper = bookkeeper
        self._budgets = budgets
        self._fairness = fairness

    def apply(self, message: FromWorker) -> bool:
        """
        Apply one message; True if it ended a request that held a slot (a refusal -- 404,
        429, a 503 from the queue -- held none, and frees nothing worth waking queues for).
        """
        books = self._bookkeeper
        if isinstance(message, Finished):
            books.finished(message.summary, message.answered)
            return message.summary.backend is not None
        if isinstance(message, Spent | BudgetRefused):
            if self._budgets is not None:
                if isinstance(message, Spent):
                    self._budgets.spent_elsewhere(
                        [(name, window, client) for name, window, client in message.buckets],
                        message.amount, message.charged)
                else:
                    self._budgets.count_refused(message.budget)
        elif isinstance(message, Served):
            if self._fairness is not None:
                self._fairness.served_elsewhere(message.tenant, message.amount)
        elif isinstance(message, Retry):
            books.retried()
        elif isinstance(message, Wait):
            books.waited(float(message.seconds))
        elif isinstance(message, Answer | Suspect | Down):
            backend = self._pool.get(message.backend)
            if backend is None:
                return False
            if isinstance(message, Answer):
                books.answered(backend, message.status, message.client)
            elif isinstance(message, Suspect):
                books.suspect(backend)
            else:
                books.down(backend, message.reason, reporter=f"worker {self._index}")
        elif not isinstance(message, Ready):  # Ready: a life-cycle matter, the supervisor's
            log.warn("worker {index} sent a message only a supervisor sends: {kind}",
                     index=self._index, kind=message.kind)
        return False
