"""
Tests written for ``_proxy/failures``' full mutation run
(``bench/results/mutation-full/_proxy-failures.json``): how a connection failure is put in
words on the result log's ``error=``.
"""

from __future__ import annotations

from twisted.internet import error as neterror
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import RequestTransmissionFailed

from txlb._proxy.failures import failure_words
from txlb._upstream.words import describe_failure


class FailuresFullRunTests(SynchronousTestCase):
    """Mutants of ``_proxy/failures`` that survived its full run."""

    def test_a_wrapper_is_worded_by_its_first_reason(self) -> None:
        """
        Twisted's wrapper lists every reason, the cause first: the words name the cause,
        not what followed from it (the connection also closing).
        """
        first = Failure(neterror.ConnectionRefusedError())
        wrapper = Failure(RequestTransmissionFailed([first, Failure(neterror.ConnectionDone())]))
        self.assertEqual(failure_words(wrapper), "connection lost while sending the request "
                                                 f"({describe_failure(first)})")
        self.assertNotEqual(describe_failure(first),
                            describe_failure(Failure(neterror.ConnectionDone())))

    def test_a_wrapper_whose_first_reason_is_a_failure_says_it_was_sending(self) -> None:
        """Only the first reason decides; what else the wrapper lists does not matter."""
        first = Failure(neterror.ConnectionLost())
        wrapper = Failure(RequestTransmissionFailed([first, "not a failure"]))
        self.assertTrue(failure_words(wrapper).startswith(
            "connection lost while sending the request ("))
