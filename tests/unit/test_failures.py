"""
The failure table: the code's rules, how failures are classified, and the docs' table
(docs/reliability.md, "The failure table") read and compared with the code's, so the two
cannot drift; and how a connection failure is put in words on the result log's ``error=``
(written for ``_proxy/failures``' full mutation run).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import attrs
from twisted.internet import error as neterror
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import (
    RequestNotSent,
    RequestTransmissionFailed,
    ResponseFailed,
    ResponseNeverReceived,
)

from txlb._http.words import describe_failure
from txlb._proxy import exchange, failures
from txlb._proxy.failures import (
    FAILURES,
    Answer,
    Blame,
    Kind,
    Rule,
    answered,
    classify,
    failure_words,
    provoked_by_request,
    standard_json_object,
)
from txlb._records.summary import RequestRecord
from txlb._upstream.resend import RESEND_WINDOW, may_send_again

from ..helpers import keep_records
from .test_proxy import BACKENDS, ProxyTestCase

DOCS = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"


def docs_table() -> dict[str, list[str]]:
    """The rows of the docs' failure table: the kind in backticks, then the other cells."""
    text = DOCS.read_text(encoding="utf-8")
    section = text.split("\n## The failure table\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        match = re.match(r"\| `(\w+)`:[^|]*\|(.*)\|\s*$", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in match.group(2).split("|")]
    return rows


def docs_section(title: str) -> str:
    """One ``## `` section of docs/reliability.md, without its heading."""
    text = DOCS.read_text(encoding="utf-8")
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


#: The sections of docs/reliability.md that state when a request is sent again.
RETRY_SECTIONS = ("What is retried, and what never is", "How each failure looks",
                  "The failure table", "Upstream connections")


def as_docs_say(rule: Rule) -> list[str]:
    """A rule in the docs' words, cell by cell."""
    status = str(rule.status) if isinstance(rule.status, int) else rule.status.value
    return [status, f"`{rule.outcome}`", "yes" if rule.retried else "no", rule.backend.value]


class DocsAgreeTests(SynchronousTestCase):
    def test_docs_table_is_the_codes(self) -> None:
        rows = docs_table()
        self.assertEqual(sorted(rows), sorted(kind.value for kind in Kind))
        for kind, rule in FAILURES.items():
            self.assertEqual(rows[kind.value], as_docs_say(rule), kind)

    def test_reader_sees_a_changed_cell(self) -> None:
        """The comparison is not vacuous: a rule that differs shows."""
        rule = FAILURES[Kind.CONNECT_TIMEOUT]
        changed = Rule(rule.kind, rule.status, rule.outcome, not rule.retried, rule.backend)
        self.assertNotEqual(docs_table()["connect_timeout"], as_docs_say(changed))


    def test_docs_give_the_codes_resend_window(self) -> None:
        """Every "N ms" where the docs say when a request is sent again is the client's
        window, and the table's ``closed_unanswered`` row says where it ends."""
        said = {int(ms) for title in RETRY_SECTIONS
                for ms in re.findall(r"\b(\d+) ms\b", docs_section(title))}
        self.assertEqual(said, {round(RESEND_WINDOW * 1000)})
        row = next(line for line in docs_section("The failure table").splitlines()
                   if line.startswith("| `closed_unanswered`:"))
        self.assertIn(f"more than {RESEND_WINDOW * 1000:g} ms after the request's last byte",
                      row)

class TableTests(SynchronousTestCase):
    def test_every_kind_has_one_rule(self) -> None:
        self.assertEqual(set(FAILURES), set(Kind))
        for kind, rule in FAILURES.items():
            self.assertIs(rule.kind, kind)

    def test_an_error_of_txlbs_own_has_a_message(self) -> None:
        for rule in FAILURES.values():
            self.assertEqual(isinstance(rule.status, int), bool(rule.message), rule.kind)

    def test_only_what_provably_never_started_is_retried(self) -> None:
        retried = {kind for kind, rule in FAILURES.items() if rule.retried}
        self.assertEqual(retried, {Kind.REFUSED, Kind.UNSENT, Kind.ANSWERED_RETRIABLE})

    def test_a_lost_connection_is_retried_as_the_resend_rule_says(self) -> None:
        """The table and :func:`may_send_again` are one rule: what reaches the exchange has
        passed the upstream client's own resend (so is, for the rule, no idle-close race)."""
        self.assertEqual(FAILURES[Kind.UNSENT].retried,
                         may_send_again(write_failed=True, reused=False, answered=False,
                                        held=0.0))
        for held in (0.0, 0.8, 60.0):
            self.assertEqual(FAILURES[Kind.CLOSED_UNANSWERED].retried,
                             may_send_again(write_failed=False, reused=False,
                                            answered=False, held=held), held)

    def test_blame_actions(self) -> None:
        self.assertEqual([b for b in Blame if b.marks_down], [Blame.DOWN, Blame.DOWN_PROBED])
        self.assertEqual([b for b in Blame if b.probes], [Blame.DOWN_PROBED, Blame.PROBED])

    def test_answers_relayed(self) -> None:
        self.assertIs(FAILURES[Kind.ANSWERED].status, Answer.RELAYED)
        self.assertIs(answered(502), Kind.ANSWERED_RETRIABLE)
        self.assertIs(answered(503), Kind.ANSWERED_RETRIABLE)
        for status in (200, 404, 429, 500, 504):
            self.assertIs(answered(status), Kind.ANSWERED, status)


class ClassifyTests(SynchronousTestCase):
    def test_kinds(self) -> None:
        lost = Failure(neterror.ConnectionLost())
        cases = [
            (neterror.ConnectionRefusedError(), Kind.REFUSED),
            (neterror.NoRouteError(), Kind.REFUSED),
            (neterror.DNSLookupError("gpu-9"), Kind.REFUSED),
            (neterror.UnknownHostError(), Kind.REFUSED),
            (RequestTransmissionFailed([lost]), Kind.UNSENT),
            (RequestNotSent(), Kind.UNSENT),
            (ResponseNeverReceived([lost]), Kind.CLOSED_UNANSWERED),
            (ResponseNeverReceived([Failure(neterror.ConnectionDone())]),
             Kind.CLOSED_UNANSWERED),
            (neterror.TimeoutError(), Kind.CONNECT_TIMEOUT),
            (neterror.TCPTimedOutError(), Kind.CONNECT_TIMEOUT),
            (ResponseFailed([Failure(ValueError("bad status line"))]), Kind.BAD_RESPONSE),
            (ResponseNeverReceived([Failure(ValueError("odd"))]), Kind.BAD_RESPONSE),
            (ValueError("anything else"), Kind.BAD_RESPONSE),
        ]
        for error, kind in cases:
            self.assertIs(classify(Failure(error)), kind, error)


class ProvokedTests(SynchronousTestCase):
    def test_body_not_a_json_object(self) -> None:
        self.assertTrue(provoked_by_request(b"POST", b""))
        self.assertTrue(provoked_by_request(b"POST", b"[1]"))
        self.assertTrue(provoked_by_request(b"GET", b"not json"))
        self.assertFalse(provoked_by_request(b"POST", b'{"model": "m"}'))
        self.assertFalse(provoked_by_request(b"GET", b""))

    def test_strict_json(self) -> None:
        self.assertTrue(standard_json_object(b' {"a": 1.5}'))
        for body in [b'{"a": NaN}', b'{"a": 1e999}', b'{"a": "\\ud800"}', b"{", b"1"]:
            self.assertFalse(standard_json_object(body), body)


class ExchangeObeysTheTableTests(ProxyTestCase):
    """The exchange takes its decisions from FAILURES: a changed row changes the proxy."""

    def patch_rule(self, kind: Kind, **changes: object) -> None:
        self.patch(failures, "FAILURES", dict(FAILURES))
        failures.FAILURES[kind] = attrs.evolve(FAILURES[kind], **changes)  # type: ignore[arg-type]
        self.patch(exchange, "FAILURES", failures.FAILURES)

    def test_status_outcome_and_message_from_the_row(self) -> None:
        self.build(BACKENDS, retries=0)
        self.patch_rule(Kind.CONNECT_TIMEOUT, status=503, outcome="shutdown",
                        message="slow {backend}")
        records: list[RequestRecord] = keep_records(self.lb)
        client = self.client()
        client.request(b"GET", b"/")
        self.upstream.last.fail(neterror.TimeoutError())
        result = client.response()
        self.assertEqual(result.status, 503)
        self.assertTrue(json.loads(result.body)["error"]["message"].startswith("slow backend "))
        self.assertEqual(records[-1].outcome, "shutdown")

    def test_retried_from_the_row(self) -> None:
        self.build(BACKENDS, retries=1)
        self.patch_rule(Kind.CONNECT_TIMEOUT, retried=True)
        self.client().request(b"GET", b"/")
        self.upstream.last.fail(neterror.TimeoutError())
        self.assertEqual(len(self.upstream.calls), 2)

    def test_backend_cost_from_the_row(self) -> None:
        self.build(BACKENDS, retries=0)
        self.patch_rule(Kind.BAD_RESPONSE, backend=Blame.DOWN)
        self.client().request(b"GET", b"/")
        key = self.upstream.last.uri.split(b"/")[2].decode()
        self.upstream.last.fail(ValueError("odd"))
        self.assertFalse({b.key: b for b in self.lb.pool}[key].health.healthy)


class WrapperWordingTests(SynchronousTestCase):
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
