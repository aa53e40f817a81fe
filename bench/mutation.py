"""
Mutation testing of txlb's core modules (``python -m bench.mutation``), on cosmic-ray.

Coverage says a line ran; a mutant says whether a test would notice it going wrong.  Each
mutant is one small change cosmic-ray makes to one module (``<`` for ``<=``, ``and`` for
``or``, a number changed, ``not`` added, ...); the module's own unit test modules
(:data:`MODULE_TESTS`) then run against it, and the mutant is *killed* if they fail,
*timed out* if they run past ``--timeout`` (the mutant made something loop or wait), else it
*survived*.  A survivor is either a missing test or an equivalent mutant (no behaviour can
differ); those are listed with the reason in ``bench/results/mutation.md``.

Why cosmic-ray and not mutmut: mutmut 3 runs pytest only (it maps mutants to tests with its
own pytest plugin and rewrites the package into trampolines); cosmic-ray takes any test
command and a timeout, so each mutant runs twisted.trial on just the relevant modules.

Every mutant runs in a copy of the tree made for the run (one per ``--jobs``), never in the
working tree, so an interrupted run leaves no mutant behind.

Examples::

    python -m bench.mutation                       # every mutant of every core module
    python -m bench.mutation --module _cluster/health   # one module
    python -m bench.mutation --sample 50 --seed 1  # a fixed sample (what CI runs)
    python -m bench.mutation --changed origin/main # only modules a change touched
    python -m bench.mutation --known               # replay the known bugs (see KNOWN_BUGS)
    python -m bench.mutation --replay bench/results/mutation-full/_scheduling-router.json
                                                   # the survivors of a run, on today's code
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

def _unit(*names: str) -> tuple[str, ...]:
    return tuple(f"tests.unit.{name}" for name in names)


#: what pins a backend and each of its parts (txlb/_cluster/backend*.py, slow_start)
_BACKEND_TESTS = ("test_scheduling", "test_failover", "test_regressions", "test_admin",
                  "test_health", "test_mutants", "test_mutants_pool")


#: Each core module (its path under txlb/, without .py) and the unit test modules that
#: should catch its mutants (in-memory only: fast, deterministic; the integration suites
#: would make each mutant cost minutes).
MODULE_TESTS: dict[str, tuple[str, ...]] = {
    "_proxy/resource": _unit("test_proxy", "test_failover", "test_regressions",
                             "test_budgets", "test_classes", "test_scheduling",
                             "test_routing_request", "test_mutants", "test_mutants_resource"),
    "_proxy/exchange": _unit("test_proxy", "test_proxy_wire", "test_failover",
                             "test_regressions", "test_upstream", "test_failures",
                             "test_budgets", "test_hung", "test_repeats", "test_outcome",
                             "test_classes", "test_scheduling", "test_kvcache",
                             "test_prompt_tokens", "test_mutants", "test_mutants_exchange"),
    "_proxy/failures": _unit("test_failures", "test_proxy", "test_failover",
                             "test_regressions", "test_mutants", "test_mutants_failures"),
    "_proxy/head": _unit("test_head", "test_proxy", "test_properties", "test_mutants"),
    "_upstream/client": _unit("test_upstream", "test_regressions", "test_mutants",
                              "test_mutants_upstream"),
    "_upstream/resend": _unit("test_upstream", "test_failures", "test_mutants_upstream"),
    "_cluster/backend": _unit(*_BACKEND_TESTS),
    "_cluster/backend_health": _unit(*_BACKEND_TESTS, "test_store", "test_reload"),
    "_cluster/backend_verdicts": _unit(*_BACKEND_TESTS, "test_hung", "test_bookkeeper"),
    "_cluster/backend_counts": _unit(*_BACKEND_TESTS, "test_policies", "test_shared_slots",
                                     "test_workers"),
    "_cluster/backend_pace": _unit(*_BACKEND_TESTS, "test_hung"),
    "_cluster/backend_engine": _unit(*_BACKEND_TESTS, "test_engines", "test_mutants_health",
                                     "test_workers"),
    "_cluster/backend_models": _unit(*_BACKEND_TESTS, "test_models"),
    "_cluster/slow_start": _unit(*_BACKEND_TESTS, "test_time", "test_dns"),
    "_cluster/pool": _unit("test_scheduling", "test_failover", "test_regressions",
                           "test_admin", "test_health", "test_reload", "test_reload_workers",
                           "test_store", "test_shared_state", "test_shared_slots", "test_dns",
                           "test_hung", "test_models", "test_mutants", "test_mutants_pool"),
    "_cluster/slots": _unit("test_scheduling", "test_failover", "test_regressions",
                            "test_admin", "test_health", "test_reload", "test_reload_workers",
                            "test_store", "test_shared_state", "test_shared_slots", "test_dns",
                            "test_hung", "test_models", "test_mutants", "test_mutants_pool",
                            "test_workers", "test_workers_supervisor"),
    "_cluster/outlier": _unit("test_failover", "test_regressions", "test_mutants"),
    "_cluster/models": _unit("test_models", "test_scheduling", "test_health", "test_mutants"),
    "_cluster/health": _unit("test_health", "test_regressions", "test_scheduling",
                             "test_reload", "test_mutants", "test_mutants_health"),
    "_scheduling/router": _unit("test_scheduling", "test_policies", "test_routing_request",
                                "test_failover", "test_policy_failure",
                                "test_policy_prepare", "test_classes", "test_reload",
                                "test_shared_slots", "test_budgets", "test_admin",
                                "test_workers", "test_mutants", "test_mutants_resource",
                                "test_mutants_router"),
    "_scheduling/prefix": _unit("test_cache_aware_prefix", "test_cache_aware",
                                "test_cache_aware_loop", "test_policy_prepare",
                                "test_shared_prefixes", "test_prefix_bench",
                                "test_prefix_scale_out", "test_mutants_cache_aware"),
    "_scheduling/prefix_index": _unit("test_cache_aware", "test_cache_aware_loop",
                                      "test_cache_aware_prefix", "test_shared_prefixes",
                                      "test_kvcache", "test_prefix_bench",
                                      "test_prefix_scale_out", "test_mutants_cache_aware"),
    "_scheduling/policies/cache_aware": _unit("test_cache_aware", "test_cache_aware_loop",
                                              "test_cache_aware_prefix",
                                              "test_policy_prepare", "test_policies",
                                              "test_shared_prefixes", "test_kvcache",
                                              "test_prefix_bench", "test_prefix_scale_out",
                                              "test_policy_registry", "test_mutants_registry",
                                              "test_mutants_cache_aware"),
    **{f"_scheduling/policies/{name}": _unit("test_policies", "test_scheduling",
                                             "test_policy_registry", "test_mutants")
       for name in ("_ties", "least_conn", "round_robin", "weighted_random", "p2c", "peak_ewma",
                    "queue_depth")},
    "_scheduling/policies/registry": _unit("test_policies", "test_scheduling",
                                           "test_policy_registry", "test_mutants",
                                           "test_mutants_registry"),
    "_server/site": _unit("test_failover", "test_regressions", "test_proxy", "test_repeats",
                          "test_admin", "test_mutants", "test_mutants_site",
                          # the lean server reads site's limits and rules (MAX_LINE, ...)
                          "test_lean", "test_review_lean")
    + ("tests.integration.test_framing",),
    "_records/resultlog": _unit("test_resultlog", "test_regressions", "test_summary",
                                "test_mutants", "test_mutants_resultlog"),
    "_records/summary": _unit("test_summary", "test_prompt_tokens", "test_properties",
                              "test_regressions", "test_resultlog", "test_mutants",
                              "test_mutants_summary"),
    "_records/fields": _unit("test_fields", "test_summary", "test_prompt_tokens",
                             "test_properties", "test_resultlog", "test_workers",
                             "test_classes", "test_mutants"),
}

#: cosmic-ray's binary and comparison operators come as every (from, to) pair: ten
#: mutants per ``+``, most killed by any test that runs the line.  One meaningful
#: replacement per operator is kept (the classic "sufficient" set); the other operators
#: (numbers, ``not``, ``and``/``or``, booleans, exceptions, loops, decorators) all run.
_KEPT_PAIRS = {
    "ReplaceBinaryOperator": {"Add_Sub", "Sub_Add", "Mul_Div", "Div_Mul", "FloorDiv_Mul",
                              "Mod_FloorDiv", "Pow_Mul", "BitOr_BitAnd", "BitAnd_BitOr",
                              "BitXor_BitOr", "LShift_RShift", "RShift_LShift"},
    "ReplaceComparisonOperator": {"Lt_LtE", "LtE_Lt", "Gt_GtE", "GtE_Gt", "Eq_NotEq",
                                  "NotEq_Eq", "Is_IsNot", "IsNot_Is", "In_NotIn",
                                  "NotIn_In", "Lt_Gt", "Gt_Lt"},
}


@dataclass(frozen=True)
class KnownBug:
    """A bug once put into the code by hand that the suite at first let through."""

    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...] = ("tests.unit.test_regressions",)


#: The nine deliberate bugs that passed the whole suite before ``tests/unit/test_regressions``.
#: ``--known`` applies each to a copy of the tree and checks the tests now fail.
KNOWN_BUGS: tuple[KnownBug, ...] = (
    KnownBug("lease released twice counts twice", "txlb/_cluster/slots.py",
             "        if not self._released:\n            self._released = True\n",
             "        if True:\n            self._released = True\n"),
    KnownBug("--max-body not enforced on lb.resource()", "txlb/_proxy/resource.py",
             "if self.max_body and len(record.request_body) > self.max_body:",
             "if False and len(record.request_body) > self.max_body:"),
    KnownBug("chunked body over --max-body refused only once whole", "txlb/_server/site.py",
             "        if limit and self._body_seen > limit:\n",
             "        if False:\n"),
    # (escaping moved to txlb/_records/escape.py: the escaped CR turned back into a raw one)
    KnownBug("carriage return raw in the result log", "txlb/_records/escape.py",
             "        text = _unprintable().sub(_unicode_escape, text)\n    return text\n",
             "        text = _unprintable().sub(_unicode_escape, text)\n"
             "    return text.replace('\\\\x0d', '\\r')\n"),
    # (the exchange's branch became a row of the failure table)
    KnownBug("connect timeout retried", "txlb/_proxy/failures.py",
             'Rule(Kind.CONNECT_TIMEOUT, 504, "timeout", retried=False,',
             'Rule(Kind.CONNECT_TIMEOUT, 504, "timeout", retried=True,'),
    KnownBug("retried answer read to the end (Agent)", "txlb/_upstream/agent.py",
             "        self.transport.stopProducing()  # type: ignore[attr-defined]\n",
             "        pass\n"),
    KnownBug("retried answer read to the end (own client)", "txlb/_upstream/client.py",
             '        """Abort: the body of a 502/503 that is retried elsewhere is not worth '
             'reading."""\n        self.abort()\n',
             '        """Read it to the end."""\n'
             "        self._owner = None\n"),
    KnownBug("connection reused after bytes beyond the body", "txlb/_upstream/client.py",
             "            self._keep_alive = False  # bytes beyond the body: never reuse "
             "this connection\n",
             "            pass\n"),
    KnownBug("probe 404 counted healthy", "txlb/_cluster/health.py",
             "        if code != 200:\n", "        if code >= 500:\n"),
    KnownBug("500 retried like 502/503", "txlb/_proxy/failures.py",
             "RETRIED_STATUSES = frozenset({502, 503})",
             "RETRIED_STATUSES = frozenset({500, 502, 503})"),
)


#: Mutants no test can kill because no behaviour can differ, each with the reason: the
#: module, cosmic-ray's operator, and text found in the mutated line (line numbers move).  They are
#: reported as ``equivalent`` and left out of the kill rate; bench/results/mutation.md
#: lists them.
EQUIVALENT: tuple[tuple[str, str, str, str], ...] = (
    ("_proxy/exchange", "ReplaceComparisonOperator_Eq_NotEq", 'elif self.state != "relaying":',
     "pauseProducing's elif: while relaying the read watchdog is always armed (it is "
     "cleared only inside _read_timed_out, which re-arms or ends), and the exchange is the "
     "client's producer only while relaying, so neither form of the branch ever runs"),
    ("_proxy/exchange", "ReplaceComparisonOperator_Gt_GtE", "if watchdog.getTime() >= now + limit:",
     "at equality, reset(limit) moves the watchdog to the time it already has"),
    ("_proxy/exchange", "ReplaceAndWithOr", "if watchdog is not None or watchdog.active():",
     "pauseProducing runs only while the exchange is the client's producer, i.e. relaying, "
     "and then the read watchdog is set and pending (see the elif's entry): both forms "
     "take the first branch"),
    ("_proxy/exchange", "ReplaceAndWithOr",
     "if self._watchdog is not None or self._watchdog.active():",
     "_retry runs in waiting, after _send armed the watchdog; it is only ever cleared to "
     "None when it fires or is cancelled (and _read_timed_out then re-arms or ends), so "
     "here it is set and pending: both forms cancel it"),
    ("_proxy/exchange", "ReplaceTrueWithFalse", "self.client_gone = False",
     "client_gone is read by _can_retry and _fail only, which run only while the state is "
     "not ended (_got_response's and _request_failed's Deferred is cancelled by _end; "
     "_retry_refused and _give_up return once ended); _client_lost sets it right before "
     "its _end, so no read ever follows the write"),
    ("_proxy/exchange", "ReplaceAndWithOr",
     "if channel is not None or channel.transport is not None:",
     "a request's channel is None only after Request.connectionLost, which fires the "
     "exchange's notifyFinish errback at once (_client_lost ends it: no _cut_client after "
     "that), and an HTTPChannel's transport is never set back to None: both forms abort"),
    ("_proxy/exchange", "NumberReplacer", "if status < 499:",
     "a 499 from the backend then also asks provoked_by_request and the client key (both "
     "pure), but Verdicts.answered resets the streak for any status under 500 whatever the "
     "client, and judge_answer returns None for it: the same outcome"),
    ("_proxy/resource", "ReplaceAndWithOr", "if budgets is not None or budgets.specs:",
     "the balancer always passes its TokenBudgets; with no [[budgets]] its admit returns "
     "ADMITTED at once, whose headers and reservation are the record's defaults"),
    ("_proxy/resource", "NumberReplacer", "context: ProxyContext, retry_after: float =",
     "ProxyResource's default: the balancer always passes max(1, ceil(--health-interval))"),
    ("_proxy/resource", "NumberReplacer", "self.retry_after = max( 0, math.ceil(retry_after))",
     "the balancer's retry_after is already at least 1 (max(1, ceil(--health-interval)))"),
    ("_proxy/resource", "NumberReplacer", 'self.affinity.split(":", 2)',
     "--affinity's header name is an HTTP token (parse_affinity), which has no colon: one "
     "split or two give the same name"),
    ("_upstream/client", "NumberReplacer", "self._chunk_state == -1:",
     "with the one-chunk fast path off, the general walk hands on the same bytes: only "
     "speed differs"),
    ("_cluster/pool", "NumberReplacer", "outliers: OutlierRule | None = None, slow_start: float =",
     "Pool's default: the balancer always passes --slow-start"),
    ("_cluster/pool", "AddNot", "            if not backend.health.removing:",
     "in refresh and mirror the loop hands each backend to _forget_if_idle, which checks "
     "removing itself: the guard only saves the call (undrain's check, less indented, is "
     "not this one)"),
    ("_cluster/health", "ReplaceBinaryOperator_Mul_Div", "def retune(self, /,",
     "retune's one caller (the reload) passes every argument by keyword: with / the "
     "method also takes them by position, and takes every call it took before alike"),
    ("_cluster/outlier", "NumberReplacer", "base_cooldown: float =",
     "OutlierRule's default: the balancer always passes --outlier-cooldown's value"),
    ("_cluster/outlier", "NumberReplacer", "consecutive_5xx: int =",
     "OutlierRule's default: the balancer always passes --outlier-5xx's value"),
    ("_cluster/outlier", "NumberReplacer", "if status < 499 or client is None:",
     "a 499 from a client resets the streak (Verdicts.answered) to 0, under any threshold: "
     "the same None"),
    ("_scheduling/policies/least_conn", "NumberReplacer", "rank=",
     "the built-in ranks are 10 apart: one up or down keeps the --help order"),
    ("_scheduling/policies/round_robin", "NumberReplacer", "rank=",
     "the built-in ranks are 10 apart: one up or down keeps the --help order"),
    ("_scheduling/policies/weighted_random", "NumberReplacer", "rank=",
     "the built-in ranks are 10 apart: one up or down keeps the --help order"),
    ("_scheduling/policies/p2c", "NumberReplacer", "rank=",
     "the built-in ranks are 10 apart: one up or down keeps the --help order"),
    ("_scheduling/policies/peak_ewma", "NumberReplacer", "rank=",
     "the built-in ranks are 10 apart: one up or down keeps the --help order"),
    ("_scheduling/policies/queue_depth", "NumberReplacer", "rank=",
     "the built-in ranks are 10 apart: one up or down keeps the --help order"),
    ("_scheduling/policies/cache_aware", "NumberReplacer", "rank=",
     "the built-in ranks are 10 apart: one up or down keeps the --help order"),
    ("_scheduling/policies/cache_aware", "ReplaceTrueWithFalse", "@attrs.define(slots=False)",
     "_Prediction without __slots__: only its memory differs -- nothing sets an attribute "
     "it does not declare, pickles or copies it"),
    ("_scheduling/policies/cache_aware", "ReplaceTrueWithFalse",
     "zip(candidates, matches, strict=False)",
     "matches is built by a comprehension over candidates in choose: the two are always "
     "of one length, so strict never raises"),
    ("_scheduling/policies/cache_aware", "ReplaceAndWithOr",
     "if entry is not None or entry.request is ref:",
     "a prediction's weakref (and with it its callback) lives only as long as the "
     "prediction, which lives only in _pending (observe's and _predict's locals hold one "
     "while its request is alive): when the callback runs, the entry under the request's "
     "id is that prediction, so both forms delete it"),
    ("_scheduling/policies/cache_aware", "NumberReplacer", "chars = -1",
     "the prediction's chars is read only by BackendIndex.learned's `chars > 0`: -1 and 0 "
     "both skip the characters-per-token update"),
    ("_scheduling/policies/cache_aware", "NumberReplacer",
     "trust = index.trust if index is not None else",
     "a backend without an index matches nothing (FleetIndex.match returns 0): its worth "
     "is 0 x trust = 0 whatever the default trust"),
    ("_scheduling/prefix_index", "ReplaceComparisonOperator_Gt_GtE",
     "if predicted >= 0 and cached < predicted",
     "with nothing predicted the eviction test is cached < 0 - 1, false for any cached "
     "(clamped to 0 or more): both forms go on to the elif"),
    ("_scheduling/prefix_index", "NumberReplacer", "return max( -1, self.capacity - len(",
     "an index never lists more than its capacity (sent, learned and counted trim to it "
     "whenever either changes): capacity - len is never below 0, nor below -1"),
    ("_scheduling/prefix_index", "NumberReplacer", "if predicted > 1 and cached < predicted",
     "the eviction test's `predicted > 0` as > 1: with 1 predicted, cached < 1 - max(1, 0) "
     "is cached < 0, false for any cached (clamped to 0 or more)"),
    ("_scheduling/prefix_index", "NumberReplacer", "if predicted > -1 and cached < predicted",
     "the eviction test's `predicted > 0` as > -1: with 0 predicted, cached < 0 - max(1, 0) "
     "is cached < -1, false for any cached (clamped to 0 or more)"),
    ("_scheduling/prefix_index", "NumberReplacer", "gone = largest.trim(max( -1,",
     "len(largest) - excess is never below 0: before a sent the exact count is at most "
     "_total, at most the cap, so the excess is at most what the index just sent to grew "
     "by -- at most its length, at most the largest's; max(-1, x) is max(0, x)"),
    ("_scheduling/prefix_index", "ReplaceComparisonOperator_LtE_Lt",
     "if self._total < self.max_entries:",
     "at exactly the cap the mutant recounts (exact: nothing is over) and trims nothing, "
     "so the indexes are the same; only a recount's cost differs"),
    ("_scheduling/prefix_index", "ReplaceBinaryOperator_Sub_Add", "return len(entries) + before",
     "sent's return only feeds FleetIndex._total, which decides when to recount; an "
     "overcount (the mutant only adds) triggers a recount that sets it exact and trims "
     "only what is really over the cap, so what the indexes hold is the same"),
    ("_scheduling/prefix", "ReplaceComparisonOperator_Lt_LtE", "if self.steps <= 0:",
     "_feed's check (text()'s, the same line, is killed by test_mutants_cache_aware): _feed "
     "appends no piece, and a _feed that takes the last look is always followed by "
     "its media's text(), which the spent budget refuses: the rendered text is the same"),
    ("_scheduling/prefix", "ReplaceComparisonOperator_GtE_Gt", "if size > room:",
     "a piece that exactly fills the budget: the mutant goes on, but with no room left the "
     "next non-empty piece appends piece[:0] and stops it -- the same text (only looks at "
     "empty pieces differ)"),
    ("_scheduling/prefix", "NumberReplacer", "if self.steps < 1:",
     "_feed's check (text()'s is killed by tests) as <= 0: see the Lt_LtE entry"),
    ("_scheduling/prefix", "NumberReplacer", "if self.steps < -1:",
     "_feed's check (text()'s is killed by tests) letting one more look through: _feed "
     "appends no piece and its media's text() that follows refuses the spent budget, so "
     "the rendered text is the same"),
    ("_scheduling/prefix_index", "NumberReplacer", "self._total = 1",
     "forget_blocks' count one too high: an overcount only brings the next recount "
     "forward, which sets it exact and trims only what is really over the cap"),
    ("_scheduling/policies/registry", "NumberReplacer", 'rpartition(".")[ 1]',
     "built_in() then also imports the registry module itself, which defines no factory: "
     "the same policies are found"),
    ("_scheduling/policies/_ties", "NumberReplacer", "if len(tied) == 0:",
     "a single tied backend through the weighted walk: its current weight rises by w and "
     "falls by the total, w; it is chosen, and nothing else changes"),
    ("_scheduling/policies/p2c", "NumberReplacer", "return candidates[ -1]",
     "reached only when there is one candidate"),
    ("_records/summary", "ReplaceFalseWithTrue",
     "tail: deque[bytes] = attrs.field(factory=deque, repr=True)",
     "only a RequestRecord's repr shows its tail, and nothing txlb writes uses that repr"),
    ("_records/summary", "ReplaceFalseWithTrue", "count_events: bool = True",
     "events are read only by a token budget's charge, for a request it reserved for, whose "
     "count_events the proxy sets to True: counting every other request's events costs "
     "time only"),
    ("_records/summary", "ReplaceFalseWithTrue", "think: bool =",
     "think is shown only for completions, for which summarize passes it"),
    ("_scheduling/router", "ReplaceFalseWithTrue", "@attrs.define(eq=True)",
     "_Waiter compared by fields instead of identity: its fields include its own Deferred "
     "and timer, compared by identity, so two waiters are equal only if they are one"),
    ("_proxy/failures", "ReplaceOrWithAnd", "if not body and body.lstrip()[:1]",
     "the check is a shortcut: json.loads refuses every body it would have refused (an empty "
     "one, one not starting with '{'), or parses it to a value that is not a dict"),
    ("_server/site", "NumberReplacer",
     "_CONTROLS = bytes([*range(0x01, 0x09), *range(0x0B, 0x0D), *range( 13, 0x20), 0x7F])",
     "adds CR (0x0D) to the control characters: headerReceived refuses a NUL, CR or LF in a "
     "value first, with the same 400, so the control-character check never sees a CR"),
    ("_server/site", "NumberReplacer", "_VISIBLE_ASCII = bytes(range( 32, 0x7F))",
     "a request target never holds a space (0x20): SP is the request line's delimiter, and "
     "twisted.web's _parseRequestLine refuses a line with more than two (400) before the "
     "target is checked"),
    ("_server/site", "ReplaceUnaryOperator_USub_Not", "request = self.requests[not 1]",
     "refuse runs only while a head or body is parsed, and then channel.requests holds one "
     "request: twisted.web buffers a pipelined request's bytes until requestDone has removed "
     "the one before, so [0] is [-1]"),
    ("_server/site", "NumberReplacer", "request = self.requests[- 0]",
     "refuse runs only while a head or body is parsed, and then channel.requests holds one "
     "request: twisted.web buffers a pipelined request's bytes until requestDone has removed "
     "the one before, so [0] is [-1]"),
    ("_proxy/head", "NumberReplacer", "if uri[: 9].lower().startswith",
     "the longest scheme looked for, 'https://', is 8 bytes: a 9-byte prefix starts with "
     "it exactly when the 8-byte one does"),
    ("_proxy/resource", "NumberReplacer", "max_body: int =",
     "ProxyResource's default: the balancer always passes --max-body"),
    ("_upstream/client", "ReplaceFalseWithTrue", 'return "close", None, True',
     "a close-delimited body ends with the connection (connectionLost), never in "
     "_complete, the only reader of keep_alive"),
    ("_upstream/client", "ReplaceOrWithAnd", "isdigit() and code_bytes[0] == 48",
     "a status code with a leading 0 is below 100, which _framing refuses with the same "
     "BadResponse (only the message differs)"),
    ("_upstream/client", "ReplaceComparisonOperator_Lt_LtE", "if len(_TITLE_CASE) <= 4096:",
     "_TITLE_CASE only memoizes _title: its bound changes how many header names are kept, "
     "never the casing written"),
    ("_upstream/client", "ReplaceComparisonOperator_Lt_Gt", "if len(_TITLE_CASE) > 4096:",
     "_TITLE_CASE only memoizes _title: never memoizing recomputes the same casing"),
    ("_upstream/client", "AddNot", "if not len(_TITLE_CASE) < 4096:",
     "_TITLE_CASE only memoizes _title: never memoizing recomputes the same casing"),
    ("_upstream/client", "NumberReplacer", "if len(_TITLE_CASE) < 409",
     "_TITLE_CASE only memoizes _title: its bound changes how many header names are kept, "
     "never the casing written"),
    ("_upstream/client", "ReplaceFalseWithTrue", "            self._paused = True",
     "resumeProducing leaving _paused set only makes a later resume call the transport's "
     "resumeProducing again while it is reading: nothing else pauses a backend socket, and "
     "resuming a reading (or aborted) transport changes nothing"),
    ("_upstream/client", "ReplaceAndWithOr", 'if (connection.state == "idle" or transport',
     "every pooled connection is idle with a connected transport (release pools it just "
     "after idle(); _expire, forget, close_idle and release's over-limit branch take it out "
     "of the pool before closing it): the check is true both ways"),
    ("_upstream/client", "ReplaceAndWithOr", "or not transport.disconnecting):",
     "every pooled connection is idle with a transport not disconnecting (release pools it "
     "just after idle(); every loseConnection of a pooled one comes after taking it out): "
     "the check is true both ways"),
    ("_upstream/client", "ReplaceAndWithOr", "if idle or connection in idle:",
     "forget is only called for a pooled connection (by _expire, whose timer take() "
     "cancels, and by connectionLost and dataReceived in the idle state, which only a "
     "pooled connection is in): its list is non-empty and holds it"),
    ("_upstream/client", "ReplaceOrWithAnd", "if attempt is None and attempt.deferred.called:",
     "in the head state the attempt is set and not yet called: everything that fires it "
     "(the head, _bad_head, a cancel through _Attempt._cancel) first takes the connection "
     "out of that state"),
    ("_upstream/client", "NumberReplacer", "self._remaining = 1",
     "the _remaining a response leaves is never read: _head sets it before the next body"),
    ("_upstream/client", "NumberReplacer", "self._remaining = -1",
     "the _remaining a response leaves is never read: _head sets it before the next body"),
    ("_scheduling/policies/weighted_random", "NumberReplacer", "weights=weights)[ -1]",
     "random.choices draws one element (k=1): [0] and [-1] are the same"),
    ("_scheduling/policies/p2c", "NumberReplacer", "weights=weights)[ -1]",
     "random.choices draws one element (k=1): [0] and [-1] are the same"),
    ("_scheduling/policies/peak_ewma", "ReplaceComparisonOperator_Gt_GtE",
     "seconds >= previous.seconds:",
     "a sample equal to the estimate: replacing it or averaging it in both leave that value, "
     "stamped now"),
    ("_scheduling/policies/_ties", "NumberReplacer", "return tied[ -1]",
     "only reached when len(tied) == 1: [0] and [-1] are the same"),
    ("_records/summary", "NumberReplacer", '.split(b";", 2)[0]',
     "the chunk size is the part before the first ';' either way"),
    ("_records/summary", "NumberReplacer", "if end < 1:",
     "end is 0 only at position 0 with an empty size line, which int() refuses: the same "
     "break"),
    ("_records/summary", "ReplaceComparisonOperator_Lt_LtE", "while position <= size:",
     "at position == size find() returns -1: the same break"),
    ("_records/summary", "NumberReplacer", "tries: int =",
     "summarize always passes tries"),
    ("_records/summary", "ReplaceComparisonOperator_Lt_LtE", "if end <= 0:",
     "end is 0 only at position 0 with an empty size line, which int() refuses: the same "
     "break"),
    ("_records/summary", "NumberReplacer", "if length <= -1:",
     "after the zero-size chunk only trailer lines follow (and the capture never holds that "
     "chunk: the client's side writes it), and a 'name: value' line never parses as a size"),
    ("_records/summary", "NumberReplacer", "position = start + length + 1",
     "the byte skipped is the CR closing a chunk's data (the upstream client refuses any "
     "other framing, so the capture holds none): the next size line then starts with LF, "
     "which int() skips as whitespace"),
    ("_records/summary", "AddNot", "if not TYPE_CHECKING:",
     "the two imports serve annotations only (from __future__ import annotations): made at "
     "run time they change nothing (no import cycle: the module still imports)"),
    ("_records/summary", "ReplaceTrueWithFalse", "empty: bool = False",
     "empty is written only for completions, for which summarize passes it"),
    ("_records/summary", "ReplaceFalseWithTrue", "stream: bool = True",
     "stream is written only for completions, for which summarize passes it, and read by "
     "time_per_output_token only beside completion_tokens, None for every other kind"),
    ("_records/summary", "ReplaceFalseWithTrue", "attrs.field(default=None, repr=True)",
     "only a RequestRecord's repr shows its routing request: nothing txlb writes uses that "
     "repr (and the request body it was made from is in it either way)"),
    ("_records/summary", "NumberReplacer", "MAX_LINE = ",
     "the bound the other limits are chosen to keep: no code reads it, the tests check "
     "lines against it"),
    ("_records/summary", "NumberReplacer", "ended: float =",
     "RequestRecord's default: every record is ended (by the exchange's _end, or by the "
     "resource for what it answers itself) before it is summarized"),
    ("_records/summary", "NumberReplacer", "clen: int =",
     "clen is shown only for completions, for which summarize passes it"),
    ("_cluster/health", "ReplaceFalseWithTrue", "scrape_engine_queue: bool =",
     "HealthChecker's default: the balancer and a reload both pass "
     "scrape_engine_queue from the policy"),
    ("_cluster/health", "NumberReplacer", "started: float =",
     "_failed's default: its one caller, probe's errback, always passes the time the "
     "probe started"),
    ("_records/fields", "NumberReplacer", "if len(wire.classes) == 0:",
     "a one-class wire type then checked with `in` its one-tuple instead of `is` its class: "
     "the same answer, a little slower"),
    ("_records/fields", "NumberReplacer", "Text(",
     "a text piece's place (at) moved by one either meets its neighbour's on the same line "
     "(refused when the formatter is made, at import) or keeps the order it had"),
    ("_records/resultlog", "NumberReplacer", "self._next_check =",
     "__init__'s value is overwritten at once by _open"),
    ("_scheduling/router", "NumberReplacer", "retry_after: int =",
     "Router's default: the balancer always passes retry_after"),
    ("_scheduling/router", "NumberReplacer", "queue_timeout: float =",
     "Router's default: the balancer always passes --queue-timeout"),
    ("_scheduling/router", "ReplaceFalseWithTrue", "forward_unknown_models: bool = True",
     "Router's default: the balancer always passes --unknown-model's choice"),
    ("_scheduling/router", "NumberReplacer", "weights=weights)[ -1]",
     "random.choices draws one element (k=1): [0] and [-1] are the same"),
    ("_scheduling/router", "ReplaceBinaryOperator_Mul_Div", "def retune(self, /, policy",
     "retune's arguments keyword-only or not: its one caller (the balancer's reload) names "
     "every argument, and the mutant accepts every call the original does, alike"),
    ("_scheduling/router", "ReplaceFalseWithTrue", "queued: bool = True",
     "_Waiter's default: the one place a waiter is made (_wait) hands it to _enqueue at "
     "once, which sets queued to True before anything reads it"),
    ("_scheduling/router", "ReplaceTrueWithFalse", "zip(snapshots, skip, strict=False)",
     "skip is made as [0] * len(snapshots): the two always have one length"),
    ("_scheduling/router", "ReplaceAndWithOr", "if waiter.timer is not None or waiter.timer",
     "in _regroup every waiter is in a queue, and a queued waiter's timer is set and pending: "
     "_enqueue arms it, only _leave cancels it and _expire clears it, each taking the waiter "
     "out of its queue in the same step -- both forms cancel it"),
    ("_scheduling/router", "NumberReplacer", "current[ -1].cancel()",
     "current holds one Deferred at most (the one choice made after a refusal: answered "
     "runs once per confirmation): [0] and [-1] are the same"),
    ("_scheduling/router", "NumberReplacer", "(queue[ -1].klass, list(queue))",
     "every waiter in a class's queue holds that class: it joins the queue named by its "
     "klass, and a reload's _regroup (the classes' only listener) re-points all of them "
     "before anything else runs -- head and tail have the one starvation age"),
    ("_scheduling/router", "NumberReplacer", "skip[number] += 0",
     "a starving waiter walked again in the precedence pass was served (no longer queued), "
     "is being confirmed, was answered, or failed to take a slot (its (model, exclude) is "
     "in failed: passed over) -- the second look changes nothing"),
    ("_scheduling/router", "NumberReplacer", "oldest = -1.0",
     "there is always at least one class (the default class must exist), and each class's "
     "wait is 0.0 or more: the max is the same from -1.0 as from 0.0"),
    ("_cluster/health", "ReplaceOrWithAnd", "if running is None and waiting is None:",
     "with one gauge missing, running + waiting raises TypeError, which the same errback "
     "turns into the same fallback (engine_depth None); only the debug message differs"),
    ("_records/summary", "ReplaceComparisonOperator_LtE_Lt", "if length < 0:",
     "after the zero-size chunk only trailer lines follow, and a 'name: value' line never "
     "parses as a chunk size: the walk stops with the same payload"),
    ("_cluster/health", "ReplaceTrueWithFalse", "gatherResults(extras, consumeErrors=False)",
     "each extra ends in its own errback, so the gathered Deferreds never fail"),
    ("_cluster/health", "NumberReplacer", "rest.rsplit(None, 2)[-1]",
     "rsplit(None, 1)[-1] and rsplit(None, 2)[-1] are the same last token"),
    ("_cluster/health", "NumberReplacer", 'rest.split("}", 2)[1]',
     "the same token follows the first '}' either way unless a label value holds '}', "
     "and then neither parses as a number (the line is skipped)"),
    ("_cluster/slow_start", "NumberReplacer", "_length: float =",
     "SlowStart's default: every SlowStart txlb makes is made by the pool, which passes its "
     "--slow-start (and without a clock, as a default SlowStart has, there is no ramp)"),
    ("_cluster/slow_start", "ReplaceFalseWithTrue", "attrs.field(default=None, repr=True)",
     "only a SlowStart's repr shows its clock: nothing txlb writes uses that repr (logs, "
     "status and metrics name a backend by its key)"),
)


@dataclass
class Outcome:
    module: str
    operator: str
    occurrence: int
    line: int
    status: str  # killed, survived, timeout, incompetent, no-test
    diff: str = ""


@dataclass
class Tally:
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, status: str) -> None:
        self.counts[status] = self.counts.get(status, 0) + 1

    def get(self, status: str) -> int:
        return self.counts.get(status, 0)


#: What a copy holds: the package, the plugin, the tests (with their fixtures), the docs,
#: which some tests hold the code to (test_failures reads docs/reliability.md's failure
#: table, test_resultlog and test_fields docs/result-log.md), and the benchmarks, which some
#: tests import (test_fields takes its varied summaries from bench.formats).
COPIED = ("txlb", "tests", "twisted", "docs", "bench")


def copy_tree(into: Path) -> Path:
    """A copy of what the tests need (:data:`COPIED`), so mutants touch no tree anyone
    works in."""
    for name in COPIED:
        # (not the benchmarks' own environments: bench/.venv-routers holds the Rust routers)
        shutil.copytree(ROOT / name, into / name,
                        ignore=shutil.ignore_patterns("__pycache__", "_trial_temp*", ".venv*"))
    return into


def test_command(copy: Path, tests: Sequence[str]) -> str:
    """
    Trial on ``tests``, run in ``copy`` (``env -C``) so the copy's txlb is imported.  It
    stops at the first failure (``--exitfirst``): one failing test kills a mutant, and the
    tests after it would only cost time.
    """
    return (f"env -C {copy} PYTHONPATH={copy} {sys.executable} -m twisted.trial --exitfirst "
            f"--temp-directory={copy}/_trial_temp " + " ".join(tests))


def baseline(copy: Path, modules: Iterable[str], timeout: float) -> bool:
    """
    Whether the modules' tests pass in ``copy`` with no mutant in it.  A test that fails
    there anyway (one reading a file the copy lacks) fails against every mutant too, and
    every mutant would be counted killed: no kill rate means anything until this passes.
    """
    tests = sorted({test for module in modules for test in MODULE_TESTS[module]})
    try:
        run = subprocess.run(test_command(copy, tests).split(), capture_output=True,
                             timeout=timeout * 10)
    except subprocess.TimeoutExpired:
        print(f"the tests, with no mutant, ran past {timeout * 10:g}s", flush=True)
        return False
    if run.returncode:
        tail = run.stdout.decode("utf-8", "replace").splitlines()[-40:]
        print("the tests fail with no mutant (so every mutant would count as killed):\n"
              + "\n".join(tail), flush=True)
        return False
    return True


def annotation_spans(module: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """
    Where the type annotations are, as ((line, column), (end line, end column)): every core
    module has ``from __future__ import annotations``, so an annotation is never evaluated
    and a mutant in one (``str | None`` to ``str & None``) is equivalent by construction.
    """
    tree = ast.parse((ROOT / "txlb" / f"{module}.py").read_text())
    spans = []
    for node in ast.walk(tree):
        annotation = None
        if isinstance(node, ast.arg | ast.AnnAssign):
            annotation = node.annotation
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            annotation = node.returns
        if annotation is not None and annotation.end_lineno is not None:
            spans.append(((annotation.lineno, annotation.col_offset),
                          (annotation.end_lineno, annotation.end_col_offset or 0)))
    return spans


def mutants(module: str) -> list[object]:
    """
    cosmic-ray's work items for one module, less the redundant operator pairs and the
    mutants inside annotations (never evaluated).
    """
    from cosmic_ray.commands.init import _all_work_items  # type: ignore[import-untyped]

    spans = annotation_spans(module)
    kept = []
    for item in _all_work_items([ROOT / "txlb" / f"{module}.py"], {}):
        spec = item.mutations[0]
        name = spec.operator_name.split("/", 1)[-1]
        family, _, pair = name.partition("_")
        if family in _KEPT_PAIRS and pair not in _KEPT_PAIRS[family]:
            continue
        if any(start <= tuple(spec.start_pos) < end for start, end in spans):
            continue
        kept.append(item)
    return kept


#: Mutants of one module queued before its "who tests what" map is made (below that, the
#: map costs more than it saves).
SELECT_FROM = 6

#: Which tests ran each line of a module: line number -> trial test ids.
Coverage = dict[int, frozenset[str]]


def who_tests_what(module: str, copy: Path, timeout: float,
                   tests: Sequence[str] | None = None) -> Coverage:
    """
    Run the module's tests once under coverage with one context per test (coverage's
    ``dynamic_context = test_function``): for each line of ``module``, the tests that ran it.

    A mutant then first runs only the tests that reach its lines -- a few seconds instead of
    the whole list.  The context is the test method's qualified name (the class that
    defines it), which trial runs by name.  Lines reached only outside a test method (in
    ``setUp``, or by the reactor after the method returned) have no test here; the
    fallback in :func:`run_one` covers them.
    """
    from coverage import CoverageData

    data_file = copy / f".who-{module.replace('/', '-')}"
    rc = copy / ".who-rc"
    rc.write_text(f"[run]\ndynamic_context = test_function\n"
                  f"include = {copy}/txlb/{module}.py\ndata_file = {data_file}\n")
    # -u: a run measured as a whole (CI's COVERAGE_FILE, COVERAGE_PROCESS_START) must
    # neither take this run's data nor start a second measurement in it
    command = (f"env -C {copy} -u COVERAGE_FILE -u COVERAGE_PROCESS_START -u COVERAGE_RCFILE "
               f"PYTHONPATH={copy} {sys.executable} -m coverage run --rcfile={rc} "
               f"--data-file={data_file} -m twisted.trial --temp-directory={data_file}-trial "
               + " ".join(MODULE_TESTS[module] if tests is None else tests))
    try:
        subprocess.run(command.split(), capture_output=True, timeout=timeout * 10)
    except subprocess.TimeoutExpired:
        # no map, not no run: every mutant then meets the module's whole test list
        print(f"who tests what: {module}'s tests ran past {timeout * 10:g}s under coverage; "
              "its mutants run every test of the module", flush=True)
        return {}
    data = CoverageData(basename=str(data_file))
    data.read()
    wanted = str(copy / "txlb" / f"{module}.py")
    measured = [f for f in data.measured_files() if f == wanted]
    if not measured:
        return {}
    return {line: frozenset(c for c in contexts if c.startswith("tests."))
            for line, contexts in data.contexts_by_lineno(measured[0]).items()}


def tests_for(item: object, module: str, coverage: Coverage) -> tuple[str, ...]:
    """The tests that ran the mutated lines (all of the module's tests when none did)."""
    spec = item.mutations[0]  # type: ignore[attr-defined]
    found: set[str] = set()
    for line in range(spec.start_pos[0], spec.end_pos[0] + 1):
        found |= coverage.get(line, frozenset())
    return tuple(sorted(found)) or MODULE_TESTS[module]


def run_one(item: object, module: str, copy: Path, timeout: float,
            coverage: Coverage | None = None) -> Outcome:
    """
    Apply one mutant in ``copy`` and run tests against it.  With ``coverage``, the tests
    that reach the mutated lines run first; a mutant they kill is killed (a failing test
    is a failing test), and one that survives them is run against every test of the
    module before it counts as survived -- so selecting never turns a kill into a survivor.
    """
    from cosmic_ray.mutating import mutate_and_test  # type: ignore[import-untyped]
    from cosmic_ray.work_item import MutationSpec  # type: ignore[import-untyped]

    spec = item.mutations[0]  # type: ignore[attr-defined]
    local = MutationSpec(module_path=copy / "txlb" / f"{module}.py",
                         operator_name=spec.operator_name, occurrence=spec.occurrence,
                         start_pos=spec.start_pos, end_pos=spec.end_pos,
                         operator_args=spec.operator_args,
                         definition_name=spec.definition_name)
    everything = MODULE_TESTS[module]
    first = everything if coverage is None else tests_for(item, module, coverage)
    result = mutate_and_test([local], test_command(copy, first), timeout)
    status = _status(result)
    if status == "survived" and first != everything:
        result = mutate_and_test([local], test_command(copy, everything), timeout)
        status = _status(result)
    operator = spec.operator_name.split("/", 1)[-1]
    if status == "survived" and is_equivalent(module, operator, result.diff or ""):
        status = "equivalent"
    return Outcome(module, operator, spec.occurrence, spec.start_pos[0], status,
                   result.diff or "")


def _status(result: object) -> str:
    status = str(result.worker_outcome.value)  # type: ignore[attr-defined]
    if result.test_outcome is not None and status == "normal":  # type: ignore[attr-defined]
        status = str(result.test_outcome.value)  # type: ignore[attr-defined]
        if status == "killed" and result.output == "timeout":  # type: ignore[attr-defined]
            status = "timeout"
    return status


def is_equivalent(module: str, operator: str, diff: str) -> bool:
    """Whether the mutant whose ``diff`` this is, is one of :data:`EQUIVALENT`."""
    added = [line[1:] for line in diff.splitlines()
             if line.startswith("+") and not line.startswith("+++")]
    return any(module == m and operator == o and any(snippet in line for line in added)
               for m, o, snippet, _ in EQUIVALENT)


def changed_modules(base: str) -> list[str]:
    """Core modules a change since ``base`` touched (``git diff --name-only``)."""
    names = subprocess.run(["git", "diff", "--name-only", base, "--", "txlb"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split()
    return [m for m in MODULE_TESTS if f"txlb/{m}.py" in names]


def run_mutants(modules: Iterable[str], sample: int | None, seed: int, timeout: float,
                jobs: int, out: Path | None, fail_under: float, select: bool = True) -> int:
    work: list[tuple[str, object]] = []
    for module in modules:
        items = mutants(module)
        if sample is not None:
            items = random.Random(f"{seed}:{module}").sample(items, min(sample, len(items)))
        work += [(module, item) for item in items]
    print(f"{len(work)} mutants over {', '.join(modules)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="txlb-mutation-") as scratch:
        copies = [copy_tree(Path(scratch) / f"copy{n}") for n in range(jobs)]
        if not baseline(copies[0], sorted({module for module, _ in work}), timeout):
            return 1
        free = list(copies)
        coverage: dict[str, Coverage] = {}
        if select:
            # mapping a module costs one run of its tests under coverage: worth it only
            # when more mutants than that will use it (not for CI's few per module)
            queued = Counter(module for module, _ in work)
            wanted = sorted(module for module, count in queued.items() if count >= SELECT_FROM)
            with ThreadPoolExecutor(jobs) as pool:
                found = pool.map(lambda m: who_tests_what(m[1], copies[m[0] % jobs], timeout),
                                 enumerate(wanted))
                coverage = dict(zip(wanted, found, strict=True))
            print(f"who tests what: {sum(len(c) for c in coverage.values())} lines mapped",
                  flush=True)

        def task(entry: tuple[str, object]) -> Outcome:
            copy = free.pop()
            try:
                return run_one(entry[1], entry[0], copy, timeout, coverage.get(entry[0]))
            finally:
                free.append(copy)

        outcomes: list[Outcome] = []
        started = time.monotonic()
        with ThreadPoolExecutor(jobs) as pool:
            for n, outcome in enumerate(pool.map(task, work), 1):
                outcomes.append(outcome)
                if outcome.status not in ("killed", "timeout"):
                    print(f"  {outcome.status}: {outcome.module}:{outcome.line} "
                          f"{outcome.operator}#{outcome.occurrence}", flush=True)
                if n % 25 == 0:
                    print(f"  ... {n}/{len(work)} in {time.monotonic() - started:.0f}s",
                          flush=True)
    report(outcomes)
    for outcome in outcomes:
        if outcome.status == "survived":
            print(f"survived {outcome.module}:{outcome.line} {outcome.operator}"
                  f"#{outcome.occurrence}\n{outcome.diff}")
    if out is not None:
        out.write_text(json.dumps([o.__dict__ for o in outcomes], indent=1))
    dead = sum(o.status in ("killed", "timeout") for o in outcomes)
    survived = sum(o.status == "survived" for o in outcomes)
    rate = 100.0 * dead / ((dead + survived) or 1)
    if rate < fail_under:
        print(f"kill rate {rate:.0f}% is under --fail-under {fail_under:g}%")
        return 1
    return 0


def table(outcomes: Sequence[Outcome]) -> list[str]:
    """The per-module Markdown table: killed, timed out, survived, equivalent, kill rate."""
    tallies: dict[str, Tally] = {}
    for outcome in outcomes:
        tallies.setdefault(outcome.module, Tally()).add(outcome.status)
    rows = ["| module | mutants | killed | timed out | survived | equivalent | other | "
            "killed of non-equivalent |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for module, tally in tallies.items():
        total = sum(tally.counts.values())
        dead = tally.get("killed") + tally.get("timeout")
        other = total - dead - tally.get("survived") - tally.get("equivalent")
        rate = dead / ((dead + tally.get("survived")) or 1)
        rows.append(f"| {module} | {total} | {tally.get('killed')} | {tally.get('timeout')} | "
                    f"{tally.get('survived')} | {tally.get('equivalent')} | {other} | "
                    f"{rate:.0%} |")
    return rows


def report(outcomes: Sequence[Outcome]) -> None:
    print("\n".join(table(outcomes)))


def run_known(timeout: float) -> int:
    """Apply each known bug to a fresh copy; the tests must fail with it (and pass without)."""
    failures = 0
    with tempfile.TemporaryDirectory(prefix="txlb-known-") as scratch:
        copy = copy_tree(Path(scratch) / "copy")
        clean = subprocess.run(test_command(copy, ("tests.unit.test_regressions",)).split(),
                               capture_output=True, timeout=timeout)
        print(f"{'passes' if clean.returncode == 0 else 'FAILS'} without any bug")
        failures += clean.returncode != 0
        for bug in KNOWN_BUGS:
            path = copy / bug.path
            original = path.read_text()
            if original.count(bug.old) != 1:
                print(f"DOES NOT APPLY (code changed): {bug.name}")
                failures += 1
                continue
            path.write_text(original.replace(bug.old, bug.new))
            try:
                run = subprocess.run(test_command(copy, bug.tests).split(),
                                     capture_output=True, timeout=timeout)
                caught = run.returncode != 0
            except subprocess.TimeoutExpired:
                caught = True
            finally:
                path.write_text(original)
            print(f"{'killed  ' if caught else 'SURVIVED'} {bug.name}")
            failures += not caught
    return 1 if failures else 0


class StaleMutant(ValueError):
    """A recorded mutant whose lines are no longer in the module as it is (the code moved on)."""


def apply_diff(source: str, diff: str) -> str:
    """
    ``source`` with one recorded mutant's ``diff`` applied: the hunk's context and removed
    lines, found exactly once, replaced by its context and added lines.

    cosmic-ray names a mutant by its operator and occurrence index, which shift whenever the
    module changes; the diff names the change itself, so a survivor recorded by an earlier
    run can be tried again on today's code as long as its lines are still there.
    """
    before: list[str] = []
    after: list[str] = []
    in_hunk = False
    for line in diff.splitlines():
        if line.startswith("@@"):
            if in_hunk:
                raise StaleMutant("a recorded mutant has one hunk; this diff has several")
            in_hunk = True
            continue
        if not in_hunk:
            continue
        if line.startswith("-"):
            before.append(line[1:])
        elif line.startswith("+"):
            after.append(line[1:])
        else:
            text = line[1:] if line.startswith(" ") else line
            before.append(text)
            after.append(text)
    if not in_hunk or before == after:
        raise StaleMutant("the diff changes nothing")
    old, new = "\n".join(before) + "\n", "\n".join(after) + "\n"
    found = source.count(old)
    while not found and before[-1:] == after[-1:] == [""]:
        # at the end of the module cosmic-ray's diff ends on a blank context line the
        # file does not have (its last line's newline is the file's end)
        before, after = before[:-1], after[:-1]
        old, new = "\n".join(before) + "\n", "\n".join(after) + "\n"
        found = source.count(old)
    if found != 1:
        raise StaleMutant(f"its lines occur {found} times in the module now, not once")
    return source.replace(old, new)


def replay(recorded: Path, timeout: float, jobs: int, out: Path | None,
           modules: Sequence[str] | None = None) -> int:
    """
    Run the survivors recorded in ``recorded`` (a ``--json`` output) again, each applied
    by its diff (:func:`apply_diff`) to a copy of today's tree, against every test of its
    module.  A mutant whose lines have gone is reported ``stale``; one that survives and
    matches :data:`EQUIVALENT` now is ``equivalent``.
    """
    entries = [o for o in json.loads(recorded.read_text())
               if o["status"] == "survived" and (not modules or o["module"] in modules)]
    print(f"{len(entries)} recorded survivors from {recorded}", flush=True)
    with tempfile.TemporaryDirectory(prefix="txlb-replay-") as scratch:
        free = [copy_tree(Path(scratch) / f"copy{n}") for n in range(jobs)]
        if entries and not baseline(free[0], sorted({str(e["module"]) for e in entries}),
                                    timeout):
            return 1

        def task(entry: dict[str, object]) -> Outcome:
            module, diff = str(entry["module"]), str(entry["diff"])
            outcome = Outcome(module, str(entry["operator"]), int(str(entry["occurrence"])),
                              int(str(entry["line"])), "stale", diff)
            copy = free.pop()
            path = copy / "txlb" / f"{module}.py"
            original = path.read_text()
            try:
                path.write_text(apply_diff(original, diff))
            except StaleMutant as why:
                print(f"  stale: {module}:{outcome.line} {outcome.operator}: {why}",
                      flush=True)
                free.append(copy)
                return outcome
            try:
                run = subprocess.run(test_command(copy, MODULE_TESTS[module]).split(),
                                     capture_output=True, timeout=timeout)
                outcome.status = "killed" if run.returncode else "survived"
            except subprocess.TimeoutExpired:
                outcome.status = "timeout"
            finally:
                path.write_text(original)
                free.append(copy)
            if outcome.status == "survived" and is_equivalent(module, outcome.operator, diff):
                outcome.status = "equivalent"
            return outcome

        with ThreadPoolExecutor(jobs) as pool:
            outcomes = list(pool.map(task, entries))
    report(outcomes)
    for outcome in outcomes:
        if outcome.status == "survived":
            print(f"survived {outcome.module}:{outcome.line} {outcome.operator}\n"
                  f"{outcome.diff}")
    if out is not None:
        out.write_text(json.dumps([o.__dict__ for o in outcomes], indent=1))
    return 1 if any(o.status == "survived" for o in outcomes) else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", action="append", choices=sorted(MODULE_TESTS),
                        help="only this core module (repeat for several)")
    parser.add_argument("--changed", metavar="REV",
                        help="only the core modules changed since REV")
    parser.add_argument("--sample", type=int, help="at most this many mutants per module")
    parser.add_argument("--seed", type=int, default=1, help="for --sample (default 1)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds one mutant's tests may take (default 60)")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once")
    parser.add_argument("--json", type=Path, help="write every outcome here")
    parser.add_argument("--fail-under", type=float, default=100.0, metavar="PCT",
                        help="exit 1 when under PCT%% of the non-equivalent mutants are "
                             "killed (default 100)")
    parser.add_argument("--known", action="store_true", help="replay KNOWN_BUGS only")
    parser.add_argument("--no-select", action="store_true",
                        help="run every test of the module against each mutant (slower; by "
                             "default the tests that reach the mutated lines run first)")
    parser.add_argument("--replay", type=Path, metavar="JSON",
                        help="the survivors in this --json output, applied by their diffs "
                             "to today's code (exit 1 if any still survives)")
    args = parser.parse_args(argv)
    if args.replay:
        return replay(args.replay, args.timeout, max(1, args.jobs), args.json, args.module)
    if args.known:
        return run_known(args.timeout)
    modules = args.module or list(MODULE_TESTS)
    if args.changed:
        modules = [m for m in modules if m in changed_modules(args.changed)]
        if not modules:
            print("no core module changed")
            return 0
    return run_mutants(modules, args.sample, args.seed, args.timeout, max(1, args.jobs),
                       args.json, args.fail_under, select=not args.no_select)


if __name__ == "__main__":
    raise SystemExit(main())
