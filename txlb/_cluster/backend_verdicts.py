"""
What the passive detectors hold against a backend: :class:`Verdicts`.

The outlier rule (:mod:`txlb._cluster.outlier`) judges a backend by the streak of 5xx its
answers make, and the hung-backend detector (:mod:`txlb._cluster.hung`) by its silence;
neither probes.  Their running streak and the ejections they decided are kept here, apart
from the prober's verdicts (:mod:`txlb._cluster.backend_health`), because they are fed by
every answer on the proxy's path, not by probes.
"""

from __future__ import annotations

import attrs


@attrs.define(eq=False)
class Verdicts:
    """One backend's 5xx streak and passive ejections; read-only from outside."""

    _errors_in_a_row: int = 0
    #: the first two distinct client keys of the current 5xx streak (two are all it needs)
    _streak_clients: tuple[str, ...] = ()
    _outlier_ejections: int = 0
    _hung_ejections: int = 0

    def answered(self, status: int, client: str | None) -> int:
        """
        Extend or end the streak of 5xx answers (see
        :func:`txlb._cluster.outlier.judge_answer`); returns its length.  A ``None`` client
        (the request provoked the 5xx itself) neither counts nor resets it.
        """
        if status < 500:
            self.streak_over()
        elif client is not None:
            self._errors_in_a_row += 1
            clients = self._streak_clients
            if client not in clients and len(clients) < 2:
                self._streak_clients = (*clients, client)
        return self._errors_in_a_row

    def streak_over(self) -> None:
        """The streak ends: a success, an ejection, or the backend back in rotation."""
        self._errors_in_a_row = 0
        self._streak_clients = ()

    def ejected(self) -> None:
        """Ejected as an outlier: the streak that did it is over."""
        self._outlier_ejections += 1
        self.streak_over()

    def judged_hung(self) -> None:
        self._hung_ejections += 1

    @property
    def errors_in_a_row(self) -> int:
        return self._errors_in_a_row

    @property
    def streak_clients(self) -> tuple[str, ...]:
        return self._streak_clients

    @property
    def outlier_ejections(self) -> int:
        return self._outlier_ejections

    @property
    def hung_ejections(self) -> int:
        return self._hung_ejections
