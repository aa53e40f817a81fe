"""
"No module assigns another object's public attributes", checked so that it stays true.

A part's settings change through its ``reconfigure(config)``, its hooks through the method
that says what it is told (``Router.tell_waits``, ``TokenBudgets.report_to``, ...): an
assignment from outside (``lb.proxy.max_body = ...``, ``balancer.router.on_queue_length =
...``) is a second road a reload can miss and an owner cannot see.  This test walks every
module of ``txlb/`` and fails on any assignment to a public attribute of an object other
than ``self``/``cls`` -- except the ones in :data:`RECORDS`: plain records a module fills in
itself (a request's record, a queued waiter), and the Twisted idioms where configuring an
object by its attributes is the documented way (``LoopingCall.clock``, a factory's
``protocol``).  Private writes are ``test_state_ownership``'s.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from .test_state_ownership import _written

TXLB = Path(__file__).resolve().parents[2] / "txlb"

_RECORD = "a record this module fills in as it goes (attrs, no behaviour of its own)"
_TWISTED = "a Twisted object configured the documented way, by its attributes"

#: (module, the object written) -> why its public attributes may be assigned there
RECORDS: dict[tuple[str, str], str] = {
    ("_admin/history.py", "tally"): _RECORD,
    ("_admin/history.py", "self._loop"): _TWISTED + " (LoopingCall.clock)",
    ("_cluster/health.py", "loop"): _TWISTED + " (LoopingCall.clock)",
    ("_cluster/hung.py", "loop"): _TWISTED + " (LoopingCall.clock)",
    ("_shared/host.py", "loop"): _TWISTED + " (LoopingCall.clock)",
    ("_shared/store.py", "self._loop"): _TWISTED + " (LoopingCall.clock)",
    ("_discovery/membership.py", "watch"): _RECORD + ": one name's schedule",
    ("_discovery/resolver.py", "protocol"): _TWISTED + " (DNSDatagramProtocol.noisy)",
    ("_proxy/exchange.py", "record"): _RECORD + ": the request's RequestRecord",
    ("_proxy/exchange.py", "self.record"): _RECORD + ": the request's RequestRecord",
    ("_proxy/exchange.py", "self.request"): _TWISTED + " (Request.responseHeaders)",
    ("_proxy/resource.py", "record"): _RECORD + ": the request's RequestRecord",
    ("_proxy/resuming.py", "record"): _RECORD + ": the request's RequestRecord (the "
                                        "exchange's, whose resume half it is)",
    ("_proxy/resuming.py", "self.record"): _RECORD + ": the request's RequestRecord",
    ("_proxy/resource.py", "request"): _TWISTED + " (Request.defaultContentType)",
    ("_records/metrics.py", "metric"): "a prometheus_client Metric family built right there",
    ("_records/resultlog.py", "sink"): _TWISTED + " (LogFile.rotateLength)",
    ("_records/answers/chat.py", "completion"): _RECORD + ": an answer's parsed counts",
    ("_records/answers/messages.py", "completion"): _RECORD + ": an answer's parsed counts",
    ("_records/answers/responses.py", "completion"): _RECORD + ": an answer's parsed counts",
    ("_scheduling/budgets.py", "routing"): "RoutingRequest.memo, the slot declared for "
                                           "what admission leaves for routing",
    ("_scheduling/policies/cache_aware.py", "request"): "RoutingRequest.memo (see budgets)",
    ("_scheduling/fairness.py", "request"): "RoutingRequest.memo (see budgets)",
    ("_scheduling/policies/cache_aware.py", "prediction"): _RECORD,
    ("_scheduling/policies/peak_ewma.py", "previous"): _RECORD + ": one backend's average",
    ("_scheduling/prefix.py", "budget"): _RECORD + ": a hashing budget",
    ("_scheduling/prefix_index.py", "index"): _RECORD + ": one backend's index",
    ("_scheduling/router.py", "waiter"): _RECORD + ": a queued request",
    ("_server/lean_channel.py", "head"): _RECORD + ": the request head being parsed",
    ("_server/lean_channel.py", "request"): "the LeanRequest this channel made and serves "
                                            "(twisted.web's Request surface: content, ...)",
    ("_server/lean_channel.py", "self._relay"): _RECORD + ": which producer the client's "
                                                "flow control goes to",
    ("_server/lean_head.py", "request"): "the LeanRequest the head's checks decide on "
                                         "(twisted.web's Request surface: persistent)",
    ("_server/site.py", "channel"): "the channel ProxySite.buildProtocol just built",
    ("_shared/link.py", "factory"): _TWISTED + " (a ReconnectingClientFactory it builds)",
    ("_shared/link.py", "txredisapi"): "the one patch of txredisapi's ClientService, "
                                       "in the module that wraps txredisapi",
    ("_shared/link.py", "txredisapi.ClientService"): "the same patch",
    ("_shared/replies.py", "queue"): "txredisapi's reply queue, replaced by the bounded "
                                     "parser's in the one module that owns that parser",
    ("_shared/replies.py", "top"): _RECORD + ": the parser's stack frame",
    ("_shared/wake.py", "factory"): _TWISTED + " (a ReconnectingClientFactory it builds)",
    ("_upstream/client.py", "attempt"): _RECORD + ": one try's connection state",
    ("_upstream/connection.py", "attempt"): _RECORD + ": one try's connection state",
    ("_upstream/client.py", "connection"): "the client's own UpstreamConnection's state, "
                                           "which its pool moves between idle and busy",
    ("testing/engine.py", "request"): _TWISTED + " (Request.defaultContentType)",
}


def public_writes(module: str, source: str) -> Iterator[tuple[int, str, str]]:
    """``(line, object, attribute)`` for each public attribute ``source`` writes elsewhere."""
    for line, target in _written(ast.parse(source)):
        owner = target.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if target.attr.startswith("_"):
            continue
        yield line, ast.unparse(owner), target.attr


def violations(module: str, source: str) -> list[str]:
    return [f"txlb/{module}:{line}: assigns {owner}.{attribute}: give its owner a method "
            "(reconfigure(config), or one that says what it is told)"
            for line, owner, attribute in public_writes(module, source)
            if (module, owner) not in RECORDS]


def _modules() -> Iterator[tuple[str, str]]:
    for path in sorted(TXLB.rglob("*.py")):
        yield path.relative_to(TXLB).as_posix(), path.read_text(encoding="utf-8")


class PublicWritesTests(SynchronousTestCase):

    def test_no_module_assigns_another_objects_public_attributes(self) -> None:
        found = [v for module, source in _modules() for v in violations(module, source)]
        self.assertEqual(found, [])

    def test_every_allowance_is_still_needed(self) -> None:
        written = {(module, owner) for module, source in _modules()
                   for _, owner, _ in public_writes(module, source)}
        self.assertEqual(set(RECORDS) - written, set())

    def test_a_write_from_outside_is_caught(self) -> None:
        for line in ("lb.proxy.max_body = 10", "balancer.router.on_queue_length = f",
                     "context.retries += 1", "setattr(site, 'header_timeout', 3)",
                     "self.pool.gate = gate", "lb.config = config"):
            [found] = violations("_reload.py", line + "\n")
            self.assertIn("give its owner a method", found)

    def test_own_attributes_and_private_ones_are_left_to_others(self) -> None:
        source = "self.max_body = 1\ncls.count = 2\nlb._private = 3\n"
        self.assertEqual(violations("_reload.py", source), [])

    def test_a_record_is_allowed_only_where_it_is_filled_in(self) -> None:
        self.assertEqual(violations("_scheduling/router.py", "waiter.timer = None\n"), [])
        self.assertEqual(len(violations("_reload.py", "waiter.timer = None\n")), 1)
